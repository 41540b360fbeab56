"""Where the first call of a fresh process goes once the caches are warm (diagnosis).

    PYTHONPATH=src python scripts/probe_first_call.py [PROBLEM]

Runs the tuning suite's child process twice on fresh temporary caches: cold (fills the
fuseml tuning cache and Triton's kernel cache), then warm under cProfile, whose top
entries by cumulative time are printed with the warm first-call time. Both children also
log each Triton kernel they specialise (in-memory cache miss: name, signature and
constexprs) and each one they compile to a cubin (a miss in Triton's disk cache too), so a
warm call that compiles shows which kernel and specialisation it was; also any compiled
kernel that fails to load, and fuseml's debug log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from fuseml.bench.suites.tuning import PROBLEMS, child_env

# Installed in each child before fuseml runs: stderr lines "jit miss: ...", "cubin: ...",
# "load failed: ...", "cache key: ..." (the disk key of each compile, in parts), "fn keys:
# ..." (at exit) and fuseml's debug log.
HOOKS = """
import atexit
import hashlib
import logging
import sys
import threading
import traceback
from pathlib import Path
from triton import knobs
from triton.compiler import CompiledKernel

_fuseml_log = logging.getLogger("fuseml")
_fuseml_log.setLevel(logging.DEBUG)
_fuseml_log.addHandler(logging.StreamHandler(sys.stderr))
_init = CompiledKernel._init_handles

def _init_logged(self):
    try:
        return _init(self)
    except Exception as err:
        print("load failed:", self.name, type(err).__name__, str(err)[:300], file=sys.stderr)
        raise

CompiledKernel._init_handles = _init_logged
from triton.backends.nvidia.compiler import CUDABackend

def _miss(*args, **kw):
    c = kw.get("compile") or {}
    keep = ("constants", "configs", "num_warps", "num_stages", "launch_pdl", "key")
    seen = {k: c[k] for k in keep if k in c}
    name = kw.get("fn").name if kw.get("fn") else "?"
    print("jit miss:", name, seen, file=sys.stderr)
    if "lora" in name:  # where the LoRA kernel's specializations come from (fuseml frames)
        frames = [f for f in traceback.extract_stack() if "fuseml" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
        print("jit miss at:", threading.current_thread().name, where, file=sys.stderr)
    return None

knobs.runtime.jit_cache_hook = _miss
_make_cubin = CUDABackend.make_cubin

def _cubin(self, src, metadata, *rest):
    print("cubin:", metadata.get("name"), file=sys.stderr)
    return _make_cubin(self, src, metadata, *rest)

CUDABackend.make_cubin = _cubin
import triton.compiler.compiler as _cc
_get_key = _cc.get_cache_key

def _short(v):
    return hashlib.sha256(str(v).encode()).hexdigest()[:10]

def _key(src, backend, options, env_vars):
    # Triton's disk-cache key of each compile, in parts: which part differs between two
    # processes that compile the same specialization
    key = _get_key(src, backend, options, env_vars)
    fn = getattr(src, "fn", None)
    if fn is not None:
        parts = {
            "key": _short(key), "triton": _short(key.split("-")[0]), "fn": fn.cache_key[:10],
            "attrs": _short(src.attrs), "sig": _short(sorted(src.signature.items())),
            "consts": _short(sorted(src.constants.items(), key=str)),
            "options": _short(options.hash()), "env": _short(sorted(env_vars.items())),
        }
        print("cache key:", fn.__name__, threading.current_thread().name, parts, file=sys.stderr)
    return key

_cc.get_cache_key = _key

def _fn_keys():
    from triton.runtime.jit import JITFunction
    import fuseml.ops._gemm as g
    keys = {n: v.cache_key[:10] for n, v in vars(g).items() if isinstance(v, JITFunction)}
    print("fn keys:", keys, file=sys.stderr)

atexit.register(_fn_keys)
"""


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "linear 512->256, M 64, relu"
    spec = PROBLEMS[name]
    code = f"import sys; exec({HOOKS!r}); from fuseml.bench.suites.tuning import child; child(sys.argv[1])"
    with tempfile.TemporaryDirectory() as tmp:
        env = child_env(f"{tmp}/f", f"{tmp}/t", f"{tmp}/py")  # as the tuning suite's children
        for label, extra in (("cold", {}), ("warm", {"FUSEML_TUNING_PROFILE": "12"})):
            proc = subprocess.run(
                [sys.executable, "-c", code, json.dumps(spec)],
                env={**env, **extra}, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            print(f"== {label}: {name}")
            print(proc.stdout.strip())
            marks = ("jit miss", "cubin:", "load failed:", "fuseml", "cache key:", "fn keys:")
            log = [ln for ln in proc.stderr.splitlines() if ln.startswith(marks)]
            print("\n".join(log))
            if label == "warm" or proc.returncode:  # the rest (profile, errors), once
                rest = [ln for ln in proc.stderr.splitlines() if not ln.startswith(marks)]
                print("\n".join(rest)[-12000:])


if __name__ == "__main__":
    main()
