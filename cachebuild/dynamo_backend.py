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
  specialised build. A piece then never computes on a scalar it cannot see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from cachebuild.effects import eliminate_dead_code
from cachebuild.facts import copy_graph, device_of, meta_of, unpin_device
from cachebuild.trace import TracedGraph

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


class GraphForward:
    """What the backend returns for one Dynamo graph: built on its first call, per set of
    scalar values."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any],
                 plan: Callable[[TracedGraph], Callable[..., Any]]) -> None:
        self.gm = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.fakes = [n.meta.get("example_value", v)
                      for n, v in zip(placeholders, example_inputs, strict=True)]
        self.scalars = scalar_inputs(gm, self.fakes)
        self.plan = plan
        self.variants: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # Plan the traced values now, inside Dynamo's compile, so a graph that cannot be
        # split fails there; build on the first call.
        values = tuple(scalar_value(example_inputs[i]) for i in self.scalars)
        self._pending = {values: self._planned(values)}

    def _planned(self, values: tuple[Any, ...]) -> Callable[[], Callable[..., Any]]:
        """Split and plan the graph with ``values`` baked in; returns what builds it."""
        import torch.utils._pytree as pytree

        gm = specialise(self.gm, dict(zip(self.scalars, values, strict=True))) \
            if self.scalars else self.gm
        unpin_device(gm, device_of(self.fakes))  # every rank's graph alike (facts.py)
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        traced = TracedGraph(
            gm=gm, bindings=[], input_metas=[meta_of(f) for f in self.fakes], source_files={},
            out_spec=pytree.treespec_dumps(pytree.tree_structure(list(range(n_out)))),
            num_outputs=n_out, fake_inputs=self.fakes,
        )
        return self.plan(traced)

    def __call__(self, *args: Any) -> Any:
        values = tuple(scalar_value(args[i]) for i in self.scalars)
        fn = self.variants.get(values)
        if fn is None:
            fn = self._build(values)
        return fn(*args)

    def _build(self, values: tuple[Any, ...]) -> Callable[..., Any]:
        resolve = self._pending.pop(values, None)
        if resolve is None:
            log.info("graph inputs %s take new values %s: building a specialised variant",
                     self.scalars, values)
            _tell_variants(self._changed(values))
            resolve = self._planned(values)
        fn = self.variants[values] = resolve()
        return fn

    def _changed(self, values: tuple[Any, ...]) -> list[str]:
        """Each scalar input whose value differs from the first variant's, in words
        (``L['kwargs']['cache'].layers[0].cumulative_length_int 8 → 9``)."""
        first = next(iter(self.variants), values)
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        said = []
        for i, before, now in zip(self.scalars, first, values, strict=True):
            if before != now:
                said.append(f"{_input_name(placeholders[i])} {before!r} → {now!r}")
        return said


#: Whether this process was told that a graph builds a variant per scalar value.
_TOLD = [False]


def _tell_variants(changed: list[str]) -> None:
    """One warning line, the first time in this process that a graph builds another
    variant because a Python number it takes changed: a server sees why its builds do not
    stop (a sliding-window cache's token count builds one per decode step)."""
    if _TOLD[0]:
        return
    _TOLD[0] = True
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
