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

aten = torch.ops.aten

# Ops that only reinterpret the logical row-major order of a tensor's elements: a chain
# of them between two ops changes nothing an elementwise-per-row kernel would see.
# The ``_copy`` variants appear after functionalization with views removed.
RESHAPE_TARGETS: frozenset[Any] = frozenset({
    aten.view.default,
    aten.view_copy.default,
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
    # Imported here: symbolic_shapes pulls in sympy (seconds), and a warm process builds
    # the pass manager (for its uuids) without ever matching a graph.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

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


def ready_before(value: Any, anchor: torch.fx.Node) -> bool:
    """Make sure ``value`` is defined before ``anchor``: constants and earlier nodes are;
    a later ``get_attr`` (no inputs) is moved up; anything else is not."""
    if not isinstance(value, torch.fx.Node):
        return True
    for node in anchor.graph.nodes:
        if node is value:
            return True
        if node is anchor:
            break
    if value.op == "get_attr":
        anchor.prepend(value)
        return True
    return False


def insert_getitems(graph: torch.fx.Graph, node: torch.fx.Node, count: int,
                    vals: list[Any] | None) -> list[torch.fx.Node]:
    """``getitem(node, i)`` for ``i < count``, inserted right after ``node``."""
    items = []
    with graph.inserting_after(node):
        for i in reversed(range(count)):
            item = graph.call_function(operator.getitem, (node, i))
            if vals is not None and vals[i] is not None:
                item.meta["val"] = vals[i]
            items.append(item)
    return list(reversed(items))


def set_tuple_val(node: torch.fx.Node, vals: list[Any]) -> None:
    """Record a tuple-returning node's value when every element's value is known."""
    if all(v is not None for v in vals):
        node.meta["val"] = tuple(vals)


SPLIT_OPS = (aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
SLICE_OPS = (aten.slice.Tensor, aten.slice_copy.Tensor)
# torch-level spellings of a split (Dynamo records the function or the method).
SPLIT_FUNCTIONS = (torch.split, torch.functional.split, torch.Tensor.split)


def last_dim_slice(node: Any) -> tuple[torch.fx.Node, int, int] | None:
    """If ``node`` is a slice of a 2-D tensor along its last dim, ``(tensor, start,
    length)``; recognises ``split_with_sizes``/``split`` + ``getitem`` and ``slice`` (and their
    ``_copy`` forms)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        split, index = node.args
        if not isinstance(split, torch.fx.Node) or not isinstance(index, int):
            return None
        split_op = next((o for o in SPLIT_OPS if is_call(split, o)), None)
        if split_op is not None:
            a = call_args(split, split_op)
            source, sizes, dim = a["self"], a["split_sizes"], a["dim"]
        elif (split.op == "call_method" and split.target == "split") or (
                split.op == "call_function" and split.target in SPLIT_FUNCTIONS):
            source = split.args[0]
            sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size")
            dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        else:
            return None
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes):
            return None
        if not is_last_dim_of_2d(source, dim) or index >= len(sizes):
            return None
        return full_slice_source(source), sum(sizes[:index]), sizes[index]
    slice_op = next((o for o in SLICE_OPS if is_call(node, o)), None)
    if slice_op is not None:
        a = call_args(node, slice_op)
        source, start = a["self"], a["start"]
        out_shape = shape_of(node)
        if a["step"] != 1 or not is_last_dim_of_2d(source, a["dim"]) or out_shape is None:
            return None
        # The slice's own width says how many elements it keeps (clamping included).
        start, length = 0 if start is None else start, out_shape[-1]
        if not (isinstance(start, int) and isinstance(length, int)) or start < 0 or length < 1:
            return None
        return full_slice_source(source), start, length
    return None


# ``x[:, a:b]`` traces as a slice of every dim up to the last; a slice end at or past this
# is "to the end" (torch writes sys.maxsize).
SLICE_TO_END = 2 ** 62


def is_full_slice(node: Any) -> bool:
    """True for ``slice(x, dim, 0, end-or-more, 1)``: a slice that keeps all of ``x``."""
    slice_op = next((o for o in SLICE_OPS if is_call(node, o)), None)
    if slice_op is None:
        return False
    a = call_args(node, slice_op)
    return (a["step"] == 1 and a["start"] in (None, 0)
            and (a["end"] is None or (isinstance(a["end"], int) and a["end"] >= SLICE_TO_END)))


def full_slice_source(node: torch.fx.Node) -> torch.fx.Node:
    """Follow slices that keep everything upwards to the tensor they slice."""
    while is_full_slice(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def is_last_dim_of_2d(source: Any, dim: Any) -> bool:
    """True if ``source`` is known to be 2-D and ``dim`` names its last dim."""
    shape = shape_of(source)
    return shape is not None and len(shape) == 2 and dim in (-1, 1)
