import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fuseml
from fuseml.ops import _fastcall
from fuseml.ops._softmax import long_rows as lr
from fuseml.ops._softmax import rows as onchip
from fuseml.ops._utils import cdiv
from fuseml.runtime import triton_interpreting
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets, poison_, tolerance

# The module, not the function fuseml.ops.softmax that shadows it as an attribute.
sm = importlib.import_module("fuseml.ops.softmax")
TARGETS = fused_targets()
SHAPES = [(1, 1), (3, 33), (1, 4096), (7, 1000), (2, 3, 17), (129, 257), (5, 7000)]


def _ref(x, dim, log):
    fn = torch.log_softmax if log else torch.softmax
    return fn(x.double(), dim)


def _check(out, x, dim, log, dtype=None):
    """``out`` against the float64 reference: the relative error norm within the
    tolerance, and the worst element too, since a norm over many rows hides a few wrong
    ones (at 65536 rows, 1-3 wrong rows give a norm of 0.004-0.005, within bf16's
    tolerance). softmax outputs are probabilities: no element may be off by more than the
    tolerance times the largest probability of its row (rows of small probabilities get
    a bound of their own scale). log_softmax outputs: the tolerance times max(1, |ref|)."""
    ref = _ref(x, dim, log)
    dtype = dtype or out.dtype
    assert_close_verbose(out, ref, dtype)
    # On the tensors' device: on the CPU, 65536 x 4096 float64 took minutes a test.
    out64, ref64 = out.detach().double(), ref
    if log:
        bound = ref64.abs().clamp(min=1.0)
    else:
        rows_max = torch.nan_to_num(ref64, nan=0.0).amax(dim % max(x.dim(), 1), keepdim=True)
        bound = rows_max.expand_as(ref64)
    scaled = (out64 - ref64).abs().div_(bound)
    worst = float(torch.where(torch.isfinite(ref64), scaled, 0.0).max()) if ref64.numel() else 0.0
    assert worst <= tolerance(dtype), (
        f"worst element off by {worst:.3e} of its scale > {tolerance(dtype):.1e} ({dtype})"
    )


def _op(log):
    return fuseml.ops.log_softmax if log else fuseml.ops.softmax


def _forced(x, log, dim=-1, backend="triton", **force):
    """The op through its launcher with a kernel forced: ``force`` holds the keywords of
    softmax._forward (path, block, split, pairs, strided_tile)."""
    return sm._forward(x, dim % max(x.dim(), 1), log, backend, False, **force)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_last_dim(device, backend, log, dtype, shape):
    x = 4 * torch.randn(shape, dtype=dtype, device=device)
    out = _op(log)(x, backend=backend)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    _check(out, x, -1, log, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -3])
def test_softmax_any_dim(device, backend, log, dim):
    x = torch.randn(6, 35, 4, device=device)
    _check(_op(log)(x, dim, backend=backend), x, dim, log)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize(("shape", "dim"), [((3, 37, 5), 1), ((70, 3), 0), ((2, 9, 3, 131), 1)])
