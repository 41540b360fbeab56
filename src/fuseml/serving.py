"""CUDA-graph serving without user code: ``fuseml.cuda_graphs(model)``.

A CUDA graph replays a captured forward with one launch, so that the CPU-side cost of a
forward (Python, dispatch, one launch per kernel) disappears; at small batches that cost
is most of the time. A graph replays fixed shapes on fixed buffers, so the wrapper keeps
one graph per *bucket* (a batch size) and fits every call into buckets::

    served = fuseml.cuda_graphs(model.cuda().eval(), batch_sizes=(1, 64, 4096))
    probs = served(dense, sparse)              # same result as model(dense, sparse)

A call with ``rows`` rows is planned by ``plan_batches``: chunks of the largest bucket
while more than that many rows remain, then the rest padded up to the smallest bucket that
holds it. Padding rows repeat the chunk's first row (``pad="first"``, always a valid input
since the caller gave it) or are zeros (``pad="zeros"``); their outputs are dropped. This
assumes the model treats rows independently, as inference of DLRM or an MLP does.

A bucket's graph is captured lazily, on the first call that lands in it: inputs are copied
into static buffers, the forward runs once eagerly on a side stream (so that tuning,
compilation and allocations happen outside the capture), then it is captured and replayed.
Every later call copies its rows into the buffers and replays. Graphs of all buckets share
one memory pool (``torch.cuda.graph_pool_handle``); each replay's output is copied out at
once, so every call returns fresh tensors, never views of the graph's static output.

Inputs: positional and keyword arguments. A tensor, or a tuple/list of tensors, is batched
along dim 0 (all with the same number of rows); anything else (``return_logits=True``,
``None``) is a static setting: each distinct set of settings has its own graphs. Nested
sequences, e.g. DLRM's multi-hot bags (one ``(indices, offsets)`` pair per table), cannot
be padded by rows and are refused: call the wrapped model eagerly (``served.module``).
The first call fixes each input's dtype, device and trailing shape; a later call that
differs raises a ValueError naming the argument and what was expected.

Limits: inference only (calls run under ``torch.no_grad``; the model must be in eval mode);
one call at a time (not thread-safe: graphs share their pool and buffers); a forward that
syncs with the host (``.item()``, ``bool(tensor)``, data-dependent shapes) cannot be
captured (DLRM's id check flags bad ids on the device inside a capture instead, and the
wrapper calls the model's ``raise_if_bad_ids()``, where it has one, after each call's
replays: one sync); parameters must be updated in place (``load_state_dict`` copies in place) for
replays to see them. ``fallback="eager"`` runs the model eagerly instead of failing where
graphs cannot be used (no CUDA, a CPU model, a failed capture), logging why once.
"""

from __future__ import annotations

import bisect
import inspect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fuseml.ops import _fastcall
from fuseml.runtime import graph_capture

__all__ = [
    "DEFAULT_BATCH_SIZES", "CudaGraphs", "ReplayCache", "bucket_for", "cuda_graphs",
    "plan_batches",
]  # fmt: skip

log = logging.getLogger(__name__)

# Powers of two from 1 to 65536: padding at most doubles a batch, 17 buckets at most, and
# graphs are captured lazily, so a stream of one batch size captures one or two of them.
DEFAULT_BATCH_SIZES: tuple[int, ...] = tuple(1 << i for i in range(17))
_PADS = ("first", "zeros")
_FALLBACKS = ("error", "eager")


