"""Suite ``tuning``: the first call of a new shape bucket in a fresh process, when fuseml
tunes the GEMM's tile, and the same first call once the tuning cache is on disk.

Targets (issue 5): cold under 10 s; with the persisted cache under 0.2 s.

Every measurement is a new Python process (this interpreter, this environment) that puts
its inputs on the GPU and synchronizes (CUDA context and allocator up: a real first call
finds them so), then times one fuseml call to its end (torch.cuda.synchronize), and then a
second call of the same shape. The caches are temporary folders, fresh for every run:

  cold   empty FUSEML_CACHE and empty TRITON_CACHE_DIR: Triton compiles every
         candidate config (and its launcher), fuseml times them and writes the winner.
         The first call on a machine that has never run these kernels.
  tune   empty FUSEML_CACHE, the Triton cache the cold process filled: the tuning
         alone (compiled kernels come from disk). A new shape bucket on a machine that
         has compiled these kernels before.
  warm   the cold process's FUSEML_CACHE and Triton cache: the persisted entry is read,
         and nothing should be tuned or compiled. A fresh process with the persisted cache.

Python bytecode: an installed package has it (pip writes it on install), so a fresh
process does not compile Triton's Python sources. Where this environment forbids writing
it (PYTHONDONTWRITEBYTECODE, as on a machine whose Triton ships without it), the children
keep it in a folder of the run instead (PYTHONPYCACHEPREFIX): cold writes it, tune and
warm read it. Without that every child compiled them again: 0.15 s for the
``triton.experimental.gluon`` import alone (H100 host), which Triton makes in a first
launch.

Rows have mode "wall": p50_ms is the median first-call time over the runs (quick 1, full
3), p20_ms / p80_ms the fastest / slowest run, second_call_ms the median second call,
tuned_entries the entries the process added to the tuning cache (0 when warm),
built_entries the most entries a run's first call added to Triton's cache (kernels or
launchers compiled there: 0 when warm finds everything on disk), and meets_target whether
the median is under the target above.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fuseml.bench.harness import Case

DTYPE = "bfloat16"
PROBLEMS = {
    "linear 4096->4096, M 4096, gelu_tanh": {
        "op": "linear", "m": 4096, "k": 4096, "n": 4096, "act": "gelu_tanh"},
    "linear 512->256, M 64, relu": {"op": "linear", "m": 64, "k": 512, "n": 256, "act": "relu"},
    "lora_linear 4096->4096 r16, M 4096": {"op": "lora", "m": 4096, "k": 4096, "n": 4096,
                                            "rank": 16},
    # Decode-like rows on Hopper tune three launches (in-loop GEMM, shrink, expand GEMM)
    # and time both LoRA modes on the first call
    "lora_linear 4096->4096 r16, M 1": {"op": "lora", "m": 1, "k": 4096, "n": 4096,
                                         "rank": 16},
    "mlp 13-512-256-64-16, B 4096": {"op": "mlp", "m": 4096, "widths": [13, 512, 256, 64, 16]},
}  # fmt: skip
QUICK = [
    "linear 4096->4096, M 4096, gelu_tanh", "linear 512->256, M 64, relu",
    "lora_linear 4096->4096 r16, M 1",
]  # fmt: skip
ARMS = {"cold": ("a", "triton"), "tune": ("b", "triton"), "warm": ("a", "triton")}
TARGET_MS = {"cold": 10_000.0, "tune": 10_000.0, "warm": 200.0}
CHILD_TIMEOUT_S = 300
_MARK = "fuseml-tuning-result: "


# ------------------------------------------------------------------------- child side
def _problem(spec: dict, device: str):
    """A no-argument function making one fuseml call on fresh bf16 inputs."""
    import torch

    import fuseml
    from fuseml.bench.suites._common import linear_params

    dtype = getattr(torch, DTYPE)
    m = spec["m"]
    if spec["op"] == "mlp":
        widths = spec["widths"]
        x = torch.randn(m, widths[0], device=device, dtype=dtype)
        params = [linear_params(n, k, dtype, device) for k, n in itertools.pairwise(widths)]
        ws, bs = [w for w, _ in params], [b for _, b in params]
        return lambda: fuseml.ops.mlp(x, ws, bs, "relu", backend="triton")
    x = torch.randn(m, spec["k"], device=device, dtype=dtype)
    w, b = linear_params(spec["n"], spec["k"], dtype, device)
    if spec["op"] == "linear":
        return lambda: fuseml.ops.linear(x, w, b, spec["act"], backend="triton")
    r = spec["rank"]
    a = torch.randn(r, spec["k"], device=device, dtype=dtype) / spec["k"] ** 0.5
    bb = torch.randn(spec["n"], r, device=device, dtype=dtype) / r**0.5
    return lambda: fuseml.ops.lora_linear(x, w, b, a, bb, 2.0, backend="triton")


def child(spec_json: str) -> None:
    """Run in the fresh process: print one result line (see _run_child)."""
    import torch

    from fuseml.ops import _tune

    fn = _problem(json.loads(spec_json), "cuda")
    torch.cuda.synchronize()
    before, _ = _tune.entry_count()
    built_before = _triton_entries()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    built = _triton_entries() - built_before
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    added = _tune.entry_count()[0] - before
    result = {"first_s": first, "second_s": second, "tuned_entries": added, "built": built}
    print(_MARK + json.dumps(result))


def _triton_entries() -> int:
    """Entries (one folder per compiled kernel or launcher) in this process's Triton cache
    (TRITON_CACHE_DIR, which the parent sets); 0 where there is none yet."""
    folder = os.environ.get("TRITON_CACHE_DIR")
    try:
        return len(os.listdir(folder)) if folder else 0
    except OSError:
        return 0


# ------------------------------------------------------------------------ parent side
class ChildFailed(RuntimeError):
    pass


def child_env(fuseml_cache: str, triton_cache: str, pycache: str) -> dict[str, str]:
    """The environment of a child process: these cache folders, tuning on, this fuseml,
    compiled Triton, bytecode in ``pycache`` where writing it is forbidden (docstring)."""
    import fuseml

    src = str(Path(fuseml.__file__).resolve().parents[1])  # this fuseml, wherever it lives
    env = dict(os.environ, FUSEML_CACHE=fuseml_cache, TRITON_CACHE_DIR=triton_cache,
               FUSEML_AUTOTUNE="1")  # fmt: skip
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        env["PYTHONPYCACHEPREFIX"] = pycache
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.pop("TRITON_INTERPRET", None)
    return env


def _run_child(spec: dict, fuseml_cache: str, triton_cache: str, pycache: str) -> dict:
    env = child_env(fuseml_cache, triton_cache, pycache)
    code = "import sys; from fuseml.bench.suites.tuning import child; child(sys.argv[1])"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(spec)],
            env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        raise ChildFailed(f"no result within {CHILD_TIMEOUT_S} s") from err
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise ChildFailed(f"exit {proc.returncode}: " + " | ".join(tail))


def measure(spec: dict, runs: int) -> dict[str, dict]:
    """arm -> row fields, ``runs`` runs each with fresh cache folders."""
    samples: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    errors: dict[str, str] = {}
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="fuseml-tuning-") as tmp:
            for arm, (fuseml_dir, triton_dir) in ARMS.items():  # in order: cold fills
                try:
                    got = _run_child(
                        spec, f"{tmp}/{fuseml_dir}", f"{tmp}/{triton_dir}", f"{tmp}/pycache"
                    )
                except ChildFailed as err:
                    errors[arm] = str(err)
                    continue
                samples[arm].append(got)
    out = {}
    for arm, got in samples.items():
        fields: dict = {"mode": "wall", "runs": len(got), "target_ms": TARGET_MS[arm]}
        if arm in errors:
            fields["error"] = errors[arm]
        if got:
            first = sorted(s["first_s"] * 1e3 for s in got)
            p50 = statistics.median(first)
            fields.update(
                p50_ms=round(p50, 3), p20_ms=round(first[0], 3), p80_ms=round(first[-1], 3),
                second_call_ms=round(statistics.median(s["second_s"] * 1e3 for s in got), 3),
                tuned_entries=max(s["tuned_entries"] for s in got),
                built_entries=max(s.get("built", 0) for s in got),
                meets_target=p50 < TARGET_MS[arm],
            )  # fmt: skip
        out[arm] = fields
    return out


def cases(quick: bool = False, cuda: bool = True):
    for name in QUICK if quick else PROBLEMS:
        spec = PROBLEMS[name]
        yield Case(
            suite="tuning",
            name=name,
            params={
                "op": spec["op"],
                "problem": name,
                "dtype": DTYPE,
                "m": spec["m"],
                "numel": spec["m"],
            },
            make_inputs=tuple,
            arms={},
            check=False,
            measure=lambda settings, spec=spec: measure(spec, 1 if settings.quick else 3),
        )


PLOT = None  # a table says it all
README = {
    "mode": "wall",
    "rows": ("problem",),
    "arms": tuple(ARMS),
    "unit": "s",
    "compare": False,
    "ceilings": False,
    "note": (
        "Cells: wall time of the first fuseml call of a new shape bucket in a fresh process "
        "(inputs already on the GPU), median over runs with fresh cache folders. cold: empty "
        "tuning and Triton caches (compiles and tunes every candidate); tune: empty tuning "
        "cache, Triton kernels on disk (tuning alone); warm: the persisted tuning cache "
        "(nothing should be tuned or compiled: the rows' built_entries count the Triton "
        "cache entries a first call added). Python bytecode as an installed package has it "
        "(kept in the run's folder where the environment forbids writing it; see the suite's "
        "docstring). Targets: cold under 10 s, warm under 0.2 s."
    ),
}
