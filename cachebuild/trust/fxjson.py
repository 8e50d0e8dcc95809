"""FX graphs as plain JSON data, and back, without Dynamo and without exec of stored code.

Used for everything cachebuild keeps of a graph: the stitching graph of an entry, the
eager splitting-op pieces, the ``eager_fusion`` artifacts, and the canonical form of a
piece that enters its key. A function target is stored by name (``module:qualname`` or
``ns::op.overload``) and resolved on load, so a changed or missing op is an error, not a
silent different program.

Stored graphs are data that becomes code (FX generates Python source from a graph and
runs it), so a graph is rebuilt only from what could have been stored, checked before FX
sees it: node names and placeholders are identifiers, constants are of the kinds
``encode_arg`` writes (integers within 64 bits), and what a node names is in the closed
language of ``cachebuild.trust.allowed`` (refused unless its table admits it), without
importing anything first:

- operators registered with torch (``torch.ops``, by name ``op:ns::name.overload``): in
  torch's namespaces and this project's, the overloads the table admits; a library's own
  operators (a splitting op) whose schemas pass ``purity.op_impurity``;
- torch's C functions that bind admitted operators (``torch.cat``, ``torch._C._nn.linear``:
  every overload the binding can reach), the functions of ``torch.nn.functional`` and
  ``torch.functional`` the table names, and the few Dynamo records (``torch.Size``,
  ``torch._C._set_grad_enabled``, ``torch.sym_*``);
- tensor methods the table admits, and ``getattr`` as a read of a tensor attribute it
  names (``w.T``);
- the ``operator``, ``math`` and builtin functions it names; a loaded graph run as Python
  calls bounded versions of those that could compute or allocate without end
  (``purity.bounded``; a graph handed to a compiler keeps the originals, which its
  tracing needs);
- callables a program registers with ``allow_callable``.

Anything else (``os.system``, ``builtins.eval``, ``aten::from_file``, ``aten::save``,
``aten::_reshape_alias``, ``Tensor.new``, ``Tensor.data_ptr``) is a ``GraphFormatError``
naming it, at save and at load alike.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import keyword
import math
import operator
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from cachebuild.errors import CachebuildError
from cachebuild.trust import allowed, purity

# Namespaces tried when a function's __module__ does not lead back to it (C functions
# bound on torch's private classes, e.g. torch.rms_norm).
_FALLBACK_MODULES = ("torch", "torch.nn.functional", "torch._C._nn", "torch._C._VariableFunctions",
                     "operator", "builtins", "math")

#: The graph ops that are stored (``get_attr`` never: pieces take weights as inputs).
_OPS = frozenset({"placeholder", "call_function", "call_method", "call_module", "output"})
#: torch's C modules whose functions bind ATen operators one to one.
_TORCH_C = ("_VariableFunctions", "_nn", "_fft", "_linalg", "_special", "_nested", "_sparse")
#: Modules a stored ``fn:`` name may come from (besides those of registered callables).
_MODULES = frozenset({"operator", "_operator", "builtins", "math", "torch", "torch._C",
                      *allowed.FUNCTIONAL, *(f"torch._C.{m}" for m in _TORCH_C)})

_REGISTERED: dict[int, Callable[..., Any]] = {}
#: A stored graph has at most this many nodes, and its integers fit in 64 bits.
MAX_NODES = 1 << 20
_INT_RANGE = (-(1 << 63), 1 << 64)


class GraphFormatError(CachebuildError, ValueError):
    """A graph that cannot be stored (unknown target, unsupported constant) or restored."""


class UnregisteredOperator(GraphFormatError):
    """A stored graph names an operator this process has not registered (a library's
    that was not imported): refused by a load, though it may be allowed where it is."""


def allow_callable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Let stored graphs call ``fn`` (a function reachable by import as
    ``fn.__module__``.``fn.__name__``), in this process; returns ``fn``, so it works as a
    decorator. For Python functions a model keeps in its graph (torch operators need
    nothing: they are allowed by name)."""
    _REGISTERED[id(fn)] = fn
    return fn


def allowed_callable(obj: Any) -> bool:
    """True if stored graphs may call ``obj`` (see the module doc)."""
    return callable_impurity(obj) is None


