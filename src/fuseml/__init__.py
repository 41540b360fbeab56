"""fuseml: fused GPU kernels for inference, with proof that they are the same and faster.

``import fuseml`` registers the custom ops and touches no GPU: CUDA is initialised, and
kernels compiled, only when an op first runs on a CUDA tensor.
"""

from fuseml import ops, runtime

__version__ = "0.1.0"
__all__ = ["__version__", "ops", "runtime"]