def _check_buckets(batch_sizes: Iterable[int]) -> tuple[int, ...]:
    """Sorted, distinct, positive bucket sizes; ValueError otherwise."""
    sizes = tuple(batch_sizes)
    if not sizes:
        raise ValueError("batch_sizes must hold at least one batch size")
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batch_sizes must be positive ints, got {b!r} in {sizes}")
    return tuple(sorted(set(sizes)))


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``rows`` (``buckets`` sorted ascending); ValueError if none."""
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def plan_batches(rows: int, buckets: Iterable[int]) -> list[tuple[int, int, int]]:
    """How a call with ``rows`` rows runs: ``[(start, stop, bucket), ...]``.

    Rows ``start:stop`` go through the graph of ``bucket`` (padded to ``bucket`` rows):
    chunks of the largest bucket while more rows than it remain, then the rest in the
    smallest bucket that holds it. No rows, no chunks.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be a non-negative int, got {rows!r}")
    sizes = _check_buckets(buckets)
    largest, plan, start = sizes[-1], [], 0
    while rows - start > largest:
        plan.append((start, start + largest, largest))
        start += largest
    if start < rows:
        plan.append((start, rows, bucket_for(rows - start, sizes)))
    return plan


@dataclass(frozen=True)
class _Leaf:
    """What a batched input was first seen with: every later call must match."""

    name: str
    dtype: torch.dtype
    device: torch.device
    trailing: tuple[int, ...]  # shape after the batch dim

    def check(self, t: torch.Tensor) -> None:
        if t.device != self.device or t.dtype != self.dtype or tuple(t.shape[1:]) != self.trailing:
            raise ValueError(
                f"{self.name}: expected a {self.dtype} tensor on {self.device} of shape "
                f"(B, {', '.join(map(str, self.trailing))}) as the CUDA graphs were captured "
                f"with, got {t.dtype} on {t.device} of shape {tuple(t.shape)}"
            )


def _flatten(
    names: Sequence[str], args: tuple, kwargs: dict[str, Any]
) -> tuple[list[tuple[str, torch.Tensor]], tuple]:
    """(named tensor leaves, spec): the spec rebuilds the call from new leaves
    (``_unflatten``) and is hashable, holding the static (non-tensor) values."""
    entries = [(names[i] if i < len(names) else f"args[{i}]", None, a) for i, a in enumerate(args)]
    entries += [(k, k, v) for k, v in sorted(kwargs.items())]  # the same graphs in any order
    leaves, spec = [], []
    for name, key, value in entries:
        if isinstance(value, torch.Tensor):
            leaves.append((name, value))
            spec.append((key, "tensor", None))
        elif isinstance(value, (tuple, list)):
            for j, v in enumerate(value):
                if isinstance(v, (tuple, list)):
                    raise ValueError(
                        f"{name}[{j}] is a sequence: nested inputs such as multi-hot bags "
                        "((indices, offsets) per table) cannot be padded to a batch bucket; "
                        "call the model eagerly (the wrapper's .module)"
                    )
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"{name}[{j}]: expected a tensor, got {type(v).__name__}")
                leaves.append((f"{name}[{j}]", v))
            spec.append((key, type(value).__name__, len(value)))
        else:
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"{name}: a non-tensor argument is a static setting of the graph and "
                    f"must be hashable, got {type(value).__name__}"
                ) from None
            spec.append((key, "static", value))
    return leaves, tuple(spec)


def _unflatten(spec: tuple, tensors: Sequence[torch.Tensor]) -> tuple[list, dict]:
    args, kwargs, it = [], {}, iter(tensors)
    for key, kind, extra in spec:
        if kind == "tensor":
            value = next(it)
        elif kind == "static":
            value = extra
        else:
            items = [next(it) for _ in range(extra)]
            value = tuple(items) if kind == "tuple" else items
        if key is None:
            args.append(value)
        else:
            kwargs[key] = value
    return args, kwargs


