"""The torch.compile front door: each graph Dynamo hands over becomes targets.

Dynamo traces every process here, and its guards stay in charge (recompiles, graph
breaks, automatic dynamic shapes all happen as with any backend). What reaches the
backend is one FX graph per frame and shape regime; it is split and planned like a
``cachebuild.compile`` trace, and its targets come from the store.

Two things differ from a cachebuild trace:

- Targets are built or loaded on the graph's first call, not inside Dynamo's compile:
  exporting or compiling a piece there would run inside Dynamo's tracing context (its
  fake mode, its shape environment) and could change the guards of the frame being
  compiled.
- Python scalars Dynamo leaves unspecialised (floats passed as 0-d tensors with
  ``dynamic=True``, ints that no tensor size carries) are baked into the graph as the
  values of the call, and each call checks its values: other values get their own
  specialised build (one warning line says so, once). A piece then never computes on a
  scalar it cannot see. A scalar that only counts (bumped and handed back, read by no
  tensor computation, as transformers' sliding-window cache counts its tokens) is not a
  reason for another build: the outputs made of it are worked out on each call
  (``Counts``).

And one thing Dynamo decides for the backend: a graph traced on one side of a branch on
the token count (a prompt longer than a sliding window: ``s0 >= 4``) holds on that side
only, and Dynamo's guards keep every other count away from it. Its shape buckets are cut
to that side (``within_guards``); the other counts get a graph of their own, as Dynamo
recompiles for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from cachebuild import process_state
from cachebuild.config import CompileConfig
from cachebuild.errors import UsageError, warn_caller
from cachebuild.graph.effects import eliminate_dead_code, graph_effects, storage_of
from cachebuild.graph.facts import (
    copy_graph,
    device_of,
    holds_at,
    meta_of,
    on_device,
    unpin_device,
    without_autograd,
)
from cachebuild.tracing.trace import TracedGraph, output_metas

log = logging.getLogger("cachebuild")


def _tensor_symbols(fakes: list[Any]) -> set[Any]:
    found: set[Any] = set()
    for f in fakes:
        if isinstance(f, torch.Tensor):
            for size in f.shape:
                if isinstance(size, torch.SymInt):
                    found |= size.node.expr.free_symbols
    return found


def scalar_inputs(gm: fx.GraphModule, fakes: list[Any]) -> list[int]:
    """Positions of graph inputs that are unspecialised Python scalars: SymFloats, SymInts
    that no tensor input's size carries, and 0-d tensors only ever read with ``.item()``
    (how Dynamo passes a float under ``dynamic=True``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes = _tensor_symbols(fakes)
    out = []
    for i, (node, fake) in enumerate(zip(placeholders, fakes, strict=True)):
        if isinstance(fake, torch.SymFloat):
            out.append(i)
        elif isinstance(fake, torch.SymInt) and not (fake.node.expr.free_symbols & sizes):
            out.append(i)
        elif (isinstance(fake, torch.Tensor) and fake.dim() == 0 and node.users
              and all(u.op == "call_method" and u.target == "item" for u in node.users)):
            out.append(i)
    return out


def scalar_value(value: Any) -> Any:
    """The Python value of a scalar input as a call passes it (a symbolic one, as Dynamo
    may hand an int it made dynamic to the backend: the value it was traced with)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"graph input {value} has no value to specialise on")
        return hint
    return value


def specialise(gm: fx.GraphModule, values: dict[int, Any]) -> fx.GraphModule:
    """A copy of ``gm`` in which input ``i`` is the constant ``values[i]`` (the inputs
    stay, unused, so that the graph is still called with all of them)."""
    new = fx.GraphModule(gm, copy_graph(gm.graph))
    placeholders = [n for n in new.graph.nodes if n.op == "placeholder"]
    for i, value in values.items():
        node = placeholders[i]
        for user in list(node.users):
            if user.op == "call_method" and user.target == "item":
                user.replace_all_uses_with(value)  # type: ignore[arg-type]
                new.graph.erase_node(user)
        node.replace_all_uses_with(value)  # type: ignore[arg-type]
    eliminate_dead_code(new.graph)  # keeping what writes in place
    new.recompile()
    return new


def without_grad_switches(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, or a copy without the calls that switch autograd on and off (Dynamo records
    a forward's ``with torch.no_grad():`` as ``torch._C._set_grad_enabled``, traced with
    the caller's mode): every piece runs without autograd (``GraphForward.__call__``), and
    a switch back on inside would have the rest of the call record it."""
    def switches(graph: fx.Graph) -> list[fx.Node]:
        return [n for n in graph.nodes
                if n.op == "call_function" and n.target is torch._C._set_grad_enabled]

    if not switches(gm.graph):
        return gm
    new = fx.GraphModule(gm, copy_graph(gm.graph))
    for node in switches(new.graph):
        new.graph.erase_node(node)
    new.recompile()
    return new


@dataclass
class Counts:
    """The outputs of a graph that are Python numbers computed from scalar inputs alone
    (``inputs``): a count read, bumped and handed back for Dynamo to store, as
    transformers' sliding-window cache counts its tokens. ``graph`` computes them from the
    graph's inputs, ``positions`` says where they go in its outputs."""

    inputs: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    graph: fx.GraphModule | None = None

    @classmethod
    def of(cls, gm: fx.GraphModule, scalars: list[int]) -> Counts:
        """The scalar inputs of ``gm`` whose every use is number arithmetic ending in
        outputs, computed from nothing but scalar inputs and constants."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        scalar_nodes = {placeholders[i] for i in scalars}
        output = next(n for n in gm.graph.nodes if n.op == "output")
        outs = list(output.args[0])
        counted = [i for i in scalars if _counts_only(placeholders[i], scalar_nodes)]
        if not counted:
            return cls()
        reached = _descendants([placeholders[i] for i in counted])
        positions = [p for p, o in enumerate(outs) if isinstance(o, fx.Node) and o in reached]
        graph = fx.Graph()
        env = {n: graph.placeholder(n.name) for n in placeholders}
        needed = _ancestors([outs[p] for p in positions])
        for node in gm.graph.nodes:
            if node in needed and node.op != "placeholder":
                env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[outs[p]] for p in positions))
        return cls(counted, positions, fx.GraphModule(gm, graph))

    def put(self, out: Any, args: Sequence[Any]) -> Any:
        """``out`` (a variant's outputs) with the counts worked out from ``args``."""
        if self.graph is None:
            return out
        values = self.graph(*args)
        fixed = list(out)
        for p, value in zip(self.positions, values, strict=True):
            fixed[p] = value
        return type(out)(fixed) if isinstance(out, tuple) else fixed


def _is_number(node: fx.Node) -> bool:
    """A call whose value is a Python number and that reads no tensor."""
    if node.op != "call_function":
        return False
    if isinstance(node.meta.get("example_value"), torch.Tensor):
        return False
    return not any(isinstance(a.meta.get("example_value"), torch.Tensor)
                   for a in node.all_input_nodes)


def _counts_only(node: fx.Node, scalars: set[fx.Node]) -> bool:
    """True if everything computed from ``node`` is number arithmetic on scalar inputs
    that ends in the graph's outputs (so no piece reads it)."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        for user in current.users:
            if user.op == "output" or user in seen:
                continue
            if not _is_number(user):
                return False
            if any(a.op == "placeholder" and a not in scalars for a in user.all_input_nodes):
                return False
            seen.add(user)
            todo.append(user)
    return any(u.op == "output" for n in seen | {node} for u in n.users) and all(
        a.op == "placeholder" or a in seen for n in seen for a in n.all_input_nodes)


def _descendants(nodes: list[fx.Node]) -> set[fx.Node]:
    found: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        current = todo.pop()
        for user in current.users:
            if user.op != "output" and user not in found:
                found.add(user)
                todo.append(user)
    return found | set(nodes)


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    found: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo += current.all_input_nodes
    return found


def graph_fakes(gm: fx.GraphModule, example_inputs: list[Any]) -> list[Any]:
    """The graph's inputs as Dynamo traced them (fake, with its symbols)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [n.meta.get("example_value", v)
            for n, v in zip(placeholders, example_inputs, strict=True)]


def within_guards(config: CompileConfig, fakes: list[Any]) -> CompileConfig:
    """``config`` with its shape buckets cut to the token counts Dynamo's guards let reach
    the graph of ``fakes``: a range with an end where one of the graph's shape guards fails
    is cut to the bounds those guards give its symbols, and an exact size where one fails
    is left out (only the end that fails moves). ``config`` itself where every bucket
    holds, or where cutting leaves no range (the build then says which guard fails)."""
    import sympy

    symbols = _tensor_symbols(fakes)
    shape_env = next((f.fake_mode.shape_env for f in fakes if isinstance(f, torch.Tensor)
                      and getattr(f, "fake_mode", None) is not None
                      and f.fake_mode.shape_env is not None), None)
    if shape_env is None or not symbols:
        return config
    # Only guards on the sizes themselves: each bucket stands for one count of every symbol.
    guards = [g.expr for g in shape_env.guards
              if g.expr.free_symbols and g.expr.free_symbols <= symbols]

    def holds(size: int) -> bool:
        return all(holds_at(g, symbols, size) for g in guards)

    if all(holds(n) for n in config.compile_sizes) and all(
            holds(lo) and holds(hi) for lo, hi in config.compile_ranges):
        return config
    low, high = 1, None
    for s in symbols:
        bounds = shape_env.var_to_range.get(s)
        if bounds is None:
            continue
        # torch's infinities are not sympy Integers
        if isinstance(bounds.lower, sympy.Integer):
            low = max(low, int(bounds.lower))
        if isinstance(bounds.upper, sympy.Integer):
            high = int(bounds.upper) if high is None else min(high, int(bounds.upper))
    ranges = []
    for lo, hi in config.compile_ranges:
        # only the end that fails moves: a count Dynamo sends elsewhere anyway (0 or
        # 1, which it specialises) is no reason to move the other
        if not holds(lo):
            lo = max(lo, low)
        if not holds(hi) and high is not None:
            hi = min(hi, high)
        if lo <= hi and holds(lo) and holds(hi):
            ranges.append((lo, hi))
    if not ranges:
        return config
    sizes = tuple(n for n in config.compile_sizes
                  if holds(n) and any(lo <= n <= hi for lo, hi in ranges))
    log.info("cachebuild: Dynamo's guards keep this graph to sizes %s: its buckets are %s",
             [str(g) for g in guards], ranges)
    return replace(config, compile_ranges=tuple(ranges), compile_sizes=sizes)


def shared_written(fakes: list[Any], written: list[int]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` of a graph's inputs that share memory where ``i`` is written in
    place (``written``; Dynamo's fake inputs share it as the call's do). Whether their
    bytes overlap is a call's to say (``overlapping``): disjoint slices of one cache are
    fine."""
    tensors = [(i, storage_of(f)) for i, f in enumerate(fakes) if isinstance(f, torch.Tensor)]
    return [(i, j) for i in written
            for j, s in tensors if j != i and s == storage_of(fakes[i])]


def overlapping(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage may reach the same element: their spans of it
    intersect (views that interleave without touching count as overlapping)."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        if t.numel() == 0:
            return (0, 0)
        start = end = t.storage_offset()
        for size, stride in zip(t.shape, t.stride(), strict=True):
            reach = (size - 1) * stride
            start, end = (start + reach, end) if stride < 0 else (start, end + reach)
        return start, end + 1

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


class GraphForward:
    """What the backend returns for one Dynamo graph: built on its first call, per set of
    scalar values. A call whose token count no bucket of ``config`` holds is refused, or
    with ``out_of_range="eager"`` runs the graph eagerly (one warning per graph), as
    ``cachebuild.compile`` does."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any],
                 plan: Callable[[TracedGraph], Callable[..., Any]],
                 config: CompileConfig) -> None:
        self.gm = gm
        self.config = config
        self.fakes = graph_fakes(gm, example_inputs)
        # Where each call's token counts are: every dim that is a bare symbol.
        self.counted = [(i, d) for i, f in enumerate(self.fakes) if isinstance(f, torch.Tensor)
                        for d, size in enumerate(f.shape) if isinstance(size, torch.SymInt)
                        and size.node.expr.is_Symbol]
        self._warned_eager = False
        #: The graph inputs it writes in place: their version counters move at each call,
        #: as eager's in-place ops move them (compiled pieces write behind autograd's back).
        self.written = graph_effects(gm, list(self.fakes)).written_inputs
        # Inputs that share memory where one is written (two views of one cache, a buffer
        # that views another): pieces take each input apart, so a read of bytes the write
        # reached would miss it. A call where they overlap runs the graph as Dynamo made
        # it, which keeps the sharing.
        self.shared = shared_written(self.fakes, self.written)
        # The graph as Dynamo made it, for the calls that run eagerly (planning below
        # names the traced GPU by its type in ``gm``).
        self._eager_gm = (fx.GraphModule(gm, copy_graph(gm.graph))
                          if config.out_of_range == "eager" or self.shared else None)
        self._names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._device = device_of(self.fakes)
        self.scalars = scalar_inputs(gm, self.fakes)
        # Scalars that only count (a cache's token count, bumped and handed back) reach
        # no tensor: the outputs they make are worked out on each call, and one build
        # serves every value. The others are baked in: a variant per value.
        self.counts = Counts.of(gm, self.scalars)
        self.keyed = [i for i in self.scalars if i not in self.counts.inputs]
        self.plan = plan
        self.variants: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # Plan the traced values now, inside Dynamo's compile, so a graph that cannot be
        # split fails there; build on the first call.
        self._pending = {self._key(example_inputs): self._planned(example_inputs)}

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The values a variant is built for: those of the scalars baked in."""
        return tuple(scalar_value(args[i]) for i in self.keyed)

    def _planned(self, args: Sequence[Any]) -> Callable[[], Callable[..., Any]]:
        """Split and plan the graph with the scalar values of ``args`` baked in; returns
        what builds it."""
        import torch.utils._pytree as pytree

        values = {i: scalar_value(args[i]) for i in self.scalars}
        gm = specialise(self.gm, values) if self.scalars else self.gm
        gm = without_grad_switches(gm)
        unpin_device(gm, device_of(self.fakes))  # every rank's graph alike (facts.py)
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        traced = TracedGraph(
            gm=gm, bindings=[], input_metas=[meta_of(f) for f in self.fakes], source_files={},
            out_spec=pytree.treespec_dumps(pytree.tree_structure(list(range(n_out)))),
            num_outputs=n_out, fake_inputs=self.fakes, whole=False,
            output_metas=output_metas(gm),
        )
        return self.plan(traced)

    def __call__(self, *args: Any) -> Any:
        for i, j in self.shared:
            if overlapping(args[i], args[j]):
                return self._outside(
                    f"graph input {self._names[i]} overlaps {self._names[j]} in memory and "
                    "is written in place: this graph runs eagerly where they overlap (its "
                    "pieces would take the two apart)", args, always=True)
        for i, d in self.counted:
            said = self.config.outside(args[i].shape[d])
            if said is not None:
                return self._outside(said, args)
        key = self._key(args)
        fn = self.variants.get(key)
        if fn is None:
            fn = self._build(key, args)
        out = without_autograd(fn, *args)
        if self.written:
            torch.autograd.graph.increment_version([args[i] for i in self.written])
        return self.counts.put(out, args)

    def _outside(self, said: str, args: Sequence[Any], always: bool = False) -> Any:
        """A call no bucket holds: refused, or run eagerly where the config says so
        (``always``: run eagerly whatever it says)."""
        if self._eager_gm is None or not (always or self.config.out_of_range == "eager"):
            raise UsageError(said)
        if not self._warned_eager:
            warn_caller(said)
            self._warned_eager = True
        with on_device(self._device):
            return self._eager_gm(*args)

    def _build(self, key: tuple[Any, ...], args: Sequence[Any]) -> Callable[..., Any]:
        resolve = self._pending.pop(key, None)
        if resolve is None:
            log.info("graph inputs %s take new values %s: building a specialised variant",
                     self.keyed, key)
            _tell_variants(self._changed(key))
            resolve = self._planned(args)
        fn = self.variants[key] = resolve()
        return fn

    def _changed(self, values: tuple[Any, ...]) -> list[str]:
        """Each scalar input whose value differs from the first variant's, in words
        (``L['kwargs']['cache'].layers[0].cumulative_length_int 8 → 9``)."""
        first = next(iter(self.variants), values)
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        said = []
        for i, before, now in zip(self.keyed, first, values, strict=True):
            if before != now:
                said.append(f"{_input_name(placeholders[i])} {before!r} → {now!r}")
        return said


def _tell_variants(changed: list[str]) -> None:
    """One warning line, the first time in this process that a graph builds another
    variant because a Python number it takes changed: a server sees why its builds do not
    stop (a sliding-window cache's token count builds one per decode step)."""
    if not process_state.current().first_saying("a graph builds a variant per number"):
        return
    log.warning("cachebuild: a compiled graph builds a new variant for each value of the "
                "Python number %s (no tensor carries it, so each value is baked into its "
                "own build; transformers' sliding-window static cache counts tokens this way)",
                ", ".join(changed) or "it takes")


def _input_name(node: fx.Node) -> str:
    """Where Dynamo read a graph input from (``L['x'].n``), else the placeholder's name."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    try:
        return str(name() if callable(name) else name) if name is not None else str(node.target)
    except Exception:  # a source that cannot name itself: the placeholder's name serves
        return str(node.target)
