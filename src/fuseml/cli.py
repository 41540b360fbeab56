"""The ``fuseml`` command line: env | bench | demo (and more as they land).

Heavy imports (torch, triton) happen inside the commands, so ``fuseml --help`` is fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    _setup_logging(verbose)


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
    from fuseml.env import print_env

    print_env(remeasure=remeasure, build_cuda=build_cuda)


@app.command()
def bench(
    suite: Annotated[str, typer.Argument(help="suite name, or 'readme' to regenerate tables")],
    quick: Annotated[bool, typer.Option(help="fewer sizes, shorter timing")] = False,
    arms: Annotated[
        str | None, typer.Option(help="comma-separated arms to run (default: all)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="results root folder")] = None,
) -> None:
    """Time a suite's arms side by side; write results JSON, a PNG plot and a table."""
    if suite == "readme":
        from fuseml.bench.readme import regenerate

        regenerate(Path("README.md"), out or Path("benchmarks/results"))
        return
    from fuseml.bench import run_suite

    try:
        run_suite(suite, quick=quick, arms=arms.split(",") if arms else None, out_root=out)
    except (ValueError, RuntimeError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err


@app.command()
def demo() -> None:
    """Environment report, then every elementwise op through every backend that runs here."""
    from fuseml.demo import run_demo

    run_demo()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
