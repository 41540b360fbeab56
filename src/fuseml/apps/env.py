"""``fuseml env``: what this machine has and which fuseml backends work on it."""

from __future__ import annotations

import torch

from fuseml import runtime, settings


def env_report(*, remeasure: bool = False, build_cuda: bool = True) -> dict:
    report: dict = {"versions": runtime.versions()}
    gpu = runtime.cuda_available()
    report["device"] = runtime.device_info() if gpu else {"name": "CPU only (no CUDA device)"}
    tv = runtime.triton_version()
    backends = {
        "eager": (True, "torch"),
        "compile": (True, "torch.compile (inductor)"),
        "triton (compiled)": (
            gpu and tv is not None and not runtime.triton_interpreting(),
            "on CUDA tensors" if gpu else "needs a CUDA GPU",
        ),
        "triton (interpreter)": (
            tv is not None,
            "active (TRITON_INTERPRET=1)"
            if runtime.triton_interpreting()
            else "available with TRITON_INTERPRET=1",
        ),
    }
    nvcc = runtime.nvcc_path()
    toolchain = runtime.cuda_toolchain_available()
    if gpu and toolchain and build_cuda:
        from fuseml import _cuda_ext

        ok, why = _cuda_ext.status()
        secs = _cuda_ext.build_seconds()
        detail = f"built ({secs:.0f} s)" if ok and secs else why
        backends["cuda (C++ twins)"] = (ok, detail)
    else:
        missing = [
            name
            for name, have in (
                ("a CUDA GPU", gpu),
                ("nvcc", nvcc is not None),
                ("ninja", runtime.ninja_available()),
                ("a CUDA build of torch", torch.version.cuda is not None),
            )
            if not have
        ]
        backends["cuda (C++ twins)"] = (
            False,
            ("needs " + ", ".join(missing)) if missing else f"toolchain ok (nvcc {nvcc})",
        )
    if gpu and toolchain and build_cuda:
        from fuseml.ops import _fastcall

        # (a first build takes about 20 s; a report is not held longer than two minutes)
        loaded = _fastcall.wait(timeout=120)
        backends["eager fast path (C++ launches)"] = (loaded, _fastcall.status()[1])
    report["backends"] = backends
    report["tuning"] = _tuning_cache()
    report["triton_key"] = _triton_key_cache()
    report["settings"] = settings.describe()
    report["gemm"] = _gemm_path(gpu)
    if gpu:
        from fuseml.bench.roofline import ceilings

        report["ceilings"] = ceilings(remeasure=remeasure)
    return report


def _gemm_path(gpu: bool) -> str:
    """Which main loop fuseml.ops.linear takes here (fuseml.ops.gemm.gemm_loop)."""
    from fuseml.ops import gemm

    if gpu and gemm.launch._has_tma(0):
        return (
            f"TMA persistent kernel from {gemm.TMA_MIN_M} rows, tuned choice of TMA or "
            f"pointer loads up to {gemm.TMA_TUNED_MAX_M} rows (16-byte aligned rows), "
            "pointer-load kernel otherwise"
        )
    return "pointer-load kernel (the TMA kernel needs a Hopper or later GPU)"


def _tuning_cache() -> str:
    """Where GEMM / MLP tile choices are kept, and how many (fuseml.ops._tune)."""
    from fuseml.ops import _tune

    entries, files = _tune.entry_count()
    try:
        autotune = settings.autotune()
    except ValueError as err:
        autotune, bad = True, err
    else:
        bad = None
    if bad is not None:
        state = str(bad)
    elif not autotune:
        state = "off (FUSEML_AUTOTUNE=0)"
    else:
        try:
            state = (
                f"on, candidates compiled {_tune.parallel_compile()}; timings with the L2 "
                f"{_tune.l2_mode()} (FUSEML_TUNE_L2)"
            )
        except ValueError as err:  # a bad FUSEML_COMPILE_THREADS / FUSEML_TUNE_L2
            state = f"on; {err}"
    return f"{_tune.cache_dir()}: {entries} tuned shape(s) in {files} file(s); tuning {state}"


def _triton_key_cache() -> str:
    """Whether Triton's installation hash is read from disk (fuseml._triton_key)."""
    from fuseml import _triton_key

    if not _triton_key.enabled():
        return (
            "recomputed by Triton in every process (the command line keeps it on disk: "
            "fuseml.runtime.enable_triton_key_cache())"
        )
    try:
        root = settings.cache_dir()
    except ValueError as err:
        return str(err)
    return f"kept on disk per Triton install ({root}/triton-key): no rehash per process"


def print_env(*, remeasure: bool = False, build_cuda: bool = True, console=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    rep = env_report(remeasure=remeasure, build_cuda=build_cuda)
    t = Table(title="fuseml env", show_header=False)
    t.add_column("what")
    t.add_column("value")
    for k, v in rep["versions"].items():
        t.add_row(k, str(v))
    dev = rep["device"]
    if "sm_count" in dev:
        t.add_row(
            "device",
            f"{dev['name']} (sm {dev['capability']}, {dev['sm_count']} SMs, "
            f"{dev['memory_gib']} GiB, L2 {dev['l2_mib']} MiB)",
        )
    else:
        t.add_row("device", dev["name"])
    for name, (ok, detail) in rep["backends"].items():
        mark = "[green]yes[/green]" if ok else "[red]no[/red]"
        t.add_row(f"backend {name}", f"{mark}  {detail}")
    t.add_row("tuning cache", rep["tuning"])
    t.add_row("Triton install hash", rep["triton_key"])
    t.add_row("GEMM main loop", rep["gemm"])
    for row in rep["settings"]:
        shown = f"[red]{row.error}[/red]" if row.error else f"{row.value} ({row.source})"
        t.add_row(row.name, f"{shown}  {row.help}")
    if "ceilings" in rep:
        c = rep["ceilings"]
        t.add_row("copy bandwidth", f"{c['copy_gbps']:,.0f} GB/s (read + write)")
        for key, label in (
            ("matmul_bf16_tflops", "bf16 matmul"),
            ("matmul_tf32_tflops", "tf32 matmul"),
            ("matmul_fp32_tflops", "fp32 matmul"),
        ):
            t.add_row(label, f"{c[key]:,.0f} TFLOP/s")
    else:
        t.add_row("ceilings", "measured on a GPU only")
    console.print(t)
    return rep
