import copy

import pytest
import torch
from torch import nn

import fuseml
import fuseml.nn.dlrm
from fuseml.models.dlrm import DLRM, DLRMConfig
from fuseml.nn import FusedDLRM, FusedMLP
from fuseml.nn.dlrm import interaction_width
from fuseml.testing import DTYPES, assert_close_verbose, fused_targets, poison_allocator

TARGETS = fused_targets(cuda_twin=False)


def _model(name, device, dtype, **overrides) -> DLRM:
    torch.manual_seed(0)
    config = DLRMConfig.from_name(name, max_cardinality=40, **overrides)
    return DLRM(config).to(device, dtype).eval()


def _inputs(model, rows, device, id_dtype=torch.int64, dtype=torch.float32):
    cards = torch.tensor(model.config.cardinalities)
    dense = torch.randn(rows, model.config.num_dense).to(device, dtype)
    sparse = (torch.rand(rows, len(cards)) * cards).long().clamp_max(cards - 1)
    return dense, sparse.to(device, id_dtype)


def _ref64(model, dense, sparse, **kwargs):
    """The plain DLRM in float64 with ``model``'s parameters (a DLRM or a FusedDLRM)."""
    ref = DLRM(model.config).to(dense.device)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        return ref.double().eval()(dense.double(), sparse, **kwargs)


def _count_ei_calls(monkeypatch) -> list:
    calls = []
    real = fuseml.nn.dlrm.embedding_interaction

    def counting(*args, **kwargs):
        calls.append((kwargs.get("out_width"), kwargs.get("backend")))
        return real(*args, **kwargs)

    monkeypatch.setattr("fuseml.nn.dlrm.embedding_interaction", counting)
    return calls


def test_interaction_width():
    assert interaction_width(367) == 368  # kaggle: 16 + 351
    assert interaction_width(479) == 480  # mlperf: 128 + 351
    assert interaction_width(368) == 368
    assert interaction_width(53) == 53  # narrow: the GEMM takes it as is
    assert interaction_width(515) == 515  # wide: linear's rule leaves it too


def test_optimize_swaps_the_dlrm_and_keeps_its_parameters():
    model = _model("kaggle", "cpu", torch.float32)
    fused, report = fuseml.optimize(model)
    assert type(fused) is FusedDLRM and isinstance(fused, DLRM)
    assert report.swapped[0].path == "" and report.swapped[0].after == "FusedDLRM"
    assert list(fused.state_dict()) == list(model.state_dict())
    for (name, a), (_, b) in zip(
        fused.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert fused.embeddings.weight is not model.embeddings.weight  # a copy (inplace=False)
    # the MLPs swapped inside it as any Sequential (the top MLP's tuning times its layers
    # one by one: one FusedMLP)
    assert type(fused.top_mlp) is FusedMLP and type(fused.bottom_mlp) is FusedMLP
    _, report2 = fuseml.optimize(fused)
    assert not any(s.after == "FusedDLRM" for s in report2.swapped)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"interaction": "cat"}, "interaction 'cat'"),
    ],
)
def test_optimize_leaves_a_dlrm_it_cannot_fuse(change, reason):
    model = _model("tiny", "cpu", torch.float32, **change)
    fused, report = fuseml.optimize(model)
    assert type(fused) is DLRM
    assert any(x.path == "" and reason in x.reason for x in report.left), str(report)


def test_optimize_leaves_a_hooked_or_subclassed_dlrm():
    model = _model("tiny", "cpu", torch.float32)
    model.interaction.register_forward_hook(lambda *a: None)
    _, report = fuseml.optimize(model)
    assert any("forward hooks" in x.reason for x in report.left if x.path == "")

    class Mine(DLRM):
        pass

    sub = Mine(_model("tiny", "cpu", torch.float32).config).eval()
    fused, report = fuseml.optimize(sub)
    assert type(fused) is Mine
    assert any("subclass of DLRM" in x.reason for x in report.left if x.path == "")


