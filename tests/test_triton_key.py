"""fuseml._triton_key: Triton's installation hash read from disk instead of recomputed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fuseml import _triton_key, runtime


@pytest.fixture(autouse=True, scope="module")
def _enabled():
    """The opt-in the command line makes, undone after this module's tests."""
    assert runtime.enable_triton_key_cache()
    yield
    _triton_key.uninstall()


def _installed():
    import triton.runtime.cache as cache

    key_fn = getattr(cache, "triton_key", None)
    if key_fn is None or not getattr(key_fn, "_fuseml_cached", False):
        import triton.compiler.compiler as compiler

        key_fn = compiler.triton_key
    return key_fn


def test_installed_and_same_key_as_triton(tmp_path, monkeypatch):
    key_fn = _installed()
    assert key_fn._fuseml_cached
    monkeypatch.setenv("FUSEML_CACHE", str(tmp_path))
    key_fn.cache_clear()
    try:
        key = key_fn()
        assert key == key_fn.original()  # exactly Triton's own value
        stored = list((tmp_path / "triton-key").glob("*.txt"))
        assert len(stored) == 1 and stored[0].read_text() == key
        # A new process (memo cleared) reads the file and does not call Triton's function.
        key_fn.cache_clear()
        calls = []
        original = key_fn.original
        monkeypatch.setattr(key_fn, "original", lambda: calls.append(1) or original())
        assert key_fn() == key
        assert not calls
    finally:
        key_fn.cache_clear()


def test_every_loaded_triton_module_sees_the_cached_function():
    key_fn = _installed()
    for name, mod in list(sys.modules.items()):
        if name.startswith("triton") and hasattr(mod, "triton_key"):
            assert mod.triton_key is key_fn, name


def test_fingerprint_follows_the_files(tmp_path):
    (tmp_path / "compiler").mkdir()
    (tmp_path / "language").mkdir()
    src = tmp_path / "compiler" / "a.py"
    src.write_text("x = 1\n")
    defining = tmp_path / "cache.py"
    defining.write_text("")
    first = _triton_key.fingerprint(tmp_path, defining)
    assert first == _triton_key.fingerprint(tmp_path, defining)
    src.write_text("x = 22\n")  # another size
    second = _triton_key.fingerprint(tmp_path, defining)
    assert second != first
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, touched
    assert _triton_key.fingerprint(tmp_path, defining) != second
    (tmp_path / "language" / "b.py").write_text("")  # a new file
    assert _triton_key.fingerprint(tmp_path, defining) not in (first, second)


def test_opt_in_is_idempotent_and_reversible():
    key_fn = _installed()
    assert _triton_key.enabled()
    assert runtime.enable_triton_key_cache() and _installed() is key_fn  # no second wrapper
    _triton_key.uninstall()
    try:
        assert not _triton_key.enabled()
        for name, mod in list(sys.modules.items()):
            if name.startswith("triton") and hasattr(mod, "triton_key"):
                assert mod.triton_key is key_fn.original, name
    finally:
        assert runtime.enable_triton_key_cache()
    assert _installed() is not key_fn.original


def _json_from_a_fresh_process(code: str) -> dict:
    """Run ``code`` in a new process with compiled Triton (no interpreter; no GPU needed
    to hash) and return the JSON its last output line holds."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kernel_keys_in_a_fresh_process(first: str) -> dict:
    """In a new process: import fuseml.ops, compute the key of the GEMM family's kernel
    ``first`` before any other is asked for, and return every GEMM-family function's key
    plus the order fuseml settled them in."""
    code = (
        "import json\n"
        "import fuseml.ops\n"
        "from fuseml.ops.gemm import common, lora_modes, pointer, stream, tma\n"
        "from fuseml import _triton_key\n"
        "from triton.runtime.jit import JITFunction\n"
        "mods = (common, lora_modes, pointer, stream, tma)\n"
        f"next(getattr(m, {first!r}) for m in mods if hasattr(m, {first!r})).cache_key\n"
        "keys = {f'{m.__name__}.{n}': v.cache_key for m in mods\n"
        "        for n, v in vars(m).items() if isinstance(v, JITFunction)}\n"
        "print(json.dumps({'keys': keys, 'order': _triton_key.settle_function_keys()}))\n"
    )
    return _json_from_a_fresh_process(code)


def test_kernel_keys_do_not_depend_on_the_first_kernel_hashed():
    """Up to Triton 3.6 a function's key depended on which kernel a process hashed first
    (see fuseml._triton_key): the pointer and the TMA GEMM kernels, hashed first in two
    processes, must give every function the same key there (later Tritons always do).
    fuseml settles each function after the functions it calls."""
    a = _kernel_keys_in_a_fresh_process("_lora_kernel")
    b = _kernel_keys_in_a_fresh_process("_lora_tma_kernel")
    assert len(a["keys"]) >= 10 and a["keys"] == b["keys"]
    order = a["order"]
    assert len(order) == len(set(order))
    at = {name.rsplit(".", 1)[1]: i for i, name in enumerate(order)}
    for callee, caller in (
        ("_tile_coords", "_gemm_body"), ("_gemm_body", "_lora_kernel"),
        ("_epilogue", "_tma_body"), ("_tma_body", "_lora_tma_kernel"),
        ("_activation", "_epilogue"),
    ):  # fmt: skip
        assert at[callee] < at[caller], (callee, caller)
    assert set(at) >= {k.rsplit(".", 1)[1] for k in a["keys"]}  # every one was settled


def test_every_fuseml_kernel_is_settled_on_import():
    """Every Triton function of every fuseml module is among those ``import fuseml.ops``
    settles: a kernel module that op import does not reach would keep order-dependent
    keys (Triton 3.6)."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import fuseml, fuseml.ops\n"
        "from fuseml import _triton_key\n"
        "from triton.runtime.jit import JITFunction\n"
        "settled = _triton_key.settle_function_keys()\n"
        "for info in pkgutil.walk_packages(fuseml.__path__, 'fuseml.'):\n"
        "    importlib.import_module(info.name)\n"
        "found = sorted({f'{v.__module__}.{v.__name__}' for n, m in list(sys.modules.items())\n"
        "                if n.startswith('fuseml') for v in vars(m).values()\n"
        "                if isinstance(v, JITFunction)})\n"
        "print(json.dumps({'settled': settled, 'found': found}))\n"
    )
    got = _json_from_a_fresh_process(code)
    assert got["found"] and set(got["found"]) <= set(got["settled"])
