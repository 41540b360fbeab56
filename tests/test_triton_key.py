"""fuseml._triton_key: Triton's installation hash read from disk instead of recomputed."""

from __future__ import annotations

import os
import sys

import pytest

import fuseml.ops  # noqa: F401  (installs the cached key)
from fuseml import _triton_key


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


def test_env_switch_is_validated(monkeypatch):
    monkeypatch.setenv("FUSEML_TRITON_KEY_CACHE", "yes")
    with pytest.raises(ValueError, match="FUSEML_TRITON_KEY_CACHE"):
        _triton_key.install()
    monkeypatch.setenv("FUSEML_TRITON_KEY_CACHE", "0")
    assert _triton_key.install() is False
