"""The eager fast path: repeat calls of the elementwise ops, the on-chip softmax, the plain
16-bit linear layer (any of its main loops, the TMA loop's host tensor descriptors and a
padded K included) and the one-adapter LoRA layer (in-loop on the pointer kernel, or the
joint launch) launched from C++ (``csrc/fastcall.cpp``); ``backend="cuda"`` calls of the
elementwise ops and the softmax reach their CUDA C++ twin's op from C++ (``call_twin``).

A fuseml call planned in Python costs several times torch's own call on the host
(validation, plan lookup, Triton's launcher). The Python path stays the one that decides:
after each direct launch it hands the plan to the C++ side (:func:`register`), which keeps
it only when the arguments it recomputes from the same tensors equal the ones Python
passed and the compiled function's parameters have the sizes it will write. A later call
with the same signature (op, dtype, sizes, device, alignment, FUSEML_PDL) is then one
lookup, an allocation and ``cuLaunchKernelEx``; anything else the C++ side does not vouch
for returns None and takes the Python path.

The extension builds in the background the first time a direct launch happens (a C++
file, built by a child process that finishes even if this one exits; cached across
processes, and loaded straight from its record once built: ``fuseml._cuda_ext``), so no
call waits for it: calls take the Python path until it is loaded.
``FUSEML_DIRECT_LAUNCH=0`` turns it off with the direct launches. A failed build logs one warning; every call then stays on the Python path, with
the same results. Inside ``with suspended():`` every call takes the Python path (tests of
that path's plans and launches).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from fuseml import _cuda_ext

log = logging.getLogger("fuseml")

EXT_NAME = _cuda_ext.FASTCALL_NAME

# Ops and parameter kinds, as csrc/fastcall.cpp numbers them.
ELEMENTWISE, SOFTMAX_ROWS, GEMM, LORA = 0, 1, 2, 3
_KINDS = {"i32": 1, "i64": 2, "fp32": 3}
DESCRIPTOR = 4  # a host tensor descriptor's CUtensorMap

compiling = torch.compiler.is_compiling


def usable(backend: str) -> bool:
    """May a public call with this ``backend`` try the fast path? The backends whose CUDA
    calls run the Triton kernels (under torch.compile ``loaded()`` is None already)."""
    return backend == "auto" or backend == "triton"


def entry(fast, backend: str):
    """The fast call an elementwise or softmax call with this ``backend`` tries, or None:
    ``fast.call`` (the Triton kernels' plans) for auto and triton, ``fast.call_twin`` (the
    CUDA C++ twin's op, called from C++) for cuda. Both take (op, code, x, y, bias, alpha,
    dim) and return the output, or None for the Python path."""
    if usable(backend):
        return fast.call
    return fast.call_twin if backend == "cuda" else None


fast = None  # the loaded extension: ``fast.call(op, code, x, y, bias, alpha, dim)``


def loaded():
    """``fast`` for a public call to try, or None under torch.compile, which traces the
    public functions: the fast call must stay out of its graphs, and a global read there
    becomes a guard on its value, which a module object cannot be (compilation fails)."""
    return None if compiling() else fast


_loaded = None  # the same, also while suspended()
_suspended = 0  # suspended() blocks open
_started = False
_done = threading.Event()
_lock = threading.Lock()
_reason: str | None = None  # why the fast path is off, once known
# why the C++ side turned plans down -> (op, code, dtype, shape) of the first such call
refusals: dict = {}


def start() -> None:
    """Build and load the extension in the background (once per process)."""
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        _started = True
    threading.Thread(target=_build, name="fuseml-fastcall-build", daemon=True).start()


def wait(timeout: float | None = None) -> bool:
    """Start the build if needed and wait for it: True when the fast path is loaded."""
    start()
    _done.wait(timeout)
    return _loaded is not None


@contextlib.contextmanager
def suspended():
    """Inside the block every call takes the Python path (for tests and measurements of
    that path; a build that finishes meanwhile takes effect after the block)."""
    global fast, _suspended
    with _lock:
        _suspended += 1
        fast = None
    try:
        yield
    finally:
        with _lock:
            _suspended -= 1
            if not _suspended:
                fast = _loaded


def status() -> tuple[bool, str]:
    """(loaded, reason it is not): for ``fuseml env`` and tests; does not start a build."""
    if _loaded is not None:
        return True, "ok"
    if not _started:
        return False, "not built yet (builds on the first direct launch)"
    return False, _reason or "building"


def _build() -> None:
    global fast, _loaded, _reason
    try:
        missing = _cuda_ext._missing_toolchain()
        if missing is not None:
            _reason = missing
            log.info("fuseml: eager fast path off: %s", missing)
            return
        start_time = time.perf_counter()
        module = _cuda_ext.load_fastcall_recorded()  # (built by an earlier process)
        if module is None:
            why = _build_apart()
            if why is not None:
                raise RuntimeError(why)
            # (the child recorded its build; torch's loader is the fallback)
            module = _cuda_ext.load_fastcall_recorded() or _cuda_ext.load_fastcall()
        with _lock:
            _loaded = module
            if not _suspended:
                fast = module
        log.debug("fuseml: eager fast path loaded in %.1f s", time.perf_counter() - start_time)
    except Exception as exc:  # the Python path serves every call without it
        _reason = f"building {EXT_NAME} failed: {_cuda_ext._summarize(exc)}"
        log.warning("fuseml: eager fast path off: %s", _reason)
    finally:
        _done.set()


def _build_apart() -> str | None:
    """Build the extension in a process of its own (``python -m fuseml._cuda_ext
    fastcall``); None when it is built, else the build's last error line.

    A build that outlives this process (a short program that exits while it builds)
    finishes and releases torch's build lock; killed halfway in a thread of this process,
    it would leave the lock behind and every later process's build would wait on it."""
    root = str(Path(_cuda_ext.__file__).resolve().parents[1])  # (the fuseml this runs)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    _cuda_ext._warn_if_locked(_cuda_ext.fastcall_build_dir())
    done = subprocess.run(
        [sys.executable, "-m", "fuseml._cuda_ext", "fastcall"],
        env=env, capture_output=True, text=True, start_new_session=True, check=False,
    )  # fmt: skip
    if done.returncode == 0:
        return None
    lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def register(
    op: int, code: int, x, y, bias, out, alpha: float, ck, grid, options, args, lora=(None, None)
) -> None:
    """Offer the C++ side the plan of the direct launch just made: ``ck`` (the compiled
    kernel) launched on ``grid`` with ``options`` and ``args`` (every argument in the
    kernel's order, constexprs included), for the call (op, code, x, y, bias, alpha) whose
    output is ``out``; ``lora``: (A, B) of a LORA call (alpha its scaling). Builds the
    extension on first use; a no-op until it is loaded."""
    if fast is None:
        start()
        return
    offer = _offer(ck, args)
    if offer is None:
        return
    positions, kinds, passed = offer
    why = fast.register_plan(
        op, code, x, y, bias, out, float(alpha), ck.function, _grid3(grid),
        options["num_warps"], ck.metadata.shared, bool(options.get("launch_pdl", False)),
        positions, kinds, passed, *lora,
    )  # fmt: skip
    _refused(why, op, code, x)