def _outputs(out: Any, bucket: int) -> tuple[list[torch.Tensor], str]:
    """The forward's output as a list of tensors with ``bucket`` rows, and its kind."""
    tensors = [out] if isinstance(out, torch.Tensor) else out
    kind = "tensor" if isinstance(out, torch.Tensor) else type(out).__name__
    if not isinstance(tensors, (tuple, list)) or not all(
        isinstance(t, torch.Tensor) for t in tensors
    ):
        raise TypeError(
            f"cuda_graphs: the model must return a tensor or a tuple/list of tensors, got "
            f"{type(out).__name__}"
        )
    for t in tensors:
        if t.ndim == 0 or t.shape[0] != bucket:
            raise ValueError(
                f"cuda_graphs: every output needs the batch ({bucket} rows) in dim 0, got "
                f"shape {tuple(t.shape)}: the model must treat rows independently"
            )
    return list(tensors), kind


def _fill(
    static: list[torch.Tensor], inputs: list[torch.Tensor], start: int, stop: int, pad: str
) -> None:
    """Rows ``start:stop`` of each input into its static buffer, then the padding rows
    (the chunk's first row repeated, or zeros)."""
    n = stop - start
    for s, x in zip(static, inputs, strict=True):
        s[:n].copy_(x[start:stop])
        if n < s.shape[0]:
            if pad == "zeros":
                s[n:].zero_()
            else:
                s[n:].copy_(x[start : start + 1].expand(s.shape[0] - n, *x.shape[1:]))


