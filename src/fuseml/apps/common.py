"""What the apps share: device choice, the model backends, the cache folder, DLRM
checkpoints, the check that a dataset was preprocessed like a model's training data,
metrics, a progress column, which errors are the user's, and whether a model fits in memory.

Public API::

    device = resolve_device(None)  # cuda when available, else cpu
    check_model_backend(backend)  # one of MODEL_BACKENDS; OPTIMIZE_BACKENDS: fuseml.optimize
    ckpt = load_checkpoint(path); model = model_from_checkpoint(ckpt)
    save_checkpoint(path, model, optimizer, epoch=1, data=data_record(data_dir), ...)
    check_data_matches(config, ckpt["data"], data_dir)  # same tables and id mapping?
    metrics_from_logits(logits, labels)  # auc, log_loss, accuracy
    is_user_error(err); user_message(err)  # shown as one line by the CLI, no traceback
    check_fits_in_memory(config, device, optimizer="sgd")  # before allocating a model
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import ProgressColumn
from rich.text import Text

from fuseml import settings
from fuseml.data import Vocabulary, load_metadata
from fuseml.data.errors import Flag, OptionError
from fuseml.models.dlrm import DLRM, DLRMConfig

__all__ = [
    "CHECKPOINT_FILE",
    "CHECKPOINT_FORMAT",
    "DTYPES",
    "MODEL_BACKENDS",
    "OPTIMIZE_BACKENDS",
    "RateColumn",
    "cache_dir",
    "check_data_matches",
    "check_fits_in_memory",
    "check_model_backend",
    "data_record",
    "free_memory",
    "human_bytes",
    "is_user_error",
    "load_checkpoint",
    "metrics_from_logits",
    "model_from_checkpoint",
    "resolve_device",
    "save_checkpoint",
    "training_bytes",
    "user_message",
    "vocabulary_digest",
]

CHECKPOINT_FORMAT = "fuseml-dlrm-checkpoint-v1"
CHECKPOINT_FILE = "checkpoint.pt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# How predict and profile run a model, in fuseml.runtime.BACKENDS' words: "eager" the model
# as is, "compile" torch.compile(model), and the op backends fuseml.optimize(model, backend=)
# with that backend. "cuda" is left out: no fused module has a CUDA C++ twin.
OPTIMIZE_BACKENDS = ("auto", "triton")
MODEL_BACKENDS = ("auto", "eager", "compile", "triton")


# -- devices, caches ----------------------------------------------------------------------


def resolve_device(device: str | None) -> torch.device:
    """``None`` -> cuda when available, else cpu; a CUDA device without CUDA is an error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(
            "{} asked for, but no CUDA device is visible to torch", Flag("device", device)
        )
    return dev


def check_model_backend(backend: str, *, name: str = "backend") -> str:
    """``backend`` if it is one of MODEL_BACKENDS; a ValueError naming ``name`` otherwise."""
    if backend not in MODEL_BACKENDS:
        raise OptionError("{} must be one of {}, got {!r}", Flag(name), MODEL_BACKENDS, backend)
    return backend


def cache_dir() -> Path:
    """$FUSEML_CACHE, else ~/.cache/fuseml (the same folder as the measured ceilings)."""
    return settings.cache_dir()


# -- the data a model was trained on ------------------------------------------------------


