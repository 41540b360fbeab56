import dataclasses
import gc
import re
from types import SimpleNamespace

import pytest
import torch
import triton

import fuseml
from fuseml.ops import _lora_modes as lora_modes
from fuseml.ops import _utils, gemm, lora_linear_ref
from fuseml.ops import lora as lora_mod
from fuseml.ops.lora import LoraPath
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets

TARGETS = fused_targets(cuda_twin=False)


def _up(t):
    return None if t is None else t.double()


def _layer(k, n, r, dtype, device, adapters=None):
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    b = torch.randn(n, dtype=dtype, device=device)
    lead = () if adapters is None else (adapters,)
    a = torch.randn(*lead, r, k, dtype=dtype, device=device) / k**0.5
    bb = torch.randn(*lead, n, r, dtype=dtype, device=device) / r**0.5
    return w, b, a, bb


def _ref64(x, w, b, a, bb, s, act=None, ids=None):
    s = s.double() if isinstance(s, torch.Tensor) else s
    return lora_linear_ref(_up(x), _up(w), _up(b), _up(a), _up(bb), s, act, ids)


@pytest.fixture(
    params=[
        "in_loop", "precomputed", "precomputed-tma", "in_loop-tma", "expand", "expand-tma",
        "joint-tma", "spread-tma",
    ]
)  # fmt: skip
def lora_mode(request, monkeypatch):
    """The LoRA modes of the kernel: x @ A^T inside the K loop, or from a first launch;
    each also through the TMA kernel where the rows are 16-byte aligned (precomputed-tma:
    the expand mode where the rank is a multiple of 8, else precomputed fp32). expand: the
    small-batch expand mode taken where launches can overlap (PDL, Hopper); forced here on
    any device (the interpreter runs the launches in order). joint-tma: one launch whose
    first programs compute xs (ranks up to 64; wider ones take the expand mode).
    spread-tma: one launch whose tiles compute xs in slices (the interpreter runs it as two
    launches: see _launch_tma). Gives the mode's name and the LoraPath that forces it."""
    from fuseml.ops.gemm import launch as _gemm

    name = request.param
    path = LoraPath(loop="tma" if name.endswith("-tma") else "ptr")
    if name.startswith(("expand", "joint", "spread")):
        # overlapped launches, as in a graph capture; the mode wherever it is tuned (joint
        # and spread only where they can run, else expand)
        mode = {"joint": _gemm.LORA_JOINT, "spread": _gemm.LORA_SPREAD}.get(
            name.split("-")[0], _gemm.LORA_EXPAND
        )
        path = dataclasses.replace(path, overlap=True, capture=True, mode=mode)
    else:
        monkeypatch.setenv("FUSEML_PDL", "0")
    if name.startswith("precomputed"):
        path = dataclasses.replace(path, in_loop_max_m=0)
    return SimpleNamespace(name=name, path=path)


@pytest.fixture
def tma_lora_modes(monkeypatch):
    """The LoRA mode of every TMA-kernel launch, in order (None for a plain layer)."""
    from fuseml.ops.gemm import launch as _gemm

    used = []
    launch = _gemm._launch_tma
    monkeypatch.setattr(
        _gemm, "_launch_tma", lambda *a, **k: used.append(a[8] and a[8][0]) or launch(*a, **k)
    )
    return used


@pytest.fixture
def one_flag_slice(monkeypatch):
    """Every joint or spread launch takes the same counters, as eager calls on one GPU
    stream share a slice of the slab; the list holds them once the first launch took them."""
    from fuseml.ops.gemm import launch as _gemm

    flags = []
    take = _gemm.joint_flags
    monkeypatch.setattr(
        _gemm,
        "joint_flags",
        lambda t, count: flags[0] if flags else flags.append(take(t, count)) or flags[0],
    )
    return flags


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n", "r"), [(1, 45, 33, 8), (37, 64, 70, 16), (20, 24, 9, 1)])
def test_lora_single(device, backend, dtype, m, k, n, r, lora_mode):
    w, b, a, bb = _layer(k, n, r, dtype, device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "relu", backend=backend, path=lora_mode.path)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu"), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("r", [64, 100])
def test_lora_large_rank(device, backend, r, lora_mode):
    # 64: the widest in-loop rank; 100 pads to 128 stacked columns, always precomputed
    w, _, a, bb = _layer(40, 24, r, torch.float32, device)
    x = torch.randn(2, 3, 40, device=device)  # batched leading dims
    out = fuseml.ops.lora_linear(
        x, w, None, a, bb, 2.0, "gelu", backend=backend, path=lora_mode.path
    )
    assert out.shape == (2, 3, 24)
    assert_close_verbose(out, _ref64(x, w, None, a, bb, 2.0, "gelu"))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [0.5, [0.5, 1.0, -2.0], "tensor"])
def test_lora_multi_adapter(device, backend, dtype, scaling, lora_mode):
    w, b, a, bb = _layer(32, 20, 4, dtype, device, adapters=3)
    x = torch.randn(2, 9, 32, dtype=dtype, device=device)
    ids = torch.randint(-1, 3, (2, 9), device=device)
    ids[0, :4] = torch.tensor([-1, 0, 1, 2])  # every adapter and 'none' present
    if scaling == "tensor":
        scaling = torch.tensor([1.5, 0.25, 1.0])
    out = fuseml.ops.lora_linear(
        x, w, b, a, bb, scaling, "silu", adapter_ids=ids, backend=backend, path=lora_mode.path
    )
    assert_close_verbose(out, _ref64(x, w, b, a, bb, scaling, "silu", ids), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize(("m", "adapters"), [(40, 3), (300, 5)])
def test_lora_multi_adapter_b_read_as_given(device, backend, m, adapters, lora_mode):
    """A contiguous (adapters, out, r) B with r a power of two >= 16 is read in place, no
    stacking copy: each adapter's columns at its own offset (pointer loads), or through
    the (adapters * out, r) view a step per adapter (the TMA kernel). out = 72 is not a
    multiple of the column tiles, so a tile's last rows reach into the next adapter's B."""
    w, b, a, bb = _layer(64, 72, 16, torch.bfloat16, device, adapters=adapters)
    assert lora_mod.stack_adapters(a, bb)[1] is bb
    assert lora_mod.stack_adapters(a, bb, in_place=False)[1].shape == (72, 16 * adapters)
    x = torch.randn(m, 64, dtype=torch.bfloat16, device=device)
    ids = torch.randint(-1, adapters, (m,), device=device)
    ids[: adapters + 1] = torch.arange(-1, adapters)
    s = [0.5 * (i + 1) for i in range(adapters)]
    out = fuseml.ops.lora_linear(
        x, w, b, a, bb, s, "relu", adapter_ids=ids, backend=backend, path=lora_mode.path
    )
    assert_close_verbose(out, _ref64(x, w, b, a, bb, s, "relu", ids), torch.bfloat16)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_functional_reads_b_in_place_up_to_b3d_max_m(device, backend, monkeypatch):
    """Up to B3D_MAX_M rows the functional op hands the kernels B as given; above, the
    stacked copy (same result)."""
    w, b, a, bb = _layer(64, 72, 16, torch.bfloat16, device, adapters=3)
    seen = []
    run = lora_mod.lora_stacked
    monkeypatch.setattr(
        lora_mod, "lora_stacked", lambda *args: seen.append(args[4].dim()) or run(*args)
    )
    path = LoraPath(b3d_max_m=20)
    for m in (20, 21):
        x = torch.randn(m, 64, dtype=torch.bfloat16, device=device)
        ids = torch.randint(-1, 3, (m,), device=device)
        out = fuseml.ops.lora_linear(
            x, w, b, a, bb, 0.5, adapter_ids=ids, backend=backend, path=path
        )
        assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, None, ids), torch.bfloat16)
    assert seen == [3, 2]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_multi_rows_without_adapter_get_the_base_layer(device, backend):
    w, b, a, bb = _layer(16, 12, 4, torch.float32, device, adapters=2)
    x = torch.randn(7, 16, device=device)
    ids = torch.full((7,), -1, device=device, dtype=torch.int32)
    out = fuseml.ops.lora_linear(x, w, b, a, bb, 1.0, adapter_ids=ids, backend=backend)
    assert_close_verbose(out, fuseml.ops.linear_ref(_up(x), _up(w), _up(b)))


