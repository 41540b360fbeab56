"""Click probabilities from a trained DLRM checkpoint (``fuseml predict``).

Public API::

    summary = predict(checkpoint, source, out, split="test", backend="eager", batch_size=16384)
    summary.rows, summary.seconds, summary.rows_per_s, summary.metrics

``source`` is either a dataset folder written by ``fuseml.data.prepare`` (one split of it
is scored) or a raw Criteo TSV file (plain or .gz, with or without the label column),
which is preprocessed on the fly exactly as the model's training data was: the same dense
transform, and the same hash range or the vocabulary stored in the checkpoint. A prepared
dataset whose tables or id mapping differ from the model's is refused.

Rows are streamed: a background thread reads and decodes batches ahead of the model (in
order; its errors are raised as the loop's), up to about 256 MB of them (at least 2
batches, at most 64), so that reading goes on while the model's first call tunes,
compiles or captures; beyond those, at most a reader chunk (TSV) or a row group (prepared
data) is in memory. Another thread writes each scored batch while the model scores the
next ones. The output (.parquet or .csv, by suffix) has columns ``row_id`` (TSV: the
1-based line number; prepared data: the 0-based row of the split), ``probability`` and,
when the source has labels, ``label``. It is written to a temporary file beside ``out``
(``.NAME.PID.partial``) and renamed to ``out`` only once every row is scored: an error or
a kill never leaves a file at ``out`` that looks complete. Temporaries of earlier runs for
the same ``out`` whose process is gone are removed.

Backends: ``eager`` (the model as trained), ``compile`` (torch.compile, one static batch
shape: the last batch is padded), and ``auto`` or ``triton`` (``fuseml.optimize`` with that
op backend: fused Triton MLPs and linear layers; ``auto`` runs their PyTorch reference on a
CPU); on CUDA the optimized model is served through CUDA graphs (``fuseml.cuda_graphs``, one
per batch bucket up to ``batch_size``, captured on first use; the graphs check the ids on
the device and the flags are read after each replay; a model that cannot be captured runs
eagerly, with a logged warning). Compiled code skips the model's id check: the compile
backend checks each batch before its call. With ``dtype="bf16"`` the eager and compile
backends use autocast, the optimized ones cast the model to bfloat16 (the custom kernels do
not take part in autocast).

Timing: the model's first call (tuning, compilation) and every call that captured a CUDA
graph are reported apart from the steady-state rows/s of the other calls.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from fuseml.apps.common import (
    DTYPES,
    MODEL_BACKENDS,
    OPTIMIZE_BACKENDS,
    RateColumn,
    check_data_matches,
    check_model_backend,
    load_checkpoint,
    metrics_from_logits,
    model_from_checkpoint,
    resolve_device,
)
from fuseml.data import (
    NUM_DENSE,
    NUM_SPARSE,
    CriteoDataset,
    CriteoReader,
    Vocabulary,
    hash_sparse,
    load_metadata,
    transform_dense,
)
from fuseml.data.criteo import open_maybe_gzip
from fuseml.data.errors import Flag, OptionError
from fuseml.models.dlrm import DLRM
from fuseml.serving import DEFAULT_BATCH_SIZES, CudaGraphs

__all__ = ["BACKENDS", "PredictSummary", "predict"]

BACKENDS = MODEL_BACKENDS
_OUT_FORMATS = (".parquet", ".csv")
_TSV_CHUNK_ROWS = 1 << 16  # rows a raw TSV file is read (and preprocessed) in at a time


@dataclass
class PredictSummary:
    out: Path
    rows: int
    seconds: float  # wall time of the whole stream: reading, preprocessing, model, writing
    model_seconds: float  # time spent in the model (synchronised on CUDA)
    has_labels: bool
    metrics: dict[str, Any] | None  # AUC, log loss, accuracy when the source has labels
    # Model calls that tuned, compiled or captured (the first call, and each call that
    # captured a CUDA graph for a new batch bucket): part of model_seconds, reported apart.
    setup_seconds: float = 0.0
    setup_rows: int = 0
    # Seconds of each model call that did no setup, in call order.
    steady_call_seconds: tuple[float, ...] = ()
    # Seconds the loop waited for the reader (reading and preprocessing not hidden behind
    # the model's calls and the writing)
    input_wait_seconds: float = 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")

    @property
    def steady_rows_per_s(self) -> float:
        """Model-only rows/s over the calls that did no setup (nan when there are none)."""
        seconds = self.model_seconds - self.setup_seconds
        rows = self.rows - self.setup_rows
        return rows / seconds if rows > 0 and seconds > 0 else float("nan")

    @property
    def steady_call_ms(self) -> float:
        """Median ms of a model call that did no setup (nan when there are none)."""
        calls = self.steady_call_seconds
        return 1e3 * float(np.median(calls)) if calls else float("nan")


@dataclass
class _Batch:
    row_ids: np.ndarray  # (B,) int64
    dense: torch.Tensor  # (B, 13) float32
    sparse: torch.Tensor  # (B, 26) int64
    labels: np.ndarray | None  # (B,) int8


class _Source:
    """Batches of preprocessed rows, plus what a progress bar needs."""

    total: int  # progress units (rows or bytes)
    unit: str
    has_labels: bool

    def __iter__(self) -> Iterator[tuple[_Batch | None, int]]:
        """(batch or None, progress to advance)."""
        raise NotImplementedError


class _PreparedSource(_Source):
    def __init__(self, root: Path, split: str, batch_size: int) -> None:
        # streamed by row group (no split-sized cache): the first batch is ready after one
        self.dataset = CriteoDataset(
            root, split, batch_size=batch_size, shuffle=False, max_cached_rows=0
        )
        self.total, self.unit, self.has_labels = self.dataset.num_rows, "rows", True

    def __iter__(self) -> Iterator[tuple[_Batch | None, int]]:
        start = 0
        for batch in self.dataset:
            n = len(batch.labels)
            ids = np.arange(start, start + n, dtype=np.int64)
            labels = batch.labels.numpy().astype(np.int8)
            yield _Batch(ids, batch.dense, batch.sparse, labels), n
            start += n


class _TsvSource(_Source):
    def __init__(
        self, path: Path, trained_on: dict[str, Any], batch_size: int, has_label: bool | None
    ) -> None:
        self.has_labels = _detect_label_column(path) if has_label is None else has_label
        self.reader = CriteoReader(
            path, has_label=self.has_labels, chunk_rows=max(batch_size, _TSV_CHUNK_ROWS)
        )
        self.batch_size = batch_size
        self.total, self.unit = self.reader.size_bytes, "bytes"  # rows unknown until read
        options = trained_on["metadata"]["options"]
        if options["mode"] == "hash":
            caps = options["max_ind_range"]
            self.to_ids = lambda values: hash_sparse(values, caps)
        else:
            vocab = trained_on["vocabulary"]
            keys = tuple(k.numpy() for k in vocab["keys"])
            self.to_ids = Vocabulary(keys=keys, min_freq=vocab["min_freq"]).lookup

    def __iter__(self) -> Iterator[tuple[_Batch | None, int]]:
        done = 0
        for chunk in self.reader:
            dense = torch.from_numpy(transform_dense(chunk.dense, chunk.dense_missing))
            sparse = torch.from_numpy(self.to_ids(chunk.sparse))
            advance = self.reader.bytes_read - done
            done = self.reader.bytes_read
            for s in range(0, chunk.num_rows, self.batch_size):
                rows = slice(s, s + self.batch_size)
                labels = chunk.labels[rows] if chunk.labels is not None else None
                yield _Batch(chunk.line_numbers[rows], dense[rows], sparse[rows], labels), 0
            yield None, advance


# Batches read ahead: as many as fit in _PREFETCH_BYTES (at least 2, at most
# _PREFETCH_MAX), so that reading goes on through the model's first call (tuning,
# compilation, graph capture: up to seconds) instead of stopping two batches in.
_PREFETCH_BYTES = 256 << 20
_PREFETCH_MAX = 64
# a batch row in memory: dense float32, ids int64, row id int64, label int8
_ROW_BYTES = NUM_DENSE * 4 + NUM_SPARSE * 8 + 8 + 1


def prefetch_depth(batch_size: int) -> int:
    """Batches of ``batch_size`` rows the reader keeps ready (see _PREFETCH_BYTES)."""
    return max(2, min(_PREFETCH_MAX, _PREFETCH_BYTES // (batch_size * _ROW_BYTES)))


def _prefetched(items: Iterable[Any], depth: int = 2) -> Iterator[Any]:
    """``items`` in order, produced on a background thread up to ``depth`` ahead; an error
    there is raised here. Closing the generator (the loop ended early or raised) stops the
    thread at its next item."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry: tuple) -> bool:  # False once the consumer has gone
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(("item", item)):
                    return
            put(("done", None))
        except BaseException as err:  # re-raised in the consumer
            put(("error", err))

    thread = threading.Thread(target=produce, name="fuseml-predict-reader", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = ready.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        thread.join(timeout=10)


def _detect_label_column(path: Path) -> bool:
    """True for 40 fields on the first line (label + 13 + 26), False for 39."""
    with open_maybe_gzip(path) as (_, stream):
        first = stream.read(1 << 16).split(b"\n", 1)[0]
    n = first.count(b"\t") + 1
    if n == 1 + NUM_DENSE + NUM_SPARSE:
        return True
    if n == NUM_DENSE + NUM_SPARSE:
        return False
    raise ValueError(
        f"{path}: the first line has {n} tab-separated fields; a Criteo TSV line has 40 "
        "(label, 13 counts, 26 categories) or 39 (no label)"
    )


def _partial_path(out: Path, pid: int) -> Path:
    return out.with_name(f".{out.name}.{pid}.partial")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def _remove_stale_partials(out: Path) -> None:
    """Remove what killed earlier runs left for ``out`` (a live run's file stays)."""
    for path in out.parent.glob(f".{out.name}.*.partial"):
        pid = path.name[len(out.name) + 2 : -len(".partial")]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            path.unlink(missing_ok=True)


class _Writer:
    """Streams record batches to a parquet or CSV file: a temporary one beside ``out``,
    renamed to ``out`` by ``commit``; ``abort`` removes it."""

    def __init__(self, out: Path, has_labels: bool) -> None:
        if out.suffix not in _OUT_FORMATS:
            raise ValueError(f"--out must end in {' or '.join(_OUT_FORMATS)}, got {out.name!r}")
        fields = [pa.field("row_id", pa.int64()), pa.field("probability", pa.float32())]
        if has_labels:
            fields.append(pa.field("label", pa.int8()))
        self.schema = pa.schema(fields)
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out)
        self.out, self.tmp = out, _partial_path(out, os.getpid())
        if out.suffix == ".parquet":
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(self.tmp, self.schema)
        else:
            import pyarrow.csv as pa_csv

            self._writer = pa_csv.CSVWriter(self.tmp, self.schema)

    def write(self, row_ids: np.ndarray, probs: np.ndarray, labels: np.ndarray | None) -> None:
        arrays = [pa.array(row_ids), pa.array(probs)]
        if labels is not None:
            arrays.append(pa.array(labels))
        self._writer.write_batch(pa.record_batch(arrays, schema=self.schema))

    def commit(self) -> None:
        try:
            self._writer.close()
            self.tmp.replace(self.out)  # e.g. IsADirectoryError: --out is a folder
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