def register_gemm(
    code: int, x, weight, bias, out, alpha: float, ck, grid, options, args, used=None
) -> None:
    """Offer the C++ side the plan of a plain linear layer's launch just made (pointer,
    streaming or TMA kernel: ``ck`` on ``grid`` with ``options`` and ``args``, the TMA
    kernel's host descriptors among them) for the call (code, x, weight, bias, alpha) whose
    output is ``out``. used: (x, W) zero-padded to the K the launch ran at, where it did
    (W's copy the one kept per tensor and version). A no-op until the extension is loaded."""
    if fast is None:
        start()
        return
    descs = [a for a in args if _is_descriptor(a)]
    offer = _offer(ck, args, expand_descriptors=bool(descs))
    if offer is None:
        return
    specs = []
    if descs:
        specs = _descriptor_specs(ck, args)
        if not specs:
            _refused("host descriptors in a form fastcall.cpp does not encode", GEMM, code, x)
            return
    positions, kinds, passed = offer
    out_desc = bool(descs) and descs[-1].base is out  # (else the kernel stores by pointer)
    x_used, w_used = (None, None) if used is None else used
    why = fast.register_gemm_plan(
        code, x, weight, bias, out, float(alpha), ck.function, _grid3(grid),
        options["num_warps"], ck.metadata.shared, bool(options.get("launch_pdl", False)),
        positions, kinds, passed, specs, out_desc, x_used, w_used,
    )  # fmt: skip
    _refused(why, GEMM, code, x)


def register_joint(
    code: int, x, weight, bias, out, scaling: float, lora_a, lora_b, xs, sync, split: int,
    n_shrink: int, ck, grid, options, args,
) -> None:  # fmt: skip
    """Offer the C++ side the plan of the one-adapter joint LoRA launch just made (``ck``
    on ``grid`` with ``options`` and ``args``, its four host descriptors among them; xs
    and sync the buffers it used, split the K split of xs). A no-op until the extension
    is loaded, and for a kernel whose descriptors Triton does not encode on the host."""
    if fast is None:
        start()
        return
    offer = _offer(ck, args, expand_descriptors=True)
    if offer is None:
        return
    specs = _descriptor_specs(ck, args)
    if not specs:
        _refused("host descriptors in a form fastcall.cpp does not encode", LORA, code, x)
        return
    positions, kinds, passed = offer
    why = fast.register_joint_plan(
        code, x, weight, bias, out, float(scaling), lora_a, lora_b, xs, sync, split, n_shrink,
        ck.function, _grid3(grid), options["num_warps"], ck.metadata.shared, positions, kinds,
        passed, specs,
    )  # fmt: skip
    _refused(why, LORA, code, x)