def test_stacked_b_is_kept_per_tensor_and_version():
    """The multi-adapter B's stacked copy is made once per tensor and version; an
    in-place write, a new tensor, autograd or inference tensors each get a fresh one."""
    a, b = torch.randn(3, 4, 5), torch.randn(3, 8, 4)
    want = b.permute(1, 0, 2).reshape(8, 12)
    first = lora_mod.stack_adapters(a, b)[1]
    assert torch.equal(first, want)
    assert lora_mod.stack_adapters(a, b)[1] is first
    b.mul_(2.0)  # bumps the version
    second = lora_mod.stack_adapters(a, b)[1]
    assert second is not first and torch.equal(second, want * 2.0)
    assert lora_mod.stack_adapters(a, b.clone())[1] is not second  # another tensor
    held = len(_utils._KEPT)
    del b, first, second
    gc.collect()
    assert len(_utils._KEPT) < held  # freed tensors leave nothing behind
    g = torch.randn(3, 8, 4, requires_grad=True)
    assert lora_mod.stack_adapters(a, g)[1].requires_grad  # not a kept, detached copy
    with torch.inference_mode():
        inf = torch.randn(3, 8, 4)
        assert lora_mod.stack_adapters(a, inf)[1] is not lora_mod.stack_adapters(a, inf)[1]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_opcheck_and_compile(device, backend):
    w, b, a, bb = _layer(16, 12, 4, torch.float32, device, adapters=2)
    x = torch.randn(5, 16, device=device)
    ids = torch.tensor([0, 1, -1, 1, 0], device=device)
    a_s, b_s, rank = lora_mod.stack_adapters(a, bb)
    scales = torch.tensor([0.5, 2.0], device=device)
    torch.library.opcheck(
        torch.ops.fuseml.lora_linear, (x, w, b, a_s, b_s, rank, 1.0, scales, ids, "relu")
    )
    torch.library.opcheck(
        torch.ops.fuseml.lora_linear, (x, w, None, a[0], bb[0], 4, 0.5, None, None, "none")
    )

    def fn(x, ids):
        return fuseml.ops.lora_linear(
            x, w, b, a, bb, [0.5, 2.0], "relu", adapter_ids=ids, backend=backend
        ).sum(-1)

    out = torch.compile(fn, fullgraph=True)(x, ids)
    assert_close_verbose(out, _ref64(x, w, b, a, bb, [0.5, 2.0], "relu", ids).sum(-1))


def test_lora_eager_compile_backends_and_grad():
    w, b, a, bb = _layer(16, 12, 4, torch.float32, "cpu")
    x = torch.randn(5, 16)
    ref = _ref64(x, w, b, a, bb, 0.5, "tanh")
    for backend in ("auto", "eager", "compile"):
        out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "tanh", backend=backend)
        assert_close_verbose(out, ref)
    a_g = a.clone().requires_grad_()
    out = fuseml.ops.lora_linear(x, w, b, a_g, bb, 0.5, backend="eager")
    out.sum().backward()
    assert a_g.grad is not None and a_g.grad.abs().sum() > 0


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_fused_refuses_autograd(device, backend):
    w, b, a, bb = _layer(16, 12, 4, torch.float32, device)
    x = torch.randn(5, 16, device=device)
    with pytest.raises(RuntimeError, match="forward-only"):
        fuseml.ops.lora_linear(x, w, b, a.requires_grad_(), bb, 0.5, backend=backend)
    with torch.no_grad():  # the same call without grad mode runs
        fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, backend=backend)


def _bad(**over):
    args = dict(
        x=torch.randn(4, 8), w=torch.randn(6, 8), b=torch.randn(6),
        a=torch.randn(2, 8), bb=torch.randn(6, 2), s=0.5, ids=None,
    )  # fmt: skip
    args.update(over)
    return fuseml.ops.lora_linear(
        args["x"], args["w"], args["b"], args["a"], args["bb"], args["s"], adapter_ids=args["ids"]
    )


