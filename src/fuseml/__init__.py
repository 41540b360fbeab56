"""fuseml: fused GPU kernels for inference, with proof that they are the same and faster.

``import fuseml`` touches no GPU and compiles nothing. Submodules load on first use
(``fuseml.ops`` registers the ``fuseml::*`` custom ops with torch when first touched), so
the command line can choose Triton's mode (e.g. its CPU interpreter) before triton loads.
"""

import importlib

__version__ = "0.1.0"
_SUBMODULES = (
    "ops",
    "nn",
    "convert",
    "runtime",
    "settings",
    "testing",
    "bench",
    "models",
    "data",
    "serving",
)
# Functions loaded with their module on first use. ``optimize`` lives in fuseml.convert: a
# submodule named fuseml.optimize would replace this function as the package attribute as
# soon as it is imported (the import system binds submodules on their parent).
# ``cuda_graphs`` (fuseml.serving) serves a model through CUDA graphs, one per batch bucket.
_FUNCTIONS = {"optimize": "fuseml.convert", "cuda_graphs": "fuseml.serving"}
__all__ = ["__version__", *_FUNCTIONS, *_SUBMODULES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"fuseml.{name}")
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'fuseml' has no attribute {name!r}")
