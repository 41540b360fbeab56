"""Lazy build and load of fuseml's CUDA C++ extension (``csrc/elementwise.cu``,
``csrc/softmax.cu`` and ``csrc/interaction.cu``, one library).

The extension registers ``torch.ops.fuseml.bias_act_cuda_out``::

    bias_act_cuda_out(Tensor x, Tensor? y, Tensor? bias, float alpha, int activation,
                      Tensor(a!) out) -> ()

which writes ``act(x + bias + alpha * y)`` into ``out`` (``activation``: a code of
``fuseml.ops._elementwise.ACTIVATIONS``); and ``torch.ops.fuseml.softmax_cuda_out``::

    softmax_cuda_out(Tensor x, bool log, Tensor(a!) out) -> ()

which writes the softmax (``log``: log-softmax) of each row of the 2-D ``x`` into ``out``;
and ``torch.ops.fuseml.embedding_interaction_cuda_out``::

    embedding_interaction_cuda_out(Tensor x, Tensor weight, Tensor table_offsets,
                                   Tensor ids, Tensor? bag_starts, bool self_interaction,
                                   Tensor(a!) out, Tensor(b!)? bad_ids) -> ()

which writes DLRM's ``[x, tril(Z Z^T), zeros]`` rows into ``out`` (see
``fuseml.ops.embedding_interaction``).

Importing this module is free: torch is imported, and nvcc runs, only on the first call
to :func:`status`, and the outcome, success or the reason
for failure, is cached for the life of the process. A failed build logs one warning.
The toolchain probes live here too (fuseml.runtime re-exports them), so that this module
needs nothing of fuseml but its settings and its file helper.

The eager fast path's launcher (``csrc/fastcall.cpp``, a library of its own) builds here
too: ``python -m fuseml._cuda_ext fastcall`` is the child process that
``fuseml.ops._fastcall`` starts to build it.

Loading a built library through ``torch.utils.cpp_extension`` costs a new process about
0.3-0.5 s before the first CUDA op runs (importing it imports setuptools, and its up-to-date
check runs ninja). So each successful load leaves a record,
``$FUSEML_CACHE/cuda-ext/<name>-<key>.json``: the library's path, size and modification
time, under a key of everything the build depends on (the contents of every file in
``csrc``, the compile flags, torch's, CUDA's and Python's versions, nvcc, CXX, the build
folder). A later process whose key and library file match loads the library directly;
any mismatch, or a failed direct load, takes the full path, which rebuilds where needed
and writes a new record.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from fuseml import settings
from fuseml._files import write_text_atomic

log = logging.getLogger("fuseml")

EXT_NAME = "fuseml_cuda_ext"
_CSRC = Path(__file__).resolve().parent / "csrc"
# Compiled as separate translation units (in parallel under ninja) into one library.
SOURCES = (_CSRC / "elementwise.cu", _CSRC / "softmax.cu", _CSRC / "interaction.cu")
OP_NAME = "fuseml::bias_act_cuda_out"
# The eager fast path's launcher (csrc/fastcall.cpp, a C++ file; see fuseml.ops._fastcall)
FASTCALL_NAME = "fuseml_fastcall"
FASTCALL_SOURCE = _CSRC / "fastcall.cpp"

_lock = threading.Lock()
_status: tuple[bool, str] | None = None
_build_seconds: float | None = None


def status() -> tuple[bool, str]:
    """(available, reason): builds and loads the extension on the first call only."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:  # another thread may have finished the build meanwhile
                _status = _build()
    return _status


def require(op: str) -> None:
    """Raise ValueError naming ``op`` unless the extension is loaded, building it first if
    no call in this process has yet.

    For the launch sites: a registered fuseml op (``torch.ops.fuseml.add(x, y, "cuda")``)
    can be called with impl ``"cuda"`` directly, without ``resolve_backend`` having built
    the extension, and ``torch.ops.fuseml.bias_act_cuda_out`` would then not exist.
    """
    ok, reason = status()
    if not ok:
        raise ValueError(f"{op}: backend='cuda' is unavailable here: {reason}")


def build_seconds() -> float | None:
    """Seconds the (successful) build and load took in this process, else None."""
    return _build_seconds


@functools.cache
def nvcc_path() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.exists(default) else None


@functools.cache
def ninja_available() -> bool:
    if shutil.which("ninja"):
        return True
    return importlib.util.find_spec("ninja") is not None


def cuda_toolchain_available() -> bool:
    """nvcc + ninja + a CUDA build of torch: what building the CUDA C++ twins needs."""
    import torch

    return nvcc_path() is not None and ninja_available() and torch.version.cuda is not None


