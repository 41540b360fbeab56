"""What the apps share: device choice, the model backends, the cache folder, DLRM
checkpoints, the check that a dataset was preprocessed like a model's training data,
metrics, and a progress column.

Public API::

    device = resolve_device(None)  # cuda when available, else cpu
    check_model_backend(backend)  # one of MODEL_BACKENDS; OPTIMIZE_BACKENDS: fuseml.optimize
    ckpt = load_checkpoint(path); model = model_from_checkpoint(ckpt)
    save_checkpoint(path, model, optimizer, epoch=1, data=data_record(data_dir), ...)
    check_data_matches(config, ckpt["data"], data_dir)  # same tables and id mapping?
    metrics_from_logits(logits, labels)  # auc, log_loss, accuracy
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import ProgressColumn
from rich.text import Text

from fuseml import settings
from fuseml.data import Vocabulary, load_metadata
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
    "check_model_backend",
    "data_record",
    "load_checkpoint",
    "metrics_from_logits",
    "model_from_checkpoint",
    "resolve_device",
    "save_checkpoint",
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
        raise ValueError(f"device {device!r} asked for, but no CUDA device is visible to torch")
    return dev


def check_model_backend(backend: str, *, name: str = "backend") -> str:
    """``backend`` if it is one of MODEL_BACKENDS; a ValueError naming ``name`` otherwise."""
    if backend not in MODEL_BACKENDS:
        raise ValueError(f"{name} must be one of {MODEL_BACKENDS}, got {backend!r}")
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
    """Samples (rows) per second of a task (rich measures the speed of ``completed``)."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        # "12,345/s" rather than "12,345 samples/s": keeps the bar on one 80-column line
        return Text("--/s" if speed is None else f"{speed:,.0f}/s", style="cyan")
