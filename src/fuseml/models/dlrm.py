"""DLRM (Naumov et al., 2019) in plain PyTorch, with the semantics of facebookresearch/dlrm.

    dense (B, 13) --bottom_mlp--> x (B, d) --------------------+
    sparse (B, 26) --embeddings--> e (B, 26, d) --interaction--> z --top_mlp--> logit (B,)

* ``bottom_mlp``: Linear + ReLU on every layer, the last one included (the reference's
  bottom MLP has no sigmoid layer, so every layer gets a ReLU).
* ``embeddings``: all 26 tables in one concatenated weight (sum of cardinalities x d) with
  per-table row offsets; sum-pooled bags, one-hot (a (B, 26) id tensor) or multi-hot
  (per-table ``(indices, offsets)`` as for ``nn.EmbeddingBag``).
* ``interaction``: "dot" stacks T = [x, e_1..e_26] (B, 27, d), takes Z = T T^T and keeps
  the strictly lower triangle in row-major order (the diagonal too with
  ``self_interaction``), output ``cat([x, Z_flat])`` of width d + 351 (d + 378); "cat"
  concatenates x and all embeddings (d + 26 d).
* ``top_mlp``: Linear + ReLU, the last layer a plain Linear whose output is the logit.
  The reference puts ``nn.Sigmoid`` inside its top MLP; here ``forward`` applies it, so
  ``return_logits=True`` (for BCE-with-logits training) needs no slicing of the MLP.

The MLPs are ``nn.Sequential`` of ``nn.Linear`` / ``nn.ReLU`` so that ``fuseml.optimize``
can later swap them (and the other submodules) for fused ones; nothing here is a kernel.

Initialisation is the reference's: Linear weights ~ N(0, sqrt(2 / (fan_in + fan_out))),
biases ~ N(0, sqrt(1 / fan_out)), table t ~ U(-sqrt(1 / n_t), sqrt(1 / n_t)) with n_t its
number of rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fuseml.data.criteo import NUM_DENSE, NUM_SPARSE
from fuseml.data.synthetic import KAGGLE_CARDINALITIES

__all__ = [
    "CONFIG_NAMES",
    "DLRM",
    "CatInteraction",
    "ConcatEmbeddingBags",
    "DLRMConfig",
    "DotInteraction",
    "SparseInput",
    "mlp",
]

# One bag per table: (indices (N_t,), offsets (B,)) as for nn.EmbeddingBag, where bag b
# of table t sums rows indices[offsets[b]:offsets[b + 1]].
Bags = Sequence[tuple[torch.Tensor, torch.Tensor]]
SparseInput = torch.Tensor | Bags

# Architectures of the reference's run scripts (bench/dlrm_s_criteo_{kaggle,terabyte}.sh,
# the MLPerf v1 recommendation benchmark) and a tiny one for tests.
_NAMED: dict[str, dict[str, Any]] = {
    "tiny": {"embedding_dim": 8, "bottom_mlp": (16, 8), "top_mlp": (32, 16, 1)},
    "kaggle": {"embedding_dim": 16, "bottom_mlp": (512, 256, 64, 16), "top_mlp": (512, 256, 1)},
    "terabyte": {
        "embedding_dim": 64,
        "bottom_mlp": (512, 256, 64),
        "top_mlp": (512, 512, 256, 1),
    },
    "mlperf": {
        "embedding_dim": 128,
        "bottom_mlp": (512, 256, 128),
        "top_mlp": (1024, 1024, 512, 256, 1),
    },
}
CONFIG_NAMES: tuple[str, ...] = tuple(_NAMED)
# Default table sizes when no data says otherwise (benchmarks): Kaggle's, capped for tiny.
_DEFAULT_MAX_CARDINALITY = {"tiny": 1000}
_INTERACTIONS = ("dot", "cat")


@dataclass(frozen=True)
class DLRMConfig:
    """Architecture of a DLRM. ``cardinalities`` may be empty until the data is known.

    ``bottom_mlp`` and ``top_mlp`` list layer output widths (the reference's
    ``--arch-mlp-bot`` without its leading 13, and ``--arch-mlp-top`` as is).
    """

    name: str = "custom"
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)
    top_mlp: tuple[int, ...] = (512, 256, 1)
    cardinalities: tuple[int, ...] = ()  # rows of each table; () = take from the data
    num_dense: int = NUM_DENSE
    interaction: str = "dot"  # "dot" or "cat"
    self_interaction: bool = False  # dot: keep the diagonal of T T^T (offset 0)
    hash_ids: bool = False  # take raw ids modulo each table's cardinality, on the device

    def __post_init__(self) -> None:
        # Accept lists (from JSON) but store tuples, so configs compare and hash.
        for field in ("bottom_mlp", "top_mlp", "cardinalities"):
            object.__setattr__(self, field, tuple(int(v) for v in getattr(self, field)))
        if self.interaction not in _INTERACTIONS:
            raise ValueError(
                f"interaction must be one of {_INTERACTIONS}, got {self.interaction!r}"
            )
        if min((self.embedding_dim, self.num_dense, *self.bottom_mlp, *self.top_mlp)) < 1:
            raise ValueError(f"{self.name}: layer widths must be positive")
        if not self.bottom_mlp or not self.top_mlp:
            raise ValueError(f"{self.name}: bottom_mlp and top_mlp need at least one layer")
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"{self.name}: the bottom MLP's last width ({self.bottom_mlp[-1]}) must equal "
                f"embedding_dim ({self.embedding_dim}): x is interacted with the embeddings"
            )
        if self.top_mlp[-1] != 1:
            raise ValueError(f"{self.name}: the top MLP must end in 1 output (the click logit)")
        if self.cardinalities and min(self.cardinalities) < 1:
            raise ValueError(f"{self.name}: every table needs at least 1 row")

    # -- derived sizes ----------------------------------------------------------------------

    @property
    def num_tables(self) -> int:
        return len(self.cardinalities) if self.cardinalities else NUM_SPARSE

    @property
    def num_features(self) -> int:
        """Vectors that interact: x and one per table (27 for Criteo)."""
        return 1 + self.num_tables

    @property
    def interaction_dim(self) -> int:
        """Width of the interaction output, i.e. of the top MLP's input."""
        n, d = self.num_features, self.embedding_dim
        if self.interaction == "cat":
            return n * d
        pairs = n * (n + 1) // 2 if self.self_interaction else n * (n - 1) // 2
        return d + pairs

    @property
    def num_embeddings(self) -> int:
        """Rows of the concatenated table."""
        return sum(self.cardinalities)

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_name(
        cls,
        name: str,
        *,
        cardinalities: Sequence[int] | None = None,
        max_cardinality: int | None = None,
        **overrides: Any,
    ) -> DLRMConfig:
        """A named architecture (``CONFIG_NAMES``).

        Args:
            cardinalities: the tables' sizes, normally the data's metadata. Without them:
                the Kaggle cardinalities (benchmarks), capped at 1000 for ``tiny``.
            max_cardinality: cap each table at this many rows.
            overrides: other fields, e.g. ``interaction="cat"``.
        """
        if name not in _NAMED:
            raise ValueError(f"unknown DLRM config {name!r}; named configs: {CONFIG_NAMES}")
        if cardinalities is None:
            cardinalities = KAGGLE_CARDINALITIES
            max_cardinality = max_cardinality or _DEFAULT_MAX_CARDINALITY.get(name)
        cards = [int(c) for c in cardinalities]
        if max_cardinality is not None:
            cards = [min(c, max_cardinality) for c in cards]
        return cls(name=name, **{**_NAMED[name], "cardinalities": tuple(cards), **overrides})

    @classmethod
    def load(cls, spec: str | Path, *, cardinalities: Sequence[int] | None = None) -> DLRMConfig:
        """A config by name or from a JSON file, with the data's ``cardinalities``.

        A file without cardinalities takes the given ones; a file whose cardinalities
        differ from the given ones is refused (the tables would not fit the data).
        """
        if str(spec) in _NAMED:
            return cls.from_name(str(spec), cardinalities=cardinalities)
        path = Path(spec)
        if not path.is_file():
            raise ValueError(
                f"--config {spec!r} is neither a named config {CONFIG_NAMES} nor a file"
            )
        config = cls.from_json(path)
        if cardinalities is None:
            return config
        cardinalities = tuple(int(c) for c in cardinalities)
        if not config.cardinalities:
            return dataclasses.replace(config, cardinalities=cardinalities)
        config.check_cardinalities(cardinalities, what="the data")
        return config

    def with_cardinalities(self, cardinalities: Sequence[int]) -> DLRMConfig:
        return dataclasses.replace(self, cardinalities=tuple(int(c) for c in cardinalities))

    def check_cardinalities(self, cardinalities: Sequence[int], *, what: str) -> None:
        """Raise ValueError naming the first table whose size differs from ``what``'s."""
        cardinalities = tuple(int(c) for c in cardinalities)
        if self.cardinalities == cardinalities:
            return
        if len(self.cardinalities) != len(cardinalities):
            raise ValueError(
                f"config {self.name!r} has {len(self.cardinalities)} tables, "
                f"{what} has {len(cardinalities)}"
            )
        t = next(i for i, (a, b) in enumerate(zip(self.cardinalities, cardinalities)) if a != b)
        raise ValueError(
            f"config {self.name!r} does not match {what}: table {t} (C{t + 1}) has "
            f"{self.cardinalities[t]} rows in the config, {cardinalities[t]} in {what}"
        )

    # -- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DLRMConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DLRMConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> DLRMConfig:
        """Read a config from a JSON file path, or from JSON text."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: not valid JSON: {err}") from err
        return cls.from_dict(data)


# -- modules ------------------------------------------------------------------------------


def mlp(widths: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    """Linear + ReLU layers for ``widths = (in, h1, ..., out)``; ``last_relu=False`` leaves
    the last Linear without its ReLU."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(n_in, n_out))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _init_linear(layer: nn.Linear) -> None:
    """The reference's initialisation of an MLP layer."""
    fan_out, fan_in = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out))


