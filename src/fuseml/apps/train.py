"""Train a DLRM on a prepared Criteo dataset (``fuseml train``).

Public API::

    result = train("kaggle", data_dir, TrainOptions(epochs=1, out_dir="runs/kaggle"))
    result.model, result.config, result.history, result.test, result.checkpoint
    metrics = evaluate(model, CriteoDataset(root, "test"), device)  # auc, log_loss, accuracy
    data_dir, summary = synthetic_dataset(rows, max_cardinality=100)  # cached synth + prepare
    split_oracle_auc(data_dir, summary, "test")  # best achievable AUC on those rows

``load_checkpoint``, ``model_from_checkpoint``, ``check_data_matches`` and the other
checkpoint and data helpers live in ``fuseml.apps.common`` and are re-exported here.

The loss is BCE-with-logits (the reference's BCE on the sigmoid, computed stably); the
default optimiser is plain SGD at lr 0.1 on all parameters, embeddings included (the
reference's Kaggle and Terabyte runs). Only held-out rows are ever scored: the validation
split after each epoch, the test split once at the end.

A checkpoint (``out_dir/checkpoint.pt``, rewritten after every epoch) holds the model's
state_dict, its config, the data's metadata (and vocabulary, in vocab mode, so that raw
TSV files can be preprocessed the same way at prediction time), the optimiser's state and
the number of finished epochs; ``resume`` continues from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from fuseml.apps.common import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    DTYPES,
    RateColumn,
    cache_dir,
    check_data_matches,
    check_fits_in_memory,
    data_record,
    load_checkpoint,
    metrics_from_logits,
    model_from_checkpoint,
    resolve_device,
    save_checkpoint,
    vocabulary_digest,
)
from fuseml.data import CriteoDataset, SynthSummary, load_metadata, prepare, synth
from fuseml.data.errors import Flag, OptionError
from fuseml.models.dlrm import DLRM, DLRMConfig

__all__ = [
    "CHECKPOINT_FORMAT",
    "TrainOptions",
    "TrainResult",
    "cache_dir",
    "check_data_matches",
    "evaluate",
    "load_checkpoint",
    "metrics_from_logits",
    "model_from_checkpoint",
    "predict_logits",
    "resolve_device",
    "split_oracle_auc",
    "synthetic_dataset",
    "train",
    "vocabulary_digest",
]

logger = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adagrad", "adam")
# Reference run scripts: Kaggle mini-batch 128, Terabyte 2048, both SGD at lr 0.1.
_DEFAULT_BATCH_SIZE = {"kaggle": 128, "terabyte": 2048, "mlperf": 2048, "tiny": 256}
_DEFAULT_LR = {"sgd": 0.1, "adagrad": 0.01, "adam": 1e-3}
_LOSS_EVERY = 50  # batches between reads of the loss (each read is a device sync)


@dataclass
class TrainOptions:
    """How to train; ``None`` picks the config's / optimiser's default."""

    epochs: int = 1
    batch_size: int | None = None  # default: the reference's for the config (kaggle 128)
    lr: float | None = None  # default: sgd 0.1, adagrad 0.01, adam 1e-3
    optimizer: str = "sgd"
    dtype: str = "fp32"  # "bf16": autocast to bfloat16 (CUDA or CPU)
    compile: bool = False
    device: str | None = None  # default: cuda if available, else cpu
    seed: int = 0
    eval_batch_size: int = 16384
    out_dir: str | Path | None = None  # checkpoint + metrics.json; None: no checkpoint
    resume: str | Path | None = None
    tensorboard: str | Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise OptionError(
                "{} must be one of {}, got {!r}", Flag("optimizer"), OPTIMIZERS, self.optimizer
            )
        if self.dtype not in DTYPES:
            raise OptionError(
                "{} must be one of {}, got {!r}", Flag("dtype"), tuple(DTYPES), self.dtype
            )
        if self.epochs < 1:
            raise OptionError("{} must be at least 1, got {}", Flag("epochs"), self.epochs)
        for name in ("batch_size", "eval_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise OptionError("{} must be at least 1, got {}", Flag(name), value)
        if self.lr is not None and not self.lr > 0:
            raise OptionError("{} must be positive, got {}", Flag("lr"), self.lr)

    def to_dict(self) -> dict[str, Any]:
        return {
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()
        }


@dataclass
class TrainResult:
    model: DLRM
    config: DLRMConfig
    history: list[dict[str, Any]]  # per epoch: train loss, samples/s, validation metrics
    test: dict[str, Any]  # metrics on the test split
    checkpoint: Path | None
    data_dir: Path
    options: TrainOptions = field(repr=False)


# -- synthetic data -----------------------------------------------------------------------


def synthetic_dataset(
    rows: int,
    *,
    seed: int = 0,
    max_cardinality: int | None = 100,
    val_fraction: float = 0.05,
    test_fraction: float = 0.1,
    root: str | Path | None = None,
    progress: bool = True,
) -> tuple[Path, SynthSummary]:
    """Generate (``fuseml.data.synth``) and prepare a synthetic dataset, cached by its options.

    Returns the prepared folder and the generator's summary (best achievable AUC). A second
    call with the same options reuses the files. Vocab mode with ``min_freq=1`` keeps
    every category its own id, so the hidden model's structure stays learnable.
    """
    name = f"criteo-{rows}-seed{seed}-max{max_cardinality}-v{val_fraction}-t{test_fraction}"
    folder = Path(root) if root is not None else cache_dir() / "synthetic" / name
    raw = folder / "raw.txt"
    summary_path = raw.with_name(raw.name + ".summary.json")
    prepared = folder / "prepared"
    if not (summary_path.is_file() and (prepared / "metadata.json").is_file()):
        summary = synth(rows, raw, seed=seed, max_cardinality=max_cardinality, progress=progress)
        prepare(
            raw,
            prepared,
            mode="vocab",
            min_freq=1,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            seed=seed,
            overwrite=True,
            progress=progress,
        )
    record = json.loads(summary_path.read_text())
    summary = SynthSummary(
        path=folder / record["path"],
        probs_path=folder / record["probs_path"],
        rows=record["rows"],
        positives=record["positives"],
        positive_rate=record["positive_rate"],
        best_auc=record["best_auc"],
        cardinalities=record["cardinalities"],
        seed=record["seed"],
    )
    return prepared, summary


def split_oracle_auc(data_dir: str | Path, summary: SynthSummary, split: str = "test") -> float:
    """AUC of the generator's true probabilities on the rows of one split of a dataset
    prepared from ``summary.path`` (row split): the best any model can score there."""
    from sklearn.metrics import roc_auc_score

    from fuseml.data.prepare import SPLITS, split_of_lines

    meta = load_metadata(data_dir)
    if meta["options"]["split"] != "rows" or len(meta["sources"]) != 1:
        raise ValueError("split_oracle_auc needs a single file prepared with split='rows'")
    probs = np.load(summary.probs_path)
    codes = split_of_lines(meta, 0, np.arange(1, len(probs) + 1))
    rows = codes == SPLITS.index(split)
    labels = np.concatenate(
        [b.labels.numpy() for b in CriteoDataset(data_dir, split, batch_size=1 << 20)]
    )
    if rows.sum() != len(labels):
        raise ValueError(f"{data_dir} was not prepared from {summary.path} with these options")
    return float(roc_auc_score(labels, probs[rows]))


# -- evaluation ---------------------------------------------------------------------------


def _autocast(device: torch.device, dtype: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


@torch.no_grad()
def predict_logits(
    model: torch.nn.Module,
    dataset: CriteoDataset,
    device: torch.device,
    dtype: str = "fp32",
) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels of every row of ``dataset``, in order, as float64 numpy."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for batch in dataset:
        with _autocast(device, dtype):
            out = model(batch.dense.to(device), batch.sparse.to(device), return_logits=True)
        logits.append(out.float().cpu())
        labels.append(batch.labels)
    model.train(was_training)
    if not logits:
        return np.empty(0), np.empty(0)
    return torch.cat(logits).double().numpy(), torch.cat(labels).double().numpy()


def evaluate(
    model: torch.nn.Module, dataset: CriteoDataset, device: torch.device, dtype: str = "fp32"
) -> dict[str, Any]:
    """AUC, log loss and accuracy of ``model`` on every row of ``dataset``."""
    return metrics_from_logits(*predict_logits(model, dataset, device, dtype))


# -- training -----------------------------------------------------------------------------


def _progress(enabled: bool, console: Console) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn("samples"),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )


def _make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    # Dense gradients for the embeddings too: the fused inference path is what fuseml
    # speeds up; sparse updates would only matter for the huge tables of real training.
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.Adam(params, lr=lr)


def _tensorboard(logdir: str | Path | None, console: Console):
    if logdir is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        console.print(
            "[yellow]tensorboard is not installed (pip install tensorboard): "
            "--tensorboard is ignored[/yellow]"
        )
        return None
    return SummaryWriter(log_dir=str(logdir))


def _resolve_config(
    config: str | Path | DLRMConfig, cardinalities: Sequence[int], ckpt: dict[str, Any] | None
) -> DLRMConfig:
    if isinstance(config, DLRMConfig):
        resolved = config.with_cardinalities(cardinalities) if not config.cardinalities else config
        resolved.check_cardinalities(cardinalities, what="the data")
    else:
        resolved = DLRMConfig.load(config, cardinalities=cardinalities)
    if ckpt is not None:
        saved = DLRMConfig.from_dict(ckpt["config"])
        if dataclasses.replace(saved, name=resolved.name) != resolved:
            raise OptionError(
                "{}: the checkpoint's model ({}) differs from {}: {}", Flag("resume"),
                saved.name, Flag("config", resolved.name), _config_diff(saved, resolved),
            )  # fmt: skip
        resolved = saved
    return resolved


def _config_diff(a: DLRMConfig, b: DLRMConfig) -> str:
    diffs = [
        f.name
        for f in dataclasses.fields(DLRMConfig)
        if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)
    ]
    return "fields " + ", ".join(diffs) + " differ"


def _train_epoch(
    run: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_set: CriteoDataset,
    device: torch.device,
    dtype: str,
    bar: Progress,
    task: TaskID,
    writer: Any,
    step: int,
) -> tuple[float, int, float]:
    """One pass over the training split; returns (mean loss, rows, seconds)."""
    loss_sum = torch.zeros((), device=device)  # summed on the device: no sync per batch
    seen, start = 0, time.perf_counter()
    for i, batch in enumerate(train_set):
        dense, sparse = batch.dense.to(device), batch.sparse.to(device)
        labels = batch.labels.to(device)
        with _autocast(device, dtype):
            logits = run(dense, sparse, return_logits=True)  # (B,)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(labels)
        seen += len(labels)
        if i % _LOSS_EVERY == 0:
            value = float(loss.detach())
            if not math.isfinite(value):
                lr = optimizer.param_groups[0]["lr"]
                raise FloatingPointError(
                    f"training diverged at step {i} of the epoch: loss {value} (lower --lr, "
                    f"now {lr})"
                )
            bar.update(task, loss=f"{value:.4f}")
            if writer is not None:
                writer.add_scalar("train/loss", value, step + i)
        bar.update(task, advance=len(labels))
    return float(loss_sum) / max(seen, 1), seen, time.perf_counter() - start


def train(
    config: str | Path | DLRMConfig,
    data_dir: str | Path,
    options: TrainOptions | None = None,
    *,
    console: Console | None = None,
) -> TrainResult:
    """Train a DLRM on the prepared dataset in ``data_dir``; see the module doc."""
    options = options or TrainOptions()
    console = console or Console()
    data_dir = Path(data_dir)
    device = resolve_device(options.device)
    metadata = load_metadata(data_dir)
    ckpt = load_checkpoint(options.resume) if options.resume is not None else None
    if ckpt is not None:  # first the data, whose mismatch has the most specific message
        check_data_matches(DLRMConfig.from_dict(ckpt["config"]), ckpt["data"], data_dir, metadata)
    config = _resolve_config(config, metadata["cardinalities"], ckpt)
    if ckpt is not None and ckpt["optimizer_name"] != options.optimizer:
        raise OptionError(
            "{}: the checkpoint was trained with {}, not {}", Flag("resume"),
            ckpt["optimizer_name"], options.optimizer,
        )  # fmt: skip

    batch_size = options.batch_size or _DEFAULT_BATCH_SIZE.get(config.name, 2048)
    lr = options.lr or _DEFAULT_LR[options.optimizer]
    # Refused before allocating: a model too big for the device would otherwise fail (or
    # swap) only after minutes, with an allocator's traceback.
    check_fits_in_memory(config, device, options.optimizer)
    torch.manual_seed(options.seed)
    model = DLRM(config).to(device)
    optimizer = _make_optimizer(options.optimizer, model.parameters(), lr)
    start_epoch, history = 0, []
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, history = ckpt["epoch"], list(ckpt["history"])
        console.print(f"resumed from {options.resume} after epoch {start_epoch}")
    run = torch.compile(model) if options.compile else model

    trained_on = data_record(data_dir, metadata)
    train_set = CriteoDataset(data_dir, "train", batch_size=batch_size, seed=options.seed)
    val_set = CriteoDataset(data_dir, "validation", batch_size=options.eval_batch_size)
    test_set = CriteoDataset(data_dir, "test", batch_size=options.eval_batch_size)
    out_dir = Path(options.out_dir) if options.out_dir is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = out_dir / CHECKPOINT_FILE if out_dir is not None else None
    writer = _tensorboard(options.tensorboard, console)
    params = sum(p.numel() for p in model.parameters())
    console.print(
        f"training DLRM [bold]{config.name}[/bold] ({params:,} parameters) on "
        f"{train_set.num_rows:,} rows of {data_dir} | {device}, {options.dtype}, "
        f"{'compiled' if options.compile else 'eager'}, {options.optimizer} lr {lr:g}, "
        f"batch {batch_size}"
    )

    step = start_epoch * len(train_set)
    with _progress(options.progress, console) as bar:
        for epoch in range(start_epoch, options.epochs):
            train_set.set_epoch(epoch)
            task = bar.add_task(
                f"epoch {epoch + 1}/{options.epochs}", total=train_set.num_rows, loss="--"
            )
            loss, seen, seconds = _train_epoch(
                run, optimizer, train_set, device, options.dtype, bar, task, writer, step
            )
            step += len(train_set)
            record = {
                "epoch": epoch + 1,
                "train_loss": loss,
                "samples_per_s": seen / seconds if seconds > 0 else None,
                "validation": evaluate(run, val_set, device, options.dtype),
            }
            history.append(record)
            if writer is not None:
                for key in ("auc", "log_loss", "accuracy"):
                    if record["validation"][key] is not None:
                        writer.add_scalar(f"validation/{key}", record["validation"][key], epoch + 1)
                writer.add_scalar("train/samples_per_s", record["samples_per_s"] or 0, epoch + 1)
            if checkpoint is not None:
                save_checkpoint(
                    checkpoint,
                    model,
                    optimizer,
                    optimizer_name=options.optimizer,
                    epoch=epoch + 1,
                    data=trained_on,
                    train_options=options.to_dict(),
                    history=history,
                )

    test = evaluate(run, test_set, device, options.dtype)
    if writer is not None:
        writer.close()
    if out_dir is not None:
        (out_dir / "metrics.json").write_text(
            json.dumps({"history": history, "test": test, "config": config.to_dict()}, indent=2)
            + "\n"
        )
    console.print(_summary_table(history, test))
    if checkpoint is not None:
        console.print(
            f"checkpoint: {checkpoint.resolve()} (metrics.json beside it)", soft_wrap=True
        )
    return TrainResult(model, config, history, test, checkpoint, data_dir, options)


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "--" if value is None else format(value, spec)


def _summary_table(history: list[dict[str, Any]], test: dict[str, Any]) -> Table:
    table = Table(title="DLRM training")
    for name in ("epoch", "train loss", "samples/s", "AUC", "log loss", "accuracy"):
        table.add_column(name, justify="right")
    for rec in history:
        val = rec["validation"]
        table.add_row(
            f"{rec['epoch']} (val)",
            _fmt(rec["train_loss"]),
            _fmt(rec["samples_per_s"], ",.0f"),
            _fmt(val["auc"]),
            _fmt(val["log_loss"]),
            _fmt(val["accuracy"]),
        )
    table.add_row("test", "", "", _fmt(test["auc"]), _fmt(test["log_loss"]), _fmt(test["accuracy"]))
    return table
