"""The elementwise part of the demo: every op x every backend that can run here."""

from __future__ import annotations

import torch

import fuseml
from fuseml import runtime
from fuseml.testing import rel_err, tolerance


def _cases(device: str, n: int, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n // 512, 512, generator=g).to(device, dtype)
    y = torch.randn(n // 512, 512, generator=g).to(device, dtype)
    b = torch.randn(512, generator=g).to(device, dtype)
    d = lambda t: t.double()
    return [
        ("add", lambda be: fuseml.ops.add(x, y, backend=be), d(x) + d(y)),
        ("gelu", lambda be: fuseml.ops.gelu(x, backend=be), fuseml.ops.gelu_ref(d(x))),
        (
            "gelu tanh",
            lambda be: fuseml.ops.gelu(x, "tanh", backend=be),
            fuseml.ops.gelu_ref(d(x), "tanh"),
        ),
        (
            "bias+0.5*res+relu",
            lambda be: fuseml.ops.bias_act(x, b, y, 0.5, "relu", backend=be),
            fuseml.ops.bias_act_ref(d(x), d(b), d(y), 0.5, "relu"),
        ),
    ]


def elementwise_demo(console) -> list[str]:
    """Prints the table; returns the (op, backend) cells whose result was wrong."""
    from rich.table import Table

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    n = (1 << 24) if gpu else (1 << 13)
    backends = ["eager", "compile", "triton", "cuda"]
    usable = {}
    for be in backends:
        try:
            runtime.resolve_backend(be, torch.device(device), "demo")
            usable[be] = ""
        except ValueError as err:
            usable[be] = str(err).split(": ", 2)[-1]
    table = Table(title=f"elementwise ops, {n:,} {str(dtype)[6:]} elements on {device}")
    table.add_column("op")
    for be in backends:
        table.add_column(be, justify="right")
    tol = tolerance(dtype)
    wrong = []
    for name, call, ref in _cases(device, n, dtype):
        cells = []
        for be in backends:
            if usable[be]:
                cells.append("[dim]n/a[/dim]")
                continue
            out = call(be)
            err = rel_err(out, ref)
            status = "[green]ok[/green]" if err <= tol else "[red]WRONG[/red]"
            if not err <= tol:
                wrong.append(f"{name} ({be}): relative error {err:.1e} > {tol:.0e}")
            cell = f"{status} err {err:.1e}"
            if gpu:
                import triton.testing

                ms = triton.testing.do_bench(lambda c=call, b=be: c(b), return_mode="median")
                cell += f", {ms * 1e3:,.0f} us"
            cells.append(cell)
        table.add_row(name, *cells)
    console.print(table)
    for be, why in usable.items():
        if why:
            console.print(f"[dim]{be}: {why}[/dim]")
    if not gpu:
        console.print(
            "Timings need a GPU: on this CPU-only machine the Triton kernels ran under "
            "Triton's interpreter to check correctness only. Run `fuseml bench elementwise` "
            "on a CUDA machine for speed."
        )
    return wrong
