"""The fuseml command line: env | bench | demo | train | predict | profile | data.

Heavy imports (torch, triton) happen inside the commands, so that fuseml --help is fast.
An error the user's input or arguments cause (fuseml.apps.common.is_user_error) is one
line naming the CLI flag or file, exit code 2; --verbose shows its traceback too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

_HELP = (
    "fuseml: fused GPU kernels for DLRM and LoRA-MLP inference, and the tools around them."
    "\n\nAn error in your input or arguments prints one line and exits with code 2; "
    "-v shows its traceback too."
)
app = typer.Typer(add_completion=False, no_args_is_help=True, help=_HELP)


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


# What _fail needs of the running command: --verbose, and the command's arguments by their
# Python names (set by _main and _user_errors; one command runs per process).
_current: dict[str, Any] = {"verbose": False, "params": {}}
_VERBOSE_HELP = "debug logs, and the traceback of an error"


@app.callback()
def _main(
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help=_VERBOSE_HELP + " (also taken after the command)",
            show_default="off",
        ),
    ] = False,
) -> None:
    _current["verbose"] = verbose
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
        _fail(err)


@app.command()
def demo() -> None:
    """Environment, elementwise ops through every backend, then DLRM end to end (synthetic)."""
    from fuseml.apps.demo import run_demo
    from fuseml.apps.demo_dlrm import DemoCheckFailed

    try:
        run_demo()
    except DemoCheckFailed as err:
        _fail(err, code=1)  # the demo ran; what it showed was wrong


def _flag_renames() -> dict[str, str]:
    """The running command's parameters whose flag is not ``--`` + the name with dashes
    (``out_dir`` -> ``--out``) and its arguments (``src`` -> ``SRC``), from click's context:
    what ``OptionError.for_cli`` needs to name them."""
    import click

    ctx = click.get_current_context(silent=True)
    renames: dict[str, str] = {}
    for p in ctx.command.params if ctx is not None else ():
        if isinstance(p, click.Argument):
            renames[p.name] = p.human_readable_name
        elif isinstance(p, click.Option):
            flag = next((o for o in p.opts if o.startswith("--")), p.opts[0])
            if flag != "--" + p.name.replace("_", "-"):
                renames[p.name] = flag
    return renames


def _input_files(params: dict[str, Any]) -> list[Path]:
    """The files among a command's arguments (SRC, --data, ...), for naming a bad one."""
    found: list[Path] = []
    for value in params.values():
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [Path(v) for v in values if isinstance(v, Path) and v.is_file()]
    return found


def _fail(err: BaseException, code: int = 2, library_names: dict | None = None) -> None:
    """Exit with ``code`` after one line for ``err`` (its traceback first with --verbose).
    An OptionError names the command's flags (``library_names``: flags of a library
    function's parameters named otherwise than the command's)."""
    from fuseml.apps.common import user_message

    if _current["verbose"]:
        typer.echo("".join(traceback.format_exception(err)).rstrip(), err=True)
    from fuseml.data.errors import OptionError

    if isinstance(err, OptionError):  # the parameters it names, as the command's flags
        err = err.for_cli(**{**_flag_renames(), **(library_names or {})})
    message = user_message(err, _input_files(_current["params"]))
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code) from err


# Every command takes -v too, where a user adds it after seeing an error.
_VERBOSE_PARAM = inspect.Parameter(
    "verbose",
    inspect.Parameter.KEYWORD_ONLY,
    default=False,
    annotation=Annotated[
        bool, typer.Option("--verbose", "-v", help=_VERBOSE_HELP, show_default="off")
    ],
)


def _user_errors(command: Callable) -> Callable:
    """``command``, with an error the user caused shown by ``_fail``, and a -v/--verbose
    option. Click itself would turn an EOFError (a truncated gzip file) into a bare
    "Aborted!", so it is caught here; what click raises to exit or to report a usage error
    is no user error here and passes."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        if kwargs.pop("verbose", False):
            _current["verbose"] = True
            logging.getLogger().setLevel(logging.DEBUG)
        _current["params"] = kwargs
        try:
            return command(*args, **kwargs)
        except Exception as err:
            from fuseml.apps.common import is_user_error

            if not is_user_error(err):
                raise
            _fail(err)

    signature = inspect.signature(command, eval_str=True)
    if "verbose" not in signature.parameters:
        params = [*signature.parameters.values(), _VERBOSE_PARAM]
        run.__signature__ = signature.replace(parameters=params)  # what typer reads
    return run


def _wrap_commands(typer_app: typer.Typer) -> None:
    """Every command of ``typer_app`` and its groups runs under ``_user_errors``."""
    for info in typer_app.registered_commands:
        if info.callback is not None and not hasattr(info.callback, "__wrapped__"):
            info.callback = _user_errors(info.callback)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _wrap_commands(group.typer_instance)


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
    from fuseml.data.errors import OptionError
    from fuseml.models.dlrm import CONFIG_NAMES

    if (data is None) == (synthetic is None):
        _fail(ValueError("give exactly one of --data DIR and --synthetic ROWS"))
    if config not in CONFIG_NAMES and not Path(config).is_file():
        _fail(
            ValueError(f"--config {config!r} is neither a named config {CONFIG_NAMES} nor a file")
        )
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
        try:
            data, summary = synthetic_dataset(
                synthetic, seed=seed, max_cardinality=max_cardinality, progress=progress
            )
        except OptionError as err:  # synth()'s rows are --synthetic here
            _fail(err, library_names={"rows": "--synthetic"})
        best = "n/a" if summary.best_auc is None else f"{summary.best_auc:.4f}"
        typer.echo(f"synthetic data: {data.resolve()} (best achievable AUC {best})")
    run_train(config, data, options)


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

    check_model_backend(backend)
    with _sigterm_exits():  # predict removes its temporary file, as on Ctrl-C
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


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Within: SIGTERM (``kill``) raises SystemExit(143) in the main thread, so that cleanups
    run as on Ctrl-C instead of the process vanishing mid-write."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


data_app = typer.Typer(no_args_is_help=True, help="Criteo data: prepare real files, synthesize.")
app.add_typer(data_app, name="data")

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

    start = time.perf_counter()
    try:
        meta = prepare(
            src if len(src) > 1 else src[0], out, mode=mode, max_ind_range=max_ind_range,
            min_freq=min_freq, split=split, val_fraction=val_fraction,
            test_fraction=test_fraction, seed=seed, skip_bad_lines=skip_bad_lines,
            overwrite=overwrite, progress=progress,
        )  # fmt: skip
    except (ValueError, OSError) as err:  # InputError names the file (and line)
        _fail(err, library_names={"out_dir": "--out"})  # prepare()'s name for --out
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

    try:
        summary = synth(
            rows, out, seed=seed, scale=scale, max_cardinality=max_cardinality,
            gzip=str(out).endswith(".gz"), progress=progress,
        )  # fmt: skip
    except (ValueError, OSError) as err:
        _fail(err, library_names={"out_path": "--out"})  # synth()'s name for --out
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

    check_model_backend(backend)
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


_wrap_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
