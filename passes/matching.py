"""Helpers shared by the passes for reading an FX graph.

The same pass runs on graphs at two levels: torch level (Dynamo: ``call_method`` views,
custom ops called through their packet) and aten level (after AOT autograd or in Inductor's
post-grad phase: ``OpOverload`` targets, ``meta["val"]`` fake tensors). These helpers hide
the difference: which op a node calls, its arguments by schema name, its shape, and the
chains of pure reshapes between ops.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

# Ops that only reinterpret the logical row-major order of a tensor's elements: a chain
# of them between two ops changes nothing an elementwise-per-row kernel would see.
RESHAPE_TARGETS: frozenset[Any] = frozenset({
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    torch.reshape,
})
RESHAPE_METHODS = frozenset({"view", "reshape"})


def is_call(node: Any, op: torch._ops.OpOverload) -> bool:
    """True if ``node`` calls ``op`` (directly, or through its packet at torch level)."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and (node.target is op or node.target is op.overloadpacket)
    )


def call_args(node: torch.fx.Node, op: torch._ops.OpOverload) -> dict[str, Any]:
    """The node's arguments by the op schema's names, defaults filled in."""
    schema = op._schema
    bound: dict[str, Any] = {}
    for arg, value in zip(schema.arguments, node.args, strict=False):
        bound[arg.name] = value
    for arg in schema.arguments:
        if arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.name not in bound:
            if not arg.has_default_value():
                raise ValueError(f"{node.format_node()} lacks argument {arg.name!r}")
            bound[arg.name] = arg.default_value
    return bound


def only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The single user of ``node``, or None when it has zero or several."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def getitem_users(node: torch.fx.Node) -> dict[int, list[torch.fx.Node]] | None:
    """For a node returning a tuple: its ``getitem`` users by index.

    None if any user is not a constant-index ``getitem`` (the tuple escapes).
    """
    by_index: dict[int, list[torch.fx.Node]] = {}
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem):
            return None
        index = user.args[1]
        if not isinstance(index, int):
            return None
        by_index.setdefault(index, []).append(user)
    return by_index


def fake_value(node: Any) -> Any:
    """The node's example value (a fake tensor at aten level, a real one at torch level),
    or None if the graph carries no metadata."""
    if not isinstance(node, torch.fx.Node):
        return None
    for key in ("val", "example_value"):
        value = node.meta.get(key)
        if value is not None:
            return value
    return None


def shape_of(node: Any) -> tuple[Any, ...] | None:
    """The node's tensor shape from its metadata (sizes may be symbolic), or None."""
    value = fake_value(node)
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    if meta is not None and hasattr(meta, "shape"):
        return tuple(meta.shape)
    return None


def dim_equals(a: Any, b: Any) -> bool:
    """True only if two sizes are known to be equal without adding a shape guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def same_shape(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    """True only if two shapes are known equal (False when either is unknown)."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(dim_equals(x, y) for x, y in zip(a, b, strict=True))


def is_reshape(node: Any) -> bool:
    """True for a node that only reshapes its first argument."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return node.target in RESHAPE_TARGETS
    return node.op == "call_method" and node.target in RESHAPE_METHODS


def reshape_source(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Follow pure reshapes upwards from ``node``; return the first non-reshape node and
    the reshapes passed through (from ``node`` upwards)."""
    chain: list[torch.fx.Node] = []
    while is_reshape(node) and isinstance(node.args[0], torch.fx.Node):
        chain.append(node)
        node = node.args[0]
    return node, chain


def single_reshape_chain_to(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """Follow ``node``'s only user through pure reshapes, each with a single user.

    Returns the last node reached (``node`` itself if its only user is no reshape) and the
    reshapes passed through, in order.
    """
    chain: list[torch.fx.Node] = []
    current = node
    while True:
        user = only_user(current)
        if user is None or not is_reshape(user) or user.args[0] is not current:
            return current, chain
        chain.append(user)
        current = user


def erase_if_dead(graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node]) -> int:
    """Erase each node in ``nodes`` (in order) that no longer has users; return how many."""
    erased = 0
    for node in nodes:
        if node.graph is graph and not node.users:
            graph.erase_node(node)
            erased += 1
    return erased


def copy_meta(new: torch.fx.Node, old: torch.fx.Node) -> None:
    """Give a replacement node the metadata of the node it replaces (the same value)."""
    for key in ("val", "example_value", "tensor_meta", "stack_trace", "nn_module_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