def callable_impurity(obj: Any) -> str | None:
    """Why stored graphs may not call ``obj``; None if they may (see the module doc)."""
    obj = purity.original(obj)
    if isinstance(obj, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return allowed.op_refusal(obj) or purity.op_impurity(obj)
    if _REGISTERED.get(id(obj)) is obj:
        return None
    name = getattr(obj, "__name__", None)
    refused = ("not in the table of what stored graphs may call (cachebuild.trust.allowed), nor "
               "registered with cachebuild.trust.fxjson.allow_callable")
    if not isinstance(name, str) or name.startswith("__"):
        return refused
    if getattr(operator, name, None) is obj:
        return None if name in allowed.OPERATOR else refused
    if obj is builtins.getattr:
        return None  # only as a read of a tensor's data attribute: see check_call
    if name in allowed.BUILTINS and getattr(builtins, name, None) is obj:
        return None
    if getattr(math, name, None) is obj:
        return None if name in allowed.MATH else refused
    module = getattr(obj, "__module__", None)
    if inspect.isfunction(obj) and name in allowed.FUNCTIONAL.get(module, ()) \
            and getattr(importlib.import_module(module), name, None) is obj:
        return None
    if any(_torch_attr(path) is obj for path in allowed.TORCH_FUNCTIONS):
        return None
    if any(getattr(getattr(torch._C, m), name, None) is obj for m in _TORCH_C):
        return allowed.binding_refusal(name) or purity.binding_impurity(name)
    return refused


def _label(target: Any) -> str:
    target = purity.original(target)
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return _op_name(target)
    return str(getattr(target, "__name__", target))


def _op_name(op: Any) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    return str(op._qualified_op_name)


def _torch_attr(path: str) -> Any:
    obj: Any = torch
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def target_name(target: Any) -> str:
    """A name that ``resolve_target`` turns back into ``target``."""
    target = purity.original(target)
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        why = callable_impurity(target)
        if why is not None:
            raise GraphFormatError(f"graph calls operator {_op_name(target)}, which stored "
                                   f"graphs may not call: {why}")
    if isinstance(target, torch._ops.OpOverload):
        # ns::name.overload, the default overload named too: "ns::name" is the packet,
        # which may reach every overload of the name.
        return f"op:{target._schema.name}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"op:{target._qualified_op_name}"
    if isinstance(target, str):
        return target
    target = purity.original(target)
    why = callable_impurity(target)
    if why is not None:
        numpy = ("numpy" in type(target).__name__ or
                 (getattr(target, "__module__", None) or "").startswith("torch._numpy"))
        hint = ("; it is Dynamo's stand-in for NumPy code in the forward (an array attribute "
                "or a NumPy call): compute with torch tensors instead, held in a buffer"
                if numpy else "")
        raise GraphFormatError(f"graph calls {_callable_name(target)}, which stored graphs "
                               f"may not call: {why}{hint}")
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


def _is_identifier(name: Any) -> bool:
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def resolve_target(name: str, *, bounded: bool = True) -> Any:
    """The callable (or method/module name) that ``target_name`` named, if stored graphs
    may call it; GraphFormatError otherwise (nothing is imported to find out).
    ``bounded``: Python arithmetic as its ``purity.bounded`` version."""
    if not isinstance(name, str):
        raise GraphFormatError(f"graph target {name!r} is not a name")
    if name.startswith("op:"):
        qual = name[3:]
        ns, _, rest = qual.partition("::")
        op_name, _, overload = rest.partition(".")
        # ``__`` only as an aten operator's own dunder name (``aten::__lshift__``): never
        # a name that reaches a Python object's internals; the table then judges it.
        dunder = ns == "aten" and op_name[:2] == op_name[-2:] == "__" and \
            op_name[2:-2].isalpha() and f"{op_name}.{overload or 'default'}" in allowed.ATEN
        if not all(map(_is_identifier, (ns, op_name))) or "__" in f"{ns}::{overload}" or (
                "__" in op_name and not dunder) or (overload and not _is_identifier(overload)):
            raise GraphFormatError(f"graph target {qual!r} is not an operator name")
        try:
            packet = getattr(getattr(torch.ops, ns), op_name)
            found = getattr(packet, overload) if overload else packet
        except (AttributeError, RuntimeError) as e:
            raise UnregisteredOperator(
                f"operator {qual} is not registered in this process: import the library "
                "that defines it before loading"
            ) from e
        if not isinstance(found, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            raise GraphFormatError(f"graph target {qual!r} is not an operator")
        why = callable_impurity(found)
        if why is not None:
            raise GraphFormatError(f"graph calls operator {qual}, which stored graphs may not "
                                   f"call: {why}")
        return purity.bounded(found) if bounded else found
    if name.startswith("fn:"):
        _, module, qual = name.split(":", 2) if name.count(":") >= 2 else ("", "", "")
        registered = {getattr(f, "__module__", None) for f in _REGISTERED.values()}
        if module not in _MODULES and module not in registered or not _is_identifier(qual):
            raise GraphFormatError(f"graph calls {module}.{qual}, which stored graphs may not "
                                   "call (not a torch operator or an allowed function)")
        try:
            found = _lookup(module, qual)
        except (ImportError, AttributeError) as e:
            raise GraphFormatError(f"function {module}.{qual} no longer exists") from e
        why = callable_impurity(found)
        if why is not None:
            raise GraphFormatError(f"graph calls {module}.{qual}, which stored graphs may not "
                                   f"call: {why}")
        return purity.bounded(found) if bounded else found
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
    """The FX argument ``encode_arg`` wrote; GraphFormatError for anything else."""
    if isinstance(data, list):
        return [decode_arg(v, env) for v in data]
    if isinstance(data, int) and not isinstance(data, bool) and not (
            _INT_RANGE[0] <= data < _INT_RANGE[1]):
        raise GraphFormatError(f"stored graph constant {_short(data)} does not fit in 64 bits")
    if data is None or isinstance(data, bool | int | str):
        return data
    if not isinstance(data, dict) or len(data) != 1:
        raise GraphFormatError(f"not a stored graph constant: {_short(data)}")
    ((tag, v),) = data.items()
    if tag == "n":
        if not isinstance(v, str) or v not in env:
            raise GraphFormatError(f"graph refers to an unknown node {_short(v)}")
        return env[v]
    if tag == "f" and isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    elif tag == "t" and isinstance(v, list):
        return tuple(decode_arg(x, env) for x in v)
    elif tag == "d" and isinstance(v, list):
        out = {}
        for pair in v:
            if not (isinstance(pair, list) and len(pair) == 2
                    and isinstance(pair[0], str | int) and not isinstance(pair[0], bool)):
                raise GraphFormatError(f"not a stored graph dict entry: {_short(pair)}")
            out[pair[0]] = decode_arg(pair[1], env)
        return out
    elif tag == "slice" and isinstance(v, list) and len(v) == 3:
        return slice(*(decode_arg(x, env) for x in v))
    elif tag in ("dtype", "torch") and isinstance(v, str) and _is_identifier(v):
        found = getattr(torch, v, None)
        kinds = (torch.dtype,) if tag == "dtype" else (torch.memory_format, torch.layout)
        if isinstance(found, kinds):
            return found
    elif tag == "device" and isinstance(v, str):
        try:
            return torch.device(v)
        except (RuntimeError, ValueError):
            pass
    elif tag == "ellipsis" and v is True:
        return Ellipsis
    raise GraphFormatError(f"not a stored graph constant: {_short(data)}")


def _callable_name(target: Any) -> str:
    """A function as its module and name (``torch._weight_norm``), not its repr."""
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"{module}.{name}"
    return _short(target)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def check_call(op: str, target: Any, args: Any, kwargs: Any) -> None:
    """Refuse (GraphFormatError) a method call that is not pure tensor computation, and a
    ``getattr`` that is not a read of a tensor's data attribute by a constant name, and
    any call that passes an ``out=`` tensor. Run on every node at save and at load."""
    if op in ("call_function", "call_method") and (why := allowed.out_refusal(kwargs)):
        shown = _short(target) if isinstance(target, str) else _label(target)
        raise GraphFormatError(f"graph calls {shown}, which stored graphs may not call so: "
                               f"{why}")
    if op in ("call_function", "call_method") and (why := _named_call(op, target, args, kwargs)):
        shown = _short(target) if isinstance(target, str) else _label(target)
        raise GraphFormatError(f"graph calls {shown}, which stored graphs may not call so: "
                               f"{why}")
    if op == "call_method":
        if not isinstance(target, str) or not _tensor_method(target):
            raise GraphFormatError(f"graph calls method {_short(target)}, which is not a "
                                   "public Tensor method")
        why = allowed.method_refusal(target)
        if why is not None:
            raise GraphFormatError(f"graph calls method {target}, which stored graphs may not "
                                   f"call: {why}")
    elif op == "call_function" and target is builtins.getattr:
        attrs = allowed.TENSOR_ATTRIBUTES
        if not (isinstance(args, tuple) and len(args) == 2 and isinstance(args[0], fx.Node)
                and isinstance(args[1], str) and args[1] in attrs and not kwargs):
            shown = _short(args[1]) if isinstance(args, tuple) and len(args) == 2 else "..."
            raise GraphFormatError(f"graph calls getattr(..., {shown}), which stored graphs may "
                                   "not call: only a tensor's data attributes (T, mT, shape, "
                                   "dtype, ...) may be read")


def _named_call(op: str, target: Any, args: Any, kwargs: Any) -> str | None:
    """``allowed.named_refusal`` of a call: a tensor method or a binding or packet of an
    ATen operator by the operator, a Python function of ``allowed.FUNCTIONAL`` by its
    parameters, anything else by keyword."""
    if op == "call_method":
        return allowed.named_refusal(f"aten::{target}" if isinstance(target, str) else None,
                                     args, kwargs)
    fn = purity.original(target)
    if isinstance(fn, torch._ops.OpOverloadPacket):
        namespace = fn._qualified_op_name.partition("::")[0]
        return allowed.named_refusal(fn._qualified_op_name if namespace == "aten" else None,
                                     args, kwargs, packet=True)
    name = getattr(fn, "__name__", None)
    if isinstance(name, str) and any(getattr(getattr(torch._C, m), name, None) is fn
                                     for m in _TORCH_C):
        return allowed.named_refusal(f"aten::{name}", args, kwargs)
    parameters: tuple[str, ...] = ()
    if inspect.isfunction(fn) and fn.__module__ in allowed.FUNCTIONAL:
        try:
            parameters = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            parameters = ()
    return allowed.named_refusal(None, args, kwargs, parameters=parameters)


def graph_to_data(graph: fx.Graph) -> list[dict[str, Any]]:
    """The nodes of ``graph`` in order, as JSON data (names, ops, targets, args); a node
    that stored graphs may not hold is a GraphFormatError (see the module doc)."""
    nodes = []
    for node in graph.nodes:
        if node.op == "get_attr":
            raise GraphFormatError(
                f"graph reads attribute {node.target!r}: pieces must take weights as inputs"
            )
        try:
            check_call(node.op, node.target, node.args, node.kwargs)
            target = target_name(node.target)
        except GraphFormatError as e:
            raise GraphFormatError(f"{e}{_called_at(node)}") from None
        nodes.append({
            "name": node.name,
            "op": node.op,
            "target": target,
            "args": encode_arg(node.args),
            "kwargs": encode_arg(node.kwargs),
        })
    return nodes


def _from(node: fx.Node) -> Iterator[fx.Node]:
    """``node`` and the nodes after it, in graph order."""
    while node.op != "root":
        yield node
        node = node.next


def _called_at(node: fx.Node) -> str:
    """Where the model's code made ``node`` (the last frame of the trace's stack: the line
    a refusal should send the reader to, for an op they did not write by name too), and
    the ways around the refusal; empty where the trace kept no stack."""
    # A node the trace made itself (a ``with`` block's switch) has no stack: the next
    # node that has one is the line it stands before.
    stack = next((n.meta["stack_trace"] for n in _from(node) if n.meta.get("stack_trace")), "")
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', stack)
    if not frames:
        return ""
    path, line, function, code = frames[-1]
    # An operator (not a function the forward names) is what a lowering made of that
    # line: eager_fusion's; Inductor's artifacts are compiled code, not such graphs.
    inductor = (", or build with backend='inductor'"
                if isinstance(node.target, torch._ops.OpOverload) else "")
    return (f" (made by {os.path.basename(path)}:{line} in {function}: {code.strip()}; "
            f"write that line with operators stored graphs may call{inductor})")


def data_to_graph(nodes: list[dict[str, Any]], *, bounded: bool = True,
                  absent_libraries: bool = False) -> fx.Graph:
    """Rebuild the fx.Graph that ``graph_to_data`` described; GraphFormatError, naming
    what is wrong, for anything ``graph_to_data`` could not have written. ``bounded``:
    Python arithmetic calls its ``purity.bounded`` version (for a graph run as Python;
    False for one handed to a compiler). ``absent_libraries``: an operator of a library
    namespace this process has not registered is let through (to check a graph outside
    the process that runs it, as ``cachebuild verify`` does); never for a graph that runs."""
    try:
        return _data_to_graph(nodes, bounded, absent_libraries)
    except RecursionError:
        raise GraphFormatError("stored graph is nested too deeply") from None


def _data_to_graph(nodes: Any, bounded: bool, absent_libraries: bool) -> fx.Graph:
    if not isinstance(nodes, list):
        raise GraphFormatError("a stored graph must be a list of nodes")
    if len(nodes) > MAX_NODES:
        raise GraphFormatError(f"a stored graph has at most {MAX_NODES} nodes, not {len(nodes)}")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    outputs = 0
    for item in nodes:
        if not isinstance(item, dict):
            raise GraphFormatError(f"not a stored graph node: {_short(item)}")
        name, op, target = item.get("name"), item.get("op"), item.get("target")
        if not isinstance(op, str) or op not in _OPS or not _is_identifier(name) \
                or not isinstance(target, str):
            raise GraphFormatError(f"not a stored graph node: {_short(item)}")
        args = decode_arg(item.get("args"), env)
        kwargs = decode_arg(item.get("kwargs"), env)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(
                _is_identifier(k) for k in kwargs):
            raise GraphFormatError(f"graph node {name} has malformed arguments")
        if op == "call_function":
            try:
                target = resolve_target(target, bounded=bounded)
            except UnregisteredOperator:
                if not (absent_libraries and _library_op(target)):
                    raise
                target = _absent
        elif op == "placeholder" and not _is_identifier(target):
            raise GraphFormatError(f"graph input {_short(target)} is not an identifier")
        elif op == "call_module" and not all(map(_is_identifier, target.split("."))):
            raise GraphFormatError(f"graph calls module {_short(target)}, which is not a "
                                   "module path")
        if op == "output":
            if len(args) != 1 or outputs:
                raise GraphFormatError("a stored graph has exactly one output of one value")
            outputs += 1
            graph.output(args[0])
            continue
        check_call(op, target, args, kwargs)
        node = graph.create_node(op, target, args, kwargs, name=name)
        env[name] = node
    return graph


def _library_op(name: str) -> bool:
    """True if ``name`` (``op:ns::...``) is in a library's namespace: one the table of
    ``cachebuild.trust.allowed`` does not close."""
    namespace = name[3:].partition("::")[0]
    return name.startswith("op:") and allowed.closed_table(namespace) is None


def _absent(*args: Any, **kwargs: Any) -> Any:
    """Stands for an operator of a library this process did not import (a check only)."""
    raise UnregisteredOperator("a library operator this process did not register")


def _tensor_method(name: str) -> bool:
    public = not name.startswith("_") or name in allowed.OPERATOR_METHODS
    return _is_identifier(name) and public and callable(getattr(torch.Tensor, name, None))


def data_to_module(nodes: list[dict[str, Any]], modules: dict[str, Callable] | None = None,
                   *, bounded: bool = True) -> fx.GraphModule:
    """A runnable GraphModule for stored nodes; ``modules`` supplies call_module targets;
    ``bounded`` as for ``data_to_graph``."""
    root = torch.nn.Module()
    for name, mod in (modules or {}).items():
        if not isinstance(mod, torch.nn.Module):
            mod = _CallableModule(mod)
        root.add_module(name, mod)
    graph = data_to_graph(nodes, bounded=bounded)
    try:
        return fx.GraphModule(root, graph)
    except (AttributeError, IndexError, KeyError, RuntimeError, SyntaxError, TypeError,
            ValueError) as e:
        # A call_module target the caller did not supply, or a graph FX cannot generate
        # code for: the stored graph does not fit this program.
        raise GraphFormatError(f"stored graph cannot be rebuilt: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None


class _CallableModule(torch.nn.Module):
    """Lets a plain callable stand where FX expects a submodule."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)

