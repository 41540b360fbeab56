"""The ``fuseml`` command line: env | bench | demo | train | predict | profile.

Heavy imports (torch, triton) happen inside the commands, so ``fuseml --help`` is fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


# The --backend of predict and profile: fuseml.apps.common.MODEL_BACKENDS (kept as text
# here so that ``fuseml --help`` imports no torch).
_BACKEND_HELP = (
    "eager (the model as is) | compile (torch.compile) | auto | triton (fuseml.optimize "
    "with that op backend; auto: Triton on a GPU, the PyTorch reference on a CPU)"
)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    _setup_logging(verbose)
    # Triton's installation hash from disk, not rehashed in every process (opt-in: it
    # replaces triton_key in the loaded Triton modules, so the library never does it).
    from fuseml import runtime

    runtime.enable_triton_key_cache()


@app.command()
def env(
    remeasure: Annotated[
        bool, typer.Option(help="measure the GPU ceilings again instead of using the cache")
    ] = False,
    build_cuda: Annotated[
        bool, typer.Option(help="build the CUDA C++ extension now to check that it works")
    ] = True,
) -> None:
    """Versions, device, working backends and (on a GPU) the measured ceilings."""
    from fuseml.apps.env import print_env

    print_env(remeasure=remeasure, build_cuda=build_cuda)


@app.command()
def bench(
    suite: Annotated[str, typer.Argument(help="suite name, or 'readme' to regenerate tables")],
    quick: Annotated[bool, typer.Option(help="fewer sizes, shorter timing")] = False,
    arms: Annotated[
        str | None, typer.Option(help="comma-separated arms to run (default: all)")
    ] = None,
    cases: Annotated[
        str | None, typer.Option(help="regular expression: run only the cases it matches")
    ] = None,
    merge: Annotated[
        bool, typer.Option(help="add to the existing results file (a suite run in parts)")
    ] = False,
    out: Annotated[Path | None, typer.Option(help="results root folder")] = None,
    turns: Annotated[
        bool,
        typer.Option(
            help="time every case's arms in turns, graph rows too (default: only cases of "
            "0.5 ms a call or more)"
        ),
    ] = False,
    sweep: Annotated[
        bool,
        typer.Option(
            help="also time every candidate launch config of fuseml's kernel (arms named "
            "ARM@CONFIG) in the cases that have one; written to SUITE-sweep.json"
        ),
    ] = False,
) -> None:
    """Time a suite's arms side by side; write results JSON, a PNG plot and a table."""
    if suite == "readme":
        from fuseml.bench.readme import regenerate

        regenerate(Path("README.md"), out or Path("benchmarks/results"))
        return
    from fuseml.bench import run_suite

    try:
        run_suite(
            suite,
            quick=quick,
            arms=arms.split(",") if arms else None,
            cases=cases,
            merge=merge,
            out_root=out,
            turns=turns,
            sweep=sweep,
        )
    except (ValueError, RuntimeError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err


@app.command()
def demo() -> None:
    """Environment, elementwise ops through every backend, then DLRM end to end (synthetic)."""
    from fuseml.apps.demo import run_demo
    from fuseml.apps.demo_dlrm import DemoCheckFailed

    try:
        run_demo()
    except DemoCheckFailed as err:
        _fail(err, code=1)  # the demo ran; what it showed was wrong


def _fail(err: Exception, code: int = 2) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(code) from err


@app.command()
def train(
    config: Annotated[
        str, typer.Option(help="named config (tiny, kaggle, terabyte, mlperf) or a JSON file")
    ],
    data: Annotated[
        Path | None, typer.Option(help="dataset folder written by fuseml.data.prepare")
    ] = None,
    synthetic: Annotated[
        int | None,
        typer.Option(help="instead of --data: generate and prepare this many synthetic rows"),
    ] = None,
    max_cardinality: Annotated[
        int, typer.Option(help="--synthetic: cap on each table's distinct values")
    ] = 100,
    epochs: Annotated[int, typer.Option(help="passes over the training split")] = 1,
    batch_size: Annotated[
        int | None, typer.Option(help="default: the reference's (kaggle 128, terabyte 2048)")
    ] = None,
    lr: Annotated[
        float | None, typer.Option(help="default: sgd 0.1, adagrad 0.01, adam 0.001")
    ] = None,
    optimizer: Annotated[str, typer.Option(help="sgd | adagrad | adam")] = "sgd",
    dtype: Annotated[str, typer.Option(help="fp32 | bf16 (autocast)")] = "fp32",
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the model")] = False,
    out: Annotated[
        Path | None, typer.Option(help="checkpoint + metrics folder (default runs/dlrm-CONFIG)")
    ] = None,
    resume: Annotated[Path | None, typer.Option(help="continue from this checkpoint")] = None,
    tensorboard: Annotated[
        Path | None, typer.Option(help="write TensorBoard scalars here (needs tensorboard)")
    ] = None,
    device: Annotated[str | None, typer.Option(help="default: cuda if available")] = None,
    seed: Annotated[int, typer.Option(help="seed of the model, shuffling and data")] = 0,
    progress: Annotated[bool, typer.Option(help="show progress bars")] = True,
) -> None:
    """Train a DLRM (BCE with logits); validation AUC after each epoch, test AUC at the end."""
    from fuseml.apps.common import resolve_device
    from fuseml.apps.train import TrainOptions, synthetic_dataset
    from fuseml.apps.train import train as run_train
    from fuseml.models.dlrm import CONFIG_NAMES

    if (data is None) == (synthetic is None):
        _fail(ValueError("give exactly one of --data DIR and --synthetic ROWS"))
    if config not in CONFIG_NAMES and not Path(config).is_file():
        _fail(
            ValueError(f"--config {config!r} is neither a named config {CONFIG_NAMES} nor a file")
        )
    try:
        name = Path(config).stem if Path(config).suffix else config
        options = TrainOptions(
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            optimizer=optimizer,
            dtype=dtype,
            compile=compile,
            device=device,
            seed=seed,
            out_dir=out or Path("runs") / f"dlrm-{name}",
            resume=resume,
            tensorboard=tensorboard,
            progress=progress,
        )
        resolve_device(device)  # fail before generating any data
        if synthetic is not None:
            data, summary = synthetic_dataset(
                synthetic, seed=seed, max_cardinality=max_cardinality, progress=progress
            )
            best = "n/a" if summary.best_auc is None else f"{summary.best_auc:.4f}"
            typer.echo(f"synthetic data: {data} (best achievable AUC {best})")
        run_train(config, data, options)
    except (ValueError, FileNotFoundError, FloatingPointError) as err:
        _fail(err)


@app.command()
def predict(
    checkpoint: Annotated[Path, typer.Option(help="checkpoint.pt written by fuseml train")],
    data: Annotated[
        Path, typer.Option(help="prepared dataset folder, or a raw Criteo TSV (.gz) file")
    ],
    out: Annotated[Path, typer.Option(help="predictions file: .parquet or .csv")],
    split: Annotated[str, typer.Option(help="prepared data: which split")] = "test",
    backend: Annotated[str, typer.Option(help=_BACKEND_HELP)] = "eager",
    batch_size: Annotated[int, typer.Option(help="rows per model call")] = 16384,
    dtype: Annotated[str, typer.Option(help="fp32 | bf16 (autocast)")] = "fp32",
    device: Annotated[str | None, typer.Option(help="default: cuda if available")] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Write click probabilities (row id, probability, label if known) for every row."""
    from fuseml.apps.common import check_model_backend
    from fuseml.apps.predict import predict as run_predict

    try:
        check_model_backend(backend, name="--backend")
        run_predict(
            checkpoint,
            data,
            out,
            split=split,
            backend=backend,
            batch_size=batch_size,
            dtype=dtype,
            device=device,
            progress=progress,
        )
    except (ValueError, FileNotFoundError, TypeError) as err:
        _fail(err)


data_app = typer.Typer(no_args_is_help=True, help="Criteo data: prepare real files, synthesize.")
app.add_typer(data_app, name="data")

# prepare()'s parameters whose flag is not simply --name-with-dashes.
_PREPARE_FLAGS = {"src": "SRC", "out_dir": "--out"}
# One string per paragraph: the help renderer keeps single line breaks as they are.
_PREPARE_HELP = (
    "Preprocess Criteo TSV files into parquet splits, as the reference DLRM does.\n\n"
    "The default (--mode vocab --min-freq 1) is the reference DLRM's: every categorical value "
    "seen in the training split gets its own id, and each table has exactly as many rows as "
    "its column needs, plus one for missing and one for values unseen in training. On "
    "Kaggle's 45M-row train.txt that is about 34M ids in all, a 2.2 GB kaggle model (16 "
    "dims): it fits one machine and loses no value. --min-freq 3 or --max-ind-range N make "
    "the tables smaller; --mode hash --max-ind-range N skips the counting pass.\n\n"
    "The dataset appears at --out only when complete; its metadata.json records the mode, "
    "the caps, each table's size and its distinct training values."
)


@data_app.command("prepare", help=_PREPARE_HELP)
def data_prepare(
    src: Annotated[
        list[Path],
        typer.Argument(
            help="Criteo TSV file(s), plain or .gz; with --split day, the days in order",
            metavar="SRC",
            readable=False,  # prepare checks, and names the file in one line
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(help="output dataset folder (parquet splits + metadata.json)", readable=False),
    ],
    mode: Annotated[
        str,
        typer.Option(
            help="vocab: every value seen --min-freq times in training gets its own id, tables "
            "sized to the data (two passes); hash: id = value mod --max-ind-range, every table "
            "exactly that size (one pass)"
        ),
    ] = "vocab",
    max_ind_range: Annotated[
        int | None,
        typer.Option(
            help="upper bound on each table's ids (vocab: keep the most frequent values; "
            "hash: required, the size of every table)",
            show_default="none: each table as large as its data needs",
        ),
    ] = None,
    min_freq: Annotated[
        int, typer.Option(help="vocab: training occurrences a value needs for its own id")
    ] = 1,
    split: Annotated[
        str,
        typer.Option(
            help="rows: each line drawn at random (seeded); day: the last file is "
            "test (first part) + validation (rest), the others train"
        ),
    ] = "rows",
    val_fraction: Annotated[
        float | None,
        typer.Option(
            help="share of lines for validation (--split day: of the last day, from its end)",
            show_default="0.05; --split day: 0.5",
        ),
    ] = None,
    test_fraction: Annotated[
        float | None,
        typer.Option(help="--split rows: share of lines for test", show_default="0.05"),
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of the row split")] = 0,
    skip_bad_lines: Annotated[
        bool, typer.Option(help="skip malformed lines and report how many, instead of failing")
    ] = False,
    overwrite: Annotated[bool, typer.Option(help="replace an existing dataset at --out")] = False,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    import time

    from fuseml.data import prepare
    from fuseml.data._progress import human_count, human_rate
    from fuseml.data.errors import OptionError

    start = time.perf_counter()
    try:
        meta = prepare(
            src if len(src) > 1 else src[0], out, mode=mode, max_ind_range=max_ind_range,
            min_freq=min_freq, split=split, val_fraction=val_fraction,
            test_fraction=test_fraction, seed=seed, skip_bad_lines=skip_bad_lines,
            overwrite=overwrite, progress=progress,
        )  # fmt: skip
    except OptionError as err:
        _fail(err.for_cli(**_PREPARE_FLAGS))
    except (ValueError, OSError) as err:  # InputError names the file (and line)
        _fail(err)
    seconds = time.perf_counter() - start
    splits = ", ".join(
        f"{name} {human_count(info['rows'])}" for name, info in meta["splits"].items()
    )
    cards = meta["cardinalities"]
    skipped = (
        f", {meta['skipped_lines']:,} malformed lines skipped" if meta["skipped_lines"] else ""
    )
    typer.echo(
        f"wrote {out}: {human_count(meta['rows'])} rows ({splits}), "
        f"{100 * meta['positive_rate']:.1f}% positive; {meta['options']['mode']} mode, "
        f"{len(cards)} tables of {human_count(min(cards))} to {human_count(max(cards))} ids "
        f"({human_count(sum(cards))} in all){skipped}; {seconds:.1f} s, "
        f"{human_rate(meta['rows'] / max(seconds, 1e-9))} rows/s"
    )


@data_app.command("synth")
def data_synth(
    rows: Annotated[int, typer.Option(help="rows to generate")],
    out: Annotated[
        Path,
        typer.Option(help="output TSV file (a name ending in .gz compresses)", readable=False),
    ],
    seed: Annotated[int, typer.Option(help="seed of every random draw")] = 0,
    scale: Annotated[
        float, typer.Option(help="multiply the Kaggle table cardinalities by this")
    ] = 1.0,
    max_cardinality: Annotated[
        int | None,
        typer.Option(
            help="cap on every table's distinct values",
            show_default="none: Kaggle's sizes",
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Generate Criteo-format TSV with a hidden click model (true probabilities saved)."""
    from fuseml.data import synth
    from fuseml.data.errors import OptionError

    try:
        summary = synth(
            rows, out, seed=seed, scale=scale, max_cardinality=max_cardinality,
            gzip=str(out).endswith(".gz"), progress=progress,
        )  # fmt: skip
    except OptionError as err:
        _fail(err.for_cli(out_path="--out"))
    except (ValueError, OSError) as err:
        _fail(err)
    auc = "n/a (one class only)" if summary.best_auc is None else f"{summary.best_auc:.4f}"
    typer.echo(
        f"wrote {summary.path}: {summary.rows:,} rows, {100 * summary.positive_rate:.1f}% "
        f"positive, best achievable AUC {auc} (true probabilities in {summary.probs_path})"
    )


profile_app = typer.Typer(no_args_is_help=True, help="Profile a model's inference.")
app.add_typer(profile_app, name="profile")


@profile_app.command("dlrm")
def profile_dlrm(
    config: Annotated[str, typer.Option(help="tiny | kaggle | terabyte | mlperf")] = "tiny",
    backend: Annotated[str, typer.Option(help=_BACKEND_HELP)] = "eager",
    batch_size: Annotated[int, typer.Option(help="rows per forward pass")] = 2048,
    steps: Annotated[int, typer.Option(help="profiled forward passes")] = 10,
    warmup: Annotated[int, typer.Option(help="unprofiled passes first")] = 3,
    dtype: Annotated[str, typer.Option(help="fp32 | bf16")] = "fp32",
    max_cardinality: Annotated[
        int | None, typer.Option(help="cap each table (default: Kaggle sizes; tiny 1000)")
    ] = None,
    out: Annotated[Path, typer.Option(help="folder for the Chrome trace")] = Path("runs/profile"),
    device: Annotated[str | None, typer.Option(help="default: cuda if available")] = None,
) -> None:
    """torch.profiler trace of DLRM inference, ranges per stage, top-10 kernels (or ops)."""
    from fuseml.apps.common import check_model_backend
    from fuseml.apps.profile import profile_dlrm as run_profile

    try:
        check_model_backend(backend, name="--backend")
        run_profile(
            config,
            backend=backend,
            batch_size=batch_size,
            steps=steps,
            warmup=warmup,
            out_dir=out,
            device=device,
            dtype=dtype,
            max_cardinality=max_cardinality,
        )
    except ValueError as err:
        _fail(err)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