def test_softmax_non_last_dim(device, backend, log, dtype, two_pass, shape, dim):
    x = 4 * torch.randn(shape, dtype=dtype, device=device)
    if two_pass:  # the running max / sum path of the strided kernel, at small sizes
        out = _forced(x, log, dim, backend, strided_tile=64)
    else:
        out = _op(log)(x, dim, backend=backend)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    _check(out, x, dim, log, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_softmax_non_last_dim_needs_no_transposing_copy(device, backend, monkeypatch):
    if backend == "cuda":
        pytest.skip("the CUDA twin reduces along the last dim only (one transposing copy)")
    calls = []
    monkeypatch.setattr(torch.Tensor, "movedim", lambda *a: calls.append(a) or None)
    x = torch.randn(60, 4, 6, device=device)[::2]  # (30, 4, 6), every other outer row
    outs = [fuseml.ops.softmax(x, dim, backend=backend) for dim in (0, 1)]
    monkeypatch.undo()
    assert not calls  # went through the strided kernel, no movedim + contiguous copy
    for dim, out in zip((0, 1), outs):
        _check(out, x, dim, False)
    # a layout with no (outer, N, inner) view still works (one transposing copy)
    xp = torch.randn(4, 30, 6, device=device).permute(1, 0, 2)
    _check(fuseml.ops.softmax(xp, 0, backend=backend), xp, 0, False)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("two_pass", [False, True])
def test_softmax_non_last_dim_edge_values(device, backend, two_pass):
    force = {"strided_tile": 8} if two_pass else {}
    ninf, inf = float("-inf"), float("inf")
    cols = torch.tensor(
        [
            [ninf] * 9,
            [ninf, 0.0, ninf, 1.0, ninf, ninf, 2.0, ninf, ninf],
            [1e4, -1e4, 0.0, 5e3, 1e4, 3.0, -2.0, 0.5, 1e4],
            [inf, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        ],
        device=device,
    ).t()  # the softmax runs down dim 0 of this (9, 4) tensor
    for log in (False, True):
        for dtype in (torch.float32, torch.float16):
            xd = cols.to(dtype).contiguous()
            out = _forced(xd, log, 0, backend, **force)
            ref = (torch.log_softmax if log else torch.softmax)(xd.double(), 0).to(dtype)
            torch.testing.assert_close(out, ref, equal_nan=True, rtol=2e-3, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("shape", "dim"), [((8, 4096, 512), 1), ((50257, 64), 0), ((4, 3, 70000, 2), 2)]
)
def test_softmax_non_last_dim_on_gpu(shape, dim):
    x = 6 * torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    for log in (False, True):
        _check(_op(log)(x, dim, backend="triton"), x, dim, log, torch.bfloat16)


def test_check_bounds_the_worst_element():
    """_check fails a few wrong rows among many that the error norm lets pass: one row of
    65536 shuffled is within bf16's norm tolerance, not within the worst-element bound."""
    x = 4 * torch.randn(65536, 64)
    for log in (False, True):
        out = _ref(x, -1, log).to(torch.bfloat16)
        _check(out, x, -1, log, torch.bfloat16)
        out[123] = out[123].flip(0)
        assert_close_verbose(out, _ref(x, -1, log), torch.bfloat16)
        with pytest.raises(AssertionError, match="worst element"):
            _check(out, x, -1, log, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [128, 1000, 4096])
def test_softmax_many_rows_on_gpu(backend, dtype, n_cols):
    # 65536 rows: where a few wrong rows would pass the error norm (see _check)
    x = 6 * torch.randn(65536, n_cols, device="cuda", dtype=dtype)
    for log in (False, True):
        _check(_op(log)(x, backend=backend), x, -1, log, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_softmax_strided_inputs(device, backend):
    big = torch.randn(40, 90, device=device)
    for x in (big[:, 10:70], big.t(), big[::2, ::3]):
        _check(fuseml.ops.softmax(x, backend=backend), x, -1, False)


# The long-row kernels, forced through the launcher's ``path``: "split" (chunks of
# ``block`` columns over several programs, on a (chunks, rows) grid), "split-1d" (the same
# on one grid axis, as for more rows than the second axis takes), "online" (the two-pass
# kernel, one program per row) or "online-persistent" (the same, fewer programs than rows).
LONG_PATHS = list(lr.LONG_ROW_PATHS)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", LONG_PATHS)
def test_softmax_long_row_paths(device, backend, log, dtype, path):
    if backend == "cuda":
        pytest.skip("the CUDA twin's long-row path is covered by test_softmax_long_rows_on_gpu")
    # The long-row kernels at sizes the interpreter can run: 9 chunks of 128 columns a row
    # (the last one ragged) for "split".
    force = {"path": path, "block": 128}
    big = 8 * torch.randn(3, 1045, dtype=dtype, device=device)
    # An odd width (rows start at every alignment: each row's aligned body, head and tail),
    # and a view whose rows are not lined up with the output's (one element at a time).
    for x in (big[:, :1037].contiguous(), big[:, 3:1040]):
        if path.startswith("split"):
            assert lr._split_config(x, block=128) == (128, 9)
        _check(_forced(x, log, backend=backend, **force), x, -1, log, dtype)
    # one row, and a batched (3-D) input
    for x in (big[:1, :1037], big[:, :1040].reshape(3, 2, 520)):
        _check(_forced(x, log, backend=backend, **force), x, -1, log, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_split_chunk_shares(device, backend, log):
    # 530 columns in chunks of at most 128: shared evenly, 5 x 112 would use 88% of each
    # program's 128 columns, so it takes half the block: 9 programs of 64 (all used).
    # Aligned, unaligned and lined-up views.
    if backend == "cuda":
        pytest.skip("the split kernel's column shares are the Triton kernel's")
    big = 8 * torch.randn(4, 540, dtype=torch.bfloat16, device=device)
    for x in (big[:, :530].contiguous(), big[:, 3:533], big[:, 8:538]):
        assert lr._split_config(x, block=128) == (64, 9)
        # chunks held as int32 pairs keep the block (the rows of the first and last views
        # line up with the output's): 5 programs of 112 columns
        assert lr._split_config(x, pairs=True, block=128) == (128, 5)
        out = _forced(x, log, backend=backend, path="split", block=128)
        _check(out, x, -1, log, torch.bfloat16)


def test_split_config_limits():
    x = torch.empty(2, 1)
    block = lr.SPLIT_BLOCK
    # (block + 1: two chunks of 4112 use half their columns, three of 2736 two thirds of
    # half the block)
    limits = ((block, None), (block + 1, (block // 2, 3)), (4 * block, (block, 4)))
    for n_cols, config in limits:
        assert lr._split_config(x.expand(2, n_cols)) == config
    # Longer rows take longer chunks, up to SPLIT_MAX_BLOCK columns; past that, the online
    # kernel
    most = lr.SPLIT_MAX_BLOCK * lr.SPLIT_MAX_CHUNKS
    assert lr._split_config(x.expand(2, most)) == (lr.SPLIT_MAX_BLOCK, lr.SPLIT_MAX_CHUNKS)
    assert lr._split_config(x.expand(2, most + 1)) is None
    # Half the block where its chunks fill their columns better (50257: 13 x 3872 of 4096
    # against 7 x 7184 of 8192), not where both fill them (65536)
    assert lr.SPLIT_BLOCK == 8192
    assert lr._split_config(x.expand(2, 50257)) == (4096, 13)
    assert lr._split_config(x.expand(2, 65536)) == (8192, 8)
    # ... unless the chunks are held as int32 pairs (16-bit rows): they keep the block
    assert lr._split_config(x.expand(2, 50257), pairs=True) == (8192, 7)


def test_split_pairs_only_where_the_int32_accesses_are_aligned():
    # int32 pairs need 16-bit elements, both data pointers 16-byte aligned and the rows of
    # x and out lined up (a first GPU run faulted on a view 3 elements into its storage);
    # float32 and a fake tensor (torch.compile tracing: no pointer) keep float32 values.
    # (pairs=False at the launch keeps them too: test_split_pairs_match_the_float_path)
    big = torch.zeros(4, 1045, dtype=torch.bfloat16)
    x = big[:, :1037].contiguous()
    assert lr._split_pairs(x, torch.empty_like(x))
    assert lr._split_pairs(x.half(), torch.empty_like(x.half()))
    assert not lr._split_pairs(x.float(), torch.empty_like(x.float()))
    view = big[:, 8:1045]  # data 16 bytes in, rows 1045 apart against the output's 1037
    assert lr._split_pairs(view, torch.empty(view.shape, dtype=view.dtype))
    shifted = big[:, 3:1040]  # data 6 bytes off 16
    assert not lr._split_pairs(shifted, torch.empty(shifted.shape, dtype=shifted.dtype))
    unlined = big[:, :1038]  # rows 1045 apart against 1038
    assert not lr._split_pairs(unlined, torch.empty(unlined.shape, dtype=unlined.dtype))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not lr._split_pairs(fake, torch.empty_like(fake))


class _SplitSpy:
    """Stands in for the split kernel and records each launch's PAIRS."""

    def __init__(self, kernel):
        self.kernel, self.pairs = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.pairs.append(kwargs["PAIRS"])
            return launch(*args, **kwargs)

        return run


def _split_pairs_runs(monkeypatch, x, log, **force):
    """The split kernel's output with pairs=False and True at the launch (and ``force``),
    and the PAIRS each launch took."""
    spy = _SplitSpy(lr._softmax_split_kernel)
    monkeypatch.setattr(lr, "_softmax_split_kernel", spy)
    outs = []
    for on in (False, True):
        spy.pairs.clear()
        outs.append((_forced(x, log, path="split", pairs=on, **force), set(spy.pairs)))
    return outs


@pytest.mark.skipif(not triton_interpreting(), reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_pairs_match_the_float_path(log, dtype, monkeypatch):
    # 16-bit rows whose x and out rows line up are held as int32 pairs of elements through
    # the split kernel's wait; the output is the same bit for bit. Odd width (every row
    # alignment, so every head / tail piece), an all -inf row and a chunk of -inf;
    # float32 and a view whose rows do not line up with the output's (1045 against 1038
    # elements apart) keep float32 values.
    big = 8 * torch.randn(4, 1045, dtype=dtype)
    big[1] = float("-inf")
    big[2, 200:400] = float("-inf")
    for x, pairs in ((big[:, :1037].contiguous(), dtype != torch.float32), (big[:, 3:1041], False)):
        (off, took_off), (on, took_on) = _split_pairs_runs(monkeypatch, x, log, block=128)
        assert took_off == {False} and took_on == {pairs}
        assert torch.equal(off.isnan(), on.isnan())
        assert torch.equal(off.nan_to_num(), on.nan_to_num())
        _check(on[[0, 2, 3]], x[[0, 2, 3]], -1, log, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_cols", [50257, 65536])
def test_split_pairs_bit_exact_on_gpu(log, dtype, n_cols, monkeypatch):
    # Pairs on and off at the same split (7 x 7184 and 8 x 8192 columns: without pairs
    # 50257 columns would take 13 x 3872, and a different split sums in another order)
    x = 10 * torch.randn(64, n_cols, device="cuda", dtype=dtype)
    x[5, : n_cols // 2] = float("-inf")
    split = lr._split_config(x, pairs=True)
    assert split == (8192, cdiv(n_cols, 8192))
    (off, took_off), (on, took_on) = _split_pairs_runs(monkeypatch, x, log, split=split)
    assert took_off == {False} and took_on == {True}
    assert torch.equal(off, on)
    _check(on, x, -1, log, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_fp32_rows_up_to_1024(device, backend, log):
    # fp32 rows of 513-1024 columns: the CUDA twin's two-warp block kernel (one warp below
    # 513); rows that start off a 16-byte boundary (a view 1 column in) take its lead path
    big = 4 * torch.randn(6, 1030, device=device)
    for n in (512, 513, 1000, 1003, 1024):
        for x in (big[:, :n].contiguous(), big[:, 1 : n + 1]):
            _check(_op(log)(x, backend=backend), x, -1, log, torch.float32)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows_vec_views(device, backend, log):
    # 1000 columns: the on-chip kernel takes 16-byte accesses where the width and both row
    # strides are whole vectors (row stride 1008), one element at a time where not (1003).
    for width, vec in ((1008, 8), (1003, 1)):
        x = (6 * torch.randn(5, width, device=device)).to(torch.bfloat16)[:, :1000]
        assert onchip._rows_vec(x, torch.empty(5, 1000, dtype=x.dtype)) == vec
        _check(_op(log)(x, backend=backend), x, -1, log, torch.bfloat16)
    assert onchip._rows_vec(torch.empty(2, 1000), torch.empty(2, 1000)) == 4  # fp32: 4 a vector


def test_rows_config_grid_kind():
    # one program per row up to 16384 columns, the persistent grid from 32768 (the rule
    # in ops/_softmax/rows.py)
    for n_cols in (128, 1000, 1024, 4096, 16384):
        assert not onchip._rows_config(n_cols, 2)["PERSISTENT"]
    # a program takes one row block, so its loop runs once: one stage (from 1024 columns),
    # but 2 for row tiles of TWO_STAGE_MIN_BYTES (fewer registers: float32 16384)
    for n_cols in (1000, 1024, 2048, 3000, 4096, 8192, 16384):
        for elem_size in (2, 4):
            big = n_cols * elem_size >= onchip.TWO_STAGE_MIN_BYTES
            assert onchip._rows_config(n_cols, elem_size)["NUM_STAGES"] == (2 if big else 1)
    assert onchip._rows_config(16384, 4)["NUM_STAGES"] == 2
    for n_cols in (16385, 32768):
        cfg = onchip._rows_config(n_cols, 2)
        assert cfg["PERSISTENT"] and cfg["NUM_STAGES"] == onchip.PERSISTENT_STAGES


def test_rows_config_warps_from_1024_columns():
    # one warp per 512 columns up to 16, WARPS_4096 for a 4096-wide block; float32 rows at
    # least FP32_MIN_WARPS (the rules in ops/_softmax/rows.py)
    for n_cols, bf16, fp32 in ((1000, 2, 4), (1024, 2, 4), (2048, 4, 4), (3000, 4, 4),
                               (4096, 4, 4), (8192, 16, 16), (16384, 16, 16),
                               (32768, 16, 16)):  # fmt: skip
        assert onchip._rows_config(n_cols, 2)["num_warps"] == bf16
        assert onchip._rows_config(n_cols, 4)["num_warps"] == fp32


def test_rows_config_stages_fit_shared_memory():
    # NUM_STAGES - 1 row tiles in flight must fit the device's shared memory per block: on an
    # H100 / H200 (232448 bytes opt-in) 32768 bf16 columns keep 3 stages, fp32 would get 2
    h100 = 232448
    assert onchip._rows_config(32768, 2, h100)["NUM_STAGES"] == onchip.PERSISTENT_STAGES == 3
    # fp32 would get 2: one program per row with one stage instead of the persistent grid
    fp32 = onchip._rows_config(32768, 4, h100)
    assert fp32["NUM_STAGES"] == 1 and not fp32["PERSISTENT"]
    assert onchip._rows_config(32768, 4)["PERSISTENT"]  # no limit (the interpreter)
    for elem_size in (2, 4):
        for n_cols in (100, 1000, 4096, 16384, 32768):
            for smem in (48 * 1024, 99 * 1024, 164 * 1024, h100):
                cfg = onchip._rows_config(n_cols, elem_size, smem)
                tile = cfg["ROWS"] * cfg["BLOCK_N"] * elem_size
                assert cfg["NUM_STAGES"] >= 1
                assert cfg["NUM_STAGES"] == 1 or (cfg["NUM_STAGES"] - 1) * tile + 64 <= smem
                unlimited = onchip._rows_config(n_cols, elem_size)
                assert cfg["NUM_STAGES"] <= unlimited["NUM_STAGES"]
                if cfg["PERSISTENT"] != unlimited["PERSISTENT"]:  # capped below its stages
                    assert unlimited["NUM_STAGES"] == onchip.PERSISTENT_STAGES
                    assert cfg["NUM_STAGES"] == 1 and not cfg["PERSISTENT"]
                same = ("ROWS", "BLOCK_N", "num_warps")
                assert all(cfg[k] == unlimited[k] for k in same)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_cols", [8192, 16384, 32768, 32769, 65536, 262144])
def test_softmax_wide_rows_every_dtype_on_gpu(backend, dtype, n_cols):
    # the on-chip kernel's widest tiles in 4-byte and 2-byte dtypes (its pipelined loop
    # keeps whole row tiles in shared memory), and the long-row kernels past it
    rows = 300 if n_cols <= 32768 else 40
    x = 8 * torch.randn(rows, n_cols, device="cuda", dtype=dtype)
    for log in (False, True):
        _check(_op(log)(x, backend=backend), x, -1, log, dtype)


@pytest.mark.parametrize("elem_size", [2, 4])
def test_rows_config_short_rows_one_vector_a_thread(elem_size):
    # rows under 1024 columns: 4 warps whose threads each hold one 16-byte vector of the
    # tile, except where that tile is one row (float32 512): two rows on two warps (four
    # vectors a thread), 2 stages
    for n_cols in (3, 100, 128, 200, 512, 1000):
        cfg = onchip._rows_config(n_cols, elem_size)
        tile_bytes = cfg["ROWS"] * cfg["BLOCK_N"] * elem_size
        if (n_cols, elem_size) == (512, 4):
            assert (cfg["ROWS"], cfg["num_warps"], cfg["NUM_STAGES"]) == (
                onchip.SHORT_PAIR_ROWS, onchip.SHORT_PAIR_WARPS, 2,
            )  # fmt: skip
        elif n_cols <= 512:
            assert tile_bytes == min(
                onchip.SHORT_TILE_BYTES, onchip.MAX_ROWS * cfg["BLOCK_N"] * elem_size
            )
            assert cfg["ROWS"] > 1 and cfg["num_warps"] == 4 and cfg["NUM_STAGES"] == 1
        else:
            assert cfg["ROWS"] == 1  # from 1024 columns (a block), one row a program
    assert onchip._rows_config(128, 2)["ROWS"] == 8 and onchip._rows_config(128, 4)["ROWS"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("n_cols", [1025, 8191, 32768, 32769, 50257, 65536, 262144, 1_048_576])
@pytest.mark.parametrize("path", ["default", *LONG_PATHS])
def test_softmax_long_rows_on_gpu(backend, n_cols, path):
    if path != "default" and (backend == "cuda" or n_cols <= sm.MAX_ONCHIP_COLS):
        pytest.skip("path sets the Triton long-row kernels only")
    force = {} if path == "default" else {"path": path, "block": 16384}
    rows = 300 if path == "online-persistent" else 40  # more rows than the persistent grid
    big = 10 * torch.randn(rows, n_cols + 3, device="cuda", dtype=torch.bfloat16)
    # contiguous, and a view with unaligned rows (the split kernel's one-element path)
    for x in (big[:, :n_cols].contiguous(), big[:, 3:]):
        if path.startswith("split"):
            assert lr._split_config(x, block=16384) is not None
        for log in (False, True):
            out = (
                _forced(x, log, backend=backend, **force) if force else _op(log)(x, backend=backend)
            )
            _check(out, x, -1, log, torch.bfloat16)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("path", ["onchip", "split", "online"])
def test_softmax_edge_values_match_torch(device, backend, log, path):
    if path != "onchip" and backend == "cuda":
        pytest.skip("thresholds of the Triton kernels only")
    force = {} if path == "onchip" else {"path": path, "block": 4}  # (split: chunks of 4)
    ninf, inf = float("-inf"), float("inf")
    x = torch.tensor(
        [
            [ninf] * 9,  # all -inf: NaN, as torch
            [ninf, 0.0, ninf, 1.0, ninf, ninf, 2.0, ninf, ninf],
            [1e4, -1e4, 0.0, 5e3, 1e4, 3.0, -2.0, 0.5, 1e4],  # large but finite in fp16
            [inf, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],  # +inf: NaN/0 pattern of torch
            [1.0, 2.0, 3.0, 4.0, ninf, ninf, ninf, ninf, 0.5],  # a whole chunk of -inf
            [-100.0, -100.0, -100.0, ninf, ninf, ninf, ninf, ninf, -100.0],  # ... low max
        ],
        device=device,
    )
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        out = _forced(xd, log, backend=backend, **force) if force else _op(log)(xd, backend=backend)
        ref = (torch.log_softmax if log else torch.softmax)(xd.double(), -1).to(dtype)
        torch.testing.assert_close(out, ref, equal_nan=True, rtol=2e-3, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_long_row_edge_values_on_gpu(backend, dtype):
    # Rows long enough for the split-row kernels (several blocks a row), with values that
    # test how the blocks' (max, sum) pairs combine.
    n = 40_000
    x = torch.randn(6, n, device="cuda", dtype=torch.float32)
    x[0] = float("-inf")  # all -inf: NaN, as torch
    x[1, :20_000] = float("-inf")  # whole blocks of -inf, the rest near -100: a block's
    x[1, 20_000:] -= 100.0  # factor exp(0 - row max) would overflow
    x[2, 123] = float("inf")  # +inf: NaN / 0 as torch
    x[3, 39_999] = float("nan")
    x[4] *= 1e4  # large magnitudes
    x[5, ::2] = float("-inf")
    x = x.to(dtype)
    for log in (False, True):
        out = _op(log)(x, backend=backend)
        ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1).to(dtype)
        rtol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(out, ref, equal_nan=True, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_softmax_single_column_and_empty(device, backend):
    x = torch.randn(5, 1, device=device)
    torch.testing.assert_close(fuseml.ops.softmax(x, backend=backend), torch.ones_like(x))
    torch.testing.assert_close(fuseml.ops.log_softmax(x, backend=backend), torch.zeros_like(x))
    for shape, dim in (((0, 7), -1), ((3, 0), -1), ((3, 0), 0)):
        e = torch.randn(shape, device=device)
        assert fuseml.ops.softmax(e, dim, backend=backend).shape == shape


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_softmax_writes_every_element(device, backend):
    x = torch.randn(33, 129, device=device)
    out = fuseml.ops.softmax(x, backend=backend)
    assert not torch.isnan(out).any()
    assert_close_verbose(out.sum(-1), torch.ones(33, dtype=torch.float64))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_backward(device, backend, log, dtype):
    x = (3 * torch.randn(4, 5, 37, device=device)).to(dtype).requires_grad_()
    g = torch.randn(4, 5, 37, device=device, dtype=dtype)
    _op(log)(x, 1, backend=backend).backward(g)
    x64 = x.detach().double().requires_grad_()
    (torch.log_softmax if log else torch.softmax)(x64, 1).backward(g.double())
    assert_close_verbose(x.grad, x64.grad, dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_softmax_opcheck(device, backend):
    x = torch.randn(6, 40, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.fuseml.softmax, (x, 1, backend))
    torch.library.opcheck(torch.ops.fuseml.log_softmax, (x.detach(), 0, backend))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_softmax_compile_fullgraph(device, backend):
    x = torch.randn(8, 50, device=device)
    fn = torch.compile(lambda a: fuseml.ops.softmax(a, backend=backend) * 3, fullgraph=True)
    assert_close_verbose(fn(x), _ref(x, -1, False) * 3)


def test_softmax_backends_on_cpu():
    x = torch.randn(4, 9)
    for backend in ("auto", "eager", "compile"):
        _check(fuseml.ops.softmax(x, backend=backend), x, -1, False)


def test_softmax_bad_input():
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 1\]"):
        fuseml.ops.softmax(torch.randn(3, 4), dim=2)
    with pytest.raises(TypeError, match="dim must be an int"):
        fuseml.ops.softmax(torch.randn(3, 4), dim=1.0)
    with pytest.raises(TypeError, match="x must have dtype"):
        fuseml.ops.log_softmax(torch.arange(4))
    with pytest.raises(ValueError, match="backend must be one of"):
        fuseml.ops.softmax(torch.randn(3), backend="fast")


def test_poison_helper_marks_unwritten():
    t = poison_(torch.empty(3))
    assert torch.isnan(t).all()


def test_online_block_halves_the_step_for_rows_it_does_not_divide():
    full = lr.ONLINE_BLOCK
    assert lr._online_block(4 * full) == full  # 65536 with 16384-column steps
    assert lr._online_block(3 * full + 1) == full // 2  # ragged (50257): half the step
    assert lr._online_block(1000) == 1024  # shorter than a step: one step of the row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("log", [False, True])
def test_softmax_direct_launch_matches_the_ordinary_launch_gpu(log, monkeypatch):
    """The on-chip kernel's repeat launches go through the compiled kernel's own launcher
    (CompiledLaunches): the same output as Triton's ordinary launch for one row, short rows
    taken several at a time, widths that are multiples of 16 and not (1000, 1003), a
    row-strided view and a 16-byte-misaligned input (always the ordinary launch); every
    case compiles its own entry."""
    launches = onchip._rows_launches
    monkeypatch.setattr(launches, "compiled", {})
    buf = torch.randn(64 * 1000 + 1, device="cuda", dtype=torch.bfloat16)
    cases = [
        torch.randn(1, 4096, device="cuda"),
        torch.randn(300, 100, device="cuda", dtype=torch.bfloat16),
        torch.randn(37, 1000, device="cuda", dtype=torch.float16),
        torch.randn(37, 1003, device="cuda", dtype=torch.bfloat16),
        torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16)[:, :2048],
        buf[1:].view(64, 1000),
    ]
    for x in cases:
        outs = []
        for direct in (False, True, True):  # ordinary, then the first and a repeat
            monkeypatch.setattr(launches, "enabled", direct)
            with _fastcall.suspended():  # (the Python path's launches are under test)
                outs.append(_op(log)(x, -1, backend="triton"))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        _check(outs[2], x, -1, log, x.dtype)
    assert len(launches.compiled) == len(cases) - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_counters_left_at_zero_gpu(monkeypatch):
    """The split kernel's row counters come from a slab zeroed once (split_counters) and
    each launch leaves them at zero: eager calls on one stream with 2 to 13 chunks a row
    (one slice reused), a call on another stream, and a CUDA graph of two launches
    replayed three times between eager calls, each time matching torch; afterwards every
    counter of the slab is zero again."""
    slab = lr.CounterSlab(1 << 14, "test counters")
    monkeypatch.setattr(lr, "_split_slab", slab)
    taken = []
    take = lr.split_counters
    monkeypatch.setattr(
        lr, "split_counters", lambda x2, n: taken.append(take(x2, n)) or taken[-1]
    )  # fmt: skip

    def check(x, log):
        assert lr._split_config(x) is not None
        _check(_op(log)(x, backend="triton"), x, -1, log, x.dtype)

    widths = [40000, 50257, 65536, 100_000, 50257]  # 13, 8, ... chunks a row
    xs = [torch.randn(37, n, device="cuda", dtype=torch.bfloat16) for n in widths]
    for i, x in enumerate(xs):
        check(x, log=bool(i % 2))
    assert len({t.data_ptr() for t in taken}) == 1  # one slice for the stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        check(xs[1], log=False)
    torch.cuda.current_stream().wait_stream(side)
    assert taken[-1].data_ptr() != taken[0].data_ptr()  # the other stream's own slice

    x = torch.randn(64, 50257, device="cuda", dtype=torch.float32)
    fuseml.ops.softmax(x, backend="triton")  # warm-up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = fuseml.ops.softmax(x, backend="triton")
        y2 = fuseml.ops.log_softmax(x, backend="triton")
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        check(xs[0], log=False)  # an eager call between replays
        torch.cuda.synchronize()
        _check(y1, x, -1, False, x.dtype)
        _check(y2, x, -1, True, x.dtype)
    torch.cuda.synchronize()
    slabs = list(slab.slabs.values())
    assert len(slabs) == 1 and slabs[0][1] > 0 and not slabs[0][0].any()


def test_split_counters_on_cpu():
    """On the CPU (the interpreter) the counters are a fresh zeroed buffer: no slab is
    made."""
    x = torch.randn(3, 8)
    c = lr.split_counters(x, 3)
    assert c.shape == (3,) and c.dtype == torch.int32 and not c.any()
    assert not lr.split_counters(x, 5).any() and not lr._split_slab.slabs


def test_long_row_path_names_are_checked():
    x = torch.randn(2, 40)
    with pytest.raises(ValueError, match="path must be one of"):
        _forced(x, False, path="splitted")


def test_rows_config_under_pdl_no_one_row_programs_of_few_warps():
    """Under PDL, one-row programs of fewer than PDL_MIN_WARPS warps (16-bit rows of a
    1024-wide block: 2 warps) take two rows and twice the warps, stages as before; float32
    512 columns keep their two-row, two-warp programs (which launch without PDL: see
    test_rows_plan_no_pdl_under_min_warps); nothing else changes."""
    cfg = onchip._rows_config(1024, 2, pdl=True)
    assert (cfg["ROWS"], cfg["num_warps"], cfg["NUM_STAGES"]) == (2, 4, 1)
    assert onchip._rows_config(1000, 2, pdl=True)["ROWS"] == 2
    plain = onchip._rows_config(1024, 2)
    assert (plain["ROWS"], plain["num_warps"]) == (1, 2)
    for n_cols, elem_size in (
        (128, 2), (512, 2), (512, 4), (1024, 4), (2048, 2), (8192, 2), (65536, 2),
    ):  # fmt: skip
        assert onchip._rows_config(n_cols, elem_size, pdl=True) == onchip._rows_config(
            n_cols, elem_size
        )


def test_rows_plan_no_pdl_under_min_warps():
    """With PDL on, the on-chip kernel's launch takes it only for programs of at least
    PDL_MIN_WARPS warps: not for float32 rows of 512 columns (two warps), but for 16-bit
    rows of 1024 (four under PDL), wider rows and short 16-bit rows (four); with PDL off,
    never. The kernel's PDL constexpr is the plan's last."""
    for n_cols, dtype, pdl in (
        (512, torch.float32, False), (1024, torch.bfloat16, True), (4096, torch.float16, True),
        (1024, torch.float32, True), (128, torch.bfloat16, True),
    ):  # fmt: skip
        x = torch.randn(8, n_cols, dtype=dtype)
        _grid, consts, warps = onchip._rows_plan(x, torch.empty_like(x), False, True)
        assert consts[-1] is pdl and (warps >= onchip.PDL_MIN_WARPS) == pdl, (n_cols, dtype)
        assert onchip._rows_plan(x, torch.empty_like(x), True, False)[1][-1] is False