def _check_id_range(ids: torch.Tensor, sizes: torch.Tensor, first: int) -> None:
    """ValueError naming the first table of (N, k) ``ids`` with an id outside [0, size)."""
    low, high = ids.amin(0), ids.amax(0)  # (k,) each: one reduction, one sync
    bad = (low < 0) | (high >= sizes)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        t = first + k
        raise ValueError(
            f"sparse ids of table {t} (C{t + 1}) must be in [0, {int(sizes[k])}), "
            f"got values in [{int(low[k])}, {int(high[k])}] (hash_ids=True takes "
            "raw ids modulo the table size)"
        )


class ConcatEmbeddingBags(nn.Module):
    """All tables in one weight (sum of cardinalities x dim); sum-pooled bags.

    ``forward(sparse)`` returns (B, T, dim) for either
      * a (B, T) integer tensor: one id per table and row (one-hot; Criteo's case), or
      * T pairs ``(indices, offsets)``, one per table, as for ``nn.EmbeddingBag``
        (offsets (B,) are the bag starts, beginning at 0; an empty bag gives zeros).

    Ids of table t must lie in [0, cardinalities[t]), checked on every call outside
    ``torch.compile`` (``check_ids=False`` skips the check and its device sync). Inside a
    CUDA graph's capture the check cannot sync: it sets a per-table flag on the device
    instead (the id read as 0), and :meth:`raise_if_bad_ids` (called by
    ``fuseml.cuda_graphs`` after each replay) raises for a flagged table. With
    ``hash_ids`` raw ids (any int64, negatives too) are first taken modulo the table size.
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        dim: int,
        *,
        hash_ids: bool = False,
        check_ids: bool = True,
    ) -> None:
        super().__init__()
        cards = torch.tensor([int(c) for c in cardinalities], dtype=torch.int64)
        if cards.ndim != 1 or len(cards) == 0 or int(cards.min()) < 1:
            raise ValueError(f"cardinalities must be positive table sizes, got {cardinalities}")
        self.dim = dim
        self.hash_ids = hash_ids
        self.check_ids = check_ids
        self.weight = nn.Parameter(torch.empty(int(cards.sum()), dim))
        # Buffers follow .to(device); they are derived from the config, so not saved.
        self.register_buffer("cardinalities", cards, persistent=False)
        self._host_cardinalities = cards  # (stays on the CPU: validate_ids of host ids)
        offsets = torch.zeros(len(cards) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(cards, 0)
        self.register_buffer("table_offsets", offsets, persistent=False)  # (T + 1,)
        self.reset_parameters()

    @property
    def num_tables(self) -> int:
        return len(self.cardinalities)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for start, n in zip(self.table_offsets.tolist(), self.cardinalities.tolist()):
                bound = math.sqrt(1.0 / n)
                self.weight[start : start + n].uniform_(-bound, bound)

    def extra_repr(self) -> str:
        return (
            f"tables={self.num_tables}, rows={self.weight.shape[0]}, dim={self.dim}, "
            f"hash_ids={self.hash_ids}"
        )

    def forward(self, sparse: SparseInput) -> torch.Tensor:
        if isinstance(sparse, torch.Tensor):
            return self._one_hot(sparse)
        return self._bags(sparse)

    def _one_hot(self, ids: torch.Tensor) -> torch.Tensor:
        ids = self.one_hot_ids(ids).long()  # (B, T)
        return F.embedding(ids + self.table_offsets[:-1], self.weight)  # (B, T, d)

    def one_hot_ids(self, ids: torch.Tensor, *, range_check: bool = True) -> torch.Tensor:
        """(B, T) one-hot ids as the forward takes them: shape and dtype checked, then
        hashed (``hash_ids``: int64) or range-checked (``check_ids``: the ids themselves),
        each relative to its table. ``range_check=False``: the caller checks the range
        itself (e.g. in its kernel, through :meth:`bad_id_flags`)."""
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[1] != self.num_tables:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"sparse ids: expected shape (B, {self.num_tables}), got {shape}")
        return self._table_ids(ids, self.cardinalities, keep_dtype=True, range_check=range_check)

    def bad_id_flags(self, device: torch.device) -> torch.Tensor:
        """The (T,) int32 flags on ``device`` that the sync-free check sets (flag t: an id
        of table t outside it was seen); kept until :meth:`raise_if_bad_ids` reads them."""
        flags = self.__dict__.setdefault("_bad_id_flags", {})
        f = flags.get(device)
        if f is None:
            with torch.inference_mode(False):  # written in and out of inference mode
                f = flags[device] = torch.zeros(self.num_tables, dtype=torch.int32, device=device)
        return f

    def raise_if_bad_ids(self) -> None:
        """ValueError naming the first table whose flag the sync-free check set (a device
        sync per flag tensor); the flags are cleared."""
        flags = self.__dict__.get("_bad_id_flags", {})
        if flags and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # read after the replay, not inside a capture
        for f in flags.values():
            if bool(f.any()):
                t = int(f.nonzero()[0, 0])
                f.zero_()
                raise ValueError(
                    f"sparse ids of table {t} (C{t + 1}) must be in [0, "
                    f"{int(self._host_cardinalities[t])}): an id outside it was seen "
                    "(checked on the device; the batch's results are not valid; "
                    "hash_ids=True takes raw ids modulo the table size)"
                )

    def _bags(self, bags: Bags) -> torch.Tensor:
        checked = self.bag_ids(bags)
        batch = checked[0][1].shape[0]
        indices, offsets, start = [], [], 0
        for t, (ids, off) in enumerate(checked):
            indices.append(ids.long() + self.table_offsets[t])
            offsets.append(off + start)
            start += ids.shape[0]
        # One call for all tables: bag t * B + b is bag b of table t.
        pooled = F.embedding_bag(
            torch.cat(indices), self.weight, torch.cat(offsets), mode="sum"
        )  # (T * B, d)
        return pooled.view(self.num_tables, batch, self.dim).transpose(0, 1)  # (B, T, d)

    def bag_ids(
        self, bags: Bags, *, range_check: bool = True
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """T ``(indices, offsets)`` bags as the forward takes them: shapes and offsets
        checked, ids hashed (``hash_ids``) or range-checked (``check_ids``; not with
        ``range_check=False``), each relative to its table."""
        if not isinstance(bags, (list, tuple)) or len(bags) != self.num_tables:
            got = len(bags) if isinstance(bags, (list, tuple)) else type(bags).__name__
            raise ValueError(f"sparse bags: expected {self.num_tables} tables, got {got}")
        batch = bags[0][1].shape[0]
        checked = []
        for t, (idx, off) in enumerate(bags):
            if idx.ndim != 1 or off.ndim != 1 or off.shape[0] != batch:
                raise ValueError(
                    f"sparse bags of table {t} (C{t + 1}): need 1-D indices and 1-D offsets "
                    f"of length {batch} (the batch), got {tuple(idx.shape)} and {tuple(off.shape)}"
                )
            self._check_offsets(t, off, idx.shape[0])
            ids = self._table_ids(
                idx.unsqueeze(1), self.cardinalities[t : t + 1], first=t, keep_dtype=True,
                range_check=range_check,
            )  # fmt: skip
            checked.append((ids.squeeze(1), off))
        return checked

    def _table_ids(
        self,
        ids: torch.Tensor,
        sizes: torch.Tensor,
        first: int = 0,
        keep_dtype: bool = False,
        range_check: bool = True,
    ) -> torch.Tensor:
        """Hash or validate (N, k) ids of tables first..first + k - 1 with ``sizes`` rows;
        int64, or (keep_dtype, unhashed) in their own dtype."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"sparse ids must be int32 or int64, got {ids.dtype}")
        if self.hash_ids:
            return torch.remainder(ids.long(), sizes)  # floor modulo: always in [0, size)
        if range_check and self.check_ids and ids.shape[0] and not torch.compiler.is_compiling():
            if ids.is_cuda and torch.cuda.is_current_stream_capturing():
                # no sync inside a capture: flag the table, read the id as 0
                bad = (ids < 0) | (ids >= sizes)  # (N, k)
                flags = self.bad_id_flags(ids.device)[first : first + ids.shape[1]]
                flags.bitwise_or_(bad.any(0).to(torch.int32))
                ids = ids.masked_fill(bad, 0)
            else:
                _check_id_range(ids, sizes, first)
        return ids if keep_dtype else ids.long()

    def validate_ids(self, ids: torch.Tensor) -> None:
        """Check (B, T) one-hot ids against the tables where they are (e.g. on the host,
        before they are copied to the GPU): the check ``check_ids`` makes in the forward,
        for a caller that turns it off to capture the forward in a CUDA graph."""
        if not self.hash_ids and ids.shape[0]:
            host = ids.device.type == "cpu"
            sizes = self._host_cardinalities if host else self.cardinalities.to(ids.device)
            _check_id_range(ids, sizes, 0)

    def _check_offsets(self, t: int, offsets: torch.Tensor, n_indices: int) -> None:
        if not self.check_ids or torch.compiler.is_compiling() or offsets.shape[0] == 0:
            return
        steps_ok = bool((offsets[1:] >= offsets[:-1]).all()) if offsets.shape[0] > 1 else True
        if int(offsets[0]) != 0 or int(offsets[-1]) > n_indices or not steps_ok:
            raise ValueError(
                f"sparse bags of table {t} (C{t + 1}): offsets must start at 0, never "
                f"decrease and not exceed the {n_indices} indices"
            )


