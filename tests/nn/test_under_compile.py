"""The swapped layers under torch.compile: Inductor is handed the replaced modules' math
(no fuseml GEMM op in its graph), with the same result and one graph (fullgraph); so is
torch.export, where an op called by name stays; FusedDLRM keeps its fused kernel under
torch.compile."""

import copy
import logging
from collections import OrderedDict

import pytest
import torch
from torch import nn

import fuseml
from fuseml.nn import FusedLinear, FusedMLP, LoRALinear
from fuseml.testing import assert_close_verbose, fused_targets


def _graph_ops(module, *inputs, fullgraph: bool = True) -> tuple[set[str], torch.Tensor]:
    """(the ops in the FX graph torch.compile hands its backend, the compiled output)."""
    seen: set[str] = set()

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                seen.add(str(node.target))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=fullgraph)(*inputs)
    return seen, out


def _layers(device, backend):
    torch.manual_seed(0)
    lora = LoRALinear((32, 24), activation="gelu", backend=backend, device=device)
    lora.add_adapter("a0", 4, lora_alpha=8)
    with torch.no_grad():
        lora.lora_B["a0"].weight.normal_()
    lora.set_adapter("a0")
    return {
        "FusedLinear": FusedLinear(32, 24, activation="relu", device=device, backend=backend),
        "FusedMLP": FusedMLP([32, 48, 24], ["relu", None], device=device, backend=backend),
        "LoRALinear": lora,
    }


@pytest.mark.parametrize(("device", "backend"), fused_targets(cuda_twin=False))
@pytest.mark.parametrize("layer", ["FusedLinear", "FusedMLP", "LoRALinear"])
def test_compile_traces_the_replaced_modules_math(device, backend, layer):
    m = _layers(device, backend)[layer].eval()
    x = torch.randn(8, 32, device=device)
    with torch.no_grad():
        expected = m(x)  # the fused kernel, called directly
    ops, out = _graph_ops(m, x)
    assert not any(op.startswith("fuseml.") for op in ops), ops
    assert any("linear" in op or "addmm" in op or "mm" in op for op in ops), ops
    assert_close_verbose(out, expected)


@pytest.mark.parametrize(("device", "backend"), fused_targets(cuda_twin=False))
@pytest.mark.parametrize("layer", ["FusedLinear", "FusedMLP", "LoRALinear"])
def test_compiled_layers_compile_once(device, backend, layer, monkeypatch):
    """Repeat calls of a compiled swapped layer reuse its first graph, also when the backend
    is first resolved while tracing (a layer compiled before any eager fuseml call): a cache
    filled during the trace made the second call compile again."""
    monkeypatch.setattr(fuseml.runtime, "_RESOLVED", {})
    m = _layers(device, backend)[layer].eval()
    x = torch.randn(8, 32, device=device)
    compiles = []

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(m, backend=count, fullgraph=True)
        outs = [compiled(x) for _ in range(3)]
    assert len(compiles) == 1
    assert torch.equal(outs[0], outs[2])


@pytest.mark.parametrize(("device", "backend"), fused_targets(cuda_twin=False))
def test_export_takes_the_modules_math_and_the_ops_themselves(device, backend):
    m = FusedLinear(32, 24, activation="relu", device=device, backend=backend).eval()
    x = torch.randn(8, 32, device=device)
    with torch.no_grad():
        program = torch.export.export(m, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fuseml.") for t in targets), targets  # portable aten ops

    class Direct(nn.Module):  # the op called by name stays in the exported program
        def forward(self, a):
            return fuseml.ops.linear(a, m.weight, m.bias, "relu", backend=backend)

    with torch.no_grad():
        program = torch.export.export(Direct(), (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "fuseml.linear.default" in targets, targets


@pytest.mark.parametrize(("device", "backend"), fused_targets(cuda_twin=False))
def test_multi_adapter_layer_keeps_the_fused_op_under_compile(device, backend):
    # (the reference's masked passes would sync with the host: a graph break)
    m = _layers(device, backend)["LoRALinear"]
    m.add_adapter("a1", 4, lora_alpha=4)
    m.eval()
    x = torch.randn(8, 32, device=device)
    ids = torch.tensor([0, 1, -1, 0, 1, 1, 0, -1], device=device)
    with torch.no_grad():
        expected = m(x, ids)
    ops, out = _graph_ops(lambda a, i: m(a, i), x, ids, fullgraph=False)
    assert any(op.startswith("fuseml.lora_linear") for op in ops), ops
    assert_close_verbose(out, expected)


def test_fused_dlrm_keeps_its_fused_kernels_under_compile():
    from fuseml.models.dlrm import DLRM, DLRMConfig

    if not fuseml.runtime.triton_interpreting():
        pytest.skip("the fused DLRM path on CPU needs the Triton interpreter")
    cfg = DLRMConfig.from_name("kaggle", max_cardinality=50)
    torch.manual_seed(0)
    model = DLRM(cfg).eval()
    model.embeddings.check_ids = False
    fused, _ = fuseml.optimize(model, backend="triton")
    dense = torch.randn(4, cfg.num_dense)
    sparse = torch.randint(0, 50, (4, len(cfg.cardinalities)))
    ops, out = _graph_ops(fused, dense, sparse)
    assert any(op.startswith("fuseml.embedding_interaction") for op in ops), ops
    # both MLPs as fuseml chains (the bottom one too, though a FusedMLP alone hands a
    # tracer its layers' math): no GEMM of torch's in the graph
    assert any(op.startswith("fuseml.mlp") for op in ops), ops
    assert not [op for op in ops if "linear" in op or "mm" in op], ops
    with torch.no_grad():
        assert_close_verbose(out, model(dense, sparse))


def _guard_count(module, *inputs) -> int:
    """The guards Dynamo checks before each call of the compiled module (its guard log)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.extend(record.getMessage().splitlines())

    logger = logging.getLogger("torch._dynamo.guards.__guards")
    keep = Keep()
    torch._logging.set_logs(guards=True)
    logger.addHandler(keep)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(module, backend="eager", fullgraph=True)(*inputs)
    finally:
        logger.removeHandler(keep)
        torch._logging.set_logs()
    return sum(1 for line in lines if "+- " in line and "GuardManager" not in line)


def _peft_mlp(width: int):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(width, width), act=nn.GELU(), fc2=nn.Linear(width, width)
        )
    )  # fmt: skip
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["fc1", "fc2"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model.eval()


@pytest.mark.parametrize("model", ["mlp", "peft"])
def test_compiled_optimized_model_checks_no_more_guards_than_the_model(model):
    """Each call of a compiled model first checks its guards (host time): the swapped layers
    hand the tracer their math before reading any fuseml state, so that
    torch.compile(fuseml.optimize(model)) checks about as many guards as
    torch.compile(model) (before: 119 against 68 for a two-layer MLP, 614 against 561
    for a peft model)."""
    torch.manual_seed(0)
    if model == "mlp":
        plain = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 24)).eval()
    else:
        plain = _peft_mlp(32)
    fused, report = fuseml.optimize(copy.deepcopy(plain))
    assert report.changed, report
    x = torch.randn(8, 32)
    ours, theirs = _guard_count(fused, x), _guard_count(plain, x)
    assert theirs > 0
    assert ours <= theirs * 1.05 + 2, (ours, theirs)
