"""The DLRM part of ``fuseml demo``: from nothing to predictions, on any machine.

1. generate a synthetic Criteo-format dataset with a planted signal (cached under
   $FUSEML_CACHE or ~/.cache/fuseml, so a second run skips this step) and prepare it;
2. train the ``tiny`` DLRM on it (Adam, 3 epochs) and score the held-out test split,
   next to the best AUC any model can reach (that of the generator's true probabilities);
3. write predictions for the test split with ``fuseml.apps.predict``;
4. ``fuseml.optimize`` the trained model and check its predictions against float64;
5. on a GPU, time inference of the Kaggle-sized model: eager, ``torch.compile`` and
   ``fuseml.optimize`` (checked likewise).

A check that fails is printed in red and raises ``DemoCheckFailed`` once all is printed.

Sizes were chosen on a 2-core CPU: 400k rows with at most 50 values per table are enough
for the tiny model to get within ~0.015 of the best AUC in 3 epochs (test AUC 0.7988 vs
0.8126). The part takes ~27 s there (12 s making the data, 15 s training); the whole
``fuseml demo`` 37 s from an empty cache.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

DEMO_ROWS = 400_000
DEMO_MAX_CARDINALITY = 50
DEMO_TRAIN = {"epochs": 3, "batch_size": 1024, "lr": 0.006, "optimizer": "adam"}


class DemoCheckFailed(RuntimeError):
    """The demo finished, but a model it optimized predicted wrongly."""


def dlrm_demo(console: Console | None = None, *, rows: int = DEMO_ROWS) -> dict:
    """Run the demo; returns its numbers (also printed as a summary table)."""
    from fuseml.apps.common import cache_dir
    from fuseml.apps.predict import predict
    from fuseml.apps.train import TrainOptions, split_oracle_auc, synthetic_dataset, train

    console = console or Console()
    console.rule("DLRM: synthetic Criteo data -> train -> evaluate -> predict")
    t0 = time.perf_counter()
    data_dir, summary = synthetic_dataset(rows, max_cardinality=DEMO_MAX_CARDINALITY)
    data_s = time.perf_counter() - t0
    console.print(
        f"data: {rows:,} synthetic rows (tables capped at {DEMO_MAX_CARDINALITY} values), "
        f"prepared in {data_dir.resolve()} ({data_s:.1f} s; cached for the next run)"
    )

    run_dir = cache_dir() / "demo-dlrm"
    t0 = time.perf_counter()
    result = train("tiny", data_dir, TrainOptions(**DEMO_TRAIN, out_dir=run_dir), console=console)
    train_s = time.perf_counter() - t0
    best_test = split_oracle_auc(data_dir, summary, "test")

    preds = predict(
        result.checkpoint, data_dir, run_dir / "test-predictions.parquet", console=console
    )
    numbers = {
        "rows": rows,
        "data_s": data_s,
        "train_s": train_s,
        "test_auc": result.test["auc"],
        "best_auc": summary.best_auc,
        "best_auc_test_split": best_test,
        "predict_rows_per_s": preds.rows_per_s,
    }
    checks = {"trained tiny model": _optimized_matches(console, result.checkpoint)}
    if torch.cuda.is_available():
        numbers["inference"], inference_checks = _eager_vs_compile(console)
        for batch, check in inference_checks.items():
            checks[f"Kaggle bf16, batch {batch:,}"] = check
    numbers["checks"] = checks
    _summary(console, numbers, result.checkpoint, preds.out)
    failed = [f"{what}: {_numbers(c)}" for what, c in checks.items() if not c["ok"]]
    if failed:
        raise DemoCheckFailed(f"the optimized DLRM's predictions are wrong ({'; '.join(failed)})")
    return numbers


def check_predictions(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, tf32: bool = False
) -> dict:
    """Probabilities ``out`` against ``ref``, held to the project's tolerance for ``dtype``:
    the relative error norm, and the worst element."""
    from fuseml.testing import rel_err, tolerance

    tol = tolerance(dtype, tf32=tf32)
    # A norm over thousands of rows hides a few wrong ones; probabilities lie in [0, 1],
    # so every element may be off by at most 10 tolerances.
    max_tol = 10 * tol
    err = rel_err(out, ref)
    worst = (out.double().cpu() - ref.double().cpu()).abs().max().item()  # NaN fails below
    ok = err <= tol and worst <= max_tol
    return {"rel_err": err, "tol": tol, "max_diff": worst, "max_tol": max_tol, "ok": ok}


def _numbers(c: dict) -> str:
    return (
        f"relative error {c['rel_err']:.1e} (limit {c['tol']:.0e}), "
        f"worst probability difference {c['max_diff']:.1e} (limit {c['max_tol']:.0e})"
    )


def check_optimized(console: Console, model, fused, dense, sparse) -> dict:
    """The optimized model's predictions against those of a float64 copy of ``model`` on
    the same inputs (the eager model's too, for context); prints both, returns the first."""
    dtype = next(model.parameters()).dtype
    # fuseml's float32 dots, like torch's, round through tf32 only where this flag allows
    tf32 = torch.backends.cuda.matmul.allow_tf32
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(dense.double(), sparse)
        eager = check_predictions(model(dense, sparse), ref, dtype, tf32=tf32)
        check = check_predictions(fused(dense, sparse), ref, dtype, tf32=tf32)
    console.print(f"eager model vs float64 (for context): {_numbers(eager)}")
    if check["ok"]:
        console.print(f"[green]PASS[/green] optimized model vs float64: {_numbers(check)}")
    else:
        console.print(
            f"[bold red]FAIL: the optimized model's predictions are wrong: {_numbers(check)}"
            "[/bold red]"
        )
    return check


def _optimized_matches(console: Console, checkpoint, *, batch: int = 4096) -> dict:
    """fuseml.optimize on the trained model: what it swapped, and that the predictions of
    the optimized model are the original's (``check_optimized``)."""
    import fuseml
    from fuseml.apps.common import load_checkpoint, model_from_checkpoint
    from fuseml.models.bench_cases import random_inputs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model_from_checkpoint(load_checkpoint(checkpoint)).to(device).eval()
    fused, report = fuseml.optimize(model)
    console.print(str(report))
    dense, sparse = random_inputs(model.config, batch, device)
    where = (
        "fused Triton kernels"
        if device == "cuda"
        else "CPU tensors: the fused modules run their PyTorch reference here"
    )
    console.print(f"optimized model ({where}), predictions on {batch:,} rows:")
    return check_optimized(console, model, fused, dense, sparse)


def _eager_vs_compile(
    console: Console,
    *,
    config: str = "kaggle",
    batch_sizes: tuple[int, ...] = (2048, 16384),
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    max_cardinality: int = 1_000_000,
    bench: Callable[[Callable[[], torch.Tensor]], float] | None = None,
) -> tuple[dict[int, dict[str, float]], dict[int, dict]]:
    """Samples/s of a DLRM's inference: eager, torch.compile and the fuseml.optimize'd
    model (default: the Kaggle architecture with tables capped at 1M rows, bf16), and per
    batch size the fused and eager models' predictions checked against float64.
    ``bench(fn)`` returns ms per call (default: triton.testing.do_bench, median)."""
    if bench is None:
        import triton.testing

        bench = lambda fn: triton.testing.do_bench(fn, return_mode="median")
    from fuseml.models.bench_cases import dlrm_inference_cases

    dtype_name = str(dtype).removeprefix("torch.")
    table = Table(
        title=f"DLRM {config} inference, {dtype_name} (tables capped at {max_cardinality:,} "
        "rows): samples/s"
    )
    for col in ("batch", "eager", "compile", "fuseml.optimize", "compile vs eager",
                "fuseml vs eager", "vs float64"):  # fmt: skip
        table.add_column(col, justify="right")
    rates, checks = {}, {}
    cases = dlrm_inference_cases(
        config, batch_sizes, dtype, device, max_cardinality=max_cardinality
    )
    import fuseml

    fused_model = ref_model = None
    for case in cases:
        if fused_model is None:  # one model shared by the cases
            fused_model, _ = fuseml.optimize(case.model)
            ref_model = copy.deepcopy(case.model).double()  # Kaggle, 1M-row cap: 0.7 GB
        dense, sparse = case.inputs

        def fused(model=fused_model, dense=dense, sparse=sparse) -> torch.Tensor:
            with torch.no_grad():
                return model(dense, sparse)

        arms = {**case.arms, "fused": fused}
        out = {arm: fn() for arm, fn in arms.items()}  # compiling and tuning: not timed
        with torch.no_grad():
            ref = ref_model(dense.double(), sparse)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        eager = check_predictions(out["eager"], ref, dtype, tf32=tf32)
        check = checks[case.batch_size] = check_predictions(out["fused"], ref, dtype, tf32=tf32)
        rate = {arm: case.batch_size / (bench(fn) * 1e-3) for arm, fn in arms.items()}
        rates[case.batch_size] = rate
        table.add_row(
            f"{case.batch_size:,}",
            f"{rate['eager']:,.0f}",
            f"{rate['compile']:,.0f}",
            f"{rate['fused']:,.0f}",
            f"{rate['compile'] / rate['eager']:.2f}x",
            f"{rate['fused'] / rate['eager']:.2f}x",
            f"{'[green]ok[/green]' if check['ok'] else '[red]WRONG[/red]'} "
            f"{check['rel_err']:.1e} (eager {eager['rel_err']:.1e})",
        )
    console.print(table)
    for batch, check in checks.items():
        if not check["ok"]:
            console.print(
                f"[bold red]FAIL: at batch {batch:,} the optimized model's predictions are "
                f"wrong (vs float64): {_numbers(check)}[/bold red]"
            )
    return rates, checks


def _summary(console: Console, n: dict, checkpoint, predictions) -> None:
    table = Table(title="DLRM demo summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("synthetic rows", f"{n['rows']:,} ({n['data_s']:.1f} s to make)")
    table.add_row("training (tiny, 3 epochs, with evaluation)", f"{n['train_s']:.1f} s")
    table.add_row("test AUC of the trained model", f"{n['test_auc']:.4f}")
    table.add_row("best achievable AUC on the test split", f"{n['best_auc_test_split']:.4f}")
    table.add_row("best achievable AUC on all rows", f"{n['best_auc']:.4f}")
    table.add_row("prediction, test split", f"{n['predict_rows_per_s']:,.0f} rows/s")
    for what, c in n["checks"].items():
        verdict = "[green]ok[/green]" if c["ok"] else "[bold red]FAILED[/bold red]"
        table.add_row(
            f"fuseml.optimize, {what}: error, worst diff",
            f"{c['rel_err']:.1e} (<= {c['tol']:.0e}), {c['max_diff']:.1e} "
            f"(<= {c['max_tol']:.0e}) {verdict}",
        )
    console.print(table)
    console.print(f"checkpoint: {Path(checkpoint).resolve()}", soft_wrap=True)
    console.print(f"predictions: {Path(predictions).resolve()}", soft_wrap=True)
    console.print(
        "[dim]The best AUC is that of the generator's true click probabilities. A model "
        "learns from finite data, and from features where a missing count and a 0 look "
        "the same (the reference preprocessing; that alone costs about 0.003 AUC here), so "
        "it stays 0.01-0.02 below.[/dim]"
    )
    if not torch.cuda.is_available():
        console.print(
            "[dim]Eager vs torch.compile inference timing needs a GPU; "
            "`fuseml profile dlrm` shows where CPU time goes.[/dim]"
        )