# ----------------------------------------------------------------------------- internals
def _missing_toolchain() -> str | None:
    """What building the extension lacks here, or None when nothing is missing."""
    import torch

    if torch.version.cuda is None:
        return "torch is a CPU-only build (torch.version.cuda is None); a CUDA build of torch is needed"
    if cuda_toolchain_available():
        return None
    missing = []
    if nvcc_path() is None:
        missing.append("nvcc (install the CUDA toolkit, or set CUDA_HOME)")
    if not ninja_available():
        missing.append("ninja (pip install ninja)")
    return "cannot build the CUDA C++ extension, missing: " + (
        ", ".join(missing) or "part of the CUDA toolchain"
    )


def _arch_flag() -> str:
    """-gencode for sm_90 (the target), or for the current device when it is not 9.x."""
    import torch

    major, minor = (9, 0)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
    arch = "90" if major == 9 else f"{major}{minor}"
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def _libstdcxx_ldflags() -> list[str]:
    """Link against the shared libstdc++ this process already runs on.

    A relocated GCC (say CXX=/opt/gcc/bin/g++ whose own library folder holds only
    libstdc++.a) links a private static copy into the extension; its locale is never set
    up, so formatting a number into an error message (TORCH_CHECK(..., n)) segfaults.
    Naming the loaded libstdc++.so ahead of the driver's implicit -lstdc++ resolves every
    C++ runtime symbol to it. Elsewhere this is the library the driver would pick anyway.
    """
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5]).startswith("libstdc++.so"):
                    path = fields[5].strip()
                    if os.path.exists(path):
                        return [path]
    except OSError:  # not Linux: nothing to pin
        pass
    return []


def _ext_flags() -> dict:
    """The main extension's build arguments (an arch flag in extra_cuda_cflags also stops
    torch from adding its own: TORCH_CUDA_ARCH_LIST or every visible device's arch)."""
    return {
        "extra_cflags": ["-O3"],
        "extra_cuda_cflags": ["-O3", _arch_flag(), "-lineinfo"],
        "extra_ldflags": _libstdcxx_ldflags(),
    }


def _build() -> tuple[bool, str]:
    global _build_seconds
    missing = _missing_toolchain()
    if missing is not None:
        return False, missing
    start = time.perf_counter()
    flags = _ext_flags()
    key = build_key(EXT_NAME, flags)
    if load_recorded(EXT_NAME, key, python_module=False) is not None:
        _build_seconds = time.perf_counter() - start
        log.debug("loaded %s from its record in %.2f s", EXT_NAME, _build_seconds)
        return True, "ok"
    import torch
    from torch.utils import cpp_extension

    kwargs = {}
    try:
        ext_dir = settings.ext_dir()
        if ext_dir is not None:
            ext_dir = os.path.abspath(ext_dir)
            os.makedirs(ext_dir, exist_ok=True)
            kwargs["build_directory"] = ext_dir
        _warn_if_locked(ext_dir or _default_build_dir())
        before = set(torch.ops.loaded_libraries)
        cpp_extension.load(
            name=EXT_NAME,
            sources=[str(source) for source in SOURCES],
            is_python_module=False,
            verbose=False,
            **flags,
            **kwargs,
        )
        _build_seconds = time.perf_counter() - start
    except Exception as exc:  # a failed build must never break the other backends
        reason = f"building {EXT_NAME} failed: {_summarize(exc)}"
        log.warning("%s", reason)
        return False, reason
    loaded = [path for path in torch.ops.loaded_libraries - before if EXT_NAME in path]
    if len(loaded) == 1:
        record(EXT_NAME, key, loaded[0])
    log.debug("loaded %s in %.1f s", EXT_NAME, _build_seconds)
    return True, "ok"


# ---------------------------------------------------------------- records of built libraries
def build_key(name: str, flags: dict) -> str:
    """A hash of everything a build of ``name`` with ``flags`` depends on (module doc).

    The link flags are left out: they only pin the libstdc++ the building process has
    mapped, and which copy of it comes first differs between processes (the child that
    builds the fast path, a process that imported pyarrow first), so a key with them
    would miss the record of the same build."""
    import sys

    import torch

    flags = {k: v for k, v in flags.items() if k != "extra_ldflags"}
    h = hashlib.sha256()
    parts = (
        name, torch.__version__, str(torch.version.cuda), str(torch.version.git_version),
        sys.version, str(nvcc_path()), os.environ.get("CXX", ""),
        os.environ.get("TORCH_EXTENSIONS_DIR", ""), str(settings.ext_dir() or ""),
        json.dumps(flags, sort_keys=True),
    )  # fmt: skip
    for part in parts:
        h.update(part.encode() + b"\0")
    for path in sorted(_CSRC.iterdir()):  # sources and headers: an edit anywhere rebuilds
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _record_path(name: str, key: str) -> Path:
    return settings.cache_dir() / "cuda-ext" / f"{name}-{key}.json"


