import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fuseml import runtime
from fuseml.testing import fused_targets


def test_import_initialises_no_cuda():
    code = (
        "import torch, fuseml, fuseml.ops\n"
        "assert not torch.cuda.is_initialized(), 'import fuseml initialised CUDA'\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert runtime.resolve_backend("auto", cpu, "op") == "eager"
    assert runtime.resolve_backend("eager", cpu, "op") == "eager"
    assert runtime.resolve_backend("compile", cpu, "op") == "compile"
    with pytest.raises(ValueError, match="op: backend must be one of"):
        runtime.resolve_backend("tvm", cpu, "op")
    with pytest.raises(ValueError, match="backend='cuda' is unavailable here"):
        runtime.resolve_backend("cuda", cpu, "op")


def test_resolve_constant_is_marked_as_torch_marks_it():
    """runtime marks _resolve_constant for dynamo without importing torch._dynamo: the
    mark must be all that torch's own decorator does."""
    import torch._dynamo  # (torch.compiler.assume_constant_result imports it anyway)

    def f():
        return None

    assert vars(torch.compiler.assume_constant_result(f)) == {"_dynamo_marked_constant": True}
    assert runtime._resolve_constant._dynamo_marked_constant is True


def test_toolchain_probes_live_in_the_extension_module():
    # runtime re-exports them; _cuda_ext needs nothing of runtime (no import cycle)
    from fuseml import _cuda_ext

    assert runtime.nvcc_path is _cuda_ext.nvcc_path
    assert runtime.ninja_available is _cuda_ext.ninja_available
    assert runtime.cuda_toolchain_available is _cuda_ext.cuda_toolchain_available


def test_gpu_slug():
    assert runtime.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


FIRST_CALL_COMPILED = """
import sys, torch, fuseml
device, backend = sys.argv[1], sys.argv[2]
fn = torch.compile(lambda a, b: fuseml.ops.add(a, b, backend=backend) * 2, fullgraph=True)
x = torch.ones(4, 8, device=device)
out = fn(x, x)
assert torch.equal(out.cpu(), torch.full((4, 8), 4.0)), out
print("ok")
"""


@pytest.mark.parametrize(("device", "backend"), fused_targets())
def test_first_call_inside_torch_compile(device, backend):
    # A model compiled before any eager fuseml call: the backend is resolved (modules
    # looked up, the CUDA extension built under a lock) while dynamo traces, in a fresh
    # process so that nothing is cached yet.
    res = subprocess.run(
        [sys.executable, "-c", FIRST_CALL_COMPILED, device, backend],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip().endswith("ok")


def test_cuda_launch_sites_load_the_extension_first(monkeypatch):
    # A registered op called with impl "cuda" directly (torch.ops.fuseml.add(x, y, "cuda"))
    # has had no resolve_backend build the extension: the launch site builds it (once per
    # process), or says why it cannot, before it calls into torch.ops.fuseml.*_cuda_out.
    import fuseml.ops  # noqa: F401  (registers torch.ops.fuseml.*)
    from fuseml import _cuda_ext

    builds = []
    monkeypatch.setattr(_cuda_ext, "_status", None)
    monkeypatch.setattr(_cuda_ext, "_build", lambda: builds.append(1) or (False, "no nvcc here"))
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="bias_act: backend='cuda' is unavailable here: no nvcc"):
        torch.ops.fuseml.add(x, x, "cuda")
    with pytest.raises(ValueError, match="log_softmax: backend='cuda' is unavailable here"):
        torch.ops.fuseml.log_softmax(x, -1, "cuda")
    assert builds == [1]


def test_cuda_build_warns_about_a_leftover_lock_file(tmp_path, caplog):
    # torch waits silently while its build lock exists; a process killed mid-build leaves
    # it behind, so the next build names the file before it waits
    from fuseml import _cuda_ext

    assert not _cuda_ext._warn_if_locked(str(tmp_path))
    assert not _cuda_ext._warn_if_locked(None)
    (tmp_path / "lock").write_text("")
    with caplog.at_level("WARNING", logger="fuseml"):
        assert _cuda_ext._warn_if_locked(str(tmp_path))
    assert str(tmp_path / "lock") in caplog.text and "delete that file" in caplog.text


@pytest.mark.parametrize(
    ("name", "value", "call"),
    [
        ("FUSEML_FP32_DOT", "tf32x9", "fuseml.ops.gemm.common.fp32_dot"),
        ("FUSEML_AUTOTUNE", "no", "fuseml.ops._tune.autotune_enabled"),
        ("FUSEML_TUNE_L2", "hot", "fuseml.ops._tune.l2_mode"),
        ("FUSEML_COMPILE_THREADS", "many", "fuseml.settings.compile_threads"),
        ("FUSEML_PDL", "on", "fuseml.settings.pdl"),
    ],
)
def test_knobs_read_per_call_reject_bad_values(monkeypatch, name, value, call):
    import importlib

    module, fn = call.rsplit(".", 1)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be .*got '{value}'"):
        getattr(importlib.import_module(module), fn)()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FUSEML_DIRECT_LAUNCH", "false"),
    ],
)
def test_knobs_read_at_import_reject_bad_values(name, value):
    import os

    env = {**os.environ, name: value}
    run = subprocess.run(
        [sys.executable, "-c", "import fuseml.ops"], env=env, capture_output=True, text=True
    )
    assert run.returncode != 0
    assert f"{name} must be" in run.stderr and f"got '{value}'" in run.stderr


