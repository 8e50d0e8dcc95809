"""FX graphs as plain JSON data, and back, without Dynamo and without exec of stored code.

Used for everything cachebuild keeps of a graph: the stitching graph of an entry, the
eager splitting-op pieces, the ``eager_fusion`` artifacts, and the canonical form of a
piece that enters its key. A function target is stored by name (``module:qualname`` or
``ns::op.overload``) and resolved on load, so a changed or missing op is an error, not a
silent different program.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

# Namespaces tried when a function's __module__ does not lead back to it (C functions
# bound on torch's private classes, e.g. torch.rms_norm).
_FALLBACK_MODULES = ("torch", "torch.nn.functional", "torch._C._nn", "torch._C._VariableFunctions",
                     "operator", "builtins", "math")


class GraphFormatError(ValueError):
    """A graph that cannot be stored (unknown target, unsupported constant) or restored."""


def target_name(target: Any) -> str:
    """A name that ``resolve_target`` turns back into ``target``."""
    if isinstance(target, torch._ops.OpOverload):
        return f"op:{target.name()}"  # ns::name.overload
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"op:{target._qualified_op_name}"
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None)
    candidates = ([module] if module else []) + list(_FALLBACK_MODULES)
    for mod in candidates:
        if mod == "_operator":
            mod = "operator"
        try:
            if _lookup(mod, name) is target:
                return f"fn:{mod}:{name}"
        except (ImportError, AttributeError):
            continue
    raise GraphFormatError(f"cannot name graph target {target!r}: it is not reachable by import")


def _lookup(module: str, name: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_target(name: str) -> Any:
    """The callable (or method/module name) that ``target_name`` named."""
    if name.startswith("op:"):
        qual = name[3:]
        ns, _, rest = qual.partition("::")
        op_name, _, overload = rest.partition(".")
        try:
            packet = getattr(getattr(torch.ops, ns), op_name)
            return getattr(packet, overload) if overload else packet
        except (AttributeError, RuntimeError) as e:
            raise GraphFormatError(
                f"operator {qual} is not registered in this process: import the library "
                "that defines it before loading"
            ) from e
    if name.startswith("fn:"):
        _, module, qual = name.split(":", 2)
        try:
            return _lookup(module, qual)
        except (ImportError, AttributeError) as e:
            raise GraphFormatError(f"function {module}.{qual} no longer exists") from e
    return name


def encode_arg(value: Any) -> Any:
    """One FX argument as JSON data."""
    if isinstance(value, fx.Node):
        return {"n": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"f": repr(value)}
    if isinstance(value, tuple):
        return {"t": [encode_arg(v) for v in value]}
    if isinstance(value, list):
        return [encode_arg(v) for v in value]
    if isinstance(value, dict):
        return {"d": [[k, encode_arg(v)] for k, v in value.items()]}
    if isinstance(value, slice):
        return {"slice": [encode_arg(value.start), encode_arg(value.stop), encode_arg(value.step)]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.memory_format, torch.layout)):
        return {"torch": str(value).removeprefix("torch.")}
    if value is Ellipsis:
        return {"ellipsis": True}
    raise GraphFormatError(f"cannot store graph constant {value!r} of type {type(value).__name__}")


def decode_arg(data: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(data, list):
        return [decode_arg(v, env) for v in data]
    if not isinstance(data, dict):
        return data
    ((tag, v),) = data.items()
    if tag == "n":
        return env[v]
    if tag == "f":
        return float(v)
    if tag == "t":
        return tuple(decode_arg(x, env) for x in v)
    if tag == "d":
        return {k: decode_arg(x, env) for k, x in v}
    if tag == "slice":
        return slice(*(decode_arg(x, env) for x in v))
    if tag == "dtype":
        return getattr(torch, v)
    if tag == "device":
        return torch.device(v)
    if tag == "torch":
        return getattr(torch, v)
    if tag == "ellipsis":
        return Ellipsis
    raise GraphFormatError(f"unknown graph constant tag {tag!r}")


def graph_to_data(graph: fx.Graph) -> list[dict[str, Any]]:
    """The nodes of ``graph`` in order, as JSON data (names, ops, targets, args)."""
    nodes = []
    for node in graph.nodes:
        if node.op == "get_attr":
            raise GraphFormatError(
                f"graph reads attribute {node.target!r}: pieces must take weights as inputs"
            )
        nodes.append({
            "name": node.name,
            "op": node.op,
            "target": target_name(node.target),
            "args": encode_arg(node.args),
            "kwargs": encode_arg(node.kwargs),
        })
    return nodes


def data_to_graph(nodes: list[dict[str, Any]]) -> fx.Graph:
    """Rebuild the fx.Graph that ``graph_to_data`` described."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for item in nodes:
        args = decode_arg(item["args"], env)
        kwargs = decode_arg(item["kwargs"], env)
        target = resolve_target(item["target"])
        op = item["op"]
        if op == "output":
            graph.output(args[0])
            continue
        node = graph.create_node(op, target, tuple(args), dict(kwargs), name=item["name"])
        env[item["name"]] = node
    return graph


def data_to_module(nodes: list[dict[str, Any]], modules: dict[str, Callable] | None = None) -> fx.GraphModule:
    """A runnable GraphModule for stored nodes; ``modules`` supplies call_module targets."""
    root = torch.nn.Module()
    for name, mod in (modules or {}).items():
        if not isinstance(mod, torch.nn.Module):
            mod = _CallableModule(mod)
        root.add_module(name, mod)
    return fx.GraphModule(root, data_to_graph(nodes))


class _CallableModule(torch.nn.Module):
    """Lets a plain callable stand where FX expects a submodule."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)

