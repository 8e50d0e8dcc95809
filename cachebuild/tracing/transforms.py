"""Functorch transforms in a traced graph, turned into the plain operators they run.

Dynamo leaves ``torch.vmap`` (and ``grad``, ``jvp``) in a graph as calls into functorch:
a transform level entered, tensors wrapped for it (``_add_batch_dim``), the body on the
wrapped tensors, the results unwrapped, the level left. Those calls carry process state
from one node to the next (the current level) and act on wrapper tensors that own no
memory, so nothing downstream can take them: a piece boundary inside a level would split
the state between two compiled programs, the write finder cannot see a wrapper's memory,
and a stored graph may not call them. ``desugar`` traces each such region once more,
through the transforms, on the trace's fake values (as AOT autograd would), and puts the
operators it ran in the region's place: a batched ``linear`` becomes the ``aten`` ops
functorch's batching rules produce, an in-place write through a wrapper a write on the
tensor underneath. What remains is an ordinary graph that computes the same values.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.fx as fx

from cachebuild.errors import UsageError
from cachebuild.graph.effects import is_transform_call

#: The calls that open and close a transform's level (their names in functorch).
_OPEN = ("_vmap_increment_nesting", "_grad_increment_nesting", "_jvp_increment_nesting",
         "_enter_dual_level")
_CLOSE = ("_vmap_decrement_nesting", "_grad_decrement_nesting", "_jvp_decrement_nesting",
          "_exit_dual_level")


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", "")


def regions(graph: fx.Graph) -> list[list[fx.Node]]:
    """The outermost runs of nodes from a first functorch call to the call that closes
    every level opened since, in graph order. UsageError where a level is never closed."""
    found: list[list[fx.Node]] = []
    current: list[fx.Node] | None = None
    depth = 0
    for node in graph.nodes:
        if current is None:
            if not is_transform_call(node):
                continue
            current = []
        current.append(node)
        if is_transform_call(node):
            if _name(node) in _OPEN:
                depth += 1
            elif _name(node) in _CLOSE:
                depth -= 1
                if depth == 0:
                    found.append(current)
                    current = None
    if current is not None and any(is_transform_call(n) and _name(n) in _OPEN
                                   for n in current):
        raise UsageError("the traced graph enters a functorch transform (vmap, grad, jvp) "
                         "that it never leaves; it cannot be compiled in pieces")
    if current:  # functorch calls that open no level (a decomposition table loaded)
        found.append(current)
    return found


def desugar(gm: fx.GraphModule, example_inputs: list[Any], fake_mode: Any) -> bool:
    """Replace every functorch region of ``gm`` (``regions``) by the operators it runs on
    ``example_inputs`` (fake values in ``fake_mode``); True if there was one. The graph
    computes what it did, with the same writes on the same tensors."""
    found = regions(gm.graph)
    if not found:
        return False
    from torch.fx.experimental.proxy_tensor import make_fx

    for region in found:
        # Run again for each region: a later one may read what an earlier one became.
        values = _values(gm, example_inputs, fake_mode)
        inputs, outputs, body = _extract(gm, region)
        try:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                plain = make_fx(body)(*[values[n] for n in inputs])
        except Exception as e:  # refused before anything is built or run
            first = (str(e).strip().splitlines() or [""])[0]
            raise UsageError("a functorch transform (vmap, grad, jvp) in the traced graph "
                             "could not be traced into plain operators: "
                             f"{type(e).__name__}: {first}") from e
        _inline(gm, region, inputs, outputs, plain)
    gm.graph.lint()
    gm.recompile()
    return True


def _extract(gm: fx.GraphModule, region: list[fx.Node]
             ) -> tuple[list[fx.Node], list[fx.Node], fx.GraphModule]:
    """``region`` as a graph of its own: the nodes it reads from outside (its inputs, in
    order), its nodes read outside (its outputs), and the module taking the one to the
    other."""
    inside = set(region)
    inputs: list[fx.Node] = []
    for node in region:
        inputs += [a for a in node.all_input_nodes if a not in inside and a not in inputs]
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: sub.placeholder(f"in{i}") for i, n in enumerate(inputs)}
    for node in region:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    return inputs, outputs, fx.GraphModule(gm, sub)


def _values(gm: fx.GraphModule, example_inputs: list[Any], fake_mode: Any) -> dict[fx.Node, Any]:
    """Every node's value on ``example_inputs`` (the region inputs' examples)."""
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n] = super().run_node(n)
            return values[n]

    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        Recorder(gm).run(*example_inputs)
    return values


def _inline(gm: fx.GraphModule, region: list[fx.Node], inputs: list[fx.Node],
            outputs: list[fx.Node], plain: fx.GraphModule) -> None:
    """Put ``plain``'s nodes where ``region`` stood, fed by ``inputs``, its results read
    where ``outputs`` were; the region's nodes are removed."""
    graph = gm.graph
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    results: Any = None
    with graph.inserting_before(region[0]):
        for node in plain.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "output":
                results = fx.map_arg(node.args[0], lambda a: env[a])
            elif node.op == "get_attr":
                raise UsageError("a functorch transform in the traced graph makes a "
                                 f"constant tensor ({node.target}); it cannot be compiled")
            else:
                env[node] = graph.node_copy(node, lambda a: env[a])
    for old, new in zip(outputs, results, strict=True):
        old.replace_all_uses_with(new)
    for node in reversed(region):
        graph.erase_node(node)