@pytest.mark.parametrize(
    ("over", "exc", "words"),
    [
        ({"a": torch.randn(2, 9)}, ValueError, "lora_a must have shape (2, 8)"),
        ({"bb": torch.randn(5, 2)}, ValueError, "lora_b must have shape (6, 2)"),
        ({"bb": torch.randn(6, 3)}, ValueError, "lora_b must have shape (6, 2)"),
        ({"a": torch.randn(3, 2, 8)}, ValueError, "stacked adapters need adapter_ids"),
        ({"a": torch.randn(2, 8, dtype=torch.float16)}, TypeError, "mixed dtypes"),
        ({"s": "0.5"}, TypeError, "scaling must be a real number"),
        ({"w": torch.randn(6, 7)}, ValueError, "in_features"),
        (
            {"a": torch.randn(3, 2, 8), "bb": torch.randn(3, 6, 2), "ids": torch.tensor([0, 1, 3, -1])},
            ValueError,
            "adapter_ids must be in [-1, 3)",
        ),
        (
            {"a": torch.randn(3, 2, 8), "bb": torch.randn(3, 6, 2), "ids": torch.tensor([0, -2, 1, 1])},
            ValueError,
            "found -2",
        ),
        (
            {"a": torch.randn(3, 2, 8), "bb": torch.randn(3, 6, 2), "ids": torch.zeros(3, dtype=torch.long)},
            ValueError,
            "adapter_ids must have shape (4,)",
        ),
        (
            {"a": torch.randn(3, 2, 8), "bb": torch.randn(3, 6, 2), "ids": torch.zeros(4)},
            TypeError,
            "adapter_ids must be an int32 or int64 tensor",
        ),
        (
            {"a": torch.randn(3, 2, 8), "bb": torch.randn(3, 6, 2), "ids": torch.zeros(4, dtype=torch.long), "s": [1.0, 2.0]},
            ValueError,
            "one per adapter (3), got 2",
        ),
    ],
)  # fmt: skip
def test_lora_bad_input(over, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        _bad(**over)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("adapters", "r"), [(1, 16), (4, 16), (16, 16), (3, 6)])
def test_lora_large_batch_tuned_gpu(adapters, r, fresh_tuning):
    """Above the in-loop rows, where Hopper takes the expand mode on the TMA kernel (up to
    256 stacked columns: 16 x 16 takes four steps), with tuning on as users run it."""
    dtype = torch.bfloat16
    w, b, a, bb = _layer(512, 384, r, dtype, "cuda", adapters=adapters)
    x = torch.randn(1500, 512, dtype=dtype, device="cuda")
    ids = torch.randint(-1, adapters, (1500,), device="cuda")
    out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, backend="triton")
    assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu", ids), dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("adapters", [None, 3])
@pytest.mark.parametrize("pdl", [False, True])
def test_lora_small_rows_tuned_loop(device, backend, adapters, pdl, tma_launches, monkeypatch):
    """Decode-like rows on a Hopper GPU (LOOP_TUNED): a config flagged TMA runs the LoRA
    launches on the TMA kernel (in-loop: A through a descriptor; with PDL the shrink and
    expand launches), any other the pointer kernel."""
    from fuseml.ops.gemm import launch as _gemm

    forced = {"overlap": True, "capture": True} if pdl else {}
    if not pdl:
        monkeypatch.setenv("FUSEML_PDL", "0")
    want_modes = [_gemm.LORA_SHRINK, _gemm.LORA_EXPAND] if pdl else [_gemm.LORA_IN_LOOP]

    dtype = torch.bfloat16
    w, b, a, bb = _layer(64, 40, 8, dtype, device, adapters=adapters)
    x = torch.randn(5, 64, dtype=dtype, device=device)
    ids = None if adapters is None else torch.tensor([0, -1, 2, 1, 2], device=device)
    ref = _ref64(x, w, b, a, bb, 0.5, "relu", ids)
    cands = _gemm.candidates(5, 40, 64, dtype, _gemm.LOOP_TUNED)
    for want_tma in (True, False):
        cfg = next(c for c in cands if bool(c.get("TMA")) == want_tma)
        path = LoraPath(**forced, config=cfg)
        out, used = tma_launches(
            lambda path=path: fuseml.ops.lora_linear(
                x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, backend=backend, path=path
            ),
        )
        assert_close_verbose(out, ref, dtype)
        assert [extra[0] for extra in used] == (want_modes if want_tma else []), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("adapters", [None, 4])
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_lora_small_rows_tuned_gpu(m, adapters, pdl, fresh_tuning, monkeypatch):
    """Decode-like rows with tuning on (on Hopper the tuner also times the TMA kernel),
    in-loop (FUSEML_PDL=0) and, on Hopper, the overlapped shrink / expand launches."""
    monkeypatch.setenv("FUSEML_PDL", pdl)
    dtype = torch.bfloat16
    w, b, a, bb = _layer(1024, 768, 16, dtype, "cuda", adapters=adapters)
    x = torch.randn(m, 1024, dtype=dtype, device="cuda")
    ids = None if adapters is None else torch.randint(-1, adapters, (m,), device="cuda")
    out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, backend="triton")
    assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu", ids), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["in_loop", "pdl", "joint", "spread", "spread16"])
def test_lora_mid_rows_every_tma_tile_gpu(mode, tma_launches, monkeypatch):
    """65 to TMA_TUNED_MAX_M rows: every TMA tile the tuner may pick there (the deep
    pipelines too: up to 192 KiB of shared memory before the adapter's own buffers) runs
    the LoRA launches, in-loop, as the overlapped shrink / expand, as the joint launch and
    as the spread launch (one wave: every tile resident, waiting for its row tile's
    slices of xs; spread16: 16 adapters of rank 16 in a mixed batch, B read in place), on
    ragged sizes."""
    from fuseml.ops.gemm import launch as _gemm

    forced = {}
    if mode == "in_loop":
        monkeypatch.setenv("FUSEML_PDL", "0")
    else:
        want_mode = {"joint": _gemm.LORA_JOINT, "pdl": _gemm.LORA_EXPAND}.get(
            mode, _gemm.LORA_SPREAD
        )
        forced = {"capture": True, "mode": want_mode}
    dtype = torch.bfloat16
    m, k, n = 200, 1024, 1000
    adapters = 16 if mode == "spread16" else None
    w, b, a, bb = _layer(k, n, 16, dtype, "cuda", adapters=adapters)
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    ids = None if adapters is None else torch.randint(-1, adapters, (m,), device="cuda")
    ref = _ref64(x, w, b, a, bb, 0.5, "relu", ids)
    tiles = [c for c in _gemm.candidates(m, n, k, dtype, _gemm.LOOP_TUNED) if c.get("TMA")]
    assert {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"]) for c in tiles} >= {
        (64, 128, 128, 4),
        (64, 128, 64, 8),
        (128, 64, 128, 4),
    }
    if mode.startswith("spread"):  # (the tiles that leave room for A's slice)
        fits = lora_modes._spread_fits(x, n, a.reshape(-1, k))
        tiles = [c for c in tiles if fits(c)]
        assert len(tiles) >= 3, tiles
    for cfg in tiles:
        path = LoraPath(**forced, config=cfg)
        out, used = tma_launches(
            lambda path=path: fuseml.ops.lora_linear(
                x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, backend="triton", path=path
            ),
        )
        assert_close_verbose(out, ref, dtype)
        want = {
            "in_loop": [_gemm.LORA_IN_LOOP],
            "pdl": [_gemm.LORA_SHRINK, _gemm.LORA_EXPAND],
            "joint": [_gemm.LORA_JOINT],
        }.get(mode, [_gemm.LORA_SPREAD])
        assert [extra[0] for extra in used] == want, cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("adapters", [None, 4])
