"""Device graphs: capture a callable once per size, replay it later.

``GraphCapture`` is a device's graph API: ``CudaGraphCapture`` for CUDA (one memory pool
shared by every graph of a model), ``ReplayCapture`` for devices without one (it keeps
the static-buffer discipline and calls the function at replay), so another device's
graph API plugs in beside them.

A capture here only *records*: nothing runs, nothing is written. The function has run for
real just before, on the same stream and at the same size, which is both the answer of
that call and the warm-up a capture needs (lazy initialisation, kernel loading, library
heuristics happen there, never inside the capture). That is what lets a capture happen
beside a live model (``capture.py``).

A ``Replayer`` is one captured callable at one size: inputs that are not the model's
weights and have no fixed address are copied into static buffers before the replay;
inputs with a fixed address (another graph's output, a cache the caller keeps, a static
argument buffer) are read in place and checked; inputs written in place that had to be
copied are copied back after. Its outputs are the graph's static tensors: **valid until
the next call**. Static buffers come from an ``Arena`` shared by every callable and size of
a model: replays run one after another on one stream, so one buffer per input position
serves them all.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from cachebuild.graph.inputs import token_symbols

log = logging.getLogger("cachebuild")


class GraphCapture(Protocol):
    """A device's graph API: record ``fn(*inputs)`` once, replay it later.

    ``records`` is True where a capture runs nothing (a device graph) and its outputs are
    static tensors; False where ``replay`` calls ``fn`` again (``ReplayCapture``).
    """

    records: bool
    seconds: dict[str, float]
    graphs: int

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
        """Record ``fn(*inputs)``; returns (graph, static outputs or None)."""
        ...

    def replay(self, graph: Any) -> Any:
        """Replay ``graph``; returns fresh outputs, or None where the static ones hold them."""
        ...

    def pool_bytes(self) -> int:
        """Device memory the graphs' pool holds (0 where there is none)."""
        ...


class CudaGraphCapture:
    """CUDA graphs in one memory pool shared by every capture of a model.

    Graphs are recorded on a stream of their own on which nothing is ever run: the
    workspaces CUDA libraries keep per stream (cuBLAS's) that a graph records are then
    touched by its replays alone, never by work running beside them (a background
    capture's real runs, a server's calls). Captures use the ``thread_local`` error mode,
    so another thread's CUDA calls neither break a capture nor are refused. ``seconds``
    splits capture time into stream capture and graph instantiation.
    """

    records = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)
        self.seconds = {"capture": 0.0, "instantiate": 0.0}
        self.graphs = 0
        self._primed: set[int] = set()

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
        from cachebuild import compat

        start = time.perf_counter()
        graph, separate = compat.cuda_graph_for_capture()
        with torch.cuda.stream(self.stream):
            self._prime()
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outputs = fn(*inputs)
            finally:
                graph.capture_end()
            captured = time.perf_counter()
            if separate:
                graph.instantiate()
        self.seconds["capture"] += captured - start
        self.seconds["instantiate"] += time.perf_counter() - captured
        self.graphs += 1
        return graph, outputs

    def _prime(self) -> None:
        """Once per thread, before its first capture: give this thread's cuBLAS handle its
        workspaces for the capture stream outside any capture (one tiny product each way
        cuBLAS is called), so no capture allocates them."""
        thread = threading.get_ident()
        if thread in self._primed:
            return
        a = torch.ones(16, 16, device=self.device)
        torch.mm(a, a)
        torch.addmm(a[0], a, a)  # the cuBLASLt path (a product with a bias)
        self.stream.synchronize()
        self._primed.add(thread)

    def replay(self, graph: Any) -> None:
        graph.replay()

    def pool_bytes(self) -> int:
        """Bytes the allocator has reserved for this pool (its segments)."""
        pool = tuple(self.pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s.get("segment_pool_id", ())) == pool)