def test_gc_paused_pauses_collects_and_restores():
    """CUDA-graph captures run with Python's cyclic collector paused (a CUDA graph freed by
    a collection inside a capture fails it); collect=True collects pending cycles first."""
    import gc

    gc_paused = runtime.gc_paused
    freed = []

    class Cyclic:
        def __init__(self):
            self.me = self

        def __del__(self):
            freed.append(1)

    Cyclic()  # cyclic garbage, pending until a collection
    assert gc.isenabled()
    with gc_paused(collect=True):
        assert freed and not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a collector paused before stays paused
    finally:
        gc.enable()


def test_build_key_follows_sources_and_flags(tmp_path, monkeypatch):
    # the record a later process loads from must name a build of the same sources and flags
    from fuseml import _cuda_ext

    monkeypatch.setattr(_cuda_ext, "_CSRC", tmp_path)
    (tmp_path / "a.cu").write_text("kernel v1")
    (tmp_path / "a.cuh").write_text("header v1")
    flags = {"extra_cflags": ["-O3"]}
    key = _cuda_ext.build_key("ext", flags)
    assert _cuda_ext.build_key("ext", dict(flags)) == key
    assert _cuda_ext.build_key("other", flags) != key
    assert _cuda_ext.build_key("ext", {"extra_cflags": ["-O2"]}) != key
    # the libstdc++ a process pins differs between processes, the build does not
    assert _cuda_ext.build_key("ext", {**flags, "extra_ldflags": ["/other/libstdc++.so"]}) == key
    (tmp_path / "a.cuh").write_text("header v2")  # a header alone changes it too
    assert _cuda_ext.build_key("ext", flags) != key


def test_recorded_library_loads_only_while_it_is_the_file_recorded(tmp_path, monkeypatch):
    from fuseml import _cuda_ext

    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path / "cache"))
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    lib = tmp_path / "ext.so"
    lib.write_bytes(b"library v1")
    assert _cuda_ext.load_recorded("ext", "k1", python_module=False) is None  # no record
    _cuda_ext.record("ext", "k1", str(lib))
    assert _cuda_ext.load_recorded("ext", "k1", python_module=False) == str(lib)
    assert _cuda_ext.load_recorded("ext", "k2", python_module=False) is None  # other key
    assert loaded == [str(lib)]
    lib.write_bytes(b"library v2, rebuilt")  # another build replaced the file
    assert _cuda_ext.load_recorded("ext", "k1", python_module=False) is None
    record = next((tmp_path / "cache" / "cuda-ext").glob("ext-k1.json"))
    record.write_text("{not json")
    assert _cuda_ext.load_recorded("ext", "k1", python_module=False) is None
    assert loaded == [str(lib)]