class _WriteBehind:
    """A ``_Writer`` whose writes run on a background thread, in order, at most ``depth``
    batches waiting: encoding and writing a batch (~10 ms for 65,536 rows of parquet)
    overlaps the next batches' model calls. An error there is raised by the next
    ``write`` or by ``commit`` (the file is then removed); ``abort`` lets the batches
    already handed over finish (a few at most), then removes the file."""

    def __init__(self, writer: _Writer, depth: int = 4) -> None:
        self.writer = writer
        self._pending: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._drain, name="fuseml-predict-writer", daemon=True
        )
        self._thread.start()

    def _drain(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            if self._error is None:  # after an error: take the rest, write nothing
                try:
                    self.writer.write(*item)
                except BaseException as err:
                    self._error = err

    def write(self, row_ids: np.ndarray, probs: np.ndarray, labels: np.ndarray | None) -> None:
        if self._error is not None:
            raise self._error
        self._pending.put((row_ids, probs, labels))

    def _finish(self) -> None:
        self._pending.put(None)
        self._thread.join()

    def commit(self) -> None:
        self._finish()
        if self._error is not None:
            self.writer.abort()
            raise self._error
        self.writer.commit()

    def abort(self) -> None:
        self._finish()
        self.writer.abort()


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad the batch dimension with zeros (id 0 exists in every table) to ``rows``."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def predict(
    checkpoint: str | Path,
    source: str | Path,
    out: str | Path,
    *,
    split: str = "test",
    backend: str = "eager",
    batch_size: int = 16384,
    device: str | None = None,
    dtype: str = "fp32",
    has_label: bool | None = None,
    progress: bool = True,
    console: Console | None = None,
) -> PredictSummary:
    """Score every row of ``source`` with the checkpoint's model; see the module doc."""
    console = console or Console()
    check_model_backend(backend)
    if batch_size < 1:
        raise OptionError("{} must be at least 1, got {}", Flag("batch_size"), batch_size)
    if dtype not in DTYPES:
        raise OptionError("{} must be one of {}, got {!r}", Flag("dtype"), tuple(DTYPES), dtype)
    source, out = Path(source), Path(out)
    if out.suffix not in _OUT_FORMATS:
        raise OptionError(
            "{} must end in {}, got {!r}", Flag("out"), " or ".join(_OUT_FORMATS), out.name
        )
    dev = resolve_device(device)
    ckpt = load_checkpoint(checkpoint)
    model: DLRM = model_from_checkpoint(ckpt).to(dev).eval()
    if source.is_dir():
        check_data_matches(model.config, ckpt["data"], source, load_metadata(source))
        stream: _Source = _PreparedSource(source, split, batch_size)
    elif source.is_file():
        stream = _TsvSource(source, ckpt["data"], batch_size, has_label)
    else:
        raise FileNotFoundError(f"{source} is neither a prepared dataset folder nor a file")
    # One batch shape for the compiled model: the last batch is padded, not recompiled.
    run = torch.compile(model, dynamic=False) if backend == "compile" else model
    use_autocast = dtype == "bf16" and backend not in OPTIMIZE_BACKENDS
    dense_dtype = torch.float32
    if backend in OPTIMIZE_BACKENDS:
        import fuseml

        if dtype == "bf16":
            model, dense_dtype = model.to(torch.bfloat16), torch.bfloat16
        run, report = fuseml.optimize(model, backend=backend, inplace=True)
        swapped = ", ".join(f"{s.path or 'model'} -> {s.after}" for s in report.swapped)
        console.print(f"fuseml.optimize: {swapped or 'nothing to fuse'}")
        if dev.type == "cuda":
            # Ids are checked inside the graph (a table's flag set on the device) and the
            # flags read after each replay: no host pass over the ids.
            run = CudaGraphs(run, _graph_buckets(batch_size), fallback="eager")
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_autocast)

    all_logits, all_labels = [], []
    rows, model_seconds = 0, 0.0
    setup_rows, setup_seconds, calls = 0, 0.0, 0
    steady_calls: list[float] = []
    input_wait = 0.0
    bar = Progress(
        TextColumn(f"predicting {source.name}"),
        BarColumn(),
        MofNCompleteColumn() if stream.unit == "rows" else DownloadColumn(),
        # a TSV file's bar counts bytes (its rows are unknown until read), its rate rows
        RateColumn("rows", field=None if stream.unit == "rows" else "rows"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
    )
    start = time.perf_counter()
    writer = _WriteBehind(_Writer(out, stream.has_labels))
    try:
        with bar, torch.no_grad(), autocast:
            task = bar.add_task("rows", total=stream.total, rows=0)
            mark = time.perf_counter()
            for batch, advance in _prefetched(stream, prefetch_depth(batch_size)):
                input_wait += time.perf_counter() - mark  # the reader had no batch ready
                if batch is not None:
                    n = len(batch.row_ids)
                    dense, sparse = batch.dense.to(dev, dense_dtype), batch.sparse.to(dev)
                    if backend == "compile":
                        if model.embeddings.check_ids:  # (compiled code skips the model's)
                            model.embeddings.validate_ids(sparse)
                        dense, sparse = _pad(dense, batch_size), _pad(sparse, batch_size)
                    captured = getattr(run, "num_graphs", 0)
                    if dev.type == "cuda":
                        # The copies and casts above finish outside the model's time.
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    logits = run(dense, sparse, return_logits=True)[:n].float()
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    elapsed = time.perf_counter() - t0
                    model_seconds += elapsed
                    if calls == 0 or getattr(run, "num_graphs", 0) != captured:
                        setup_rows, setup_seconds = setup_rows + n, setup_seconds + elapsed
                    else:
                        steady_calls.append(elapsed)
                    calls += 1
                    logits = logits.cpu()
                    probs = torch.sigmoid(logits).numpy()
                    writer.write(batch.row_ids, probs, batch.labels)
                    if batch.labels is not None:
                        all_logits.append(logits.double().numpy())
                        all_labels.append(batch.labels.astype(np.float64))
                    rows += n
                    if stream.unit == "rows":
                        advance = n
                bar.update(task, advance=advance, rows=rows)
                mark = time.perf_counter()
    except BaseException:  # a kill (KeyboardInterrupt) too: nothing at --out
        writer.abort()
        raise
    writer.commit()
    seconds = time.perf_counter() - start
    metrics = None
    if stream.has_labels and all_logits:
        metrics = metrics_from_logits(np.concatenate(all_logits), np.concatenate(all_labels))
    summary = PredictSummary(
        out,
        rows,
        seconds,
        model_seconds,
        stream.has_labels,
        metrics,
        setup_seconds,
        setup_rows,
        tuple(steady_calls),
        input_wait,
    )
    graphs = None
    if isinstance(run, CudaGraphs):
        graphs = "none: ran eagerly (see the warning)" if run.eager else str(run.num_graphs)
    console.print(_summary_table(summary, backend, dev, graphs))
    console.print(f"wrote {out.resolve()} ({rows:,} rows)", soft_wrap=True)  # a whole path
    return summary


def _graph_buckets(batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``batch_size``, and ``batch_size``: full batches replay one
    graph, a short last batch (or a TSV chunk's tail) pads at most to twice its rows."""
    return (*(b for b in DEFAULT_BATCH_SIZES if b < batch_size), batch_size)


def _summary_table(
    s: PredictSummary, backend: str, device: torch.device, graphs: str | None = None
) -> Table:
    table = Table(title=f"DLRM prediction ({backend}, {device})", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("rows", f"{s.rows:,}")
    table.add_row("seconds (total)", f"{s.seconds:.2f}")
    table.add_row("rows/s (total)", f"{s.rows_per_s:,.0f}")
    table.add_row(
        "seconds waiting for input (reading, preprocessing)", f"{s.input_wait_seconds:.2f}"
    )
    if s.model_seconds > 0:
        table.add_row("rows/s (model only)", f"{s.rows / s.model_seconds:,.0f}")
        table.add_row(
            "seconds in first calls (tuning, compiling, capture)", f"{s.setup_seconds:.2f}"
        )
        steady = s.steady_rows_per_s
        table.add_row(
            "rows/s (model only, after first calls)",
            "n/a" if steady != steady else f"{steady:,.0f}",
        )
        ms = s.steady_call_ms
        table.add_row(
            "ms per model call (median after first calls)",
            "n/a" if ms != ms else f"{ms:.3f} (of {len(s.steady_call_seconds)})",
        )
    if graphs is not None:
        table.add_row("CUDA graphs captured", graphs)
    if s.metrics is not None and s.metrics["auc"] is not None:
        m = s.metrics
        table.add_row(
            "AUC / log loss / accuracy",
            f"{m['auc']:.4f} / {m['log_loss']:.4f} / {m['accuracy']:.4f}",
        )
    return table