def test_lora_joint_persistent_every_tma_tile_gpu(adapters, tma_launches, monkeypatch):
    """Past IN_LOOP_MAX_M rows the joint launch's GEMM programs walk several tiles each
    (a persistent grid smaller than the SM count, the SMs left computing xs) and wait per
    row tile: every large TMA tile, ragged sizes, single and mixed batches."""
    from fuseml.ops.gemm import launch as _gemm

    grids = []
    compiled = _gemm._lora_tma_launches
    monkeypatch.setattr(
        _gemm, "_lora_tma_launches", lambda grid, *a: grids.append(grid[0]) or compiled(grid, *a)
    )
    dtype = torch.bfloat16
    m, k, n = 3000, 1000, 2040
    w, b, a, bb = _layer(k, n, 16, dtype, "cuda", adapters=adapters)
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    ids = None if adapters is None else torch.randint(-1, adapters, (m,), device="cuda")
    ref = _ref64(x, w, b, a, bb, 0.5, "relu", ids)
    tiles = [c for c in _gemm.candidates(m, n, k, dtype, _gemm.LOOP_TMA) if c.get("TMA", True)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    r_pad = 16 * (adapters or 1)  # stacked columns (a power of two here)
    ran = 0
    for cfg in tiles:
        grids.clear()
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        path = LoraPath(mode=_gemm.LORA_JOINT, config=cfg)
        try:
            out, used = tma_launches(
                lambda path=path: fuseml.ops.lora_linear(
                    x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, backend="triton", path=path
                ),
            )
        except triton.runtime.errors.OutOfResources:
            # The tuner skips a tile that does not fit; only where the main loop's buffers
            # and the adapter dot's operands (BLOCK_M + BLOCK_N) x R_PAD together pass the
            # limit (128 x 256 x 64 with 4 stages at 64 stacked columns)
            smem = (cfg["num_stages"] * cfg["BLOCK_K"] + r_pad) * (bm + bn) * 2
            assert smem > gemm.SMEM_LIMIT, cfg
            continue
        ran += 1
        assert_close_verbose(out, ref, dtype)
        assert [extra[0] for extra in used] == [_gemm.LORA_JOINT], cfg
        n_tiles = -(-m // bm) * -(-n // bn)
        assert n_tiles > sms and grids and grids[0] <= sms, (cfg, grids)
    assert ran >= len(tiles) - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_ranks_of_one_pad_each_tuned_before_capture_gpu(fresh_tuning):
    """Rank 8, then rank 16 (both padded to 16 columns), each warmed up eagerly and then
    captured, in one process: each rank's own launches are tuned by its eager call, none
    inside the capture (the mode choice was once shared by the pad, and the rank-16
    capture failed tuning its shrink)."""
    dtype = torch.bfloat16
    for r in (8, 16):
        w, b, a, bb = _layer(1024, 768, r, dtype, "cuda")
        x = torch.randn(1, 1024, dtype=dtype, device="cuda")
        fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "relu", backend="triton")  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "relu", backend="triton")
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu"), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [16, 200])
def test_lora_spread_cuda_graph_gpu(m, tma_lora_modes, monkeypatch):
    """The spread launch (cooperative: every program resident before it starts) captured
    into two CUDA graphs, each replayed in turn with new inputs between eager calls on the
    same stream: every output matches the reference, so each launch found its counters at
    zero (the eager calls share a slice of the counter slab, each capture has its own)."""
    from fuseml.ops.gemm import launch as _gemm

    path = LoraPath(mode=_gemm.LORA_SPREAD)
    used = tma_lora_modes
    dtype = torch.bfloat16
    w, b, a, bb = _layer(1024, 768, 16, dtype, "cuda", adapters=16)
    xs = [torch.randn(m, 1024, dtype=dtype, device="cuda") for _ in range(2)]
    ids = torch.randint(-1, 16, (m,), device="cuda")

    def call(x):
        return fuseml.ops.lora_linear(
            x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, check_ids=False, backend="triton",
            path=path,
        )  # fmt: skip

    call(xs[0])  # tunes the tile
    assert used and set(used) == {_gemm.LORA_SPREAD}
    torch.cuda.synchronize()
    graphs, outs = [], []
    for x in xs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(call(x))
        graphs.append(graph)
    for _ in range(3):
        for x, graph, out in zip(xs, graphs, outs, strict=True):
            x.copy_(torch.randn_like(x))
            graph.replay()
            eager = call(x)
            torch.cuda.synchronize()
            want = _ref64(x, w, b, a, bb, 0.5, "relu", ids)
            assert_close_verbose(out, want, dtype)
            assert_close_verbose(eager, want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 64, 256, 1024, 2048])