def test_recorded_library_that_fails_to_load_takes_the_full_path(tmp_path, monkeypatch, caplog):
    from fuseml import _cuda_ext

    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    lib = tmp_path / "fuseml_nothing.so"
    lib.write_bytes(b"not a shared library")
    _cuda_ext.record("fuseml_nothing", "k", str(lib))
    with caplog.at_level("INFO", logger="fuseml"):
        assert _cuda_ext.load_recorded("fuseml_nothing", "k", python_module=True) is None
    assert "building it" in caplog.text


def test_extension_loads_from_its_record_without_torch_build_tools(monkeypatch):
    # the record spares a new process torch.utils.cpp_extension (setuptools, ninja's check)
    from torch.utils import cpp_extension

    from fuseml import _cuda_ext

    monkeypatch.setattr(_cuda_ext, "_missing_toolchain", lambda: None)
    keys = []
    monkeypatch.setattr(
        _cuda_ext, "load_recorded", lambda name, key, python_module: keys.append(key) or "/x.so"
    )
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built again"))
    assert _cuda_ext._build() == (True, "ok")
    assert keys == [_cuda_ext.build_key(_cuda_ext.EXT_NAME, _cuda_ext._ext_flags())]


def test_fast_path_loads_from_its_record_without_a_build_process(monkeypatch):
    from fuseml import _cuda_ext
    from fuseml.ops import _fastcall

    module = object()
    monkeypatch.setattr(_cuda_ext, "_missing_toolchain", lambda: None)
    monkeypatch.setattr(_cuda_ext, "load_fastcall_recorded", lambda: module)
    monkeypatch.setattr(_fastcall, "_build_apart", lambda: pytest.fail("built again"))
    monkeypatch.setattr(_fastcall, "_done", threading.Event())
    for name in ("fast", "_loaded", "_reason"):
        monkeypatch.setattr(_fastcall, name, None)
    _fastcall._build()
    assert _fastcall._loaded is module and _fastcall._done.is_set()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_new_process_loads_the_built_extensions_from_their_records():
    # after one process built and loaded both libraries, the next loads them directly
    from fuseml import _cuda_ext

    if not _cuda_ext.cuda_toolchain_available():
        pytest.skip("needs the CUDA toolchain")
    code = (
        "import sys, torch\n"
        "from fuseml import _cuda_ext\n"
        "import fuseml.ops as ops\n"
        "from fuseml.ops import _fastcall\n"
        "assert _cuda_ext.status() == (True, 'ok'), _cuda_ext.status()\n"
        "assert _fastcall.wait(300), _fastcall.status()\n"
        "x = torch.randn(64, 96, device='cuda')\n"
        "out = ops.add(x, x, backend='cuda')\n"
        "torch.testing.assert_close(out, 2 * x)\n"
        "print('cpp_extension' if 'torch.utils.cpp_extension' in sys.modules else 'direct')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(_cuda_ext.__file__).parents[1])}
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-4000:]
    assert runs[1].stdout.strip() == "direct"  # (the first run may have built them)


def test_cache_files_are_written_whole(tmp_path, monkeypatch):
    # the tuning tables, Triton's key and the library records: the old file or the new one
    from fuseml._files import write_text_atomic

    target = tmp_path / "sub" / "table.json"
    write_text_atomic(target, "v1")  # (creates the folder)
    assert target.read_text() == "v1"

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(target, "v2")
    assert target.read_text() == "v1"
    assert [p.name for p in target.parent.iterdir()] == ["table.json"]  # no temporary left
