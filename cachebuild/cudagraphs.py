"""Graph capture after load: ``none``, ``piecewise`` or ``full``.

``piecewise``: every compiled piece is captured once per capture size, and splitting
ops run eagerly between the replays. ``full``: the whole forward is captured per size.
Sizes are captured largest first into one shared memory pool. Each captured callable
keeps static input buffers: at replay, inputs that are not the model's own weights are
copied into them, so callers may pass any tensors; inputs the graph writes in place (a
KV cache) are read at their own address instead, so the write lands where eager's does.
Outputs of a replay are the graph's
static tensors: **valid until the next call** of the compiled model. Sizes that were not
captured run the compiled pieces without graphs, or, with ``pad_to_capture_size``, are
padded up to the next captured size (for token-parallel models, where padding rows is
safe) and the outputs sliced back.

The device graph API sits behind ``GraphCapture``: ``CudaGraphCapture`` for CUDA, and
``ReplayCapture`` for devices without one (it keeps the static-buffer discipline but
calls the function at replay), so another device's graph API plugs in beside them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

log = logging.getLogger("cachebuild")


class GraphCapture(Protocol):
    """A device's graph API: capture ``fn(*inputs)`` once, replay it later."""

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
        """Warm ``fn`` up, capture it on ``inputs``; returns (graph, static outputs)."""
        ...

    def replay(self, graph: Any) -> None: ...