class _Graph:
    """One bucket's captured forward: static inputs, the graph, static outputs."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        self.inputs = inputs
        self.graph: torch.cuda.CUDAGraph | None = None  # set by the capture
        self.outputs: list[torch.Tensor] = []
        self.kind = "tensor"


def _model_device(model: nn.Module) -> torch.device | None:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


class CudaGraphs(nn.Module):
    """``model`` served through CUDA graphs, one per batch bucket; see the module doc.

    Attributes:
        module: the wrapped model (call it for what graphs cannot take, e.g. bags).
        batch_sizes: the buckets, ascending.
        num_graphs: how many graphs are captured so far.
        eager: True when calls run the model eagerly (``fallback="eager"`` took effect).
    """

    def __init__(
        self,
        model: nn.Module,
        batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
        *,
        pad: str = "first",
        fallback: str = "error",
        warmup: int = 1,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if pad not in _PADS:
            raise ValueError(f"pad must be one of {_PADS}, got {pad!r}")
        if fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(
                f"warmup must be an int >= 1 (eager calls before a capture), got {warmup!r}"
            )
        self.module = model
        self.batch_sizes = _check_buckets(batch_sizes)
        self.pad, self.fallback, self.warmup = pad, fallback, warmup
        self.eager = False
        self._graphs: dict[tuple, _Graph] = {}  # (spec, bucket) -> graph
        # tensor input names -> what they must be (whatever the static settings)
        self._leaves: dict[tuple[str, ...], list[_Leaf]] = {}
        self._pool = None
        self._stream = None
        try:
            names = list(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            names = []
        self._names = names
        device = _model_device(model)
        why = None
        if not torch.cuda.is_available():
            why = "CUDA is not available"
        elif device is not None and device.type != "cuda":
            why = f"the model is on {device}, not on a CUDA device (move it with .cuda())"
        if device is None and why is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        if why is not None:
            if fallback == "error":
                raise ValueError(
                    f"cuda_graphs needs a model on a CUDA device: {why}; pass "
                    "fallback='eager' to run it eagerly instead"
                )
            self._go_eager(why)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def extra_repr(self) -> str:
        return (
            f"batch_sizes={self.batch_sizes}, pad={self.pad!r}, fallback={self.fallback!r}, "
            f"graphs={self.num_graphs}{', eager' if self.eager else ''}"
        )

    def _go_eager(self, why: str) -> None:
        self.eager = True
        self._graphs.clear()  # their memory back
        log.warning("cuda_graphs: running %s eagerly: %s", type(self.module).__name__, why)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            if self.eager:
                return self.module(*args, **kwargs)
            leaves, spec = _flatten(self._names, args, kwargs)
            if not leaves:
                raise ValueError("cuda_graphs: the call has no tensor input to batch")
            rows = self._check_inputs(leaves)
            if rows == 0:  # nothing to replay: the model's own empty result
                return self.module(*args, **kwargs)
            try:
                return self._run(leaves, spec, rows)
            except _CaptureError as e:
                if self.fallback == "error":
                    raise RuntimeError(str(e)) from e.__cause__
                self._go_eager(str(e))
                return self.module(*args, **kwargs)

    def _check_inputs(self, leaves: list[tuple[str, torch.Tensor]]) -> int:
        """The call's rows, after checking every input against the first call's."""
        for name, t in leaves:
            if t.ndim == 0:
                raise ValueError(f"{name}: a batched input needs a batch dim, got a 0-d tensor")
        rows = leaves[0][1].shape[0]
        for name, t in leaves[1:]:
            if t.shape[0] != rows:
                raise ValueError(
                    f"{name}: expected {rows} rows (the batch, dim 0) like {leaves[0][0]}, "
                    f"got shape {tuple(t.shape)}"
                )
        names = tuple(n for n, _ in leaves)
        expected = self._leaves.get(names)
        if expected is None:
            for name, t in leaves:
                if t.device != self.device:
                    raise ValueError(
                        f"{name}: expected a tensor on {self.device} (the model's device), "
                        f"got one on {t.device}"
                    )
            expected = [_Leaf(n, t.dtype, t.device, tuple(t.shape[1:])) for n, t in leaves]
            self._leaves[names] = expected
        for leaf, (_, t) in zip(expected, leaves, strict=True):
            leaf.check(t)
        return rows

    def _run(self, leaves: list[tuple[str, torch.Tensor]], spec: tuple, rows: int) -> Any:
        results: list[torch.Tensor] | None = None
        kind = "tensor"
        with torch.cuda.device(self.device):
            for start, stop, bucket in plan_batches(rows, self.batch_sizes):
                g = self._graphs.get((spec, bucket))
                fresh = g is None
                if fresh:
                    # Buffers and graph outside inference mode, so that calls made either
                    # inside it or outside may write the buffers.
                    with torch.inference_mode(False):
                        g = _Graph([t.new_empty((bucket, *t.shape[1:])) for _, t in leaves])
                _fill(g.inputs, [t for _, t in leaves], start, stop, self.pad)
                if fresh:
                    with torch.inference_mode(False):
                        self._capture(g, spec, bucket)
                    self._graphs[(spec, bucket)] = g
                g.graph.replay()
                # Copied out at once: a graph captured later may reuse, for its own
                # buffers, pool memory this one freed, so static outputs last until the
                # next replay only (which is what makes one shared pool safe).
                kind = g.kind
                if results is None:
                    results = [o.new_empty((rows, *o.shape[1:])) for o in g.outputs]
                for r, o in zip(results, g.outputs, strict=True):
                    r[start:stop].copy_(o[: stop - start])
        # A model that checks its inputs on the device inside the graph (DLRM's ids)
        # raises here for what the replays flagged (one sync).
        check = getattr(self.module, "raise_if_bad_ids", None)
        if callable(check):
            check()
        if kind == "tensor":
            return results[0]
        return tuple(results) if kind == "tuple" else results

    def _capture(self, g: _Graph, spec: tuple, bucket: int) -> None:
        """Warm up on a side stream, then capture ``g`` (PyTorch's documented recipe)."""
        if self.module.training:
            raise RuntimeError("cuda_graphs serves inference only: call .eval() on the model first")
        args, kwargs = _unflatten(spec, g.inputs)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream()
        side = self._stream

        def forward():
            # grad mode off: the caller's inference_mode(False) turns it back on, under which
            # a fused module runs the forward autograd asks for (its eager reference)
            with torch.no_grad():
                return self.module(*args, **kwargs)

        # The warm-up is an eager call on real rows: its errors are the model's, as they are.
        _warm_up(side, forward, self.warmup)
        try:
            g.graph, out = _capture_graph(side, forward, self._pool)
        except Exception as e:
            g.graph = None
            raise _CaptureError(
                f"cuda_graphs: capturing {type(self.module).__name__} at batch {bucket} "
                f"failed ({type(e).__name__}: {e}); a forward that syncs with the host "
                "(.item(), bool(tensor), data-dependent shapes) "
                "cannot be captured; fallback='eager' runs such a model eagerly"
            ) from e
        g.outputs, g.kind = _outputs(out, bucket)


CAPTURE_MODE = "thread_local"  # (see _capture_graph)


class _CaptureError(Exception):
    pass


def _warm_up(stream: torch.cuda.Stream, fn, times: int) -> None:
    """``fn()`` ``times`` times on ``stream``, ordered after the current stream's work
    and before its later work (the warm-up of PyTorch's capture recipe)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def _capture_graph(stream: torch.cuda.Stream, fn, pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, output) of ``fn()`` captured on ``stream``; when the capture fails, the
    CUDA state is put back in order (``_end_failed_capture``) and the error raised.

    The capture is thread-local: CUDA calls other threads make meanwhile (fuseml's
    background build of its fast path, a user's loader thread) do not invalidate it, as
    they do a capture in PyTorch's default global mode. What the captured forward itself
    calls is checked as strictly."""
    graph = torch.cuda.CUDAGraph()
    try:
        with graph_capture(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
            out = fn()
    except Exception:
        _end_failed_capture(stream)
        raise
    return graph, out


def _end_failed_capture(stream: torch.cuda.Stream) -> None:
    """Put the process back in order after a capture that failed. When the capture was
    invalidated (a host sync inside it), ending it raises before PyTorch takes its CUDA
    random generators out of their capturing state, and every later random op on the
    device fails ("Offset increment outside graph capture"). One empty capture on the
    same stream begins and ends their capture cleanly."""
    try:
        torch.cuda.synchronize(stream.device)
        with graph_capture(torch.cuda.CUDAGraph(), stream=stream, capture_error_mode=CAPTURE_MODE):
            pass
    except Exception as e:  # the original error is what the caller reports
        log.warning("cuda_graphs: could not reset the CUDA state after a failed capture: %s", e)


def cuda_graphs(
    model: nn.Module,
    batch_sizes: Iterable[int] = DEFAULT_BATCH_SIZES,
    *,
    pad: str = "first",
    fallback: str = "error",
    warmup: int = 1,
) -> CudaGraphs:
    """Serve ``model`` (on a CUDA device, in eval mode) through CUDA graphs.

    Args:
        batch_sizes: the buckets, each a graph captured on first use; a call is padded to
            the smallest bucket that holds it, and split in chunks of the largest above it.
            Default: powers of two from 1 to 65536.
        pad: ``"first"`` (padding rows repeat the first row) or ``"zeros"``.
        fallback: ``"error"`` (refuse a CPU model; raise when a capture fails) or
            ``"eager"`` (run the model eagerly then, logged once).
        warmup: eager calls on a side stream before each capture.

    Returns a ``CudaGraphs`` module; calling it returns what the model would, as fresh
    tensors. See ``fuseml.serving`` for the rules on inputs.
    """
    return CudaGraphs(model, batch_sizes, pad=pad, fallback=fallback, warmup=warmup)


# --------------------------------------------------------------- replays of eager calls
class ReplayCache:
    """Repeated eager calls of a forward replayed from CUDA graphs, one per call signature.

    For a model whose eager forward costs more host time than GPU time (a few launches of
    Triton kernels through Python), a graph replay takes the host cost of one launch. The
    owner decides what a signature is (the inputs' shapes, dtypes and strides, static
    settings, and the data pointers and versions of every parameter, so that a weight
    replaced or updated in place is never replayed stale) and calls :meth:`run`. A
    signature's first ``capture_after`` calls run eagerly (tuning, compilation and warm-up
    happen there); the next one captures its graph and every later one replays it: the
    inputs are copied into the graph's static buffers and the output copied out, so every
    call returns a fresh tensor. At most ``max_graphs`` graphs are kept (least recently
    used dropped, their memory with them: each has its own pool). A capture that fails
    turns the replays off for the owner, logged once, and the eager forward runs (the same
    result).
    """

    def __init__(self, owner: str, *, capture_after: int = 2, max_graphs: int = 4) -> None:
        self.owner = owner
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.enabled = True
        self._seen: dict[tuple, int] = {}
        # key -> (graph, static inputs, static output, raw executable or None: see _first_replay)
        self._graphs: dict[tuple, tuple] = {}
        self.cpp_replays = 0  # replays launched from C++ (fastcall_replay.h)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def __deepcopy__(self, memo) -> ReplayCache:  # a copy of the owner starts with none
        return ReplayCache(self.owner, capture_after=self.capture_after, max_graphs=self.max_graphs)

    def __getstate__(self) -> dict:  # pickled (torch.save of the owner): without graphs
        state = dict(self.__dict__)
        state["_seen"], state["_graphs"] = {}, {}
        return state

    def clear(self) -> None:
        self._seen.clear()
        self._graphs.clear()

    def run(self, key: tuple, fn, inputs: list[torch.Tensor]) -> torch.Tensor:
        """``fn(*inputs)`` (one output tensor), replayed from the graph of ``key`` once it
        is captured."""
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs[key] = self._graphs.pop(key)  # most recently used last
            graph, static, out, raw = entry
            fast = _fastcall.loaded() if raw is not None else None
            if fast is not None:  # copies in, launch, copy out: one C++ call
                self.cpp_replays += 1
                return fast.replay(raw, static, inputs, out)
            _replay(graph, static, inputs)
            return out.clone()
        seen = self._seen.get(key, 0) + 1
        if seen <= self.capture_after or not self.enabled or self.max_graphs < 1:
            if len(self._seen) > 64 * max(1, self.max_graphs):  # many signatures: forget
                self._seen.clear()
            self._seen[key] = seen
            return fn(*inputs)
        self._seen.pop(key, None)
        with torch.inference_mode(False):
            static = [x.clone() for x in inputs]
        side = torch.cuda.Stream()
        try:
            _warm_up(side, lambda: fn(*static), 1)
            graph, out = _capture_graph(side, lambda: fn(*static))
        except Exception as e:
            self.enabled = False
            self.clear()
            log.warning(
                "%s: replaying eager calls from CUDA graphs is off: the capture failed "
                "(%s: %s); calls run eagerly (the same result)", self.owner, type(e).__name__, e,
            )  # fmt: skip
            return fn(*inputs)
        if not isinstance(out, torch.Tensor):
            self.enabled = False
            return fn(*inputs)
        while len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        raw = _first_replay(graph, static, inputs)
        self._graphs[key] = (graph, static, out, raw)
        return out.clone()


def _replay(graph, static: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """The call's inputs into the graph's static inputs, then one replay through torch."""
    for s, x in zip(static, inputs, strict=True):
        s.copy_(x)
    graph.replay()


def _first_replay(graph, static: list[torch.Tensor], inputs: list[torch.Tensor]) -> int | None:
    """Replay a new graph once on ``inputs`` through torch; its executable's handle
    (``raw_cuda_graph_exec``, torch 2.9 on) where later replays may launch it from C++: where
    this replay left the default CUDA generator's offset unchanged (the graph draws no
    random numbers, whose offsets torch's replay advances), else None."""
    raw_exec = getattr(graph, "raw_cuda_graph_exec", None)
    generator = None
    if raw_exec is not None and static:
        generator = torch.cuda.default_generators[static[0].device.index or 0]
    before = None if generator is None else generator.get_offset()
    _replay(graph, static, inputs)
    if generator is None or generator.get_offset() != before:
        return None
    return int(raw_exec())


# ------------------------------------------------------------------ replays of modules
def replay_cache(module: nn.Module, owner: str) -> ReplayCache:
    """``module``'s ReplayCache of at most ``module.replay_graphs`` graphs (made anew when
    that number changes), kept outside its state: not in state_dict, not deep-copied."""
    cache = module.__dict__.get("_replay_cache")
    if cache is None or cache.max_graphs != module.replay_graphs:
        cache = ReplayCache(owner, max_graphs=module.replay_graphs)
        module.__dict__["_replay_cache"] = cache
    return cache


def _state_plan(module: nn.Module, listed: bool = False) -> tuple[list, list]:
    """(children, slots) of ``module``'s tree: (a parent's ``_modules``, name, child) for
    every child, (a ``_parameters`` or ``_buffers`` dict, name) for every slot; listed anew
    when a module anywhere below was replaced, or when ``listed`` (the C++ key found so)."""
    plan = module.__dict__.get("_state_slots")
    if listed or plan is None or any(d.get(n) is not c for d, n, c in plan[0]):
        modules = list(module.modules())
        children = [(p._modules, n, c) for p in modules for n, c in p._modules.items()]
        slots = [(m._parameters, n) for m in modules for n in m._parameters]
        slots += [(m._buffers, n) for m in modules for n in m._buffers]
        plan = module.__dict__["_state_slots"] = (children, slots)
    return plan


def module_state(module: nn.Module) -> list[torch.Tensor | None]:
    """Every parameter and buffer slot's tensor of ``module`` now (None where a slot holds
    none): a parameter replaced by another is seen, and the slots are listed again when a
    module anywhere below is replaced."""
    return [d.get(n) for d, n in _state_plan(module)[1]]


def state_key(module: nn.Module) -> tuple | bytes | None:
    """What a replayed graph of ``module`` depends on of its state: each slot's tensor's
    address, version, shape and dtype (a new tensor may be given a freed one's address);
    None where an inference tensor (no version) leaves nothing to key on. Read in C++ where
    the eager fast path is loaded (csrc/fastcall_state.h: bytes), else here (a tuple)."""
    fast = _fastcall.loaded()
    if fast is not None:
        plan = module.__dict__.get("_state_slots") or _state_plan(module)
        key = fast.state_key(*plan)
        if key is False:  # a module below was replaced: list the tree again
            key = fast.state_key(*_state_plan(module, listed=True))
        return key
    try:
        return tuple(
            None if t is None else (t.data_ptr(), t._version, t.shape, t.dtype)
            for t in module_state(module)
        )
    except RuntimeError:
        return None


def replay_key(module: nn.Module, x: torch.Tensor, *settings) -> tuple | None:
    """The signature of ``module``'s eager call on ``x`` whose replays a CUDA graph can
    serve, or None: inference (eval mode, ``replayable``) with every state tensor keyed
    (``state_key``). ``settings``: what else the forward depends on (activations, backend,
    an adapter's name and scaling); the TF32 flag is keyed too."""
    if module.training or not replayable(x):
        return None
    state = state_key(module)
    if state is None:
        return None
    return (
        tuple(x.shape), x.stride(), x.dtype, x.device, *settings,
        torch.backends.cuda.matmul.allow_tf32, state,
    )  # fmt: skip


def replayable(*inputs: torch.Tensor) -> bool:
    """May an eager call on ``inputs`` be served by graph replays? Inference (no autograd
    recording) on plain CUDA tensors, not inside a capture, a compilation, autocast or a
    dispatch mode."""
    from fuseml.ops._utils import needs_dispatch

    return not (
        torch.is_grad_enabled()
        or any(type(t) is not torch.Tensor or not t.is_cuda for t in inputs)
        or torch.compiler.is_compiling()
        or torch.cuda.is_current_stream_capturing()
        or torch.is_autocast_enabled("cuda")
        or needs_dispatch(*inputs)
    )
