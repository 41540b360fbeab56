import pytest
import torch

import fuseml
from fuseml.models.dlrm import DLRM, DLRMConfig
from fuseml.ops._interaction_kernels import (
    LOOPED,
    PLANNED,
    WIDE_F32,
    Variant,
    _forward,
    default_variant,
    gram_precision,
)
from fuseml.ops.embedding_interaction import (
    TWIN_MIN_ROWS,
    embedding_interaction_ref,
    num_pairs,
    pack_bags,
)
from fuseml.ops.gemm.common import dot_precision, fp32_dot
from fuseml.runtime import tf32_matmuls
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets, poison_allocator

TARGETS = fused_targets()
op = fuseml.ops.embedding_interaction


def _tables(n_tables, dim, dtype, device, *, max_rows=20, seed=0):
    """(weight, table_offsets, cardinalities) of ``n_tables`` random tables."""
    gen = torch.Generator().manual_seed(seed)
    cards = torch.randint(1, max_rows + 1, (n_tables,), generator=gen)
    offsets = torch.zeros(n_tables + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(cards, 0)
    weight = torch.randn(int(offsets[-1]), dim, generator=gen).to(dtype)
    return weight.to(device), offsets.to(device), cards


def _ids(batch, cards, id_dtype, device):
    ids = (torch.rand(batch, len(cards)) * cards.double()).long().clamp_max(cards - 1)
    return ids.to(id_dtype).to(device)


def _expected(x, weight, offsets, ids, **kwargs):
    """The float64 reference."""
    return embedding_interaction_ref(x.double(), weight.double(), offsets, ids, **kwargs)


def _prepare(device):
    if device == "cuda":
        poison_allocator()  # a column the kernel leaves unwritten shows as NaN


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_tables", "dim"), [(3, 4), (3, 16), (26, 4), (26, 16)])
@pytest.mark.parametrize("batch", [1, 5, 33])
def test_embedding_interaction_matches_float64(device, backend, dtype, n_tables, dim, batch):
    weight, offsets, cards = _tables(n_tables, dim, dtype, device)
    x = torch.randn(batch, dim, dtype=dtype, device=device)
    ids = _ids(batch, cards, torch.int64, device)
    _prepare(device)
    out = op(x, weight, offsets, ids, backend=backend)
    width = dim + num_pairs(n_tables + 1)
    assert out.shape == (batch, width) and out.dtype == dtype
    assert torch.equal(out[:, :dim], x)  # x is copied, not recomputed
    assert_close_verbose(out, _expected(x, weight, offsets, ids), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dim", [32, 128])
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_embedding_interaction_float32_gram_precision(device, backend, dim, allow_tf32):
    """float32 tables from d = 32: the Gram on the tensor cores, TF32 only where torch's
    matmul flag allows it (else tf32x3, float32's tolerance); below d = 32, exact FMAs."""
    weight, offsets, cards = _tables(26, dim, torch.float32, device, seed=2)
    x = torch.randn(9, dim, device=device)
    ids = _ids(9, cards, torch.int64, device)
    _prepare(device)
    with tf32_matmuls(allow_tf32):
        assert gram_precision(torch.float32, dim) == ("tf32" if allow_tf32 else fp32_dot())
        out = op(x, weight, offsets, ids, backend=backend)
    expected = _expected(x, weight, offsets, ids)
    assert_close_verbose(out, expected, torch.float32, tf32=allow_tf32 and backend == "triton")
    assert gram_precision(torch.float32, 16) == "ieee"
    assert gram_precision(torch.bfloat16, 16) == dot_precision(torch.bfloat16)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize(("n_tables", "dim"), [(3, 16), (26, 4)])
def test_embedding_interaction_options(
    device, backend, dtype, id_dtype, self_interaction, n_tables, dim
):
    """int32 and int64 ids, with and without the diagonal, int32 table offsets too."""
    weight, offsets, cards = _tables(n_tables, dim, dtype, device, seed=1)
    x = torch.randn(7, dim, dtype=dtype, device=device)
    ids = _ids(7, cards, id_dtype, device)
    offsets = offsets.to(id_dtype)
    _prepare(device)
    out = op(x, weight, offsets, ids, self_interaction=self_interaction, backend=backend)
    assert out.shape == (7, dim + num_pairs(n_tables + 1, self_interaction))
    expected = _expected(x, weight, offsets, ids, self_interaction=self_interaction)
    assert_close_verbose(out, expected, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("extra", [0, 1, 13, 200])
def test_embedding_interaction_out_width_pads_zeros(
    device, backend, dtype, self_interaction, extra
):
    """Columns past d + pairs are exactly zero (written by the kernel, no pad pass)."""
    n_tables, dim = 26, 16
    weight, offsets, cards = _tables(n_tables, dim, dtype, device, seed=2)
    x = torch.randn(9, dim, dtype=dtype, device=device)
    ids = _ids(9, cards, torch.int32, device)
    width = dim + num_pairs(n_tables + 1, self_interaction)
    _prepare(device)
    out = op(
        x, weight, offsets, ids, self_interaction=self_interaction, out_width=width + extra,
        backend=backend,
    )  # fmt: skip
    assert out.shape == (9, width + extra) and out.is_contiguous()
    assert torch.equal(out[:, width:], torch.zeros(9, extra, dtype=dtype, device=device))
    expected = _expected(
        x, weight, offsets, ids, self_interaction=self_interaction, out_width=width + extra
    )
    assert_close_verbose(out, expected, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("layout", ["sliced", "transposed", "strided_ids"])
def test_embedding_interaction_non_contiguous(device, backend, layout):
    n_tables, dim, batch = 26, 16, 11
    weight, offsets, cards = _tables(n_tables, dim, torch.float32, device, seed=3)
    ids = _ids(batch, cards, torch.int64, device)
    if layout == "sliced":  # row stride != d
        x = torch.randn(batch, dim + 5, device=device)[:, 2 : 2 + dim]
    elif layout == "transposed":
        x = torch.randn(dim, batch, device=device).t()
    else:  # ids with a row stride != T and a column stride of 2; weight a column slice
        x = torch.randn(batch, dim, device=device)
        ids = torch.stack([ids, ids], dim=2).flatten(1)[:, ::2]
        weight = torch.randn(weight.shape[0], 2 * dim, device=device)[:, ::2]
    assert not (x.is_contiguous() and ids.is_contiguous())
    out = op(x, weight, offsets, ids, backend=backend)
    assert_close_verbose(out, _expected(x, weight, offsets, ids))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_embedding_interaction_empty(device, backend):
    weight, offsets, _ = _tables(3, 4, torch.float32, device)
    x = torch.randn(0, 4, device=device)
    ids = torch.zeros(0, 3, dtype=torch.int64, device=device)
    assert op(x, weight, offsets, ids, out_width=16, backend=backend).shape == (0, 16)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("self_interaction", [False, True])
def test_embedding_interaction_matches_model(device, backend, dtype, self_interaction):
    """DotInteraction(x, ConcatEmbeddingBags(ids)) of a tiny DLRM, x its bottom MLP's."""
    config = DLRMConfig.from_name("tiny", self_interaction=self_interaction)
    model = DLRM(config).to(device)
    dense = torch.randn(13, config.num_dense, device=device)
    ids = _ids(13, torch.tensor(config.cardinalities), torch.int64, device)
    with torch.no_grad():
        x = model.bottom_mlp(dense)
        emb = model.embeddings
        expected = model.double().interaction(x.double(), emb(ids))  # float64 model
        model.to(dtype)
        x = x.to(dtype)
        out = op(x, emb.weight, emb.table_offsets, ids, self_interaction=self_interaction,
                 backend=backend)  # fmt: skip
        assert out.shape == (13, config.interaction_dim)
        assert_close_verbose(out, expected, dtype)
        eager = op(x, emb.weight, emb.table_offsets, ids, self_interaction=self_interaction,
                   backend="eager")  # fmt: skip
        assert torch.equal(eager, model.interaction(x, emb(ids)))  # the model's own ops


def test_embedding_interaction_backends_agree():
    weight, offsets, cards = _tables(4, 8, torch.float32, "cpu")
    x = torch.randn(6, 8)
    ids = _ids(6, cards, torch.int32, "cpu")
    expected = embedding_interaction_ref(x, weight, offsets, ids, out_width=24)
    for backend in ("auto", "eager", "compile"):
        out = op(x, weight, offsets, ids, out_width=24, backend=backend)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_embedding_interaction_opcheck(device, backend):
    weight, offsets, cards = _tables(26, 16, torch.float32, device)
    x = torch.randn(5, 16, device=device)
    ids = _ids(5, cards, torch.int32, device)
    for self_interaction, width in ((False, 16 + 351), (True, 400)):
        args = (x, weight, offsets, ids, None, self_interaction, width, backend)
        torch.library.opcheck(torch.ops.fuseml.embedding_interaction, args)
    flat, starts = pack_bags("t", _bags(5, cards, device), 5, 26, x.device)  # multi-hot
    args = (x, weight, offsets, flat, starts, False, 16 + 351, backend)
    torch.library.opcheck(torch.ops.fuseml.embedding_interaction, args)
    flags = torch.zeros(26, dtype=torch.int32, device=device)  # the device-side id check
    args = (x, weight, offsets, ids, None, False, 16 + 351, backend, flags)
    torch.library.opcheck(torch.ops.fuseml.embedding_interaction_checked, args)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_embedding_interaction_compile_fullgraph(device, backend):
    weight, offsets, cards = _tables(26, 16, torch.float32, device)
    x = torch.randn(6, 16, device=device)
    ids = _ids(6, cards, torch.int64, device)

    def fn(a, w, t, i):
        return op(a, w, t, i, out_width=368, backend=backend) * 2

    out = torch.compile(fn, fullgraph=True)(x, weight, offsets, ids)
    assert_close_verbose(out, _expected(x, weight, offsets, ids, out_width=368) * 2)
    flags = torch.zeros(26, dtype=torch.int32, device=device)  # with the id flags
    bad = ids.clone()
    bad[1, 2] = -1

    def checked(a, w, t, i, f):
        return op(a, w, t, i, out_width=368, bad_ids=f, backend=backend) * 2

    torch.compile(checked, fullgraph=True)(x, weight, offsets, bad, flags)
    assert flags.nonzero().flatten().tolist() == [2]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_embedding_interaction_check_ids(device, backend):
    weight, offsets, cards = _tables(3, 4, torch.float32, device)
    x = torch.randn(4, 4, device=device)
    ids = _ids(4, cards, torch.int64, device)
    good = op(x, weight, offsets, ids, check_ids=True, backend=backend)
    assert_close_verbose(good, _expected(x, weight, offsets, ids))
    bad = ids.clone()
    bad[2, 1] = int(cards[1])  # one past table 1's last row
    with pytest.raises(ValueError, match=r"ids of table 1 must be in \[0, "):
        op(x, weight, offsets, bad, check_ids=True, backend=backend)
    bad[2, 1] = -1
    with pytest.raises(ValueError, match="ids of table 1"):
        op(x, weight, offsets, bad, check_ids=True, backend=backend)
    short = offsets.clone()
    short[-1] = weight.shape[0] + 1  # the last table runs past weight
    with pytest.raises(ValueError, match="table_offsets must rise"):
        op(x, weight, short, ids, check_ids=True, backend=backend)


@pytest.mark.parametrize(("device", "backend"), [*TARGETS, ("cpu", "eager")])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embedding_interaction_bad_ids_flags(device, backend, id_dtype):
    """The check without a sync: a table with an id outside it is flagged, the other
    samples' rows are right, nothing is read past a table."""
    weight, offsets, cards = _tables(4, 16, torch.float32, device)
    x = torch.randn(6, 16, device=device)
    ids = _ids(6, cards, id_dtype, device)
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    good = op(x, weight, offsets, ids, bad_ids=flags, backend=backend)
    assert_close_verbose(good, _expected(x, weight, offsets, ids))
    assert flags.tolist() == [0, 0, 0, 0]
    bad = ids.clone()
    bad[2, 1] = int(cards[1])  # one past table 1's last row
    bad[4, 3] = -(2**31) if id_dtype == torch.int32 else -(2**40)
    out = op(x, weight, offsets, bad, bad_ids=flags, backend=backend)
    assert flags.tolist() == [0, 1, 0, 1]
    keep = [0, 1, 3, 5]
    assert_close_verbose(out[keep], _expected(x, weight, offsets, ids)[keep])
    op(x, weight, offsets, ids, bad_ids=flags, backend=backend)
    assert flags.tolist() == [0, 1, 0, 1]  # set, never cleared
    # bags: every id of every bag checked
    bags = _bags(6, cards, device, id_dtype=id_dtype)
    flags.zero_()
    op(x, weight, offsets, bags, bad_ids=flags, backend=backend)
    assert flags.tolist() == [0, 0, 0, 0]
    idx, off = bags[2]
    if idx.numel():
        bags[2] = (idx.clone().fill_(int(cards[2]) + 5), off)
        op(x, weight, offsets, bags, bad_ids=flags, backend=backend)
        assert flags.tolist() == [0, 0, 1, 0]
    with pytest.raises(
        ValueError, match=r"bad_ids must be a contiguous int32 tensor of shape \(4,\)"
    ):
        op(x, weight, offsets, ids, bad_ids=flags[:3], backend=backend)


def test_embedding_interaction_bad_input():
    weight, offsets, cards = _tables(3, 4, torch.float32, "cpu")
    x = torch.randn(5, 4)
    ids = _ids(5, cards, torch.int64, "cpu")
    with pytest.raises(TypeError, match="x must have dtype"):
        op(x.double(), weight, offsets, ids)
    with pytest.raises(TypeError, match="mixed dtypes"):
        op(x, weight.half(), offsets, ids)
    with pytest.raises(TypeError, match="ids must have dtype"):
        op(x, weight, offsets, ids.float())
    with pytest.raises(TypeError, match="table_offsets must have dtype"):
        op(x, weight, offsets.float(), ids)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        op(x, weight.tolist(), offsets, ids)
    with pytest.raises(ValueError, match="x must be 2-D"):
        op(x[0], weight, offsets, ids)
    with pytest.raises(ValueError, match=r"weight must be \(rows, 4\)"):
        op(x, weight[:, :3], offsets, ids)
    with pytest.raises(ValueError, match=r"ids must be \(5, T\)"):
        op(x, weight, offsets, ids[:4])
    with pytest.raises(ValueError, match=r"ids must be \(5, T\)"):
        op(x, weight, offsets, ids[:, :0])
    with pytest.raises(ValueError, match=r"table_offsets must have shape \(4,\)"):
        op(x, weight, offsets[:-1], ids)
    with pytest.raises(ValueError, match="out_width must be at least 10"):
        op(x, weight, offsets, ids, out_width=9)
    with pytest.raises(TypeError, match="out_width must be an int"):
        op(x, weight, offsets, ids, out_width=12.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        op(x, weight, offsets, ids, backend="fast")
    with pytest.raises(
        ValueError,
        match="backend='cuda' is unavailable here: the CUDA C\\+\\+ backend runs on CUDA",
    ):
        op(x, weight, offsets, ids, backend="cuda")
    other = "cuda" if torch.cuda.is_available() else "meta"
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        op(x, weight.to(other), offsets, ids)
    with pytest.raises(ValueError, match="ids is on"):
        op(x, weight, offsets, ids.to(other))
    with pytest.raises(ValueError, match="table_offsets is on"):
        op(x, weight, offsets.to(other), ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_embedding_interaction_kaggle_size_on_gpu(self_interaction, id_dtype, impl):
    """Kaggle's shape (B = 4099, T = 26, d = 16, bf16), tables of a few thousand rows,
    padded to a multiple of 8 columns; first and repeat call. From 4096 rows the Triton
    kernel takes its looped launch (LOOPED: 4 samples a program, the last one ragged)."""
    n_tables, dim, batch, dtype = 26, 16, 4099, torch.bfloat16
    weight, offsets, cards = _tables(n_tables, dim, dtype, "cuda", max_rows=5000, seed=4)
    x = torch.randn(batch, dim, dtype=dtype, device="cuda")
    ids = _ids(batch, cards, id_dtype, "cuda")
    width = dim + num_pairs(n_tables + 1, self_interaction)
    padded = (width + 7) // 8 * 8 + 8  # at least 8 padding columns
    expected = _expected(
        x, weight, offsets, ids, self_interaction=self_interaction, out_width=padded
    )
    for _ in range(2):
        poison_allocator()
        out = op(x, weight, offsets, ids, self_interaction=self_interaction,
                 out_width=padded, backend=impl)  # fmt: skip
        assert out.shape == (batch, padded) and out.dtype == dtype
        assert torch.equal(out[:, :dim], x)
        assert torch.equal(out[:, width:], torch.zeros_like(out[:, width:]))
        assert_close_verbose(out, expected, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize(
    ("n_tables", "dim"), [(26, 32), (26, 128), (15, 16), (31, 16), (32, 16), (26, 24)]
)
def test_embedding_interaction_cuda_tensor_core_form(dtype, self_interaction, n_tables, dim):
    """The CUDA twin's tensor-core form (16-bit, d a multiple of 16, up to 32 rows of Z:
    one or two 16-row tiles, the widest staging at d = 128) and the shapes just outside it
    (33 rows, d = 24), which take the CUDA-core form; bags in both."""
    weight, offsets, cards = _tables(n_tables, dim, dtype, "cuda", max_rows=3000, seed=7)
    x = torch.randn(67, dim, dtype=dtype, device="cuda")
    ids = _ids(67, cards, torch.int64, "cuda")
    width = dim + num_pairs(n_tables + 1, self_interaction)
    for extra in (0, 3):  # the staged row stored 16 bytes a lane, or one element a lane
        expected = _expected(
            x, weight, offsets, ids, self_interaction=self_interaction, out_width=width + extra
        )
        poison_allocator()
        out = op(x, weight, offsets, ids, self_interaction=self_interaction,
                 out_width=width + extra, backend="cuda")  # fmt: skip
        assert torch.equal(out[:, :dim], x)
        assert_close_verbose(out, expected, dtype)
    bags = _bags(67, cards, "cuda", seed=8)  # sum-pooled, empty bags included
    poison_allocator()
    pooled = op(x, weight, offsets, bags, self_interaction=self_interaction, backend="cuda")
    expected = _expected_bags(x, weight, offsets, bags, self_interaction=self_interaction)
    assert_close_verbose(pooled, expected, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("dim", [16, 32])
def test_embedding_interaction_cuda_warps_stride_over_samples(dtype, self_interaction, dim):
    """The CUDA twin's one-hot 16-bit forms over aligned rows (d = 16: Z's rows loaded
    straight into the MMA operands, two samples ahead; d = 32: a ring of staged copies):
    past one sample per resident warp (~4,200 on an H200) each warp strides over several
    samples; an id outside its table in the middle of the run reads nothing and flags its
    table."""
    n_tables, batch = 26, 40_003
    weight, offsets, cards = _tables(n_tables, dim, dtype, "cuda", max_rows=4000, seed=11)
    x = torch.randn(batch, dim, dtype=dtype, device="cuda")
    ids = _ids(batch, cards, torch.int32, "cuda")
    width = dim + num_pairs(n_tables + 1, self_interaction)
    out_width = -(-width // 16) * 16
    expected = _expected(
        x, weight, offsets, ids, self_interaction=self_interaction, out_width=out_width
    )
    flags = torch.zeros(n_tables, dtype=torch.int32, device="cuda")
    for _ in range(2):
        poison_allocator()
        out = op(x, weight, offsets, ids, self_interaction=self_interaction,
                 out_width=out_width, backend="cuda", bad_ids=flags)  # fmt: skip
        assert_close_verbose(out, expected, dtype)
        assert torch.equal(out[:, :dim], x)
    assert flags.tolist() == [0] * n_tables
    bad = ids.clone()
    bad[batch // 2 + 1, 7] = int(cards[7])  # one past table 7's last row
    out = op(x, weight, offsets, bad, self_interaction=self_interaction,
             out_width=out_width, backend="cuda", bad_ids=flags)  # fmt: skip
    assert flags.nonzero().flatten().tolist() == [7]
    keep = torch.ones(batch, dtype=torch.bool, device="cuda")
    keep[batch // 2 + 1] = False  # (that row's share of the result is unspecified)
    assert_close_verbose(out[keep], expected[keep], dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_embedding_interaction_auto_takes_the_twin_from_its_row_count(dtype):
    """auto on kaggle's shape: the Triton kernel below TWIN_MIN_ROWS rows, the CUDA twin's
    fragment form from there (seen in the profile), each equal to the reference and,
    bitwise, to its backend called by name; a strided x (not the fragment form's layout)
    stays on Triton."""
    n_tables, dim = 26, 16
    weight, offsets, cards = _tables(n_tables, dim, dtype, "cuda", max_rows=5000, seed=12)
    width = 384
    for batch, impl, kernel in (
        (TWIN_MIN_ROWS - 1, "triton", "_embedding_interaction_kernel"),
        (TWIN_MIN_ROWS, "cuda", "interaction_frag_kernel"),
        (3 * TWIN_MIN_ROWS + 5, "cuda", "interaction_frag_kernel"),
    ):
        x = torch.randn(batch, dim, dtype=dtype, device="cuda")
        ids = _ids(batch, cards, torch.int32, "cuda")
        expected = _expected(x, weight, offsets, ids, out_width=width)
        poison_allocator()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = op(x, weight, offsets, ids, out_width=width)
            torch.cuda.synchronize()
        names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
        assert any(kernel in n for n in names), (batch, names)
        assert_close_verbose(out, expected, dtype)
        assert torch.equal(out, op(x, weight, offsets, ids, out_width=width, backend=impl))
    wide = torch.randn(batch, 2 * dim, dtype=dtype, device="cuda")[:, 1 : dim + 1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = op(wide, weight, offsets, ids, out_width=width)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    assert any("_embedding_interaction_kernel" in n for n in names), names
    assert_close_verbose(out, _expected(wide, weight, offsets, ids, out_width=width), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_embedding_interaction_in_cuda_graph(dtype, impl):
    """Captured once, replayed on new ids and x written into the captured inputs."""
    from fuseml.testing import capture_graph, replay_poisoned

    n_tables, dim, batch = 26, 16, 333
    weight, offsets, cards = _tables(n_tables, dim, dtype, "cuda", max_rows=1000, seed=5)
    x = torch.randn(batch, dim, dtype=dtype, device="cuda")
    ids = _ids(batch, cards, torch.int32, "cuda")
    graph, out = capture_graph(lambda: op(x, weight, offsets, ids, out_width=376, backend=impl))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        ids.copy_(_ids(batch, cards, torch.int32, "cuda"))
        replay_poisoned(graph, out)
        assert_close_verbose(out, _expected(x, weight, offsets, ids, out_width=376), dtype)
        assert torch.equal(out[:, 367:], torch.zeros_like(out[:, 367:]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_embedding_interaction_rows_past_int32_offsets(impl):
    """Rows whose element offset (row * d) passes 2^31: the second table starts at row
    2^27 of a d = 16 weight (4.3 GB in bf16)."""
    dim, first = 16, 2**27
    weight = torch.randn(first + 1000, dim, dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, first, first + 1000], device="cuda")
    x = torch.randn(64, dim, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 1000, (64, 2), device="cuda")
    out = op(x, weight, offsets, ids, check_ids=True, backend=impl)
    small = torch.cat([weight[:1000], weight[first:]])  # the rows the ids can reach
    small_offsets = torch.tensor([0, 1000, 2000], device="cuda")
    assert_close_verbose(out, _expected(x, small, small_offsets, ids), torch.bfloat16)


# ------------------------------------------------------------------------------- bags
def _bags(batch, cards, device, *, max_len=4, seed=0, id_dtype=torch.int64):
    """T (indices, offsets) pairs with bags of 0..max_len ids (empty ones included)."""
    gen = torch.Generator().manual_seed(seed)
    bags = []
    for size in cards.tolist():
        lengths = torch.randint(0, max_len + 1, (batch,), generator=gen)
        offsets = torch.zeros(batch, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)[:-1]
        idx = torch.randint(0, size, (int(lengths.sum()),), generator=gen)
        bags.append((idx.to(id_dtype).to(device), offsets.to(id_dtype).to(device)))
    return bags


def _expected_bags(x, weight, offsets, bags, **kwargs):
    """float64, with the pooled rows rounded once to the table's dtype as the model's
    embedding_bag output is, then the interaction."""
    rows = torch.stack(
        [torch.nn.functional.embedding_bag(idx.long(), weight.double()[int(offsets[t]):],
                                           off.long(), mode="sum")
         for t, (idx, off) in enumerate(bags)], dim=1,
    ).to(weight.dtype)  # fmt: skip
    batch, n_tables = rows.shape[:2]
    table = rows.reshape(batch * n_tables, -1)  # row b * T + t: sample b's pooled table t
    ids = torch.arange(batch * n_tables, device=x.device).view(batch, n_tables)
    zero_offsets = torch.zeros(n_tables + 1, dtype=torch.int64, device=x.device)
    return _expected(x, table, zero_offsets, ids, **kwargs)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_tables", "dim"), [(3, 4), (26, 16)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embedding_interaction_bags_match_float64(device, backend, dtype, n_tables, dim, id_dtype):
    """Multi-hot bags, sum-pooled (empty bags give zeros), against float64."""
    weight, offsets, cards = _tables(n_tables, dim, dtype, device, seed=3)
    x = torch.randn(9, dim, dtype=dtype, device=device)
    bags = _bags(9, cards, device, id_dtype=id_dtype)
    _prepare(device)
    out = op(x, weight, offsets, bags, out_width=dim + num_pairs(n_tables + 1) + 5,
             check_ids=True, backend=backend)  # fmt: skip
    expected = _expected_bags(x, weight, offsets, bags, out_width=out.shape[1])
    assert_close_verbose(out, expected, dtype)
    assert torch.equal(out[:, -5:], torch.zeros_like(out[:, -5:]))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_embedding_interaction_one_id_bags_equal_one_hot(device, backend):
    """Bags of one id each give exactly the one-hot result."""
    weight, offsets, cards = _tables(26, 16, torch.float32, device, seed=4)
    x = torch.randn(6, 16, device=device)
    ids = _ids(6, cards, torch.int64, device)
    bags = [(ids[:, t].contiguous(), torch.arange(6, device=device)) for t in range(26)]
    assert torch.equal(op(x, weight, offsets, bags, backend=backend),
                       op(x, weight, offsets, ids, backend=backend))  # fmt: skip


def test_embedding_interaction_bags_bad_input():
    weight, offsets, cards = _tables(3, 4, torch.float32, "cpu")
    x = torch.randn(2, 4)
    good = _bags(2, cards, "cpu")
    with pytest.raises(ValueError, match=r"3 \(indices, offsets\) bags, one per table"):
        op(x, weight, offsets, good[:2])
    with pytest.raises(TypeError, match=r"ids\[1\] must be an \(indices, offsets\) pair"):
        op(x, weight, offsets, [good[0], good[1][0], good[2]])
    with pytest.raises(
        ValueError, match=r"ids\[2\] must be 1-D indices and 1-D offsets of length 2"
    ):
        op(x, weight, offsets, [*good[:2], (good[2][0], torch.zeros(3, dtype=torch.int64))])
    with pytest.raises(TypeError, match=r"ids\[0\] indices"):
        op(x, weight, offsets, [(good[0][0].float(), good[0][1]), *good[1:]])
    bad_off = [(good[0][0], good[0][1] + 1), *good[1:]]
    with pytest.raises(ValueError, match=r"ids\[0\] offsets must start at 0"):
        op(x, weight, offsets, bad_off, check_ids=True)
    big = [good[0], good[1], (good[2][0] + int(cards[2]), good[2][1])]
    if big[2][0].numel():
        with pytest.raises(ValueError, match=r"ids\[2\] indices must be in \[0, "):
            op(x, weight, offsets, big, check_ids=True)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_embedding_interaction_bags_compile_fullgraph(device, backend):
    weight, offsets, cards = _tables(3, 16, torch.float32, device, seed=5)
    x = torch.randn(4, 16, device=device)
    bags = _bags(4, cards, device, seed=5)
    fn = torch.compile(lambda *a: op(*a, backend=backend), fullgraph=True)
    assert_close_verbose(fn(x, weight, offsets, bags), _expected(x, weight, offsets, bags))


# The kernel's launch variants (sweeps): loops over groups, rows loaded a group ahead, flat
# stores. Each gives the planned launch's result, one-hot and bags, with the id check.
VARIANTS = [
    Variant(),
    Variant(2, 2, 1, False, True),
    Variant(1, 1, 4, True, False),
    Variant(1, 1, 4, True, True),
    Variant(2, 2, 3, True, True),
    Variant(2, 2, 3, False, False),
]


@pytest.mark.parametrize(("device", "backend"), fused_targets(cuda_twin=False))
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("batch", [1, 7, 37])
def test_kernel_variants_match_float64(device, backend, variant, dtype, self_interaction, batch):
    weight, offsets, cards = _tables(26, 16, dtype, device, seed=5)
    x = torch.randn(batch, 16, dtype=dtype, device=device)
    ids = _ids(batch, cards, torch.int32, device)
    width = 16 + num_pairs(27, self_interaction)
    out_width = -(-width // 16) * 16 + 16  # (zero columns too)
    flags = torch.zeros(26, dtype=torch.int32, device=device)
    _prepare(device)
    out = _forward(
        x, weight, offsets, ids, None, self_interaction, out_width, False, variant,
        bad_ids=flags,
    )  # fmt: skip
    expected = _expected(
        x, weight, offsets, ids, self_interaction=self_interaction, out_width=out_width
    )
    assert_close_verbose(out, expected, dtype)
    assert flags.tolist() == [0] * 26
    bad = ids.clone()
    bad[batch // 2, 3] = int(cards[3])  # one past table 3's last row
    _forward(x, weight, offsets, bad, None, self_interaction, out_width, False, variant,
             bad_ids=flags)  # fmt: skip
    assert flags.nonzero().flatten().tolist() == [3]
    bags = _bags(batch, cards, device, seed=6)
    flat_ids, starts = pack_bags("embedding_interaction", bags, batch, 26, x.device)
    pooled = _forward(
        x, weight, offsets, flat_ids, starts, self_interaction, out_width, False, variant
    )
    expected = _expected_bags(
        x, weight, offsets, bags, self_interaction=self_interaction, out_width=out_width
    )
    assert_close_verbose(pooled, expected, dtype)


def test_default_variant_rule():
    # one-hot ids, the tensor-core form (9+ features), d <= 16, from 4096 rows: LOOPED
    assert default_variant(4096, 16, 27, bags=False) is LOOPED
    assert default_variant(65536, 8, 27, bags=False) is LOOPED
    assert default_variant(4095, 16, 27, bags=False) is PLANNED
    assert default_variant(65536, 32, 27, bags=False) is PLANNED  # not measured at d > 16
    assert default_variant(65536, 16, 27, bags=True) is PLANNED
    f32 = torch.float32  # wide float32 rows (tensor-core Gram): one sample a warp, any count
    assert default_variant(64, 128, 27, False, f32) is WIDE_F32
    assert default_variant(65536, 32, 27, False, f32) is WIDE_F32
    assert default_variant(65536, 16, 27, False, f32) is LOOPED
    assert default_variant(64, 128, 27, True, f32) is PLANNED  # (bags: not measured)
    assert default_variant(64, 128, 5, False, f32) is PLANNED  # (the broadcast form)
    assert default_variant(65536, 16, 8, bags=False) is PLANNED  # the broadcast form
    assert default_variant(torch.SymInt, 16, 27, bags=False) is PLANNED  # not a plain int