class DotInteraction(nn.Module):
    """Pairwise dot products of [x, e_1, ..., e_T]: ``cat([x, tril(T T^T)])``."""

    def __init__(self, num_features: int, *, self_interaction: bool = False) -> None:
        super().__init__()
        self.num_features = num_features
        self.self_interaction = self_interaction
        # Row-major lower triangle: (1,0), (2,0), (2,1), ... as the reference's li/lj.
        li, lj = torch.tril_indices(num_features, num_features, 0 if self_interaction else -1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def output_dim(self, dim: int) -> int:
        return dim + self.li.numel()

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, self_interaction={self.self_interaction}"

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        t = torch.cat([x.unsqueeze(1), emb.to(x.dtype)], dim=1)  # (B, F, d)
        z = torch.bmm(t, t.transpose(1, 2))  # (B, F, F)
        return torch.cat([x, z[:, self.li, self.lj].to(x.dtype)], dim=1)  # (B, d + pairs)


class CatInteraction(nn.Module):
    """No interaction: ``cat([x, e_1, ..., e_T])``."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features = num_features

    def output_dim(self, dim: int) -> int:
        return self.num_features * dim

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, emb.to(x.dtype).flatten(1)], dim=1)  # (B, d + T d)


class DLRM(nn.Module):
    """The reference DLRM; ``forward(dense, sparse)`` gives click probabilities (B,).

    Args of ``forward``:
        dense: (B, num_dense) float features (log(x + 1) counts for Criteo).
        sparse: (B, T) ids, or T ``(indices, offsets)`` bags (see ConcatEmbeddingBags).
        return_logits: return the pre-sigmoid logits instead (for BCE-with-logits).
    """

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        if not config.cardinalities:
            raise ValueError(
                f"config {config.name!r} has no table cardinalities: pass the data's "
                "(DLRMConfig.from_name(name, cardinalities=...))"
            )
        self.config = config
        d = config.embedding_dim
        self.bottom_mlp = mlp((config.num_dense, *config.bottom_mlp), last_relu=True)
        self.embeddings = ConcatEmbeddingBags(config.cardinalities, d, hash_ids=config.hash_ids)
        if config.interaction == "dot":
            self.interaction: nn.Module = DotInteraction(
                config.num_features, self_interaction=config.self_interaction
            )
        else:
            self.interaction = CatInteraction(config.num_features)
        self.top_mlp = mlp((config.interaction_dim, *config.top_mlp), last_relu=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference initialisation (uses torch's global RNG)."""
        for layer in [*self.bottom_mlp, *self.top_mlp]:
            if isinstance(layer, nn.Linear):
                _init_linear(layer)
        self.embeddings.reset_parameters()

    def raise_if_bad_ids(self) -> None:
        """Raise for ids outside their tables seen by the sync-free check (inside CUDA
        graphs); see ``ConcatEmbeddingBags.raise_if_bad_ids``."""
        self.embeddings.raise_if_bad_ids()

    def forward(
        self, dense: torch.Tensor, sparse: SparseInput, return_logits: bool = False
    ) -> torch.Tensor:
        self._check_dense(dense)
        x = self.bottom_mlp(dense)  # (B, d)
        e = self.embeddings(sparse)  # (B, T, d)
        z = self.interaction(x, e)  # (B, interaction_dim)
        logits = self.top_mlp(z).squeeze(1)  # (B,)
        return logits if return_logits else torch.sigmoid(logits)

    def _check_dense(self, dense: torch.Tensor) -> None:
        n = self.config.num_dense
        if dense.ndim != 2 or dense.shape[1] != n:
            raise ValueError(f"dense features: expected shape (B, {n}), got {tuple(dense.shape)}")
        if not dense.is_floating_point():
            raise TypeError(f"dense features must be floating point, got {dense.dtype}")