def test_from_dlrm_bad_input():
    with pytest.raises(TypeError, match="model must be a DLRM"):
        FusedDLRM.from_dlrm(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="interaction is 'cat'"):
        FusedDLRM.from_dlrm(_model("tiny", "cpu", torch.float32, interaction="cat"))
    with pytest.raises(TypeError, match="from_dlrm"):
        FusedDLRM(_model("tiny", "cpu", torch.float32).config)
    with pytest.raises(ValueError, match="backend must be one of"):
        FusedDLRM.from_dlrm(_model("tiny", "cpu", torch.float32), backend="fast")


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny", "kaggle"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_fused_dlrm_matches_float64(device, backend, dtype, name, id_dtype, monkeypatch):
    """Probabilities and logits against the float64 model, through the fused kernel (one
    embedding_interaction call per forward, kaggle's 367 columns padded to 368)."""
    model = _model(name, device, dtype)
    fused, _ = fuseml.optimize(model, backend=backend)
    dense, sparse = _inputs(model, 37, device, id_dtype, dtype)
    calls = _count_ei_calls(monkeypatch)
    if device == "cuda":
        poison_allocator()
    with torch.no_grad():
        probs = fused(dense, sparse)
        logits = fused(dense, sparse, return_logits=True)
    k = model.config.interaction_dim
    assert calls == [(interaction_width(k), "triton")] * 2  # the kernel, not its reference
    assert probs.shape == (37,) and probs.dtype == dtype
    assert_close_verbose(probs, _ref64(model, dense, sparse), dtype)
    assert_close_verbose(logits, _ref64(model, dense, sparse, return_logits=True), dtype)
    worst = (probs.double() - _ref64(model, dense, sparse)).abs().max().item()
    assert worst < 0.02, f"worst probability off by {worst}"


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_fused_dlrm_few_rows(device, backend, rows):
    """One row and other tiny batches (a single program, masked samples) against float64."""
    model = _model("kaggle", device, torch.bfloat16)
    fused, _ = fuseml.optimize(model, backend=backend)
    dense, sparse = _inputs(model, rows, device, torch.int32, torch.bfloat16)
    with torch.no_grad():
        out = fused(dense, sparse)
    assert out.shape == (rows,)
    assert_close_verbose(out, _ref64(model, dense, sparse), torch.bfloat16)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("self_interaction", [False, True])
def test_fused_dlrm_options(device, backend, self_interaction):
    """The diagonal kept, hashed raw ids, and a top MLP of plain modules."""
    model = _model(
        "kaggle", device, torch.float32, self_interaction=self_interaction, hash_ids=True
    )
    fused = FusedDLRM.from_dlrm(model, backend=backend)  # MLPs left as plain nn.Linear
    dense, _ = _inputs(model, 9, device)
    raw = torch.randint(-(2**40), 2**40, (9, 26), device=device)
    with torch.no_grad():
        out = fused(dense, raw)
    assert_close_verbose(out, _ref64(model, dense, raw))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_dlrm_other_top_modules_run_as_they_are(device, backend, monkeypatch):
    """A top MLP the chain cannot take (a dropout module inside) gets the unpadded
    interaction and runs as it is."""
    model = _model("kaggle", device, torch.float32)
    model.top_mlp.insert(1, nn.Dropout(0.0))
    fused = FusedDLRM.from_dlrm(model, backend=backend)
    calls = _count_ei_calls(monkeypatch)
    dense, sparse = _inputs(model, 5, device)
    with torch.no_grad():
        out = fused(dense, sparse)
    assert calls == [(model.config.interaction_dim, "triton")]
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(dense.double(), sparse)
    assert_close_verbose(out, ref)


