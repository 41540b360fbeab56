"""Suite ``interaction``: DLRM's embedding gather + dot interaction alone, over the full
Kaggle tables (26 tables, 33.8M rows, uniform random ids), d = 16 (kaggle) and 128
(mlperf), bf16, and mlperf in float32; B = 64 to 65536; output [x, tril(Z Z^T)] padded to
the top MLP's aligned width (368 / 480 columns).

Arms
  torch    F.embedding, cat, bmm, the triangle's index, cat and pad: what the DLRM model
           runs
  compile  torch.compile of that reference
  triton   fuseml.ops.embedding_interaction (one kernel)
  cuda     its CUDA C++ twin
  gather   a gather-only Triton kernel: the same rows at the same ids read and written
           out as (B, 26, d), nothing computed. Random 32-256-byte rows do not stream like
           a copy, so this is the floor of any gather at these ids, measured in the same
           run. A reference, not a peer.
--sweep adds the Triton kernel at every samples-per-program x warps pair (SWEEP), and the
looping variants (VARIANTS: groups per program, rows loaded a group ahead, flat stores).
"""

from __future__ import annotations

import functools

import torch

import fuseml
from fuseml.bench.harness import Case
from fuseml.bench.suites._common import dtype_name, launch_bound
from fuseml.data.synthetic import KAGGLE_CARDINALITIES
from fuseml.ops._interaction_kernels import Variant, _forward, gather_rows
from fuseml.ops.embedding_interaction import embedding_interaction_ref, num_pairs

# --sweep: the Triton kernel's samples per program x warps (arms triton@b<B>w<W>)
SWEEP = [(b, w) for b in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]
# (name, variant): around the best of a probe of loops with loads a group ahead (1 sample a
# warp, 4 groups a program: 47.3 us against the planned kernel's 50.9 at kaggle 65536 rows,
# H200), with and without flat stores
VARIANTS = [
    (f"i{i}{'p' if p else ''}{'f' if f else ''}", Variant(b, w, i, p, f))
    for b, w, i, p, f in [
        (2, 2, 1, False, True), (1, 1, 4, True, False), (1, 1, 4, True, True),
        (1, 1, 8, True, False), (2, 2, 4, True, False), (2, 2, 4, True, True),
        (1, 1, 4, False, False),
    ]
]  # fmt: skip
BATCHES_FULL = [64, 256, 4096, 16384, 65536]
BATCHES_QUICK = [64, 4096, 65536]
DIMS = {"kaggle": 16, "mlperf": 128}
# (config, table dtype): float32 at d = 128 forms the Gram on the tensor cores (tf32x3, as
# torch's TF32 flag is off by default), where the FMA form took 4.1 ms at 65536 rows
CONFIGS = [("kaggle", torch.bfloat16), ("mlperf", torch.bfloat16), ("mlperf", torch.float32)]


@functools.cache
def _tables(
    d: int, dtype: torch.dtype, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, table_offsets, cardinalities) of the Kaggle tables, built once per width."""
    cards = torch.tensor(KAGGLE_CARDINALITIES, dtype=torch.int64)
    offsets = torch.zeros(len(cards) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(cards, 0)
    weight = torch.empty(int(offsets[-1]), d, device=device, dtype=dtype).uniform_(-0.05, 0.05)
    return weight, offsets.to(device), cards.to(device)


def _case(config: str, batch: int, dtype: torch.dtype, cuda: bool) -> Case:
    d = DIMS[config]
    t = len(KAGGLE_CARDINALITIES)
    width = d + num_pairs(t + 1)
    out_width = -(-width // 16) * 16

    def make_inputs():
        weight, offsets, cards = _tables(d, dtype)
        g = torch.Generator(device="cuda").manual_seed(batch)
        u = torch.rand(batch, t, device="cuda", generator=g, dtype=torch.float64)
        ids = (u * cards).long().clamp_max(cards - 1).to(torch.int32)
        x = torch.randn(batch, d, device="cuda", dtype=dtype, generator=g)
        return x, weight, offsets, ids

    def ref(x, weight, offsets, ids):
        return embedding_interaction_ref(x, weight, offsets, ids, out_width=out_width)

    def sweep() -> dict:
        arms = {}
        runs = [(f"b{b}w{w}", Variant(b, w)) for b, w in SWEEP]
        for name, variant in runs + [(f"b{v.block_b}w{v.num_warps}{n}", v) for n, v in VARIANTS]:

            def call(x, w, o, i, variant=variant):
                return _forward(x, w, o, i, None, False, out_width, False, variant)

            arms[f"triton@{name}"] = call
        return arms

    es = torch.empty((), dtype=dtype).element_size()
    # reads: ids (int32), the gathered rows and x; writes: the output rows
    nbytes = batch * (4 * t + es * (t + 1) * d + es * out_width)
    flops = 2 * batch * num_pairs(t + 1) * d
    return Case(
        suite="interaction",
        name=f"{config}/{dtype_name(dtype)}/bs{batch}",
        params={
            "config": config,
            "dtype": dtype_name(dtype),
            "batch": batch,
            "d": d,
            "numel": batch,
            "shape": [batch, out_width],
        },
        make_inputs=make_inputs,
        arms={
            "torch": ref,
            "compile": torch.compile(ref, dynamic=False),
            "triton": lambda x, w, o, i: fuseml.ops.embedding_interaction(
                x, w, o, i, out_width=out_width, backend="triton"
            ),
            **(
                {
                    "cuda": lambda x, w, o, i: fuseml.ops.embedding_interaction(
                        x, w, o, i, out_width=out_width, backend="cuda"
                    )
                }
                if cuda
                else {}
            ),
            "gather": lambda x, w, o, i: gather_rows(w, o, i),
        },
        bytes=nbytes,
        flops=flops,
        dtype=dtype,
        unchecked_arms=("gather",),
        sweep=sweep,
        graph=launch_bound(flops, nbytes),
    )


def cases(quick: bool = False, cuda: bool = True):
    for config, dtype in CONFIGS:
        for batch in BATCHES_QUICK if quick else BATCHES_FULL:
            yield _case(config, batch, dtype, cuda)


PLOT = {"x": "batch", "panels": ("config", "dtype"), "xlabel": "batch size", "logx": True}
README = {
    "rows": ("config", "dtype", "batch"),
    "arms": ("torch", "compile", "triton", "cuda", "gather"),
    "min_numel": 0,
    "sort": "numeric",
    "reference_arms": ("gather",),
}
