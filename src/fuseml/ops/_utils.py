"""Shared helpers for the fused ops: validation, 2-D views, launch heuristics."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fuseml import settings
from fuseml.runtime import FLOAT_DTYPES, log, triton_interpreting


# --------------------------------------------------------------------------- validation
def check_tensor(op: str, name: str, t, *, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype in ({allowed}), got {t.dtype}")
    return t


def check_same(op: str, ref_name: str, ref: torch.Tensor, name: str, t: torch.Tensor) -> None:
    """``t`` must be on the same device and have the same dtype as ``ref``."""
    if t.device != ref.device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
            "all tensors must be on one device"
        )
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
            "mixed dtypes are not supported (cast first)"
        )


def check_shape(op: str, name: str, t: torch.Tensor, expected, what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        suffix = f" ({what})" if what else ""
        raise ValueError(
            f"{op}: {name} must have shape {tuple(expected)}{suffix}, got {tuple(t.shape)}"
        )


def check_choice(op: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {tuple(choices)}, got {value!r}")


# ------------------------------------------------------------------------------ layouts
def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one block of storage, in any order.

    Such tensors (contiguous, channels-last, transposed, ...) can be processed as a flat
    vector over their storage when all operands share the same strides.
    """
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (M, N) with unit column stride; a view when the layout allows one.

    Leading dims that cannot be merged into one row stride (or a last dim with a
    non-unit stride) cost a copy; the result is the same either way.
    """
    rows = rows_view(t)
    if rows is None:  # no such view: one contiguous copy
        rows = t.reshape(-1, t.shape[-1]).contiguous()
    return rows


def rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as (M, N) with unit column stride without copying; None when no such view
    exists (outputs must be written in place; :func:`as_rows` copies inputs instead)."""
    dim = t.dim()
    if dim == 2 and (t.stride(1) == 1 or t.shape[1] <= 1):
        return t  # already (M, N) with unit column stride (the eager path's common case)
    if dim == 0:
        t = t.reshape(1)
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        return None
    return rows


