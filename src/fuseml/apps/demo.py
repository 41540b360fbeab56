"""``fuseml demo``: the environment, then each elementwise op through every backend that
runs here, checked against a float64 reference (and timed, on a GPU), then DLRM end to end
(synthetic data, training, evaluation, prediction; see ``fuseml.apps.demo_dlrm``)."""

from __future__ import annotations

import os


def run_demo(console=None) -> None:
    import torch

    if not torch.cuda.is_available():
        # Run the Triton kernels on the CPU through Triton's interpreter. This must be set
        # before triton is imported; it only affects this demo process.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from rich.console import Console

    from fuseml.apps.demo_dlrm import DemoCheckFailed, dlrm_demo
    from fuseml.apps.demo_elementwise import elementwise_demo
    from fuseml.apps.env import print_env

    console = console or Console()
    print_env(console=console)
    wrong = elementwise_demo(console)
    dlrm_demo(console)  # raises DemoCheckFailed itself
    if wrong:
        raise DemoCheckFailed(f"elementwise ops gave wrong results: {'; '.join(wrong)}")
