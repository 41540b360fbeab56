"""DLRM model: forward against a from-scratch float64 computation of the reference's
formulas, configs, initialisation, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from fuseml.models import DLRM, CatInteraction, ConcatEmbeddingBags, DLRMConfig, DotInteraction
from fuseml.testing import assert_close_verbose

CARDS = (5, 3, 11, 1, 7)  # odd sizes, a 1-row table


def _config(interaction: str = "dot", self_interaction: bool = False, **kw) -> DLRMConfig:
    return DLRMConfig(
        name="test",
        embedding_dim=4,
        bottom_mlp=(6, 4),
        top_mlp=(9, 5, 1),
        cardinalities=CARDS,
        interaction=interaction,
        self_interaction=self_interaction,
        **kw,
    )


def _one_hot(cards, batch: int, g: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randint(0, n, (batch,), generator=g) for n in cards], 1)


def _bags(cards, batch: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-table bags of 0..3 ids (empty bags included)."""
    bags = []
    for n in cards:
        lengths = torch.randint(0, 4, (batch,), generator=g)
        offsets = torch.zeros(batch, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)[:-1]
        bags.append((torch.randint(0, n, (int(lengths.sum()),), generator=g), offsets))
    return bags


# -- the reference, from scratch ----------------------------------------------------------