def record(name: str, key: str, library: str) -> None:
    """Note that the build of ``name`` under ``key`` is the file ``library`` (atomically;
    a record that cannot be written only costs the next process the full load)."""
    try:
        st = os.stat(library)
        entry = {"path": os.path.abspath(library), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        write_text_atomic(_record_path(name, key), json.dumps(entry))
    except OSError as err:
        log.debug("fuseml: no record of %s kept (%s)", name, err)


def load_recorded(name: str, key: str, python_module: bool):
    """Load the library the record of (``name``, ``key``) names, when that file is still
    the one recorded: the module (``python_module``) or the library's path; else None."""
    try:
        entry = json.loads(_record_path(name, key).read_text())
        path = entry["path"]
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) != (entry["size"], entry["mtime_ns"]):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        if python_module:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        import torch

        torch.ops.load_library(path)
        return path
    except Exception as exc:  # the full path builds and loads it again
        log.info("fuseml: loading %s from %s failed (%s); building it", name, path, exc)
        return None


def _default_build_dir() -> str | None:
    """torch's build folder for the extension (TORCH_EXTENSIONS_DIR or its cache), if known."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(EXT_NAME, verbose=False)
    except Exception:  # a private helper: its absence only costs the warning below
        return None


def _warn_if_locked(build_dir: str | None) -> bool:
    """Warn when the build folder holds torch's build lock before this process builds.

    torch waits, silently and for as long as the file exists, for whoever holds it to
    finish: a process killed while it built the extension leaves the file behind, and every
    later first call of a CUDA op then hangs. True if the lock file is there.
    """
    if build_dir is None:
        return False
    lock = os.path.join(build_dir, "lock")
    if not os.path.exists(lock):
        return False
    log.warning(
        "%s exists: another process is building the CUDA extension, or one was killed while "
        "building it. Waiting for it to go; if no build is running, delete that file.",
        lock,
    )
    return True


def _summarize(exc: BaseException, max_lines: int = 6) -> str:
    """The first line of a build error and its diagnostic lines, short enough to log.

    torch's message is "Error building extension 'x': [1/2] <nvcc command line>", then
    ninja's log; the compiler's and linker's diagnostics are the lines worth keeping.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0].split(": [", 1)[0]  # drop the echoed command line
    keys = ("error", "cannot find", "undefined", "not found", "no such file")
    found = [
        line
        for line in lines[1:]
        if not line.startswith("[") and any(key in line.lower() for key in keys)
    ]
    kept = [head[:300], *(line[:300] for line in found[: max_lines - 1])]
    return f"{type(exc).__name__}: " + " | ".join(kept)


# -------------------------------------------------------------------- the fast path's build
def fastcall_build_dir() -> str | None:
    """The fast path extension's build folder: FUSEML_EXT_DIR/fuseml_fastcall, else
    torch's (None where unknown)."""
    ext_dir = settings.ext_dir()
    if ext_dir is not None:
        return os.path.join(os.path.abspath(ext_dir), FASTCALL_NAME)
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(FASTCALL_NAME, verbose=False)
    except Exception:  # a private helper: its absence only costs a lock warning
        return None


def _fastcall_flags() -> dict:
    return {"extra_cflags": ["-O3"], "extra_ldflags": _libstdcxx_ldflags()}


def load_fastcall_recorded():
    """The fast path's module, loaded from its record (see the module doc), else None."""
    flags = _fastcall_flags()
    return load_recorded(FASTCALL_NAME, build_key(FASTCALL_NAME, flags), python_module=True)


def load_fastcall():
    """Build (where not up to date) and load the fast path's extension module."""
    from torch.utils import cpp_extension

    kwargs = {}
    if settings.ext_dir() is not None:
        kwargs["build_directory"] = fastcall_build_dir()
        os.makedirs(kwargs["build_directory"], exist_ok=True)
    flags = _fastcall_flags()
    # (csrc/fastcall_plan.h: ninja's dependency file rebuilds the source when it changes)
    module = cpp_extension.load(
        name=FASTCALL_NAME,
        sources=[str(FASTCALL_SOURCE)],
        with_cuda=True,
        verbose=False,
        **flags,
        **kwargs,
    )
    if getattr(module, "__file__", None):
        record(FASTCALL_NAME, build_key(FASTCALL_NAME, flags), module.__file__)
    return module


def _main(argv: list[str]) -> int:
    """``python -m fuseml._cuda_ext fastcall``: build the fast path's extension (the child
    process fuseml.ops._fastcall starts); exit status 1 with the reason on failure."""
    import sys

    if argv != ["fastcall"]:
        print("usage: python -m fuseml._cuda_ext fastcall", file=sys.stderr)
        return 2
    missing = _missing_toolchain()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 1
    try:
        load_fastcall()
    except Exception as exc:
        print(_summarize(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
