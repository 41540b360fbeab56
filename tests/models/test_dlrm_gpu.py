"""DLRM on a CUDA GPU: forward against the float64 reference, bf16, compile, training,
prediction and profiling (scripts/gpu-check.sh runs these)."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from test_dlrm import CARDS, _config, _one_hot, reference_dlrm  # same folder (rootdir import)

from fuseml.models import DLRM
from fuseml.runtime import tf32_matmuls
from fuseml.testing import assert_close_verbose, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture(autouse=True)
def _no_tf32():
    with tf32_matmuls(False):
        yield


@pytest.mark.parametrize(("interaction", "self_interaction"), [("dot", False), ("dot", True), ("cat", False)])  # fmt: skip
@pytest.mark.parametrize("batch", [1, 33, 4096])
def test_cuda_forward_matches_reference(interaction, self_interaction, batch):
    g = torch.Generator().manual_seed(batch)
    model = DLRM(_config(interaction, self_interaction))
    dense = torch.rand(batch, 13, generator=g) * 3
    ids = _one_hot(CARDS, batch, g)
    ref_p, ref_logits = reference_dlrm(
        model, dense, [[[int(v)] for v in ids[:, t]] for t in range(len(CARDS))]
    )
    model = model.cuda()
    dense, ids = dense.cuda(), ids.cuda()
    assert_close_verbose(model(dense, ids), ref_p, torch.float32)
    assert_close_verbose(model(dense, ids, return_logits=True), ref_logits, torch.float32)
    with torch.no_grad():
        bf16 = model.to(torch.bfloat16)(dense.to(torch.bfloat16), ids)
    assert_close_verbose(bf16, ref_p, torch.bfloat16)


def test_cuda_compile_equals_eager():
    g = torch.Generator().manual_seed(0)
    model = DLRM(_config()).cuda().eval()
    dense, ids = (torch.rand(256, 13, generator=g) * 3).cuda(), _one_hot(CARDS, 256, g).cuda()
    with torch.no_grad():
        eager = model(dense, ids)
        compiled = torch.compile(model, fullgraph=True)(dense, ids)
    assert_close_verbose(compiled, eager.double(), torch.float32)


def test_cuda_out_of_range_ids_raise():
    model = DLRM(_config()).cuda()
    ids = _one_hot(CARDS, 4, torch.Generator().manual_seed(1)).cuda()
    ids[2, 2] = CARDS[2]
    with pytest.raises(ValueError, match="table"):
        model(torch.rand(4, 13, device="cuda"), ids)


def test_cuda_train_predict_profile(tmp_path):
    from fuseml.apps.predict import predict
    from fuseml.apps.profile import profile_dlrm
    from fuseml.apps.train import TrainOptions, synthetic_dataset, train

    data_dir, _ = synthetic_dataset(
        60_000, max_cardinality=30, root=tmp_path / "data", progress=False
    )
    options = TrainOptions(
        epochs=2, optimizer="adam", lr=0.006, batch_size=1024, dtype="bf16", device="cuda",
        out_dir=tmp_path / "run", progress=False,
    )  # fmt: skip
    result = train("tiny", data_dir, options, console=Console(quiet=True))
    assert result.test["auc"] > 0.7, result.test
    out = tmp_path / "preds.parquet"
    pred = predict(result.checkpoint, data_dir, out, progress=False)
    assert pred.rows > 0 and out.is_file()
    prof = profile_dlrm("kaggle", backend="eager", batch_size=2048, steps=3, max_cardinality=100_000,
                        out_dir=tmp_path / "prof", console=Console(quiet=True))  # fmt: skip
    assert prof.device.type == "cuda" and prof.trace.is_file()
    assert len(prof.top) == 10 and all(row["total_us"] > 0 for row in prof.top)
    stages = {row["name"] for row in prof.stages}
    expected = {"bottom_mlp", "embeddings", "interaction", "top_mlp"}
    assert expected <= {n.split(".")[-1] for n in stages}
