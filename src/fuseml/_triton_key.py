"""Triton's installation hash, kept on disk so a new process does not recompute it.

Before a process's first kernel launch can look up its compiled binary in Triton's cache,
Triton computes ``triton_key()``: a SHA-256 of its compiler and language sources and of
the whole ``libtriton`` shared library (hundreds of MB), importing every Triton submodule
on the way. On an H100 host that is 0.34 s of hashing plus 0.10 s of imports in every
process, most of the first call of a layer whose tuning and kernels are already on disk.

The key depends only on those files, so fuseml keeps it per *fingerprint* of them (path,
size and modification time of every file the hash reads: one ``stat`` each, a few ms):

    $FUSEML_CACHE/triton-key/<fingerprint>.txt

A reinstall or an edit changes the fingerprint and the key is computed again by Triton's
own function. Triton's own parallel-compile helpers replace ``triton_key`` the same way.
This is opt-in (``fuseml.runtime.enable_triton_key_cache()``, which the command line
calls): importing fuseml leaves Triton's function, and every module bound to it, alone.

The other half of a kernel's disk-cache key is its function key (``JITFunction.cache_key``:
its source and those of the functions it calls, and the global constexprs they read). Up
to Triton 3.6 a caller's key takes in a callee's global constexprs only where the callee's
own key was computed first, so the key of the same kernel depends on which kernel a
process hashed first: on an H100 host with triton 3.6, ``_lora_tma_kernel``'s key differed
between a process whose first launch was the TMA kernel and one whose first was the
pointer kernel (``_gemm_body`` and ``_tma_body`` read ``PREFETCH`` / ``TILE_SHORTCUT``).
A process then missed every kernel another process had compiled: the warm first call of
a LoRA layer compiled its kernel again (0.3 s). ``settle_function_keys`` computes every
fuseml kernel's key once at import, callees before callers, which is the order later
Tritons' keys do not depend on.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import re
import sys
import sysconfig
from pathlib import Path

from fuseml import settings
from fuseml._files import write_text_atomic

log = logging.getLogger("fuseml")

# Where Triton defines triton_key (it moved between versions).
_DEFINERS = ("triton.runtime.cache", "triton.compiler.compiler")


def enabled() -> bool:
    """True once :func:`install` has routed this process's triton_key through the disk."""
    return _installed is not None


_installed = None  # the replacement function, once installed


def fingerprint(triton_dir: Path, defining_file: Path) -> str:
    """sha256 over (path, size, mtime) of every file Triton's key hashes."""
    files = [defining_file]
    for sub in ("compiler", "backends", "language"):
        for root, dirs, names in os.walk(triton_dir / sub):
            dirs.sort()
            files += [Path(root) / n for n in sorted(names) if n.endswith(".py")]
    ext = (sysconfig.get_config_var("EXT_SUFFIX") or ".so").split(".")[-1]
    files.append(triton_dir / "_C" / f"libtriton.{ext}")
    h = hashlib.sha256()
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _cache_file(fp: str) -> Path:
    return settings.cache_dir() / "triton-key" / f"{fp}.txt"


def install() -> bool:
    """Route Triton's triton_key() through the on-disk copy. Idempotent; True if installed."""
    global _installed
    original = None
    defining = None
    for name in _DEFINERS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        fn = getattr(mod, "triton_key", None)
        if fn is None:
            continue
        if getattr(fn, "_fuseml_cached", False):
            _installed = fn
            return True
        if getattr(fn, "__module__", None) == name:  # the defining module, not an import
            original, defining = fn, mod
            break
    if original is None:
        log.info("fuseml: Triton has no triton_key() here; its installation hash is not cached")
        return False
    triton_dir = Path(importlib.import_module("triton").__file__).parent
    defining_file = Path(defining.__file__)

    @functools.lru_cache
    def cached_key() -> str:
        try:
            path = _cache_file(fingerprint(triton_dir, defining_file))
            if path.is_file():
                key = path.read_text()
                if key:
                    return key
        except OSError:
            path = None
        key = cached_key.original()  # Triton's own function (an attribute: tests stub it)
        if path is not None:
            try:
                write_text_atomic(path, key)  # a reader sees no key or the whole key
            except OSError as err:
                log.warning("fuseml: could not keep Triton's key in %s (%s)", path, err)
        return key

    cached_key._fuseml_cached = True
    cached_key.original = original
    # Every loaded Triton module that bound the function by name (``from .cache import
    # triton_key``); modules imported later bind the replacement.
    for name, mod in list(sys.modules.items()):
        if name.startswith("triton") and getattr(mod, "triton_key", None) is original:
            mod.triton_key = cached_key
    _installed = cached_key
    return True


def uninstall() -> None:
    """Give every Triton module its own triton_key back (tests; the reverse of install)."""
    global _installed
    if _installed is None:
        return
    for name, mod in list(sys.modules.items()):
        if name.startswith("triton") and getattr(mod, "triton_key", None) is _installed:
            mod.triton_key = _installed.original
    _installed = None


def settle_function_keys(prefix: str = "fuseml.") -> list[str]:
    """Compute the function key of every Triton kernel and helper in the loaded modules
    named ``prefix*``, each after those of the functions it calls (see the module
    docstring); returns their qualified names in that order. Keys already computed stay
    as they are (Triton keeps each), so call this before any launch. Under the interpreter
    (no compiled functions) it does nothing."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    found = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith(prefix) and mod is not None:
            for value in vars(mod).values():
                if isinstance(value, JITFunction):
                    found.setdefault(id(value), value)
    order: list[str] = []
    seen: set[int] = set()

    def settle(fn) -> None:
        if id(fn) in seen:
            return
        seen.add(id(fn))  # (before its callees: a cycle ends here)
        for word in sorted(set(re.findall(r"[A-Za-z_]\w*", getattr(fn, "src", "") or ""))):
            callee = fn.__globals__.get(word)
            if isinstance(callee, JITFunction):
                settle(callee)
        _ = fn.cache_key  # computed here, kept by Triton
        order.append(f"{fn.__module__}.{fn.__name__}")

    for fn in found.values():
        settle(fn)
    return order
