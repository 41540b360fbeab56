"""Synthetic Criteo-like click logs, written in the real TSV format.

The files go through the same reader and preprocessing as the real data, and their
statistics resemble the Kaggle Display Advertising set:

* categorical tables C1..C26 with the Kaggle cardinalities (:data:`KAGGLE_CARDINALITIES`),
  optionally scaled down (``scale``) and/or capped (``max_cardinality``); values follow a
  Zipf-like law (exponent 1.05-1.2 per table) and are written as 8-digit hex hashes;
* heavy-tailed non-negative counts I1..I13 (floored log-normals), occasionally negative
  in I2 and I9 (-1, -2, -3, as in Kaggle's I2);
* per-feature missing rates close to Kaggle's (e.g. I12 and C22 about 76% empty);
* labels drawn from a hidden logistic model: per-category random effects on a subset of
  tables, pairwise interactions that are dot products of per-category latent vectors
  (what DLRM's embeddings + dot interaction can represent), and a linear term in
  log(1 + count); its bias is solved numerically for about 25% positives.

The true click probability of every row is saved next to the file (``FILE.probs.npy``,
float32, row-aligned), so the best achievable AUC is known: ``synth`` reports the AUC of
those probabilities against the drawn labels (scikit-learn's ``roc_auc_score``).

Public API::

    summary = synth(rows, out_path, seed=0, scale=1.0, max_cardinality=None, gzip=False)
    summary.best_auc, summary.positive_rate, summary.probs_path
    synthetic_cardinalities(scale, max_cardinality) -> list[int]

Every random draw is a counter-based hash of (seed, row index, field), so the output
depends only on ``seed``, ``scale`` and ``max_cardinality``: not on ``chunk_rows``, which
only bounds memory, and the first N rows of a longer file equal an N-row file.
"""

from __future__ import annotations

import contextlib
import gzip as gzip_module
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fuseml.data import _hashing
from fuseml.data._progress import row_progress
from fuseml.data.criteo import NUM_DENSE, NUM_SPARSE
from fuseml.data.errors import Flag, OptionError

__all__ = ["KAGGLE_CARDINALITIES", "SynthSummary", "synth", "synthetic_cardinalities"]

logger = logging.getLogger(__name__)

# Distinct values per categorical feature in the Kaggle Display Advertising training set.
KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

# Share of empty fields per feature, approximately as in Kaggle's train.txt.
_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22)
_SPARSE_MISSING = (
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0,
    0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44,
)  # fmt: skip
# Counts are floor(exp(N(mu, sigma))): (mu, sigma) per feature, loosely matching Kaggle's
# medians (I5 in the thousands, I1/I10/I12 mostly 0 or 1, the others tens).
_DENSE_LOGNORMAL = (
    (0.3, 1.2), (1.2, 1.6), (2.0, 1.4), (1.5, 1.0), (8.0, 1.8), (3.7, 1.7), (2.3, 1.6),
    (2.3, 1.0), (3.7, 1.4), (0.0, 0.8), (0.8, 1.1), (-0.5, 1.2), (1.5, 1.1),
)  # fmt: skip
_NEGATIVE_RATE = {1: 0.04, 8: 0.002}  # feature index -> share of negative values (I2, I9)
_DENSE_LIMIT = 10**9 - 1  # keeps every count within _DIGITS decimal digits