@pytest.mark.parametrize("adapters", [None, 4, 16])
def test_lora_cuda_graph_gpu(m, adapters, fresh_tuning):
    """Captured into a CUDA graph after an eager warm-up (which tunes), as serving does: on
    Hopper the capture takes the tuned mode (the overlapped shrink / expand launches where
    they measured faster); replays match the reference for new inputs."""
    dtype = torch.bfloat16
    w, b, a, bb = _layer(1024, 768, 16, dtype, "cuda", adapters=adapters)
    x = torch.randn(m, 1024, dtype=dtype, device="cuda")
    ids = None if adapters is None else torch.randint(-1, adapters, (m,), device="cuda")

    def call():
        return fuseml.ops.lora_linear(
            x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, check_ids=False, backend="triton"
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up: tunes both modes
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu", ids), dtype)


def test_joint_flag_slab_slices(monkeypatch, caplog):
    """The joint launch's flag slab, on the host (the GPU test runs it for real): eager
    calls on one stream share a slice (a larger count takes a new one), another stream
    has its own, each captured launch takes a fresh slice and leaves the streams' alone;
    a capture before any eager call, and a spent slab, give None (the call zeroes its
    own counters), the latter said once."""
    import logging

    from fuseml.ops._utils import CounterSlab

    state = {"capturing": False, "stream": 1}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(
        torch.cuda, "current_stream",
        lambda device=None: type("S", (), {"cuda_stream": state["stream"]})(),
    )  # fmt: skip
    slab = CounterSlab(2048, "the joint LoRA launch's flags")
    x = torch.empty(1)
    state["capturing"] = True
    assert slab.take(x, 8) is None  # no slab may be allocated inside a capture
    state["capturing"] = False
    first = slab.take(x, 8)
    assert first.numel() == 256 and not first.any()
    assert slab.take(x, 100).data_ptr() == first.data_ptr()  # same stream, fits
    bigger = slab.take(x, 300)
    assert bigger.numel() == 300 and bigger.data_ptr() != first.data_ptr()
    assert slab.take(x, 8).data_ptr() == bigger.data_ptr()
    state["stream"] = 2
    other = slab.take(x, 8)
    assert other.data_ptr() not in (first.data_ptr(), bigger.data_ptr())
    state["capturing"] = True
    captured = [slab.take(x, 4) for _ in range(3)]
    assert len({t.data_ptr() for t in captured}) == 3 and all(t.numel() == 4 for t in captured)
    captured.append(slab.take(x, 5))  # rounded up to 8 counters: the next slice stays aligned
    assert captured[-1].numel() == 8
    state["capturing"] = False
    assert slab.take(x, 8).data_ptr() == other.data_ptr()  # captures left it alone
    state["stream"] = 3
    odd = slab.take(x, 257)  # eager slices round up too
    assert odd.numel() == 260
    # Every slice 16-byte aligned: a captured launch specializes as the eager ones do
    slices = [first, bigger, other, odd, *captured]
    assert all(t.data_ptr() % 16 == 0 for t in slices)
    # 256 + 300 + 256 + 20 + 260 of 2048 used: a capture of 1000 no longer fits
    state["capturing"] = True
    with caplog.at_level(logging.INFO, logger="fuseml"):
        assert slab.take(x, 1000) is None and slab.take(x, 1000) is None
    assert sum("spent" in r.getMessage() for r in caplog.records) == 1


def test_flag_slab_reserved_before_a_capture(monkeypatch):
    """reserve(): a caller whose eager calls take another launch allocates the slab
    outside the capture, so captured launches take slices of it instead of zeroing
    counters of their own in every replay; inside a capture and for fake tensors it
    allocates nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fuseml.ops._utils import CounterSlab

    state = {"capturing": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 1})()
    )
    slab = CounterSlab(1024, "the joint LoRA launch's flags")
    x = torch.empty(1)
    slab.reserve(x)  # inside a capture: nothing
    assert slab.take(x, 8) is None
    with FakeTensorMode() as mode:
        slab.reserve(mode.from_tensor(x))
    state["capturing"] = False
    with FakeTensorMode():
        slab.reserve(x)
    assert not slab.slabs
    slab.reserve(x)
    held = slab.slabs[x.get_device()][0]
    assert held.numel() == 1024 and not held.any()
    slab.reserve(x)  # once
    assert slab.slabs[x.get_device()][0] is held
    state["capturing"] = True
    piece = slab.take(x, 8)
    assert piece is not None and piece.numel() == 8 and piece.data_ptr() == held.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eager_lora_call_reserves_the_joint_flags_gpu():
    """An eager call of a 512-row layer (in-loop, launched from C++ on repeats) leaves the
    joint flags' slab allocated on its device, for the joint launches of a later capture."""
    from fuseml.ops.gemm import lora_modes as launch_modes

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, w, a, bb = rand(512, 256), rand(128, 256), rand(16, 256), rand(128, 16)
    fuseml.ops.lora_linear(x, w, None, a, bb, 0.5)
    assert x.get_device() in launch_modes._flag_slab.slabs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_joint_flags_per_stream_and_capture_gpu(monkeypatch):
    """The joint launch's counters (zeroed once, put back to zero by each launch): eager
    calls on one stream share one slice of the device's slab, and each launch captured
    into a CUDA graph has its own; two graphs replayed in turn, between eager calls, match
    the reference, and every slice is zero after each of them."""
    from fuseml.ops.gemm import launch as _gemm

    path = LoraPath(mode=_gemm.LORA_JOINT)
    taken = []
    take = _gemm.joint_flags
    monkeypatch.setattr(
        _gemm, "joint_flags", lambda t, count: taken.append(take(t, count)) or taken[-1]
    )
    dtype = torch.bfloat16
    layers = []
    for m, adapters in ((1100, None), (2100, 3)):  # past IN_LOOP_MAX_M: eager calls go joint
        w, b, a, bb = _layer(512, 384, 16, dtype, "cuda", adapters=adapters)
        x = torch.randn(m, 512, dtype=dtype, device="cuda")
        ids = None if adapters is None else torch.randint(-1, adapters, (m,), device="cuda")
        layers.append((x, w, b, a, bb, ids))

    def call(i):
        x, w, b, a, bb, ids = layers[i]
        return fuseml.ops.lora_linear(
            x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, check_ids=False, backend="triton",
            path=path,
        )  # fmt: skip

    def check(i, out):
        torch.cuda.synchronize()
        x, w, b, a, bb, ids = layers[i]
        assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu", ids), dtype)
        assert not any(t.any() for t in taken)

    for i in (0, 1):
        check(i, call(i))
    eager = {t.data_ptr() for t in taken}
    assert len(taken) == 2 and len(eager) == 1, "eager calls on one stream share counters"
    graphs, outs = [], []
    for i in (0, 1):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            outs.append(call(i))
    captured = [t.data_ptr() for t in taken[2:]]
    assert len(captured) == 2, captured
    assert len(set(captured)) == 2 and not eager & set(captured), (eager, captured)
    for i in (0, 1, 0, 1):
        layers[i][0].copy_(torch.randn_like(layers[i][0]))
        graphs[i].replay()
        check(i, outs[i])
        check(1 - i, call(1 - i))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_modes_chosen(device, backend, monkeypatch):
    """Which LoRA mode each call takes (as on a Hopper GPU): in-loop up to IN_LOOP_MAX_M
    rows, above it the tuned choice of expand in stream order and the joint launch (the
    default, untuned: expand) when the rank is a multiple of 8 and TMA reads the adapters,
    precomputed fp32 else; with PDL up to IN_LOOP_MAX_M rows the tuned choice of in-loop
    and overlapped expand in a CUDA-graph capture (forced here), in-loop for eager calls."""
    from fuseml.ops.gemm import launch as _gemm

    monkeypatch.setattr(_gemm, "_tma_device", lambda t: True)
    asked = []
    tuned_mode = lora_mod._tuned_mode

    def tuned(args, loop, default, overlap=True, **kw):
        asked.append((args[1].shape[0], overlap))
        return tuned_mode(args, loop, default, overlap, **kw)

    monkeypatch.setattr(lora_mod, "_tuned_mode", tuned)  # (a spy: what was timed)
    modes = []
    launch = _gemm.launch_linear
    monkeypatch.setattr(
        _gemm, "launch_linear", lambda *a, **k: modes.append(k.get("lora")) or launch(*a, **k)
    )
    cases = ((600, 8, False, "auto"), (600, 6, False, "auto"), (3, 8, False, "auto"),
             (3, 6, True, "auto"), (3, 8, True, "ptr"))  # fmt: skip
    for m, r, pdl, loop in cases:
        path = LoraPath(loop=loop, overlap=pdl, capture=True, in_loop_max_m=16)
        w, b, a, bb = _layer(64, 40, r, torch.float32, device)
        x = torch.randn(m, 64, device=device)
        modes.clear()
        asked.clear()
        out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, backend=backend, path=path)
        assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5), torch.float32)
        # (600 rows, rank 8: expand in stream order or joint; 3 rows with PDL: in-loop or
        # the overlapped pair)
        tuned_at = {(600, 8): [(600, False)]}.get((m, r), [(3, True)] if pdl else [])
        assert asked == tuned_at, (m, r, loop)
        want = {
            (600, 8): [_gemm.LORA_SHRINK, _gemm.LORA_EXPAND],
            (600, 6): [_gemm.LORA_NONE, _gemm.LORA_PRECOMPUTED],
            (3, 8): [_gemm.LORA_IN_LOOP],
            # PDL, untuned (the interpreter): overlapped expand where the tuner may take
            # the TMA kernel (any rank: the pointer kernel's expand), in-loop on pointers
            (3, 6, "auto"): [_gemm.LORA_SHRINK, _gemm.LORA_EXPAND],
            (3, 8, "ptr"): [_gemm.LORA_IN_LOOP],
        }[(m, r, loop) if pdl else (m, r)]
        assert [_gemm.LORA_NONE if v is None else v for v in modes] == want, (m, r)
    path = dataclasses.replace(path, capture=False)  # an eager call: one launch
    modes.clear()
    fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, backend=backend, path=path)
    assert modes == [_gemm.LORA_IN_LOOP]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("adapters", [None, 3])