def _offer(ck, args, expand_descriptors: bool = False) -> tuple[list, list, list] | None:
    """(positions, kinds, the values Python passed) of the compiled kernel's parameters for
    a launch with ``args`` (see _layout), or None for a kernel the C++ side cannot launch."""
    key = (ck, expand_descriptors)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = _layout(ck, len(args), expand_descriptors)
    if not layout:
        return None
    positions, kinds = layout
    flat = _expanded(args) if expand_descriptors else args
    return positions, kinds, [flat[p] for p in positions]


def _grid3(grid) -> list:
    return [grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1]


def _refused(why: str, op: int, code: int, x) -> None:
    """Keep (and log once) why the C++ side turned a plan down; "" when it kept it."""
    if why and why not in refusals and len(refusals) < 64:
        refusals[why] = (op, code, x.dtype, tuple(x.shape))
        log.debug("fuseml: fast path not taken for op %d %s: %s", op, tuple(x.shape), why)


def _is_descriptor(arg) -> bool:
    return type(arg).__name__ == "TensorDescriptor"


def _expanded(args) -> list:
    """The arguments with each host descriptor spread as Triton's launcher passes it: the
    descriptor, its shape, its strides."""
    flat = []
    for a in args:
        flat.extend([a, *a.shape, *a.strides] if _is_descriptor(a) else [a])
    return flat


def _descriptor_specs(ck, args) -> list | None:
    """Per host descriptor of the launch, in order: (CUtensorMap data type, swizzle,
    padding, box rows, box columns) as the compiled kernel's launcher encodes it, or None
    where this triton does not say (no descriptor metadata, or forms the C++ side does not
    encode: im2col, fp4 padding, tf32 rounding, not 2-D). The box is the metadata's, not
    the descriptor's block: the compiler narrows it to the swizzle's width (a 128 x 128
    bf16 block loads as two 128 x 64 boxes), and the kernel issues its loads that way."""
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:
        return None
    metas = getattr(ck.metadata, "tensordesc_meta", None)
    descs = [a for a in args if _is_descriptor(a)]
    if not metas or len(metas) != len(descs):
        return None
    specs = []
    for desc, meta in zip(descs, metas):
        block = list(meta["block_size"])
        if (
            meta.get("fp4_padded") or meta.get("is_im2col")
            or getattr(desc, "round_f32_to_tf32", False) or len(block) != 2
            or len(desc.block_shape) != 2
        ):  # fmt: skip
            return None
        padding = 1 if getattr(desc, "padding", "zero") == "nan" else 0
        elem = TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]
        specs.append([int(elem), int(meta["swizzle"]), padding, int(block[0]), int(block[1])])
    return specs


_LAYOUTS: dict = {}  # (compiled kernel, expand_descriptors) -> _layout(...)


def _layout(ck, n_args: int, expand_descriptors: bool = False) -> tuple[list, list] | tuple[()]:
    """(positions, kinds) of the compiled kernel's non-constexpr parameters among its
    ``n_args`` arguments, or () for a kernel the C++ side cannot launch (scratch memory,
    clusters, tuples, other parameter types). expand_descriptors: a 2-D host descriptor
    (``tensordesc<...>``) takes 5 positions of the expanded arguments (``_expanded``), as
    Triton's launcher passes it: the CUtensorMap, its shape (int32), its strides (int64)."""
    meta = ck.metadata
    if (
        getattr(meta, "global_scratch_size", 0)
        or getattr(meta, "profile_scratch_size", 0)
        or getattr(meta, "num_ctas", 1) != 1
        or getattr(meta, "launch_cooperative_grid", False)
    ):
        return ()
    signature = list(getattr(ck.src, "signature", {}).values())
    if len(signature) != n_args:
        return ()
    positions, kinds = [], []
    pos = 0
    for ty in signature:
        if expand_descriptors and isinstance(ty, str) and ty.startswith("tensordesc"):
            if ty.count(",") != 1:  # (2-D only)
                return ()
            positions.extend(range(pos, pos + 5))
            kinds.extend([DESCRIPTOR, _KINDS["i32"], _KINDS["i32"], _KINDS["i64"], _KINDS["i64"]])
            pos += 5
            continue
        if ty != "constexpr":
            kind = (0 if ty.startswith("*") else _KINDS.get(ty)) if isinstance(ty, str) else None
            if kind is None:
                return ()
            positions.append(pos)
            kinds.append(kind)
        pos += 1
    return positions, kinds
