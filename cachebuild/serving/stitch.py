"""The stitched forward: compiled pieces dispatched by size, splitting ops run eagerly.

Built from an Entry alone (no Dynamo): the stitching graph becomes a GraphModule whose
submodules are ``PieceRunner``s (compiled pieces) or small eager graphs (splitting ops).
A PieceRunner picks its target by the runtime size of the dynamic dim: an exact compile
size first, else the range that holds it, and gives the inputs that come from inside the
model the strides its piece was compiled for (``inputs.LayoutGuard``, made by the caller
with the other checks of the inputs). Splitting-op pieces that compute the same thing are
one module, shared.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild.building.entry import Entry
from cachebuild.errors import UsageError
from cachebuild.graph.facts import on_device
from cachebuild.graph.inputs import LayoutGuard
from cachebuild.graph.outputs import Builder
from cachebuild.serving.capture import PieceSpec
from cachebuild.tracing.targets import canonical_graph
from cachebuild.tracing.trace import Binding
from cachebuild.trust.fxjson import GraphFormatError, data_to_module


def _size_reader(size_input: tuple[int, int] | None) -> Callable[[tuple[Any, ...]], int | None]:
    """Reads a call's dynamic size from input ``i``'s dim ``d``, or input ``i`` itself
    where ``d`` is -1 (None: no dynamic size)."""
    if size_input is None:
        return lambda args: None
    i, d = size_input
    if d == -1:
        return lambda args: int(args[i])
    return lambda args: args[i].shape[d]


class PieceRunner:
    """One compiled piece over all its buckets.

    ``layout`` gives the inputs that come from inside the model the strides the piece was
    compiled for before it reads them (``inputs.LayoutGuard``); an input in ``written``
    (written in place by the piece) that had to be copied for that is copied back after.
    """

    def __init__(self, name: str, size_input: tuple[int, int] | None, single_output: bool,
                 table: list[tuple[dict[str, Any], Callable[..., Any]]],
                 layout: LayoutGuard | None = None, written: Sequence[int] = ()) -> None:
        self.name = name
        self.written = list(written)
        self.size_of = _size_reader(size_input)
        self.single_output = single_output
        self.layout = layout if layout is not None and layout.checked else None
        self.exact = {b["size"]: fn for b, fn in table if "size" in b}
        self.ranges = [(b["range"][0], b["range"][1], fn) for b, fn in table if "range" in b]
        self.static = next((fn for b, fn in table if "static" in b), None)

    def select(self, size: int | None) -> Callable[..., Any]:
        if size is None:
            assert self.static is not None
            return self.static
        fn = self.exact.get(size)
        if fn is not None:
            return fn
        for lo, hi, fn in self.ranges:
            if lo <= size <= hi:
                return fn
        raise UsageError(f"size {size} lies outside every compile range of {self.name}")

    def __call__(self, *args: Any) -> Any:
        given = args
        if self.layout is not None:
            args = self.layout(args)
        out = self.select(self.size_of(args))(*args)
        if args is not given:
            for i in self.written:
                if args[i] is not given[i]:
                    given[i].copy_(args[i])
        return out[0] if self.single_output else tuple(out)


@dataclass
class Stitched:
    """The stitched forward of an entry: a GraphModule over the pieces, each piece's
    callable by name (a PieceRunner or an eager splitting-op graph's forward), and how a
    capture pass wraps the compiled ones."""

    gm: torch.fx.GraphModule
    calls: dict[str, Callable[..., Any]]
    compiled: dict[str, PieceSpec] = field(default_factory=dict)
    #: The graph's outputs that are numbers (a size, or a value computed from sizes) by
    #: position, with their Python type: a compiled piece may hand them back as 0-dim
    #: tensors (AOTInductor's wrapper does, on the CPU), which the caller must not see.
    numbers: dict[int, type] = field(default_factory=dict)


def stitch(entry: Entry, loaded: dict[str, Any], layouts: dict[str, LayoutGuard]) -> Stitched:
    """The stitched forward of ``entry`` over loaded targets; takes the graph's inputs.
    ``layouts``: each compiled piece's ``LayoutGuard`` by name (``inputs.layout_guards``)."""
    calls: dict[str, Any] = {}
    compiled: dict[str, PieceSpec] = {}
    # Splitting-op pieces are small stateless graphs, most of them alike (one attention
    # call per layer): each distinct one becomes a module once, shared by its copies.
    eager: dict[str, torch.fx.GraphModule] = {}
    for piece in entry.pieces:
        if piece.compiled:
            table = [(t.bucket, loaded[t.key]) for t in piece.targets]
            calls[piece.name] = PieceRunner(piece.name, piece.size_input, piece.single_output,
                                            table, layouts.get(piece.name), piece.written)
            compiled[piece.name] = PieceSpec(list(piece.weights),
                                             _flags(piece.written, len(piece.input_metas)))
        else:
            try:  # what it computes, with its names made canonical: alike pieces are equal
                shape = json.dumps(canonical_graph(piece.nodes, [])["nodes"], sort_keys=True,
                                   allow_nan=False)
            except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
                data_to_module(piece.nodes)  # raises GraphFormatError saying what is wrong
                raise GraphFormatError(f"stored piece {piece.name} is not a graph") from None
            if shape not in eager:
                eager[shape] = data_to_module(piece.nodes)
            calls[piece.name] = eager[shape].forward
    numbers = {i: float if m.kind == "float" else int for i, m in enumerate(entry.output_metas)
               if m is not None and m.kind in ("symint", "int", "float")}
    return Stitched(data_to_module(entry.stitch, calls), calls, compiled, numbers)


class _Direct:
    """Stands for a stitched GraphModule as ``self`` in its generated forward, handing out
    the raw piece callables: a call then skips ``nn.Module.__call__`` twice per piece,
    microseconds that a piecewise replay pays on the CPU at every layer."""

    def __init__(self, gm: torch.fx.GraphModule, calls: dict[str, Callable[..., Any]]) -> None:
        self._gm = gm
        self.__dict__.update(calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gm, name)


def direct_forward(stitched: Stitched,
                   calls: dict[str, Callable[..., Any]] | None = None) -> Callable[..., Any]:
    """The stitched forward, calling each piece's callable (``calls``, default the
    stitched ones) directly; a number among its outputs is a Python number."""
    run = type(stitched.gm).forward.__get__(_Direct(stitched.gm, calls or stitched.calls))
    if not stitched.numbers:
        return run
    numbers = stitched.numbers

    def forward(*args: Any) -> Any:
        out = run(*args)
        return type(out)(numbers[i](v) if i in numbers and isinstance(v, torch.Tensor) else v
                         for i, v in enumerate(out))

    return forward


def forward_over(stitched: Stitched, calls: dict[str, Callable[..., Any]],
                 weights: Callable[[], list[Any]], from_call: Sequence[tuple[int, Binding]],
                 make_output: Builder) -> Callable[[tuple[Any, ...]], Any]:
    """The forward over a call's arguments: the stitched graph, calling ``calls`` (the
    pieces as they are, a capture pass's wrapped ones, a size's replayers), on the graph
    inputs ``weights()`` gives (the model's, as bound at the call) with the call's
    arguments and sizes put where ``from_call`` says; its outputs (and tensors returned as
    they are) as ``make_output`` structures them."""
    run = direct_forward(stitched, calls)

    def forward(args: tuple[Any, ...]) -> Any:
        flat = list(weights())  # weights and constants in place; fill in the call
        for position, b in from_call:
            flat[position] = args[b.arg] if b.kind == "arg" else args[b.arg].shape[b.dim]
        return make_output(run(*flat), flat, args)

    return forward


def on_device_forward(forward: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``forward`` run with ``device`` current (``facts.on_device``), where it has an index:
    graphs name the model's GPU by type alone, so they run on whichever GPU is current."""
    if torch.device(device).index is None:
        return forward
    scope = on_device(device)

    def run(*args: Any) -> Any:
        with scope:
            return forward(*args)

    return run


def _flags(positions: Sequence[int], count: int) -> list[bool]:
    """``count`` flags, True at ``positions``."""
    chosen = set(positions)
    return [i in chosen for i in range(count)]