@pytest.mark.parametrize("sms", [None, 3])
@pytest.mark.parametrize("m", [300, 40])
def test_lora_joint_mode_one_launch(
    device, backend, adapters, sms, m, lora_mode, tma_lora_modes, one_flag_slice, monkeypatch
):
    """The joint mode: one TMA launch whose first programs write xs (here 2 programs for 3
    row tiles on the interpreter, 1 per free SM on a GPU) and whose tile programs wait for
    their rows of it; single and mixed batches (ids -1 included) match the reference.
    sms = 3: a persistent grid of 3 programs, 1 of them the shrink and 2 walking the 3
    tiles (the interpreter; the GPU keeps its own SM count). m = 40: one row tile, so K
    is split over the free SMs (2 parts on the interpreter, 4 on a GPU), the parts summed
    by the tiles."""
    from fuseml.ops.gemm import launch as _gemm

    if lora_mode.name != "joint-tma":
        pytest.skip("the joint mode's own test")
    if sms is not None and device == "cuda":
        pytest.skip("a persistent grid smaller than the tiles is the interpreter's case")
    if sms is not None:
        monkeypatch.setattr(_gemm, "persistent_programs", lambda x: sms)
    grids = []
    compiled = _gemm._lora_tma_launches
    monkeypatch.setattr(
        _gemm, "_lora_tma_launches", lambda grid, *a: grids.append(grid) or compiled(grid, *a)
    )
    used = tma_lora_modes
    # 300 rows: 3 row tiles of the default config's 128; 40 rows, K = 600: the shrink's
    # 256-wide steps in 2 parts of 512 and 88 columns (the last one ragged)
    k = 600 if m == 40 else 64
    w, b, a, bb = _layer(k, 72, 8, torch.bfloat16, device, adapters=adapters)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    ids = None if adapters is None else torch.randint(-1, adapters, (m,), device=device)
    # per-adapter scales where the shrink writes K in parts (each part scaled, then summed)
    s = [0.5, -1.0, 2.0] if adapters and m == 40 else 0.5
    flags = one_flag_slice  # one set of counters for both calls
    out = fuseml.ops.lora_linear(
        x, w, b, a, bb, s, "gelu", adapter_ids=ids, backend=backend, path=lora_mode.path
    )
    assert used == [_gemm.LORA_JOINT]
    if device == "cpu":  # 300 rows, 3 tiles: one program each and 2 shrink programs, or
        # 2 + 1; 40 rows, 1 tile: 1 + 2 shrink programs (K in 2 parts), or 2 + 1
        assert grids == [
            {(300, None): (5,), (300, 3): (3,), (40, None): (3,), (40, 3): (3,)}[m, sms]
        ]
    assert_close_verbose(out, _ref64(x, w, b, a, bb, s, "gelu", ids), torch.bfloat16)
    # The launch leaves its counters at zero, so the next one can wait on them again
    assert not flags[0].any(), flags[0]
    x.copy_(torch.randn_like(x))
    out = fuseml.ops.lora_linear(
        x, w, b, a, bb, s, "gelu", adapter_ids=ids, backend=backend, path=lora_mode.path
    )
    assert_close_verbose(out, _ref64(x, w, b, a, bb, s, "gelu", ids), torch.bfloat16)
    assert not flags[0].any(), flags[0]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize(("adapters", "rank"), [(None, 16), (3, 8), (5, 16)])
@pytest.mark.parametrize("m", [300, 40])
def test_lora_spread_mode_one_launch(
    device, backend, adapters, rank, m, lora_mode, tma_lora_modes, one_flag_slice
):
    """The spread mode: one TMA launch, one tile a program, whose first column tiles of
    each row tile compute a slice of that row tile's xs in their K loop and post it, and
    whose tiles all wait for their row tile's slices before adding xs @ B^T. Single and
    mixed batches (ids -1 included, per-adapter scales) match the reference: 1 slice (one
    adapter), 2 slices of 16 (3 adapters x rank 8: 24 stacked columns, one expand step
    with B through pointers), 2 slices of 64 (5 x 16 = 80 columns, the last slice ragged;
    the expand in 2 steps of 64 columns, each over several adapters). The counters are
    back at zero after each launch. (The interpreter runs it as two launches.)"""
    from fuseml.ops.gemm import launch as _gemm

    if lora_mode.name != "spread-tma":
        pytest.skip("the spread mode's own test")
    used = tma_lora_modes
    flags = one_flag_slice  # one set of counters for both calls
    k, n = 96, 200
    w, b, a, bb = _layer(k, n, rank, torch.bfloat16, device, adapters=adapters)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    ids = None if adapters is None else torch.randint(-1, adapters, (m,), device=device)
    s = [0.5, -1.0, 2.0, 1.5, -0.25][: adapters or 1] if adapters else 0.5
    for _ in range(2):
        out = fuseml.ops.lora_linear(
            x, w, b, a, bb, s, "gelu", adapter_ids=ids, backend=backend, path=lora_mode.path
        )
        assert used == [_gemm.LORA_SPREAD]
        assert_close_verbose(out, _ref64(x, w, b, a, bb, s, "gelu", ids), torch.bfloat16)
        # The launch leaves its counters at zero, so the next one can wait on them again
        assert not flags[0].any(), flags[0]
        used.clear()
        x.copy_(torch.randn_like(x))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_spread_mode_offered_to_wide_stacks(device, backend, monkeypatch):
    """The mode tuner times the spread launch beside the overlapped pair for a mixed batch
    whose stack is wider than 64 columns (16 adapters x rank 16), and not for a single
    adapter (where it lost at every size measured); the wide stack's modes are keyed apart
    from entries made before the spread mode existed."""
    from fuseml.ops import _tune
    from fuseml.ops.gemm import launch as _gemm

    path = LoraPath(loop="tma", overlap=True, capture=True)
    offered = {}
    choose = _tune.choose

    def spy(memo_key, device_, key, candidates, bench, default, **kw):
        if memo_key[0] == "loramode":
            offered[key()] = [c["LORA"] for c in candidates()]
            return default
        return choose(memo_key, device_, key, candidates, bench, default, **kw)

    monkeypatch.setattr(_tune, "choose", spy)
    k, n, m = 64, 96, 40
    for adapters in (16, None):
        w, b, a, bb = _layer(k, n, 16, torch.bfloat16, device, adapters=adapters)
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        ids = None if adapters is None else torch.randint(-1, adapters, (m,), device=device)
        out = fuseml.ops.lora_linear(
            x, w, b, a, bb, 0.5, adapter_ids=ids, backend=backend, path=path
        )
        assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, None, ids), torch.bfloat16)
    (wide_key, wide), (one_key, one) = offered.items()
    assert wide == [_gemm.LORA_EXPAND, _gemm.LORA_SPREAD] and wide_key.endswith(":s")
    assert _gemm.LORA_SPREAD not in one and not one_key.endswith(":s"), one