def vocabulary_digest(vocab: Vocabulary) -> str:
    h = hashlib.sha256(str(vocab.min_freq).encode())
    for keys in vocab.keys:
        h.update(np.ascontiguousarray(keys, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _vocabulary_record(data_dir: Path) -> dict[str, Any] | None:
    """The dataset's vocabulary as tensors (vocab mode), with a digest to compare by."""
    path = data_dir / "vocabulary.npz"
    if not path.is_file():
        return None
    vocab = Vocabulary.load(path)
    return {
        "min_freq": vocab.min_freq,
        "digest": vocabulary_digest(vocab),
        "keys": [torch.from_numpy(np.ascontiguousarray(k, dtype=np.int64)) for k in vocab.keys],
    }


def data_record(data_dir: str | Path, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint keeps of its training data: the dataset's metadata and (vocab
    mode) its vocabulary, so that raw TSV files can be preprocessed the same way later."""
    data_dir = Path(data_dir)
    metadata = metadata if metadata is not None else load_metadata(data_dir)
    return {"metadata": metadata, "vocabulary": _vocabulary_record(data_dir)}


def _preprocessing(metadata: dict[str, Any]) -> dict[str, Any]:
    """The options that decide which id a raw value gets."""
    options = metadata["options"]
    keys = ("mode", "max_ind_range") if options["mode"] == "hash" else ("mode", "min_freq")
    return {k: options.get(k) for k in keys}


def check_data_matches(
    config: DLRMConfig,
    trained_on: dict[str, Any],
    data_dir: str | Path,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Raise ValueError unless the dataset in ``data_dir`` was preprocessed like the model's
    training data: same table sizes, same id mapping (hash range or vocabulary)."""
    metadata = metadata or load_metadata(data_dir)
    config.check_cardinalities(metadata["cardinalities"], what=f"the data in {data_dir}")
    ours, theirs = _preprocessing(trained_on["metadata"]), _preprocessing(metadata)
    if ours != theirs:
        raise ValueError(
            f"the data in {data_dir} was preprocessed with {theirs}, the model was trained "
            f"on data preprocessed with {ours}: its ids would mean other categories"
        )
    vocab = trained_on.get("vocabulary")
    if vocab is not None:
        path = Path(data_dir) / "vocabulary.npz"
        if not path.is_file():
            raise ValueError(f"{data_dir} has no vocabulary.npz, but the model used one")
        if vocabulary_digest(Vocabulary.load(path)) != vocab["digest"]:
            raise ValueError(
                f"the vocabulary of {data_dir} differs from the one the model was trained "
                "with (same sizes, other categories): prepare this data from the same "
                "training files, or predict on raw TSV files, which are mapped with the "
                "checkpoint's own vocabulary"
            )


# -- checkpoints --------------------------------------------------------------------------


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by ``fuseml train``; checks its format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        raise ValueError(f"{path} is not a readable fuseml checkpoint: {err}") from err
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a fuseml DLRM checkpoint ({CHECKPOINT_FORMAT})")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any]) -> DLRM:
    model = DLRM(DLRMConfig.from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model


def save_checkpoint(
    path: Path,
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    *,
    optimizer_name: str,
    epoch: int,
    data: dict[str, Any],
    train_options: dict[str, Any],
    history: list[dict[str, Any]],
) -> None:
    """Write what ``load_checkpoint`` reads and ``fuseml train --resume`` continues from;
    ``data`` comes from ``data_record``."""
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "config": model.config.to_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "optimizer_name": optimizer_name,
        "epoch": epoch,
        "data": data,
        "train_options": train_options,
        "history": history,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ckpt, tmp)
    tmp.replace(path)  # never leave a half-written checkpoint under the real name


# -- metrics, progress --------------------------------------------------------------------


def metrics_from_logits(logits: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """AUC (None if one class is absent), log loss and accuracy at 0.5."""
    from sklearn.metrics import roc_auc_score

    n = len(labels)
    if n == 0:
        return {"rows": 0, "auc": None, "log_loss": None, "accuracy": None}
    both = 0 < labels.sum() < n
    t_logits, t_labels = torch.from_numpy(logits), torch.from_numpy(labels)
    return {
        "rows": n,
        "auc": float(roc_auc_score(labels, logits)) if both else None,
        # from the logits: exact in float64, no clipping of probabilities needed
        "log_loss": float(F.binary_cross_entropy_with_logits(t_logits, t_labels)),
        "accuracy": float(((logits > 0) == (labels > 0.5)).mean()),
    }


class RateColumn(ProgressColumn):
    """Rows per second of a task, as "12,345 rows/s". By default the speed of ``completed``
    (as rich measures it); with ``field``, ``task.fields[field]`` over the elapsed time, for
    bars whose ``completed`` counts something else (bytes of a file whose rows are unknown)."""

    def __init__(self, unit: str = "rows", field: str | None = None) -> None:
        super().__init__()
        self.unit, self.field = unit, field

    def render(self, task) -> Text:
        if self.field is None:
            speed = task.finished_speed or task.speed
        else:
            elapsed = task.elapsed
            done = task.fields.get(self.field, 0)
            speed = done / elapsed if elapsed and done else None
        text = "--" if speed is None else f"{speed:,.0f}"
        return Text(f"{text} {self.unit}/s", style="cyan")


# -- user errors --------------------------------------------------------------------------

# Exceptions that a user's input or arguments cause: a bad value, a missing, unreadable or
# corrupt file. The CLI shows them as one line (exit code 2) and their traceback only with
# --verbose. Any other exception with a ``user_message`` attribute counts too: that is how
# an error type of another layer (e.g. a data reader's, with the file and line) opts in
# without this module importing it.
USER_ERRORS = (ValueError, TypeError, OSError, EOFError, zlib.error, FloatingPointError)
# What a truncated or corrupt gzip stream raises; its messages name no file.
GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


def is_user_error(err: BaseException) -> bool:
    return isinstance(err, USER_ERRORS) or getattr(err, "user_message", None) is not None


def _is_gzip(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def user_message(err: BaseException, inputs: list[Path] | tuple[Path, ...] = ()) -> str:
    """One line for ``err``: its ``user_message`` if it has one, else its text, led by its
    ``path`` (and ``line``) where it has them and does not name them itself; a gzip error
    names the gzip file(s) among ``inputs`` (the files the command read)."""
    message = getattr(err, "user_message", None) or str(err) or type(err).__name__
    path, line = getattr(err, "path", None), getattr(err, "line", None)
    if isinstance(path, (str, Path)) and str(path) not in message:
        message = f"{path}{f', line {line}' if line else ''}: {message}"
    if isinstance(err, GZIP_ERRORS):
        files = [
            str(p)
            for p in inputs
            if Path(p).is_file() and (Path(p).suffix == ".gz" or _is_gzip(Path(p)))
        ]
        if not any(f in message for f in files):
            where = " or ".join(files) if files else "a gzip input"
            message = f"{where}: truncated or corrupt gzip data ({message})"
    return " ".join(message.split())  # one line


# -- does a model fit -----------------------------------------------------------------------

# Float32 copies of the parameters that training keeps: the weights and their (dense)
# gradients, plus the optimiser's state (Adagrad: a sum of squares; Adam: two moments).
_TRAINING_COPIES = {"sgd": 2, "adagrad": 3, "adam": 4}
# Room for activations, the data and the allocator beyond the parameters' copies.
_MEMORY_MARGIN = 1.25


def training_bytes(config: DLRMConfig, optimizer: str = "sgd") -> tuple[int, int]:
    """(parameters, bytes to train them) of a DLRM with ``config``, without building it."""
    d = config.embedding_dim
    params = config.num_embeddings * d
    for widths in (
        (config.num_dense, *config.bottom_mlp),
        (config.interaction_dim, *config.top_mlp),
    ):
        params += sum(a * b + b for a, b in itertools.pairwise(widths))
    return params, int(params * 4 * _TRAINING_COPIES.get(optimizer, 4) * _MEMORY_MARGIN)


def _cgroup_free() -> int | None:
    """Bytes left under this process's cgroup (v2) memory limit, if it has one."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation can get on ``device``: free GPU memory, or on a CPU the
    available system memory (psutil if installed, else sysconf), within a cgroup limit."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except ImportError:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    capped = _cgroup_free()
    return free if capped is None else min(free, capped)


def human_bytes(n: float) -> str:
    """``n`` bytes to three significant digits in the unit that fits: "1.6 TB", "277 kB"."""
    units, i = ("B", "kB", "MB", "GB", "TB"), 0
    while abs(n) >= 999.5 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    unit = units[i]
    return f"{n:.3g} {unit}" if abs(n) < 1000 else f"{n:,.0f} {unit}"


def check_fits_in_memory(
    config: DLRMConfig, device: torch.device, optimizer: str = "sgd", *, free: int | None = None
) -> int:
    """Raise ValueError, before anything is allocated, if training ``config`` on ``device``
    would not fit in its free memory (``free``, default ``free_memory(device)``), naming the
    size and what to change; returns the bytes needed."""
    params, need = training_bytes(config, optimizer)
    free = free_memory(device) if free is None else free
    if need <= free:
        return need
    tables = config.num_embeddings * config.embedding_dim
    biggest = max(config.cardinalities) if config.cardinalities else 0
    raise OptionError(
        "the {} model has {:,} parameters ({:.0%} of them in embedding tables, the largest "
        "{:,} rows); training it with {} needs about {}, but {} has {} free. Pick a smaller "
        "{}, or prepare the data with a smaller {} (smaller tables)",
        config.name, params, tables / params, biggest, optimizer, human_bytes(need), device,
        human_bytes(free), Flag("config"), Flag("max_ind_range"),
    )  # fmt: skip