def _linears(state: dict, prefix: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(W, b) of each Linear of an nn.Sequential in order, as float64."""
    idx = sorted({int(k.split(".")[1]) for k in state if k.startswith(prefix + ".")})
    return [
        (state[f"{prefix}.{i}.weight"].double(), state[f"{prefix}.{i}.bias"].double()) for i in idx
    ]


def reference_dlrm(model: DLRM, dense: torch.Tensor, bags, *, hash_ids: bool = False):
    """DLRM forward in float64 with explicit loops, from the weights alone.

    ``bags[t][b]`` is the list of raw ids in row b's bag of table t.
    Returns (probabilities, logits), each (B,).
    """
    cfg = model.config
    state = {k: v.detach() for k, v in model.state_dict().items()}
    table = state["embeddings.weight"].double()
    batch, d = dense.shape[0], cfg.embedding_dim

    # bottom MLP: ReLU after every layer, the last included
    x = dense.double()
    for w, b in _linears(state, "bottom_mlp"):
        x = torch.clamp(torch.einsum("bi,oi->bo", x, w) + b, min=0.0)

    # embeddings: rows of table t live at sum(cards[:t]) + id; bags are sums
    start = 0
    emb = []
    for t, n in enumerate(cfg.cardinalities):
        e = torch.zeros(batch, d, dtype=torch.float64)
        for r in range(batch):
            for raw in bags[t][r]:
                i = raw % n if hash_ids else raw  # Python %: floor modulo, like the model
                assert 0 <= i < n
                e[r] += table[start + i]
        emb.append(e)
        start += n

    # interaction
    feats = [x, *emb]
    if cfg.interaction == "dot":
        pairs = []
        for i in range(len(feats)):  # row-major lower triangle, strictly or with diagonal
            for j in range(i + 1 if cfg.self_interaction else i):
                pairs.append(torch.einsum("bd,bd->b", feats[i], feats[j]))
        z = torch.cat([x, torch.stack(pairs, 1)], 1)
    else:
        z = torch.cat(feats, 1)

    # top MLP: ReLU after every layer but the last; sigmoid on the output
    layers = _linears(state, "top_mlp")
    for k, (w, b) in enumerate(layers):
        z = torch.einsum("bi,oi->bo", z, w) + b
        if k < len(layers) - 1:
            z = torch.clamp(z, min=0.0)
    logits = z[:, 0]
    return 1.0 / (1.0 + torch.exp(-logits)), logits


def _bags_as_lists(bags, batch: int) -> list[list[list[int]]]:
    out = []
    for idx, off in bags:
        ends = [*off[1:].tolist(), len(idx)]
        out.append([idx[s:e].tolist() for s, e in zip(off.tolist(), ends)])
    return out


# -- forward vs reference -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("interaction", "self_interaction"), [("dot", False), ("dot", True), ("cat", False)]
)
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_one_hot_forward_matches_reference(interaction, self_interaction, batch):
    g = torch.Generator().manual_seed(batch)
    model = DLRM(_config(interaction, self_interaction))
    dense = torch.rand(batch, 13, generator=g) * 3
    ids = _one_hot(CARDS, batch, g)
    ref_p, ref_logits = reference_dlrm(
        model, dense, [[[int(v)] for v in ids[:, t]] for t in range(5)]
    )

    assert_close_verbose(model(dense, ids), ref_p, torch.float32)
    assert_close_verbose(model(dense, ids, return_logits=True), ref_logits, torch.float32)
    # In float64 the model computes exactly the reference's formulas.
    p64 = model.double()(dense.double(), ids)
    assert torch.allclose(p64, ref_p, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("interaction", "self_interaction"), [("dot", False), ("dot", True), ("cat", False)]
)
def test_multi_hot_bags_match_reference(interaction, self_interaction):
    g = torch.Generator().manual_seed(1)
    batch = 9
    model = DLRM(_config(interaction, self_interaction))
    dense = torch.rand(batch, 13, generator=g)
    bags = _bags(CARDS, batch, g)
    ref_p, _ = reference_dlrm(model, dense, _bags_as_lists(bags, batch))
    assert_close_verbose(model(dense, bags), ref_p, torch.float32)


def test_one_hot_equals_bags_of_one():
    g = torch.Generator().manual_seed(2)
    model = DLRM(_config())
    dense, ids = torch.rand(6, 13, generator=g), _one_hot(CARDS, 6, g)
    bags = [(ids[:, t].clone(), torch.arange(6)) for t in range(len(CARDS))]
    torch.testing.assert_close(model(dense, ids), model(dense, bags), rtol=1e-6, atol=1e-7)


def test_hashing_takes_raw_ids_modulo_the_table_size():
    g = torch.Generator().manual_seed(3)
    batch = 8
    model = DLRM(_config(hash_ids=True))
    dense = torch.rand(batch, 13, generator=g)
    raw = torch.randint(-(2**40), 2**40, (batch, len(CARDS)), generator=g)
    raw[0] = -1  # negative ids hash too (floor modulo)
    lists = [[[int(v)] for v in raw[:, t]] for t in range(len(CARDS))]
    ref_p, _ = reference_dlrm(model, dense, lists, hash_ids=True)
    assert_close_verbose(model(dense, raw), ref_p, torch.float32)
    # multi-hot raw ids hash the same way
    bags = _bags((1000,) * len(CARDS), batch, g)
    ref_p, _ = reference_dlrm(model, dense, _bags_as_lists(bags, batch), hash_ids=True)
    assert_close_verbose(model(dense, bags), ref_p, torch.float32)


def test_tril_order_is_the_references():
    n = 27
    for self_interaction, offset in ((False, 1), (True, 0)):
        # the reference's comprehension: li = [i for i in range(n) for j in range(i + offset)]
        li = [i for i in range(n) for j in range(i + 1 - offset)]
        lj = [j for i in range(n) for j in range(i + 1 - offset)]
        inter = DotInteraction(n, self_interaction=self_interaction)
        assert inter.li.tolist() == li and inter.lj.tolist() == lj
    assert DotInteraction(27).output_dim(16) == 16 + 351
    assert CatInteraction(27).output_dim(16) == 27 * 16


def test_bf16_autocast_is_close():
    g = torch.Generator().manual_seed(4)
    model = DLRM(_config())
    dense, ids = torch.rand(32, 13, generator=g), _one_hot(CARDS, 32, g)
    ref = model(dense, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(dense, ids)
    assert_close_verbose(out, ref.double(), torch.bfloat16)


def test_gradients_reach_every_parameter():
    g = torch.Generator().manual_seed(5)
    model = DLRM(_config())
    dense, bags = torch.rand(5, 13, generator=g), _bags(CARDS, 5, g)
    model(dense, bags, return_logits=True).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_compiles_without_graph_breaks():
    model = DLRM(DLRMConfig.from_name("tiny", max_cardinality=20))
    g = torch.Generator().manual_seed(6)
    dense, ids = torch.rand(16, 13, generator=g), _one_hot(model.config.cardinalities, 16, g)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(dense, ids), model(dense, ids))


# -- structure, configs, initialisation ---------------------------------------------------


def test_submodules_and_mlp_layout():
    model = DLRM(DLRMConfig.from_name("tiny"))
    kinds = lambda seq: [type(m).__name__ for m in seq]
    # bottom: ReLU after every layer (the reference's bottom MLP has no sigmoid layer)
    assert kinds(model.bottom_mlp) == ["Linear", "ReLU", "Linear", "ReLU"]
    # top: the last Linear gives the logit; sigmoid is applied by forward
    assert kinds(model.top_mlp) == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert isinstance(model.embeddings, ConcatEmbeddingBags)
    assert model.top_mlp[0].in_features == 8 + 351


@pytest.mark.parametrize(
    ("name", "dim", "top_in"), [("kaggle", 16, 367), ("terabyte", 64, 415), ("mlperf", 128, 479)]
)
def test_named_configs(name, dim, top_in):
    cfg = DLRMConfig.from_name(name, max_cardinality=10)
    assert cfg.embedding_dim == dim == cfg.bottom_mlp[-1]
    assert cfg.interaction_dim == top_in
    assert max(cfg.cardinalities) == 10 and len(cfg.cardinalities) == 26
    assert dataclasses.replace(cfg, self_interaction=True).interaction_dim == dim + 378
    assert dataclasses.replace(cfg, interaction="cat").interaction_dim == 27 * dim
    from fuseml.data import KAGGLE_CARDINALITIES

    assert DLRMConfig.from_name(name).cardinalities == KAGGLE_CARDINALITIES


def test_config_json_round_trip_and_load(tmp_path):
    cfg = DLRMConfig.from_name("tiny", cardinalities=[4] * 26, self_interaction=True)
    path = tmp_path / "cfg.json"
    cfg.to_json(path)
    assert DLRMConfig.from_json(path) == cfg
    assert DLRMConfig.from_json(cfg.to_json()) == cfg

    # a file without cardinalities takes the data's; with other ones it is refused
    data = cfg.to_dict() | {"cardinalities": []}
    path.write_text(json.dumps(data))
    assert DLRMConfig.load(path, cardinalities=[4] * 26) == cfg
    cfg.to_json(path)
    with pytest.raises(ValueError, match=r"table 2 \(C3\) has 4 rows in the config, 9 in the data"):
        DLRMConfig.load(path, cardinalities=[4, 4, 9] + [4] * 23)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown DLRM config 'huge'"):
        DLRMConfig.from_name("huge")
    with pytest.raises(ValueError, match="neither a named config"):
        DLRMConfig.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="must equal embedding_dim"):
        DLRMConfig(embedding_dim=8, bottom_mlp=(16, 4))
    with pytest.raises(ValueError, match="interaction must be one of"):
        DLRMConfig(interaction="mul")
    with pytest.raises(ValueError, match=r"unknown DLRMConfig field\(s\) \['dim'\]"):
        DLRMConfig.from_dict({"dim": 3})
    with pytest.raises(ValueError, match="no table cardinalities"):
        DLRM(DLRMConfig())


def test_reference_initialisation():
    torch.manual_seed(0)
    cards = (3, 50, 2000) + (10,) * 23
    model = DLRM(DLRMConfig.from_name("kaggle", cardinalities=cards))
    w = model.embeddings.weight.detach()
    start = 0
    for n in cards:
        rows = w[start : start + n]
        bound = math.sqrt(1 / n)
        assert rows.abs().max() <= bound
        start += n
    big = w[53 : 53 + 2000]  # the 2000-row table: U(-b, b) has std b / sqrt(3)
    assert big.std().item() == pytest.approx(math.sqrt(1 / 2000) / math.sqrt(3), rel=0.05)
    layer = model.top_mlp[0]  # 367 -> 512
    fan_out, fan_in = layer.weight.shape
    assert layer.weight.std().item() == pytest.approx(math.sqrt(2 / (fan_in + fan_out)), rel=0.02)
    assert layer.bias.std().item() == pytest.approx(math.sqrt(1 / fan_out), rel=0.15)
    assert layer.weight.mean().abs().item() < 0.01


# -- bad input ----------------------------------------------------------------------------


def test_out_of_range_ids_name_the_table_and_range():
    model = DLRM(_config())
    dense, ids = torch.rand(4, 13), torch.zeros(4, 5, dtype=torch.int64)
    ids[2, 2] = 11  # table 2 has 11 rows: 0..10
    with pytest.raises(
        ValueError, match=r"table 2 \(C3\) must be in \[0, 11\), got values in \[0, 11\]"
    ):
        model(dense, ids)
    ids[2, 2], ids[1, 4] = 0, -3
    with pytest.raises(
        ValueError, match=r"table 4 \(C5\) must be in \[0, 7\), got values in \[-3, 0\]"
    ):
        model(dense, ids)
    bags = [(torch.zeros(4, dtype=torch.int64), torch.arange(4)) for _ in CARDS]
    bags[3] = (torch.tensor([0, 0, 1, 0]), torch.arange(4))  # table 3 has one row
    with pytest.raises(ValueError, match=r"table 3 \(C4\) must be in \[0, 1\)"):
        model(dense, bags)


def test_wrong_shapes_and_types():
    model = DLRM(_config())
    ids = torch.zeros(4, 5, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"dense features: expected shape \(B, 13\), got \(4, 12\)"
    ):
        model(torch.rand(4, 12), ids)
    with pytest.raises(TypeError, match="dense features must be floating point"):
        model(torch.zeros(4, 13, dtype=torch.int64), ids)
    with pytest.raises(ValueError, match=r"sparse ids: expected shape \(B, 5\), got \(4, 26\)"):
        model(torch.rand(4, 13), torch.zeros(4, 26, dtype=torch.int64))
    with pytest.raises(TypeError, match="sparse ids must be int32 or int64"):
        model(torch.rand(4, 13), ids.float())
    with pytest.raises(ValueError, match="expected 5 tables, got 2"):
        model(torch.rand(4, 13), [(torch.zeros(1, dtype=torch.int64), torch.zeros(4))] * 2)
    bad_offsets = [(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 2, 1, 3]))] * 5
    with pytest.raises(
        ValueError, match=r"table 0 \(C1\): offsets must start at 0, never decrease"
    ):
        model(torch.rand(4, 13), bad_offsets)


def test_validate_ids_is_the_forward_check_made_apart():
    """validate_ids raises what the forward's check raises, for a caller that checks ids on
    the host and runs the forward with check_ids off (a CUDA-graph capture)."""
    emb = ConcatEmbeddingBags([3, 5], 4)
    emb.validate_ids(torch.tensor([[0, 4], [2, 0]]))  # in range: nothing
    bad = torch.tensor([[0, 4], [2, 5]])
    with pytest.raises(ValueError, match=r"table 1 \(C2\) must be in \[0, 5\), got values in"):
        emb.validate_ids(bad)
    with pytest.raises(ValueError, match=r"table 1 \(C2\) must be in \[0, 5\)"):
        emb(bad)
    emb.check_ids = False
    with pytest.raises(ValueError, match=r"table 1 \(C2\)"):
        emb.validate_ids(bad)  # the check itself does not depend on check_ids
    ConcatEmbeddingBags([3, 5], 4, hash_ids=True).validate_ids(bad)  # hashed: any id