def _shrink_ref(x, a, scale, ids, rank, dtype):
    """xs = scale * x @ A^T in float64, each row keeping its adapter's columns, in dtype."""
    xs = _up(x) @ _up(a).t() * scale
    owner = torch.arange(a.shape[0], device=x.device) // rank
    return torch.where(ids[:, None] == owner[None, :], xs, 0.0).to(dtype)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize(("m", "k", "rank", "adapters"), [(300, 200, 8, 5), (37, 1000, 16, 3)])
def test_shrink_segments(device, backend, m, k, rank, adapters):
    """The segmented shrink (each program: one block of one adapter's rows): every config
    matches the float64 reference of the stacked, masked product, on ragged sizes with ids
    -1, an id past the adapters (no adapter, as the stacked product treats it) and an
    adapter with no rows; xs starts as NaN (the launch zeroes it); a second call gives
    the same bits."""
    from fuseml.ops.gemm import launch as _gemm

    dtype = torch.bfloat16
    r = rank * adapters
    x = torch.randn(m, k, dtype=dtype, device=device)
    a = torch.randn(r, k, dtype=dtype, device=device) / k**0.5
    ids = torch.randint(-1, adapters + 1, (m,), device=device)
    ids[ids == 1] = 0  # adapter 1 has no rows
    ref = _shrink_ref(x, a, 0.5, ids, rank, dtype)
    for cfg in gemm.SEGMENT_CONFIGS:
        outs = []
        for _ in range(2):
            xs = torch.full((m, r), float("nan"), dtype=dtype, device=device)
            _gemm.launch_shrink_segments(xs, x, a, ids, None, 0.5, rank, cfg)
            outs.append(xs)
        assert_close_verbose(outs[0], ref, dtype)
        assert torch.equal(outs[0], outs[1]), cfg


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_lora_with_segmented_shrink(device, backend, monkeypatch):
    """Mixed batches whose shrink the tuner gave to the segmented kernel (forced here), in
    the overlapped expand mode and in stream order: match the reference; the segmented
    configs are candidates for mixed batches of several adapters only."""
    from fuseml.ops.gemm import launch as _gemm

    # the expand mode's TMA kernel, also past IN_LOOP_MAX_M rows (the interpreter runs it
    # on the CPU)
    path = LoraPath(loop="tma", overlap=True, capture=True, mode=_gemm.LORA_EXPAND)
    offered = []
    choose = _gemm.choose_config

    def forced(op, x, n, k, run, extra, loop, **kw):
        if extra.startswith("shrink"):
            offered.append(kw.get("more", []))
            if kw.get("more"):
                return kw["more"][0]
        return choose(op, x, n, k, run, extra, loop, **kw)

    monkeypatch.setattr(_gemm, "choose_config", forced)
    for m in (40, 1100):  # overlapped, then (past IN_LOOP_MAX_M) in stream order
        for adapters in (None, 3):
            w, b, a, bb = _layer(96, 72, 8, torch.bfloat16, device, adapters=adapters)
            x = torch.randn(m, 96, dtype=torch.bfloat16, device=device)
            ids = None if adapters is None else torch.randint(-1, adapters, (m,), device=device)
            out = fuseml.ops.lora_linear(
                x, w, b, a, bb, 0.5, "relu", adapter_ids=ids, backend=backend, path=path
            )
            assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu", ids), torch.bfloat16)
    assert [bool(o) for o in offered] == [False, True, False, True]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("loop", ["tma", "ptr"])
def test_lora_path_loop_reaches_the_precomputed_x_at_a(
    device, backend, loop, tma_lora_modes, monkeypatch
):
    """LoraPath's loop forces the precomputed mode's x @ A^T launch too, as FUSEML_GEMM
    did: "tma" runs it on the TMA kernel (float32 output), "ptr" on the pointer kernel."""
    from fuseml.ops.gemm import launch as _gemm

    monkeypatch.setenv("FUSEML_PDL", "0")
    w, b, a, bb = _layer(64, 40, 6, torch.bfloat16, device)  # rank 6: precomputed, not expand
    x = torch.randn(5, 64, dtype=torch.bfloat16, device=device)
    path = LoraPath(loop=loop, in_loop_max_m=0)
    out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "relu", backend=backend, path=path)
    assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu"), torch.bfloat16)
    assert tma_lora_modes == ([None, _gemm.LORA_PRECOMPUTED] if loop == "tma" else [])


@pytest.mark.parametrize(("device", "backend"), TARGETS[:1])  # the interpreter: which key
# the tile comes from is the point here (the GPU tests run the joint launch's tiles)
def test_joint_past_in_loop_rows_takes_the_expand_tile(
    device, backend, lora_mode, tma_lora_modes, monkeypatch
):
    """Past IN_LOOP_MAX_M rows the joint launch runs on the tile tuned for the expand
    mode's main launch (one tuning key for the same GEMM), and matches the reference."""
    from fuseml.ops.gemm import launch as _gemm

    if lora_mode.name != "joint-tma":
        pytest.skip("the joint mode's own test")
    path = dataclasses.replace(lora_mode.path, in_loop_max_m=16)
    keys = []
    choose = _gemm.choose_config

    def spy(op, x, n, k, run, extra, loop, **kw):
        keys.append(extra)
        return choose(op, x, n, k, run, extra, loop, **kw)

    monkeypatch.setattr(_gemm, "choose_config", spy)
    used = tma_lora_modes
    w, b, a, bb = _layer(64, 72, 8, torch.bfloat16, device)
    x = torch.randn(300, 64, dtype=torch.bfloat16, device=device)
    out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, "relu", backend=backend, path=path)
    assert used == [_gemm.LORA_JOINT]
    assert keys == [f"lora{_gemm.LORA_EXPAND}r16tma"]  # (rank 8 pads to 16 columns)
    assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, "relu"), torch.bfloat16)