def test_fused_dlrm_reference_paths(monkeypatch):
    """On the CPU with backend auto (one-hot ids and bags) and while autograd records, the
    DLRM's own forward runs (no fused call), with the same result."""
    model = _model("tiny", "cpu", torch.float32)
    fused = FusedDLRM.from_dlrm(model)
    calls = _count_ei_calls(monkeypatch)
    dense, sparse = _inputs(model, 4, "cpu")
    with torch.no_grad():
        assert torch.equal(fused(dense, sparse), model(dense, sparse))
        bags = [(sparse[:, t], torch.arange(4)) for t in range(26)]
        assert torch.equal(fused(dense, bags), model(dense, bags))
    out = fused(dense, sparse)  # grad mode, parameters requiring grad: training
    out.sum().backward()
    assert model.bottom_mlp[0].weight.grad is not None
    assert calls == []


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_dlrm_checks_ids_as_the_model_does(device, backend):
    model = _model("tiny", device, torch.float32)
    fused = FusedDLRM.from_dlrm(model, backend=backend)
    dense, sparse = _inputs(model, 3, device)
    sparse[1, 4] = model.config.cardinalities[4]
    with torch.no_grad(), pytest.raises(ValueError, match=r"sparse ids of table 4 \(C5\)"):
        fused(dense, sparse)
    with pytest.raises(ValueError, match=r"expected shape \(B, 26\)"), torch.no_grad():
        fused(dense, sparse[:, :5])
    with pytest.raises(ValueError, match="dense features"), torch.no_grad():
        fused(dense[:, :3], sparse)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_dlrm_padded_weight_follows_updates(device, backend):
    """The first top layer's padded copy is kept per weight version: an in-place update
    of the weight is seen by the next call."""
    model = _model("kaggle", device, torch.float32)
    fused, _ = fuseml.optimize(model, backend=backend)
    dense, sparse = _inputs(model, 6, device)
    with torch.no_grad():
        fused(dense, sparse)
        fused.top_mlp[0].weight.mul_(-1.0)
        out = fused(dense, sparse, return_logits=True)
    assert_close_verbose(out, _ref64(fused, dense, sparse, return_logits=True))


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dlrm_bags(device, backend, dtype, monkeypatch):
    """Multi-hot bags (empty ones too) through the fused kernel, checked as the model
    checks them."""
    model = _model("kaggle", device, dtype)
    fused, _ = fuseml.optimize(model, backend=backend)
    gen = torch.Generator().manual_seed(7)
    bags = []
    for size in model.config.cardinalities:
        lengths = torch.randint(0, 4, (11,), generator=gen)
        offsets = torch.zeros(11, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)[:-1]
        idx = torch.randint(0, size, (int(lengths.sum()),), generator=gen)
        bags.append((idx.to(device), offsets.to(device)))
    dense = torch.randn(11, 13).to(device, dtype)
    calls = _count_ei_calls(monkeypatch)
    with torch.no_grad():
        out = fused(dense, bags)
    assert calls == [(interaction_width(model.config.interaction_dim), "triton")]
    assert_close_verbose(out, _ref64(model, dense, bags), dtype)
    bad = list(bags)
    bad[3] = (bags[3][0] + model.config.cardinalities[3], bags[3][1])
    if bad[3][0].numel():
        with torch.no_grad(), pytest.raises(ValueError, match=r"sparse ids of table 3 \(C4\)"):
            fused(dense, bad)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_fused_dlrm_compiles_fullgraph(device, backend):
    """torch.compile(fuseml.optimize(model), fullgraph=True): one graph, the fused ops
    inside it, the same predictions."""
    model = _model("kaggle", device, torch.float32)
    model.embeddings.check_ids = False
    fused, _ = fuseml.optimize(model, backend=backend)
    compiled = torch.compile(fused, fullgraph=True)
    dense, sparse = _inputs(model, 8, device)
    with torch.no_grad():
        out = compiled(dense, sparse)
    assert_close_verbose(out, _ref64(model, dense, sparse))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dlrm_eager_calls_replay_graphs(dtype, monkeypatch):
    """Repeated eager calls of one signature replay a CUDA graph: fresh outputs, new
    inputs seen, a weight updated in place or replaced seen, bad ids still raising;
    replay_graphs = 0 launches every call."""
    model = _model("kaggle", "cuda", dtype)
    fused, _ = fuseml.optimize(model)
    calls = _count_ei_calls(monkeypatch)
    outs = []
    with torch.no_grad():
        for _ in range(6):
            dense, sparse = _inputs(model, 37, "cuda", dtype=dtype)
            poison_allocator()
            out = fused(dense, sparse)
            assert_close_verbose(out, _ref64(model, dense, sparse), dtype)
            outs.append((out, out.clone()))
        assert len(calls) == 4  # two eager calls, the warm-up and the capture, then replays
        assert fused._replays().num_graphs == 1
        assert all(torch.equal(o, kept) for o, kept in outs)  # each call's own tensor
        fused.top_mlp[0].weight.mul_(-1.0)  # in place: a new version, a new graph
        out = fused(dense, sparse)  # (the signature whose graph was captured)
        assert_close_verbose(out, _ref64(fused, dense, sparse), dtype)
        fused.bottom_mlp[0].bias = nn.Parameter(fused.bottom_mlp[0].bias + 1)  # replaced
        out = fused(dense, sparse)
        assert_close_verbose(out, _ref64(fused, dense, sparse), dtype)
        for _ in range(4):
            out = fused(dense, sparse, return_logits=True)
            ref = _ref64(fused, dense, sparse, return_logits=True)
            assert_close_verbose(out, ref, dtype)
        bad = sparse.clone()
        bad[5, 2] = model.config.cardinalities[2]
        with pytest.raises(ValueError, match=r"sparse ids of table 2 \(C3\)"):
            fused(dense, bad, return_logits=True)  # a replayed signature
        fused.embeddings.check_ids = False  # graphs captured without the check ...
        for _ in range(3):
            fused(dense, sparse, return_logits=True)
        fused.embeddings.check_ids = True  # ... are not replayed once it is back on
        with pytest.raises(ValueError, match=r"sparse ids of table 2 \(C3\)"):
            fused(dense, bad, return_logits=True)
        fused.replay_graphs = 0
        n = len(calls)
        for _ in range(3):
            fused(dense, sparse)
        assert len(calls) == n + 3 and fused._replays().num_graphs == 0
    copy.deepcopy(fused)  # the graphs are not copied


def test_fused_dlrm_replay_key_state_follows_replaced_tensors_and_modules():
    """What a replayed graph is keyed on sees a parameter replaced by another, a
    submodule replaced deep inside, and an in-place update (its version)."""
    model = _model("tiny", "cpu", torch.float32)
    fused, _ = fuseml.optimize(model)
    before = fused._state_tensors()
    assert len(before) == len([*fused.parameters(), *fused.buffers()])
    layer = fused.top_mlp[0]
    old = layer.bias
    layer.bias = nn.Parameter(old.detach() + 1)  # the same module, a new tensor
    after = fused._state_tensors()
    assert any(t is layer.bias for t in after) and not any(t is old for t in after)
    fused.bottom_mlp[0] = copy.deepcopy(fused.bottom_mlp[0])  # a module replaced below
    fresh = fused._state_tensors()
    assert any(t is fused.bottom_mlp[0].weight for t in fresh)
    version = layer.weight._version
    with torch.no_grad():
        layer.weight.mul_(2)
    assert layer.weight._version != version