def flat_storage_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over the storage block of a dense tensor (see :func:`is_dense`)."""
    return t.as_strided((t.numel(),), (1,))


# --------------------------------------------------------------------------- heuristics
@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor, traced: bool = False) -> bool:
    """Launch a kernel on ``t``'s device with programmatic dependent launch (PDL)?

    With it a launch may begin while the kernel before it on the stream finishes: its
    programs start, wait (``griddepcontrol.wait``: every prior grid complete and its
    writes visible) before their first global memory access, then let the next PDL launch
    begin. No read or write can race (every program waits first); what moves is the gap
    between two kernels (the launch, the programs' start), which a launch-bound kernel
    feels (the on-chip softmax also changes some launch shapes under it, so its sums
    there round in another order: see softmax.PDL_MIN_WARPS): fp32 add at 1M elements in
    CUDA-graph replay 5.89 -> 5.31 us on an H100 (docs/performance/elementwise.md). The
    gain needs the kernel before to take part (a fuseml kernel, or any that triggers);
    after one that does not (torch's own), a PDL launch costs a little more than a plain
    one.

    Hopper and later, compiled launches only: not under the interpreter or torch.compile's
    tracing (its wrapped launches take no launch options). ``FUSEML_PDL=0`` turns every
    PDL launch off (LoRA's overlapped shrink / expand too, see fuseml.ops.lora).
    """
    if traced or not t.is_cuda or triton_interpreting():
        return False
    return settings.pdl() and _hopper_or_later(t.get_device())


def fast_math(t: torch.Tensor) -> bool:
    """Whether a Triton launch on ``t`` may use PTX approximations (inline assembly).

    True for CUDA tensors on NVIDIA builds; CPU tensors mean the interpreter, which has no
    inline assembly.
    """
    return t.is_cuda and torch.version.hip is None


def vec_width(elem_size: int, n_cols, *strides) -> int:
    """Elements per 16 bytes if ``n_cols`` and every row stride are multiples of it, else 1.

    A kernel given this as its VEC rewrites those values as ``(v // VEC) * VEC``: Triton
    specialises only multiples of 16, so without it a width like 1000 leaves Triton unable
    to tell that rows start on 16-byte boundaries and that masks change only between
    vectors, and every access is one element wide. (Base pointers' 16-byte alignment
    Triton checks by itself.) Symbolic sizes (torch.compile) give 1.
    """
    vec = 16 // elem_size
    ok = all(type(v) is int and v % vec == 0 for v in (n_cols, *strides))
    return vec if ok else 1


# The most blocks a CUDA grid takes along its second (and third) axis; kernels that put
# rows there fall back to one axis past it.
GRID_Y_MAX = 65535


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: triton.cdiv is a JIT function, whose Python call costs
    microseconds on every launch (it also works on SymInts under torch.compile)."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Tensor types the kernels take as they are (nn.Parameter: module weights); any other
# subclass (fake, functorch wrappers, user subclasses) goes through the dispatcher.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# Scalar types the fast path passes as they are (not bool: its own type)
REAL_NUMBERS = (float, int)


def needs_dispatch(*tensors: torch.Tensor | None) -> bool:
    """Must this call go through the registered custom op rather than a direct launch?

    Yes under torch.compile / export, when autograd must record the call, for tensor
    subclasses (fake, meta, functorch wrappers) and under a dispatch mode. Otherwise the
    direct launch computes the same thing without the dispatcher's per-call cost.
    """
    if torch.compiler.is_compiling():
        return True
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in PLAIN_TENSORS or t.is_meta:  # (is_meta: no torch.device object built)
            return True
        if grad and t.requires_grad:
            return True
    return _get_current_dispatch_mode() is not None


@functools.cache
def compiled(fn):
    """torch.compile(fn), built once per reference function (the 'compile' backend)."""
    return torch.compile(fn)


# ------------------------------------------------------------------------ registration
_launch_state = threading.local()


@contextlib.contextmanager
def _launch_flag(name: str):
    """Set the thread's launch-state flag ``name`` inside the block."""
    prev = getattr(_launch_state, name, False)
    setattr(_launch_state, name, True)
    try:
        yield
    finally:
        setattr(_launch_state, name, prev)


def launches_skipped() -> bool:
    """True while an op body runs as its own fake (shape-only) implementation."""
    return getattr(_launch_state, "skip", False)


def _skipping_launches():
    return _launch_flag("skip")


def compiling_only() -> bool:
    """True while the tuner compiles candidate configs ahead of timing them (see
    ``fuseml.ops._tune``): kernel launches then compile without running."""
    return getattr(_launch_state, "compile_only", False)


def compile_only():
    return _launch_flag("compile_only")


def grid_launch(kernel, grid):
    """``kernel[grid]``, or inside ``compile_only()`` the kernel's warmup (compiles it for
    these arguments, launches nothing). For launches the tuner reaches."""
    if compiling_only():
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


class CompiledLaunches:
    """Repeat launches of one Triton kernel through its compiled kernel's own launcher.

    ``kernel[grid](*args, **options)`` binds and specializes every argument on each call:
    26 us of host time for the MLP chain kernel's 53 arguments on the H100 host, where the
    compiled kernel's launcher takes 10 us (scripts/host_overhead.py mlp). The caller
    names the specialization in ``key``: every constexpr value, the dtypes, the options,
    and for each int argument whether it is 1 or a multiple of 16 (what Triton
    specializes ints on). Pointer alignment is the other thing Triton specializes on:
    ``aligned`` says every tensor argument is 16-byte aligned; unaligned calls take the
    ordinary launch. ``args``: every argument in the kernel's order, constexprs included.
    ``FUSEML_DIRECT_LAUNCH=0`` turns this off (every call the ordinary launch).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}
        # (the interpreter runs kernels as Python: nothing compiled to launch)
        self.enabled = settings.direct_launch() and not triton_interpreting()

    def __call__(self, grid: tuple, key, aligned: bool, args: tuple, options: dict):
        """Launch; the compiled kernel that ran when it went through one, else None."""
        if not (aligned and self.enabled) or compiling_only():
            grid_launch(self.kernel, grid)(*args, **options)
            return None
        device = _current_device()
        key = (key, device)
        ck = self.compiled.get(key)
        if ck is not None:
            g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
            if _launch_hooks() is None:  # the launcher itself: 3 us less than ck[grid]
                ck.run(
                    *g, _raw_stream(device), ck.function, ck.packed_metadata, None, None, None,
                    *args,
                )  # fmt: skip
            else:  # (a profiler's launch hooks: the launch that calls them)
                ck[g](*args)
                return None
            return ck
        ck = self.kernel[grid](*args, **options)
        from triton.compiler import CompiledKernel

        if isinstance(ck, CompiledKernel) and hasattr(ck, "packed_metadata"):
            self.compiled[key] = ck
        return None


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream
)


_knobs_runtime = None


def _launch_hooks():
    """Triton's launch enter/exit hooks (set by profilers such as proton), None when
    neither is set."""
    global _knobs_runtime
    runtime = _knobs_runtime
    if runtime is None:
        import triton

        runtime = _knobs_runtime = getattr(getattr(triton, "knobs", None), "runtime", False)
    if runtime is False:
        return True  # (a Triton without knobs: the launch that knows where hooks live)
    # (newer Tritons keep each hook as a chain of calls: an object even when empty)
    for hook in (runtime.launch_enter_hook, getattr(runtime, "launch_exit_hook", None)):
        if hook is not None and getattr(hook, "calls", True):
            return hook
    return None


def aligned16(*tensors: torch.Tensor | None) -> bool:
    """Every given tensor's data 16-byte aligned (None skipped): ``CompiledLaunches``'
    ``aligned``."""
    ptrs = 0
    for t in tensors:
        if t is not None:
            ptrs |= t.data_ptr()
    return ptrs % 16 == 0


@functools.lru_cache(maxsize=1 << 16)  # (a lookup: half the cost of computing it, per int)
def int_spec(v: int) -> tuple[bool, bool, bool]:
    """What Triton specializes an int argument on: == 1, a multiple of 16, 32-bit."""
    return v == 1, v % 16 == 0, -(2**31) <= v < 2**31


def fused_op(name: str, *, mutates_args=()):
    """Register ``fn`` as the custom op ``name`` so torch.compile can trace through it.

    With compiled Triton this is ``torch.library.triton_op``: compile sees the kernels
    themselves. Under the Triton interpreter torch cannot wrap kernels (wrap_triton hands
    back the interpreted function), so the op registers as an opaque custom op whose fake
    implementation runs the same body with launches skipped.
    """

    def register(fn):
        if not triton_interpreting():
            with _kernel_scan_deferred():
                return torch.library.triton_op(name, mutates_args=mutates_args)(fn)
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        def fake(*args, **kwargs):
            with _skipping_launches():
                return fn(*args, **kwargs)

        op.register_fake(fake)
        return op

    return register


class _DeferredKernels(list):
    """The Triton kernels of a triton_op body, found on first read: torch's scan imports
    torch._inductor (and torch._dynamo: about 2 s), which only torch.compile needs, and
    torch.compile reads the list (its AOTAutograd cache key) with both already loaded."""

    def __init__(self, scan, fn) -> None:
        super().__init__()
        self._scan: tuple | None = (scan, fn)

    def _fill(self) -> None:
        if self._scan is not None:
            scan, fn = self._scan
            self._scan = None
            self.extend(scan(fn))

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def __getitem__(self, index):
        self._fill()
        return super().__getitem__(index)


@contextlib.contextmanager
def _kernel_scan_deferred():
    """Inside the block, ``torch.library.triton_op`` records its body's kernels as a
    ``_DeferredKernels`` instead of scanning the body's source at registration (where
    this torch scans there). Restored after the block: nothing of torch stays changed."""
    from torch._library import triton as library

    scan = getattr(library, "get_inner_triton_kernels", None)
    if scan is None:  # a torch that does not scan at registration
        yield
        return
    library.get_inner_triton_kernels = lambda fn: _DeferredKernels(scan, fn)
    try:
        yield
    finally:
        library.get_inner_triton_kernels = scan


# (id(tensor), tag) -> (weak reference, version, derived tensor, data pointer): a copy
# derived from a tensor (a multi-adapter B stacked, a weight padded), kept between calls
# while the tensor lives, is not written to and keeps its storage.
_KEPT: dict[tuple[int, str], tuple] = {}


def keeps_derived(t: torch.Tensor) -> bool:
    """Would ``kept_derived`` keep a copy derived from ``t`` (else it derives per call)?
    Not where the copy could go stale, be unwritten or break autograd: while launches are
    skipped or only compiled (a fake implementation, the tuner's compile-only pass: a
    derivation that launches a kernel then returns an unwritten tensor), under
    torch.compile (tracing, fake tensors), inference tensors (no version counter), a graph
    capture (its allocations belong to the graph's pool, and a graph replayed after an
    in-place write must see it), or a tensor that needs a gradient."""
    return not (
        launches_skipped()
        or compiling_only()
        or torch.compiler.is_compiling()
        or is_fake(t)
        or t.is_inference()
        or (t.requires_grad and torch.is_grad_enabled())
        or (t.is_cuda and torch.cuda.is_current_stream_capturing())
    )


def kept_derived(t: torch.Tensor, tag: str, derive, *, keep: bool | None = None) -> torch.Tensor:
    """``derive(t)``, computed once per tensor, tag and version where that is safe (see
    ``keeps_derived``): the copy is kept for the next call with the same tensor object at
    the same version (an in-place write bumps it) and storage (``t.data = other`` swaps it
    without one). keep: ``keeps_derived(t)``, where the caller has asked it already."""
    if not (keeps_derived(t) if keep is None else keep):
        return derive(t)
    key = (id(t), tag)
    hit = _KEPT.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[3] == t.data_ptr():
        return hit[2]
    out = derive(t).detach()

    def forget(ref, key=key):  # t was freed; a newer tensor may own its id by now
        if _KEPT.get(key, (None,))[0] is ref:
            del _KEPT[key]

    _KEPT[key] = (weakref.ref(t, forget), t._version, out, t.data_ptr())
    return out


# ------------------------------------------------------------------------ counter slabs
class CounterSlab:
    """Zeroed int32 counters for kernels whose programs synchronise through global
    counters and put them back to zero before they exit (the joint LoRA launch's flags,
    the split softmax's row counters), handed out in slices of one slab per device
    (``counters`` of them, zeroed once, never freed), so that no memset precedes each
    launch. A slice serves every later launch that cannot run beside it: one slice per
    stream for eager calls (stream order), and a slice of its own for each launch
    captured into a CUDA graph (a graph never runs beside itself, but may beside other
    graphs and other streams). Without a slice (the slab is spent, or the device's first
    launch is being captured, where no slab may be allocated) ``take`` gives None and the
    caller zeroes its own counters (a memset; a node in a graph): the same result, a
    launch more. ``what`` names the counters in the one message a spent slab logs."""

    def __init__(self, counters: int, what: str) -> None:
        self.counters = counters
        self.what = what
        self.slabs: dict[int, list] = {}  # device -> [slab, next free counter]
        self.streams: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> slice
        self.spent = False
        self.lock = threading.Lock()  # threads launching on streams of their own

    def take(self, x: torch.Tensor, count: int) -> torch.Tensor | None:
        with self.lock:
            return self._take(x, count)

    def reserve(self, x: torch.Tensor) -> None:
        """Allocate x's device's slab now if it has none and no capture is under way: for
        callers whose eager calls take another kernel than the one they capture (a capture
        cannot allocate the slab, and its launches would zero counters per replay)."""
        device = x.get_device()
        if device in self.slabs or is_fake(x) or torch._guards.detect_fake_mode() is not None:
            return  # (fake tensors: nothing real to keep)
        if torch.cuda.is_current_stream_capturing():
            return
        with self.lock:
            if device not in self.slabs:
                self._allocate(x)

    def holds(self, t: torch.Tensor) -> bool:
        """Is t a slice of one of the slabs (kept for the process, not a fresh buffer)?"""
        entry = self.slabs.get(t.get_device()) if t.is_cuda else None
        return entry is not None and t.untyped_storage().data_ptr() == entry[0].data_ptr()

    def _allocate(self, x: torch.Tensor) -> list:
        """x's device's slab, zeroed, with none of it handed out (the lock held; not
        while capturing)."""
        entry = [torch.zeros(self.counters, dtype=torch.int32, device=x.device), 0]
        self.slabs[x.get_device()] = entry
        return entry

    def _take(self, x: torch.Tensor, count: int) -> torch.Tensor | None:
        device = x.get_device()
        capturing = torch.cuda.is_current_stream_capturing()
        key = (device, torch.cuda.current_stream(x.device).cuda_stream)
        if not capturing:
            held = self.streams.get(key)
            if held is not None and held.numel() >= count:
                return held
        entry = self.slabs.get(device)
        if entry is None:
            if capturing:
                return None
            entry = self._allocate(x)
        slab, used = entry
        # Slices start 16 bytes apart at least: a captured launch's pointer then has the
        # alignment its eager launches specialize on (a 4-byte offset made LoRA tuning's
        # timed captures compile each joint config again, in series: 6 of them, ~3.5 s of
        # a cold first call at 1 row, H100)
        size = cdiv(count, 4) * 4 if capturing else max(cdiv(count, 4) * 4, 256)
        if used + size > slab.numel():
            if not self.spent:
                self.spent = True
                log.info(
                    "fuseml: the slab of %s (%d counters) is spent; further launches "
                    "zero their counters per call", self.what, self.counters,
                )  # fmt: skip
            return None
        entry[1] = used + size
        piece = slab[used : used + size]
        if not capturing:
            self.streams[key] = piece
        return piece


def slab_counters(slab: CounterSlab, x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` zeroed int32 counters on x's device for a launch on its current stream,
    from ``slab`` (see CounterSlab), else a fresh zeroed buffer."""
    # (fake tensors, torch.compile tracing: nothing to keep in the slab)
    if x.is_cuda and not is_fake(x):
        piece = slab.take(x, count)
        if piece is not None:
            return piece
    return torch.zeros(count, dtype=torch.int32, device=x.device)