# Hidden model. Std of the per-category random effect of each table (0: no effect).
_EFFECT_STD = (
    0.5, 0.4, 0.3, 0.2, 0.4, 0.5, 0.4, 0.3, 0.0, 0.3, 0.3, 0.0, 0.3,
    0.4, 0.3, 0.0, 0.5, 0.3, 0.3, 0.3, 0.0, 0.4, 0.4, 0.3, 0.3, 0.3,
)  # fmt: skip
# Table pairs whose latent vectors' dot product enters the logit.
_INTERACTIONS = ((0, 5), (1, 13), (6, 16), (10, 22), (4, 24), (12, 18))
_LATENT_DIM = 4
_INTERACTION_SCALE = 0.6
# Weights of the standardised log(1 + count) of each dense feature.
_DENSE_WEIGHTS = (0.3, 0.0, -0.2, 0.15, 0.0, 0.25, -0.3, 0.0, 0.2, 0.35, -0.15, 0.0, 0.1)
_EFFECT_GAIN = 0.6  # overall strength: sets the best achievable AUC (about 0.80)
_TARGET_POSITIVE_RATE = 0.25
_CALIBRATION_ROWS = 100_000
_CALIBRATION_OFFSET = 1 << 60  # row indices used for calibration, never written
_ZIPF_EXPONENT_RANGE = (1.05, 1.2)

# Stream ids: every kind of draw uses its own hash stream.
_S_ZIPF, _S_OFFSET, _S_DENSE_MISS, _S_DENSE, _S_NEGATIVE = 1, 2, 3, 4, 5
_S_SPARSE_MISS, _S_RANK, _S_EFFECT, _S_LATENT, _S_LABEL = 6, 7, 8, 9, 10

_DIGITS = 12  # digit slots per count (a multiple of 4, >= the digits of _DENSE_LIMIT)
_POW10 = 10 ** np.arange(_DIGITS, dtype=np.int64)  # 1, 10, ..., 1e11


def _packed_strings(template: str, count: int) -> np.ndarray:
    """uint32 words whose 4 bytes in memory are ``template.format(i)``, for i < count.

    Looking up 4 characters as one word is much faster than handling characters one by
    one; the bytes are reinterpreted in place, so byte order does not matter.
    """
    return np.frombuffer("".join(template.format(i) for i in range(count)).encode(), np.uint32)


_DECIMAL4_WORDS = _packed_strings("{:04d}", 10_000)
_HEX4_WORDS = _packed_strings("{:04x}", 1 << 16)
_TAB, _NEWLINE, _MINUS, _ZERO = ord("\t"), ord("\n"), ord("-"), ord("0")


def synthetic_cardinalities(scale: float = 1.0, max_cardinality: int | None = None) -> list[int]:
    """Kaggle cardinalities multiplied by ``scale`` (at least 1) and capped."""
    if scale <= 0:
        raise OptionError("{} must be positive, got {}", Flag("scale"), scale)
    if max_cardinality is not None and max_cardinality < 1:
        raise OptionError("{} must be at least 1, got {}", Flag("max_cardinality"), max_cardinality)
    cards = [max(1, round(c * scale)) for c in KAGGLE_CARDINALITIES]
    return cards if max_cardinality is None else [min(c, max_cardinality) for c in cards]


@dataclass(frozen=True)
class SynthSummary:
    """What ``synth`` wrote."""

    path: Path
    probs_path: Path  # true click probability per row, float32 .npy
    rows: int
    positives: int
    positive_rate: float
    best_auc: float | None  # AUC of the true probabilities; None if one class is absent
    cardinalities: list[int]  # distinct values possible per table (not all need occur)
    seed: int


@dataclass
class _Rows:
    labels: np.ndarray  # (n,) int8
    probs: np.ndarray  # (n,) float64
    dense: np.ndarray  # (n, 13) int64
    dense_missing: np.ndarray  # (n, 13) bool
    sparse: np.ndarray  # (n, 26) int64 values in [0, 2**32), -1 = missing