class ReplayCapture:
    """For devices without a graph API: "replay" calls the function on the static inputs.

    Outputs follow the same contract (valid until the next call); used on CPU.
    """

    records = False

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.graphs = 0

    def capture(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
        self.graphs += 1
        return (fn, list(inputs)), None

    def replay(self, graph: Any) -> Any:
        fn, inputs = graph
        return fn(*inputs)

    def pool_bytes(self) -> int:
        return 0


def capture_for(device: str) -> GraphCapture:
    """The graph API for a device type."""
    if device.startswith("cuda"):
        return CudaGraphCapture(device)
    return ReplayCapture()


class Arena:
    """Static input buffers, one per (input position, dtype, device), grown as needed.

    A buffer is handed out as a view of the shape and strides asked for; a request larger
    than the buffer replaces it with one at least twice as large (graphs captured on the
    old one keep it alive through the views they hold). Sharing is safe because replays run
    one after another on one stream and every graph reads its buffer only while it runs.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple[Any, ...], torch.Tensor] = {}
        self.nbytes = 0  # every buffer ever allocated, outgrown ones included

    def buffer(self, slot: Any, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped and strided like ``like``, at the address of ``slot``'s buffer."""
        need = _extent(like)
        key = (slot, like.dtype, like.device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < need:
            size = max(need, 2 * flat.numel() if flat is not None else need, 1)
            flat = torch.empty(size, dtype=like.dtype, device=like.device)
            self._flat[key] = flat
            self.nbytes += flat.numel() * flat.element_size()
        return flat.as_strided(like.size(), like.stride())


def _extent(t: torch.Tensor) -> int:
    """Elements a tensor of ``t``'s shape and strides spans from its first one."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


@dataclass(eq=False)
class Replayer:
    """One callable captured at one size; ``replayer(*args)`` is ``fn(*args)``.

    ``copies``: (input position, static buffer) filled before each replay; ``pinned``:
    (input position, address) read in place, and checked: a call with another tensor there
    runs ``fallback`` instead (counted in ``misses``); ``written_back``: buffers copied
    back into the caller's tensor after the replay (inputs written in place).
    """

    api: GraphCapture
    graph: Any
    outputs: Any
    fallback: Callable[..., Any]
    copies: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    pinned: list[tuple[int, int]] = field(default_factory=list)
    written_back: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    #: a call's result (not a piece's): its tensors that lie in a static argument buffer
    #: are given back as the caller's argument, or the same view of it (``ArgumentViews``)
    argument_views: ArgumentViews | None = None
    replays: int = 0
    misses: int = 0

    def __call__(self, *args: Any) -> Any:
        for i, address in self.pinned:
            if args[i].data_ptr() != address:
                self.misses += 1
                return self.fallback(*args)
        for i, buf in self.copies:
            buf.copy_(args[i])
        self.replays += 1
        result = self.api.replay(self.graph)
        for i, buf in self.written_back:
            args[i].copy_(buf)
        result = self.outputs if result is None else result
        return result if self.argument_views is None else self.argument_views(result, args)

    def fast(self) -> Callable[..., Any]:
        """``self(*args)`` as a closure over what a replay uses, looked up once (the graph's
        launch bound, the lists made tuples, steps with nothing to do left out): for
        replayers whose fields are final, called once per piece per step. It counts
        ``replays`` and ``misses`` as a call does."""
        launch = functools.partial(self.api.replay, self.graph)
        outputs, fallback = self.outputs, self.fallback
        pinned, copies = tuple(self.pinned), tuple(self.copies)
        back = tuple(self.written_back)
        views = self.argument_views if copies else None
        me = self
        if not (pinned or copies or back):
            def bare(*args: Any) -> Any:
                me.replays += 1
                result = launch()
                return outputs if result is None else result

            return bare

        def run(*args: Any) -> Any:
            for i, address in pinned:
                if args[i].data_ptr() != address:
                    me.misses += 1
                    return fallback(*args)
            for i, buf in copies:
                buf.copy_(args[i])
            me.replays += 1
            result = launch()
            for i, buf in back:
                args[i].copy_(buf)
            result = outputs if result is None else result
            return result if views is None else views(result, args)

        return run


class ArgumentViews:
    """A call's result as eager gives it: where the forward returns an argument, or a view
    of one (``return x``, ``x.t()``), a replay's result holds that argument's static buffer
    instead. Given back as the caller's argument, or the same view of it, so that a later
    write into the argument shows in the output as it would eagerly.

    Which tensors of the result lie in which buffer is found at the first replay (the
    result's structure is the same at every replay of one size); a result with none costs
    one check of an empty tuple per call after that."""

    def __init__(self, copies: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.copies = tuple(copies)
        #: (leaf index, argument, the buffer's strides, offset in it; None: the buffer)
        self.placed: tuple[tuple[int, int, tuple[int, ...], int | None], ...] | None = None

    def __call__(self, result: Any, args: Sequence[Any]) -> Any:
        if self.placed is None:
            self.placed = self._find(result)
        if not self.placed:
            return result
        leaves, spec = pytree.tree_flatten(result)
        for k, i, stride, offset in self.placed:
            a = args[i]
            if offset is None:  # the argument itself, however it is laid out
                leaves[k] = a
            elif a.stride() == stride:  # else laid out otherwise: the copy stays
                t = leaves[k]
                leaves[k] = a.view(t.dtype).as_strided(t.size(), t.stride(),
                                                       a.storage_offset() + offset)
        return pytree.tree_unflatten(leaves, spec)

    def _find(self, result: Any) -> tuple[tuple[int, int, tuple[int, ...], int | None], ...]:
        placed = []
        for k, t in enumerate(pytree.tree_leaves(result)):
            if not isinstance(t, torch.Tensor):
                continue
            for i, buf in self.copies:
                if t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                    continue
                if t.element_size() != buf.element_size():  # its bytes as wider or
                    break  # narrower elements: the copy stays
                same = (t.dtype == buf.dtype and t.size() == buf.size()
                        and t.stride() == buf.stride()
                        and t.storage_offset() == buf.storage_offset())
                placed.append((k, i, tuple(buf.stride()),
                               None if same else t.storage_offset() - buf.storage_offset()))
                break
        return tuple(placed)


def weak(outputs: Any) -> Any:
    """``outputs`` with every tensor replaced by one at the same address that does not keep
    its memory: the pool may hand it to later captures, which is safe because a graph
    writes it only when it replays, and then in the order the capture saw."""
    from cachebuild import compat

    return pytree.tree_map_only(torch.Tensor, compat.unowned_alias, outputs)


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples, lists and dicts."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


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


#: How one graph output of a padded call comes back to the call's size: the dims to cut
#: (a tensor whose dims are the token count), the size itself (a size the model returns),
#: or nothing (it does not depend on the token count).
Unpad = tuple[int, ...] | str


def pad_plan(output_metas: Sequence[Any], input_metas: Sequence[Any]) -> list[Unpad] | str:
    """How each graph output of a padded call is cut back (``unpad_outputs``), or why a
    call cannot be padded: an output that depends on the token count other than as a
    whole dim of its own (``2 * T`` rows, a sum over tokens in a size), or one whose
    traced value is unknown. The token count is every symbol that is a whole dim of an
    input (``inputs.token_symbols``)."""
    tokens = token_symbols(input_metas)
    plan: list[Unpad] = []
    for i, m in enumerate(output_metas):
        if m is None:
            return f"output {i} was traced without a value to say what it is"
        dims = list(m.shape) if m.kind in ("tensor", "symint") else []
        odd = [d for d in dims if isinstance(d, str) and d not in tokens]
        if odd:
            return f"output {i} depends on the token count as {odd[0]}, not as a dim of its own"
        cut = tuple(j for j, d in enumerate(dims) if isinstance(d, str))
        plan.append(("size" if m.kind == "symint" else cut) if cut else ())
    return plan


def unpad_outputs(outputs: Any, plan: list[Unpad], size: int) -> Any:
    """The outputs of a call padded to a capture size, as the call of ``size`` tokens
    gives them: each output's token dims cut back to ``size`` (``pad_plan``), a size it
    returns made ``size``. ``outputs`` is the model's output structure over the graph's
    outputs in order (a plain pytree)."""
    leaves, spec = pytree.tree_flatten(outputs)
    if len(leaves) != len(plan):
        raise RuntimeError(f"padded call returned {len(leaves)} values, {len(plan)} planned")
    out = []
    for leaf, how in zip(leaves, plan, strict=True):
        if how == "size":
            leaf = size if not isinstance(leaf, torch.Tensor) else torch.full_like(leaf, size)
        else:
            for dim in how:
                leaf = leaf.narrow(dim, 0, size)
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)