@pytest.mark.parametrize(("device", "backend"), TARGETS[:1])  # the interpreter: the order
# of choices and launches is the point here (the GPU tests time and run the real pairs)
@pytest.mark.parametrize("adapters", [None, 3])
def test_overlapped_shrink_is_tuned_with_the_main_launch(device, backend, adapters, monkeypatch):
    """The overlapped expand mode chooses the main launch's tile alone first, then times
    each shrink tile with that main launch behind it (the pair as it runs, under a key of
    its own that names N), then, for a mixed batch of several adapters, the main tile
    again behind that shrink (a key of its own); the call then runs the shrink and the
    main launch once each."""
    from fuseml.ops.gemm import launch as _gemm

    monkeypatch.setattr(_gemm, "_tma_device", lambda t: True)
    path = LoraPath(overlap=True, capture=True, mode=_gemm.LORA_EXPAND)
    launched = []
    launch = _gemm.launch_linear
    monkeypatch.setattr(
        _gemm, "launch_linear", lambda *a, **k: launched.append(k.get("lora")) or launch(*a, **k)
    )
    chosen = []  # (tuning-key suffix, launches one timing of a candidate makes)
    choose = _gemm.choose_config

    def spy(op, x, n, k, run, extra, loop, **kw):
        cfg = choose(op, x, n, k, run, extra, loop, **kw)
        before = len(launched)
        run(cfg)  # what timing this candidate would launch
        chosen.append((extra, launched[before:]))
        return cfg

    monkeypatch.setattr(_gemm, "choose_config", spy)
    w, b, a, bb = _layer(64, 40, 8, torch.float32, device, adapters)
    x = torch.randn(3, 64, device=device)
    ids = None if adapters is None else torch.tensor([2, -1, 0], device=device)
    out = fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, adapter_ids=ids, backend=backend, path=path)
    assert_close_verbose(out, _ref64(x, w, b, a, bb, 0.5, ids=ids), torch.float32)
    (main_key, main_runs), (shrink_key, pair_runs), *again = chosen
    assert main_key.startswith(f"lora{_gemm.LORA_EXPAND}") and main_runs == [_gemm.LORA_EXPAND]
    assert shrink_key.startswith("shrinkpdl") and ":n40" in shrink_key
    assert pair_runs == [_gemm.LORA_SHRINK, _gemm.LORA_EXPAND]
    assert again == ([] if adapters is None else [(main_key + "pair", pair_runs)])
    assert launched[-2:] == [_gemm.LORA_SHRINK, _gemm.LORA_EXPAND]  # the call itself


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "lora_mode", ["in_loop-tma", "precomputed-tma", "expand-tma"], indirect=True
)
@pytest.mark.parametrize("adapters", [None, 3])
def test_lora_tma_direct_launch_matches_the_ordinary_launch_gpu(lora_mode, adapters, monkeypatch):
    """Each LoRA mode's TMA launches (shrink, expand with PDL, in-loop, precomputed) give
    the same output through the compiled kernel's launcher as through Triton's ordinary
    launch, on the first direct call and a repeat."""
    from fuseml.ops.gemm import launch as _gemm

    if not _gemm._has_tma(torch.cuda.current_device()):
        pytest.skip("needs TMA (Hopper or later)")
    w, b, a, bb = _layer(64, 72, 16, torch.bfloat16, "cuda", adapters)
    for m in (1, 37):
        x = torch.randn(m, 64, dtype=torch.bfloat16, device="cuda")
        ids = None if adapters is None else torch.randint(-1, adapters, (m,), device="cuda")
        outs = []
        for direct in (False, True, True):
            for launches in (_gemm._lora_tma_launches, _gemm._linear_tma_launches):
                monkeypatch.setattr(launches, "enabled", direct)
            outs.append(
                fuseml.ops.lora_linear(x, w, b, a, bb, 0.5, adapter_ids=ids, path=lora_mode.path)
            )
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        assert_close_verbose(outs[2], _ref64(x, w, b, a, bb, 0.5, ids=ids), torch.bfloat16)
    assert _gemm._lora_tma_launches.compiled


def test_pointer_kernel_launches_name_every_argument_and_their_specialization(monkeypatch):
    """LoRA launches on the pointer kernel repeat through its compiled launcher
    (CompiledLaunches): the arguments go positionally in _lora_kernel's order, and the key
    holds every dtype, constexpr, launch option and int specialization."""
    seen = []

    def record(grid, key, aligned, args, options):
        seen.append((key, args, options))

    monkeypatch.setattr(gemm.launch, "_lora_launches", record)
    x = torch.randn(20, 48, dtype=torch.bfloat16)
    w = torch.randn(32, 48, dtype=torch.bfloat16)
    a = torch.randn(16, 48, dtype=torch.bfloat16)
    bb = torch.randn(32, 16, dtype=torch.bfloat16)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4,
           "num_stages": 2}  # fmt: skip
    for m in (20, 32):
        out = torch.empty(m, 32, dtype=torch.bfloat16)
        gemm.launch_linear(
            out, x[:m] if m <= 20 else torch.randn(m, 48, dtype=torch.bfloat16), w, None, None,
            1.0, 0, cfg, lora=gemm.LORA_IN_LOOP, lora_a=a, lora_b=bb, lora_scale=0.5, rank=16,
        )  # fmt: skip
    assert len(seen) == 2
    (key20, args, options), (key32, _, _) = seen
    named = dict(zip(_lora_kernel_arg_names(), args, strict=True))
    assert named["M"] == 20 and named["N"] == 32 and named["K"] == 48
    assert named["LORA"] == gemm.LORA_IN_LOOP and named["R"] == 16 and named["RANK"] == 16
    assert named["lora_scale"] == 0.5 and named["HAS_BIAS"] is False
    assert named["BLOCK_K"] == 32 and named["PDL"] is False and named["B3D"] is False
    assert named["a_ptr"] is a and named["b_ptr"] is bb
    assert options == {"num_warps": 4, "num_stages": 2}
    assert key20 != key32  # M = 20 and 32: another int specialization (a multiple of 16)


def _lora_kernel_arg_names() -> list[str]:
    from fuseml.ops.gemm.pointer import _lora_kernel

    return list(_lora_kernel.arg_names)