class _HiddenModel:
    """Draws rows and their click probabilities; a pure function of seed and row index."""

    def __init__(self, seed: int, cardinalities: Sequence[int]) -> None:
        self.seed = seed
        self.cardinalities = np.asarray(cardinalities, dtype=np.int64)
        one = np.zeros(1, dtype=np.uint64)
        low, high = _ZIPF_EXPONENT_RANGE
        self.zipf_exponents = [
            low + (high - low) * float(_hashing.uniform(self._key(_S_ZIPF, t), one)[0])
            for t in range(NUM_SPARSE)
        ]
        # Per-table offset so equal ranks in different tables get different hex values.
        self.value_offsets = [
            int(_hashing.hash_u64(self._key(_S_OFFSET, t), one)[0]) & 0xFFFFFFFF
            for t in range(NUM_SPARSE)
        ]
        calibration = np.arange(_CALIBRATION_ROWS, dtype=np.uint64) + np.uint64(_CALIBRATION_OFFSET)
        dense, dense_missing, ranks = self._features(calibration)
        self.bias = _solve_bias(self._logits(dense, dense_missing, ranks), _TARGET_POSITIVE_RATE)

    def _key(self, stream: int, *parts: int) -> int:
        return _hashing.derive_key(self.seed, stream, *parts)

    def draw(self, rows: np.ndarray) -> _Rows:
        """Rows with the given (uint64) indices."""
        dense, dense_missing, ranks = self._features(rows)
        probs = _sigmoid(self._logits(dense, dense_missing, ranks) + self.bias)
        labels = (_hashing.uniform(self._key(_S_LABEL), rows) < probs).astype(np.int8)
        sparse = np.full(ranks.shape, -1, dtype=np.int64)
        for t in range(NUM_SPARSE):
            present = ranks[:, t] > 0
            sparse[present, t] = _mix32(ranks[present, t] + self.value_offsets[t])
        return _Rows(labels, probs, dense, dense_missing, sparse)

    def _features(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dense counts, their missing mask, and category ranks (0 = missing, 1 = most common)."""
        n = len(rows)
        dense = np.zeros((n, NUM_DENSE), dtype=np.int64)
        dense_missing = np.zeros((n, NUM_DENSE), dtype=bool)
        for j, (mu, sigma) in enumerate(_DENSE_LOGNORMAL):
            missing = _hashing.uniform(self._key(_S_DENSE_MISS, j), rows) < _DENSE_MISSING[j]
            z = _hashing.normal(self._key(_S_DENSE, j), rows)
            counts = np.minimum(np.floor(np.exp(mu + sigma * z)), _DENSE_LIMIT)
            rate = _NEGATIVE_RATE.get(j, 0.0)
            if rate:
                u = _hashing.uniform(self._key(_S_NEGATIVE, j), rows)
                negative = u < rate
                # Given u < rate, u / rate is uniform: a geometric magnitude 1, 2, 3 (capped).
                magnitude = np.minimum(1 + np.floor(np.log(u / rate) / np.log(0.5)), 3)
                counts = np.where(negative, -magnitude, counts)
            dense[:, j] = np.where(missing, 0, counts)
            dense_missing[:, j] = missing
        ranks = np.zeros((n, NUM_SPARSE), dtype=np.int64)
        for t in range(NUM_SPARSE):
            u = _hashing.uniform(self._key(_S_RANK, t), rows)
            rank = _zipf_rank(u, int(self.cardinalities[t]), self.zipf_exponents[t])
            missing = _hashing.uniform(self._key(_S_SPARSE_MISS, t), rows) < _SPARSE_MISSING[t]
            ranks[:, t] = np.where(missing, 0, rank)
        return dense, dense_missing, ranks

    def _logits(
        self, dense: np.ndarray, dense_missing: np.ndarray, ranks: np.ndarray
    ) -> np.ndarray:
        """Logit without the bias. Effects are hashes of (table, rank), so missing (rank 0)
        has an effect of its own, like any category."""
        logit = np.zeros(len(ranks))
        for t, std in enumerate(_EFFECT_STD):
            if std:
                logit += std * _hashing.normal(self._key(_S_EFFECT, t), ranks[:, t])
        for a, b in _INTERACTIONS:
            for d in range(_LATENT_DIM):
                va = _hashing.normal(self._key(_S_LATENT, a, d), ranks[:, a])
                vb = _hashing.normal(self._key(_S_LATENT, b, d), ranks[:, b])
                logit += (_INTERACTION_SCALE / math.sqrt(_LATENT_DIM)) * va * vb
        for j, (mu, sigma) in enumerate(_DENSE_LOGNORMAL):
            if _DENSE_WEIGHTS[j]:
                # log(1 + count) is roughly N(mu, sigma) by construction: standardise with it.
                z = (np.log1p(np.maximum(dense[:, j], 0)) - mu) / sigma
                logit += _DENSE_WEIGHTS[j] * np.where(dense_missing[:, j], 0.0, z)
        return _EFFECT_GAIN * logit


def _zipf_rank(u: np.ndarray, n: int, s: float) -> np.ndarray:
    """Ranks in 1..n with P(k) roughly proportional to k**-s (inverse CDF of a power law)."""
    tail = 1.0 - (n + 1.0) ** (1.0 - s)
    x = (1.0 - u * tail) ** (1.0 / (1.0 - s))
    return np.clip(np.floor(x), 1, n).astype(np.int64)


def _mix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser: a bijection, so distinct ranks get distinct values."""
    h = (x & 0xFFFFFFFF).astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h.astype(np.int64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free form of 1 / (1 + exp(-x))


def _solve_bias(logits: np.ndarray, target: float) -> float:
    """Bias b with mean(sigmoid(logits + b)) == target (bisection; the mean is monotone)."""
    low, high = -30.0, 30.0
    for _ in range(100):
        mid = 0.5 * (low + high)
        if _sigmoid(logits + mid).mean() < target:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def _format_lines(rows: _Rows) -> bytes:
    """TSV lines for the rows, built with vectorised numpy (no per-row Python).

    Every row is laid out in a fixed-width byte matrix with room for the widest value of
    each field, with a mask of the bytes actually used; the masked bytes, read row by row,
    are the concatenated variable-length lines. Digits are looked up four characters at a
    time, as one uint32 word per lookup, which is much faster than per-character work.
    """
    n = len(rows.labels)
    int_width = 1 + _DIGITS  # sign + digits
    width = 2 + NUM_DENSE * (int_width + 1) + NUM_SPARSE * 9
    chars = np.empty((n, width), dtype=np.uint8)
    used = np.ones((n, width), dtype=bool)
    chars[:, 0] = _ZERO + rows.labels
    chars[:, 1] = _TAB
    pos = 2
    digit_slots = np.arange(_DIGITS)
    words = np.empty((n, _DIGITS // 4), dtype=np.uint32)
    for j in range(NUM_DENSE):
        value = rows.dense[:, j]
        present = ~rows.dense_missing[:, j]
        chars[:, pos] = _MINUS
        used[:, pos] = present & (value < 0)
        rest = np.abs(value).astype(np.uint32)  # |value| <= _DENSE_LIMIT < 2**32
        for limb in reversed(range(_DIGITS // 4)):  # base-10000 limbs, least significant first
            rest, low = np.divmod(rest, np.uint32(10_000))
            words[:, limb] = _DECIMAL4_WORDS[low]
        chars[:, pos + 1 : pos + 1 + _DIGITS] = words.view(np.uint8)
        n_digits = 1 + np.searchsorted(_POW10[1:], np.abs(value), side="right")
        keep_digit = digit_slots >= _DIGITS - n_digits[:, None]  # drop the leading zeros
        used[:, pos + 1 : pos + 1 + _DIGITS] = keep_digit & present[:, None]
        chars[:, pos + int_width] = _TAB
        pos += int_width + 1
    hex_words = np.empty((n, 2), dtype=np.uint32)
    for t in range(NUM_SPARSE):
        value = rows.sparse[:, t]
        bits = value.astype(np.uint32)  # -1 (missing) wraps around; masked out below
        hex_words[:, 0] = _HEX4_WORDS[bits >> np.uint32(16)]
        hex_words[:, 1] = _HEX4_WORDS[bits & np.uint32(0xFFFF)]
        chars[:, pos : pos + 8] = hex_words.view(np.uint8)
        used[:, pos : pos + 8] = (value >= 0)[:, None]
        chars[:, pos + 8] = _TAB if t < NUM_SPARSE - 1 else _NEWLINE
        pos += 9
    return chars[used].tobytes()


def _gzip_writer(raw: BinaryIO) -> gzip_module.GzipFile:
    # filename="" and mtime=0 keep the gzip header, hence the bytes, identical across runs;
    # level 4 compresses almost as well as the default 9 at several times the speed.
    return gzip_module.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=4)


def synth(
    rows: int,
    out_path: str | Path,
    *,
    seed: int = 0,
    scale: float = 1.0,
    max_cardinality: int | None = None,
    gzip: bool = False,
    chunk_rows: int = 131_072,
    progress: bool = True,
) -> SynthSummary:
    """Write ``rows`` synthetic Criteo lines to ``out_path`` (see the module doc).

    Also writes ``out_path + ".probs.npy"`` (true click probabilities) and
    ``out_path + ".summary.json"``. Files appear only when complete (written under a
    temporary name, then renamed). ``gzip=True`` compresses the TSV (deterministically:
    no timestamp in the header).

    Returns:
        A :class:`SynthSummary` with the positive rate and the best achievable AUC.
    """
    if rows < 1:
        raise OptionError("{} must be at least 1, got {}", Flag("rows"), rows)
    if chunk_rows < 1:
        raise OptionError("{} must be at least 1, got {}", Flag("chunk_rows"), chunk_rows)
    from sklearn.metrics import roc_auc_score  # optional dependency, only needed here

    out_path = Path(out_path)
    if out_path.is_dir():
        raise OptionError("{} {} is a folder; give a file name", Flag("out_path"), out_path)
    probs_path = out_path.with_name(out_path.name + ".probs.npy")
    summary_path = out_path.with_name(out_path.name + ".summary.json")
    tmp_out = out_path.with_name(f".{out_path.name}.tmp")
    tmp_probs = out_path.with_name(f".{out_path.name}.probs.tmp.npy")
    cardinalities = synthetic_cardinalities(scale, max_cardinality)
    model = _HiddenModel(seed, cardinalities)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    labels = np.empty(rows, dtype=np.int8)  # kept for the AUC: one byte per row
    probs = np.lib.format.open_memmap(tmp_probs, mode="w+", dtype=np.float32, shape=(rows,))
    bar = row_progress(progress)
    try:
        with (
            tmp_out.open("wb") as raw,
            _gzip_writer(raw) if gzip else contextlib.nullcontext(raw) as sink,
            bar,
        ):
            task = bar.add_task("writing synthetic rows", total=rows)
            for start in range(0, rows, chunk_rows):
                stop = min(rows, start + chunk_rows)
                drawn = model.draw(np.arange(start, stop, dtype=np.uint64))
                sink.write(_format_lines(drawn))
                labels[start:stop] = drawn.labels
                probs[start:stop] = drawn.probs
                bar.advance(task, stop - start)
        probs.flush()
        positives = int(labels.sum())
        both_classes = 0 < positives < rows
        best_auc = float(roc_auc_score(labels, probs)) if both_classes else None
        del probs  # close the memory map before renaming its file
        os.replace(tmp_out, out_path)
        os.replace(tmp_probs, probs_path)
    except BaseException:
        tmp_out.unlink(missing_ok=True)
        tmp_probs.unlink(missing_ok=True)
        raise

    summary = SynthSummary(
        path=out_path,
        probs_path=probs_path,
        rows=rows,
        positives=positives,
        positive_rate=positives / rows,
        best_auc=best_auc,
        cardinalities=cardinalities,
        seed=seed,
    )
    record = asdict(summary) | {
        "path": out_path.name,
        "probs_path": probs_path.name,
        "scale": scale,
        "max_cardinality": max_cardinality,
    }
    summary_path.write_text(json.dumps(record, indent=2) + "\n")
    # Debug only: the caller (the command line) reports the result once, its own way.
    logger.debug(
        "wrote %d rows to %s: %.1f%% positives, best achievable AUC %s",
        rows,
        out_path,
        100 * summary.positive_rate,
        best_auc,
    )
    return summary