class CudaGraphCapture:
    """CUDA graphs in one memory pool shared by every capture of a model.

    ``seconds`` splits the time spent into warm-up runs, stream capture and graph
    instantiation (summed over every capture). Unlike ``torch.cuda.graph``, a capture does
    not empty the allocator's cache first: a model captures hundreds of piece graphs, and
    doing that each time costs more than it frees.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)  # warm-up runs and captures happen here
        # Addresses of every captured graph's outputs: a later piece that reads one of them
        # reads the same address at every replay, so it needs no copy.
        self.static_ptrs: set[int] = set()
        self.seconds = {"warmup": 0.0, "capture": 0.0, "instantiate": 0.0}
        self.graphs = 0

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
        from cachebuild import compat

        current = torch.cuda.current_stream(self.device)
        start = time.perf_counter()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            # One run first: lazy initialisation (cuBLAS workspaces, kernel loading) must
            # not happen inside the capture.
            fn(*inputs)
            torch.cuda.synchronize(self.device)
            warm = time.perf_counter()
            graph, separate = compat.cuda_graph_for_capture()
            graph.capture_begin(pool=self.pool)
            try:
                outputs = fn(*inputs)
            finally:
                graph.capture_end()
            captured = time.perf_counter()
            if separate:
                graph.instantiate()
            done = time.perf_counter()
        current.wait_stream(self.stream)
        self.seconds["warmup"] += warm - start
        self.seconds["capture"] += captured - warm
        self.seconds["instantiate"] += done - captured
        self.graphs += 1
        flat = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        self.static_ptrs.update(t.data_ptr() for t in flat if isinstance(t, torch.Tensor))
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()


class ReplayCapture:
    """For devices without a graph API: "replay" calls the function on the static inputs.

    Outputs follow the same contract (valid until the next call); used on CPU. With
    ``pin_into`` (a ``CudaGraphCapture``'s ``static_ptrs``) it gives a call's arguments
    fixed addresses for the graphs captured inside it: in piecewise mode the model's inputs
    are copied once per call rather than once per piece that reads them.
    """

    def __init__(self, pin_into: set[int] | None = None) -> None:
        self.pin_into = pin_into

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
        if self.pin_into is not None:
            self.pin_into.update(t.data_ptr() for t in inputs if isinstance(t, torch.Tensor))
        return (fn, list(inputs)), fn(*inputs)

    def replay(self, graph: Any) -> Any:
        fn, inputs = graph
        return fn(*inputs)


def capture_for(device: str) -> GraphCapture:
    """The graph API for a device type."""
    if device.startswith("cuda"):
        return CudaGraphCapture(device)
    return ReplayCapture()


@dataclass
class _Captured:
    graph: Any
    copies: list[tuple[int, torch.Tensor]]  # (input index, static buffer) copied into at replay
    pinned: list[tuple[int, int]]  # (input index, address) of inputs read in place
    outputs: Any
    written_back: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # after replay


@dataclass(eq=False)  # identity, not field-wise comparison of captured tensors
class GraphedCallable:
    """``fn`` captured per size; sizes seen while ``capturing`` are captured.

    ``size_of(args)`` reads the dynamic size of a call; ``stable[i]`` marks inputs that
    are the same tensor at every call (weights), which need no copy; ``in_place[i]`` marks
    inputs that ``fn`` writes in place (a KV cache). A written input at an address that
    stays (``persistent``, as a cache the caller keeps; another graph's output) is read and
    written there, and a call that passes another tensor in its place runs ``fn`` without
    the graph (logged once); any other written input is copied into a static buffer before
    the replay and back after it. Either way the write lands in the caller's tensor.
    """

    fn: Callable[..., Any]
    size_of: Callable[[tuple[Any, ...]], int | None]
    stable: list[bool]
    capture: GraphCapture
    in_place: list[bool] | None = None
    capturing: bool = False
    graphs: dict[int, _Captured] = field(default_factory=dict)
    replays: int = 0
    persistent: set[int] = field(default_factory=set)  # addresses of written inputs that stay
    misses: int = 0  # calls of a captured size that ran without the graph

    def _capture(self, size: int, args: tuple[Any, ...]) -> _Captured:
        captured = _Captured(None, [], [], None)
        inputs: list[Any] = []
        static = getattr(self.capture, "static_ptrs", set())
        written = self.in_place or [False] * len(args)
        for i, (a, keep) in enumerate(zip(args, self.stable, strict=True)):
            if keep or not isinstance(a, torch.Tensor):
                inputs.append(a)
            elif a.data_ptr() in static or (written[i] and a.data_ptr() in self.persistent):
                # Another graph's output, a model input already copied to a fixed address,
                # or a cache the caller keeps: the same address at every replay. Checked.
                captured.pinned.append((i, a.data_ptr()))
                inputs.append(a)
            else:
                buf = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
                buf.copy_(a)
                captured.copies.append((i, buf))
                if written[i]:
                    captured.written_back.append((i, buf))
                inputs.append(buf)
        captured.graph, captured.outputs = self.capture.capture(self.fn, inputs)
        self.graphs[size] = captured
        return captured

    def __call__(self, *args: Any) -> Any:
        size = self.size_of(args)
        captured = self.graphs.get(size) if size is not None else None
        if captured is None:
            if self.capturing and size is not None:
                return self._capture(size, args).outputs
            return self.fn(*args)
        for i, address in captured.pinned:
            if args[i].data_ptr() != address:  # not fed by the graph it was captured with
                self._missed(i)
                return self.fn(*args)
        for i, buf in captured.copies:
            buf.copy_(args[i])
        self.replays += 1
        result = self.capture.replay(captured.graph)
        for i, buf in captured.written_back:
            args[i].copy_(buf)
        return captured.outputs if result is None else result

    def _missed(self, i: int) -> None:
        self.misses += 1
        if self.misses == 1 and self.in_place and self.in_place[i]:
            log.warning("input %d, which the compiled model writes in place, is not the tensor "
                        "its graphs were captured with: such calls run without graphs "
                        "(capture with this tensor: prepare(*call) or capture(like=call))", i)


def next_capture_size(size: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size ≥ ``size`` (None if there is none)."""
    bigger = [s for s in sizes if s >= size]
    return min(bigger) if bigger else None


def pad_args(args: tuple[Any, ...], dynamic_dims: dict[int, int], size: int) -> tuple[Any, ...]:
    """``args`` with every dynamic dim zero-padded to ``size``."""
    out = list(args)
    for i, d in dynamic_dims.items():
        a = args[i]
        extra = size - a.shape[d]
        if extra > 0:
            pad_shape = list(a.shape)
            pad_shape[d] = extra
            out[i] = torch.cat([a, a.new_zeros(pad_shape)], dim=d)
    return tuple(out)


def unpad_outputs(outputs: Any, padded: int, size: int) -> Any:
    """Slice every output tensor whose first dim is ``padded`` back to ``size`` rows."""
    import torch.utils._pytree as pytree

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == padded:
            return t[:size]
        return t

    return pytree.tree_map(cut, outputs)
