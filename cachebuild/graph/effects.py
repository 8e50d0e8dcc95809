"""What a graph writes in place, and which of its values share memory.

A model's forward may write tensors in place: a KV cache filled by ``index_copy_``, a
counter bumped by ``add_``, slice assignment, an op whose schema mutates an argument (a
splitting op that writes a paged cache), ``out=``. Splitting and compiling must keep each
write, on the very tensor eager writes, and every value that shares memory with a written
tensor must still share it. This module states those facts once, from one run of the graph
on fake values (``graph_effects``):

- a node *writes* a tensor when that tensor's version counter moves while the node runs
  (views share their base's counter, so a write through a view counts for the base);
- every tensor value has a *base*: the placeholder or the node whose run allocated its
  memory; a node whose value lives in another node's memory is an *alias* (a view, or an
  op like ``.to()`` that returned its argument);
- a node *reshapes* a tensor when that tensor's shape, strides or offset differ after the
  node ran (``unsqueeze_``, ``t_``, ``resize_``): the tensor's value from then on is
  another layout than the one it was made with.

Writers are marked in ``node.meta`` (``WRITES``) so that the mark travels with the node into
the pieces ``split_module`` makes, and ``eliminate_dead_code`` keeps them: FX's own pass
drops a ``call_method`` such as ``cache.index_copy_(...)`` whose result nobody reads.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from cachebuild.graph.facts import fake_mode_of

#: ``node.meta`` key marking a node that writes a tensor in place.
WRITES = "cachebuild_writes"

#: Python operators that write their first operand in place when it is a tensor.
_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul}


@dataclass
class Effects:
    """The in-place facts of one graph (see the module doc).

    ``writes``: writer node → the bases it writes. ``base``: tensor-valued node → the
    node owning its memory (itself for a fresh value). ``same``: node → the argument
    node whose value it returned as is (an in-place op's result, a no-op ``.to()``).
    ``written_inputs``: positions of the placeholders some node writes. ``reshapes``:
    node → the argument nodes whose tensor's layout it changed in place.
    """

    writes: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    reshapes: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    base: dict[fx.Node, fx.Node] = field(default_factory=dict)
    same: dict[fx.Node, fx.Node] = field(default_factory=dict)
    written_inputs: list[int] = field(default_factory=list)

    @property
    def written(self) -> set[fx.Node]:
        """Every base some node writes."""
        return {b for bases in self.writes.values() for b in bases}

    def is_alias(self, node: fx.Node) -> bool:
        """True if ``node``'s value lives in memory another node allocated."""
        base = self.base.get(node)
        return base is not None and base is not node


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s memory: ``t`` itself, or, for a tensor a functorch
    transform wraps (``vmap``'s batched tensors, ``grad``'s), the tensor under every
    wrapper. A wrapper has no storage of its own; writes through it land in that tensor."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def storage_of(t: torch.Tensor) -> Any:
    """A hashable handle on ``t``'s memory, equal for every tensor that shares it (a
    functorch wrapper shares the memory of the tensor it wraps)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(unwrapped(t).untyped_storage())


def layout_of(t: torch.Tensor) -> tuple[Any, ...]:
    """``t``'s shape, strides and storage offset, symbolic ones as their expressions:
    compared as they are, without asking the shape environment (which would add guards)."""
    def plain(values: Any) -> tuple[Any, ...]:
        return tuple(v.node.expr if isinstance(v, torch.SymInt) else v for v in values)

    return plain(t.shape), plain(t.stride()), plain([t.storage_offset()])


def graph_effects(gm: fx.GraphModule, fake_inputs: list[Any], fake_mode: Any = None) -> Effects:
    """Run ``gm`` on ``fake_inputs`` and return what it writes and what aliases what;
    writers are marked in their ``meta`` (``WRITES``). ``fake_mode``: the inputs' (found
    from them where not given; a graph whose inputs are only sizes needs it given).

    The run is on static stand-ins of the inputs where they can be made (``stand_ins``):
    what an op writes, returns as is or aliases does not depend on whether its sizes are
    symbols, and ops on static sizes run about four times faster (most of a split's time
    on a deep model went here). Else, or where an op needs the symbols (a size that
    depends on data), on the inputs themselves."""
    static = stand_ins(fake_inputs)
    if static is not None:
        try:
            return _run(gm, *static)
        except Exception:  # noqa: BLE001 - the symbolic run below says what is wrong
            pass
    if fake_mode is None:
        fake_mode = fake_mode_of(fake_inputs)
    return _run(gm, fake_mode, fake_inputs)


class _NoStandIn(Exception):
    """An input that ``stand_ins`` cannot stand in for."""


def stand_ins(values: list[Any]) -> tuple[Any, list[Any]] | None:
    """A fresh fake mode without symbols, and ``values`` in it: each symbolic size as its
    hint (the size it was traced at), each fake tensor as one of those sizes, strides and
    offset, sharing memory where the tensors of ``values`` share it. None where one
    cannot be made (a symbol without a hint, a tensor a transform wraps, a tensor subclass),
    or where there is no fake tensor to stand in for."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def hint(v: Any) -> Any:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            h = v.node.hint
            if h is None:
                raise _NoStandIn
            return h
        return v

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors or any(type(t) is not FakeTensor for t in tensors):
        return None
    try:
        bytes_of: dict[Any, int] = {}  # storage → the bytes its stand-in needs
        for t in tensors:
            size, stride = [hint(s) for s in t.shape], [hint(s) for s in t.stride()]
            end = 0 if 0 in size else (hint(t.storage_offset()) + 1 + sum(
                (n - 1) * s for n, s in zip(size, stride, strict=True))) * t.element_size()
            key = storage_of(t)
            bytes_of[key] = max(bytes_of.get(key, 0), end,
                                hint(t.untyped_storage().nbytes()))
        mode = FakeTensorMode()
        made: dict[Any, torch.Tensor] = {}
        standing: dict[int, torch.Tensor] = {}  # id → stand-in: one input passed twice
        out = []
        with mode, torch.no_grad():
            for v in values:
                if not isinstance(v, torch.Tensor):
                    out.append(hint(v))
                    continue
                if id(v) in standing:
                    out.append(standing[id(v)])
                    continue
                key = storage_of(v)
                if key not in made:
                    made[key] = torch.empty(bytes_of[key], dtype=torch.uint8, device=v.device)
                t = torch.empty(0, dtype=v.dtype, device=v.device).set_(
                    made[key].untyped_storage(), hint(v.storage_offset()),
                    [hint(s) for s in v.shape], [hint(s) for s in v.stride()])
                standing[id(v)] = t.requires_grad_(v.requires_grad)
                out.append(t)
    except (_NoStandIn, RuntimeError, TypeError, ValueError):
        return None
    return mode, out


def _run(gm: fx.GraphModule, fake_mode: Any, fake_inputs: list[Any]) -> Effects:
    """``graph_effects``' one run of ``gm`` on ``fake_inputs`` in ``fake_mode``."""
    effects = Effects()
    owner: dict[Any, fx.Node] = {}  # storage → the node whose value first held it
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    class Watcher(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            arg_nodes = [a for a in pytree.tree_leaves((n.args, n.kwargs))
                         if isinstance(a, fx.Node)]
            arg_values = [(a, self.env[a]) for a in arg_nodes if a in self.env]
            before = [(a, t, t._version) for a, v in arg_values
                      for t in map(unwrapped, _tensors(v))]
            # Only an op that may write in place can change a layout (by its form: such
            # ops end in ``_``, as ``unsqueeze_`` and ``set_`` do), so only theirs are kept.
            layouts = [(a, t, layout_of(t)) for a, t, _ in before] if might_write(n) else []
            result = super().run_node(n)
            reshaped = [a for a, t, layout in layouts if layout_of(t) != layout]
            if reshaped:
                effects.reshapes[n] = list(dict.fromkeys(reshaped))
            changed = [t for _, t, version in before if t._version != version]
            written = []
            for t in changed + _schema_written(n, self.env):
                base = owner.get(storage_of(t))
                if base is not None and base not in written:
                    written.append(base)
            if written:
                effects.writes[n] = written
                n.meta[WRITES] = True
            same = next((a for a, v in arg_values if v is result), None) \
                if isinstance(result, torch.Tensor) else None
            if same is not None and n.op != "placeholder":
                effects.same[n] = same
            tensors = _tensors(result)
            if tensors:
                bases = [owner.get(storage_of(t)) for t in tensors]
                if all(b is not None for b in bases):
                    effects.base[n] = bases[0]  # type: ignore[assignment]
                else:
                    effects.base[n] = n
                    for t in tensors:
                        owner.setdefault(storage_of(t), n)
            return result

    from torch._dispatch.python import enable_python_dispatcher

    # Outside inference mode: a tensor made in it keeps no version counter to watch. Without
    # autograd all the same (leaving inference mode turns it on), as every trace and
    # compiled forward runs: a write into a weight that requires grad (``self.w.mul_(0.5)``
    # called under no_grad) is no error there.
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), \
            enable_python_dispatcher(), torch.inference_mode(False), torch.no_grad():
        Watcher(gm).run(*fake_inputs)
    written = effects.written
    effects.written_inputs = [i for i, p in enumerate(placeholders) if p in written]
    return effects


def _schema(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    return getattr(target, "_schema", None)


def _written_positions(target: Any) -> list[tuple[int, str]]:
    """See ``_find_written_positions``; kept per target (a graph asks for every node)."""
    try:
        return _WRITTEN[target]
    except KeyError:
        found = _WRITTEN[target] = _find_written_positions(target)
        return found
    except TypeError:  # not hashable
        return _find_written_positions(target)


#: ``_written_positions`` by target.
_WRITTEN: dict[Any, list[tuple[int, str]]] = {}


def _find_written_positions(target: Any) -> list[tuple[int, str]]:
    """The arguments (position, name) that ``target`` writes by its schema (``Tensor(a!)``,
    ``Tensor(a!)[]``). A torch function without a schema of its own (``torch._foreach_add_``,
    ``torch.index_put_``) is read by its aten op's overloads: the arguments every one of them
    writes."""
    schemas = []
    schema = _schema(target)
    if schema is not None:
        schemas = [schema]
    elif getattr(target, "__module__", None) in ("torch", "torch._C._VariableFunctions") or \
            type(target).__name__ == "builtin_function_or_method":
        packet = getattr(torch.ops.aten, getattr(target, "__name__", ""), None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    found: set[tuple[int, str]] | None = None
    for schema in schemas:
        here = {(i, arg.name) for i, arg in enumerate(schema.arguments)
                if arg.alias_info is not None and arg.alias_info.is_write}
        found = here if found is None else found & here
    return sorted(found or ())


def _schema_written(node: fx.Node, env: dict[fx.Node, Any]) -> list[torch.Tensor]:
    """The tensors an op's schema says it writes (``Tensor(a!)``, a list of them): an op
    defined without an autograd kernel, or a ``_foreach`` op on fake tensors, does not move
    their version counters."""
    if node.op != "call_function":
        return []
    found = []
    for i, name in _written_positions(node.target):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, fx.Node):
                found += _tensors(env.get(leaf))
    return found


def might_write(node: fx.Node) -> bool:
    """True if ``node`` may write a tensor in place: marked by ``graph_effects``, or by
    its form (an in-place method, an in-place operator, ``out=``/``inplace=True``, an op
    whose schema mutates)."""
    if node.meta.get(WRITES):
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op != "call_function":
        return False
    if node.target in _INPLACE_OPERATORS:
        return True
    if node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True:
        return True
    # torch's in-place functions (``torch.relu_``, ``torch.index_put_``,
    # ``torch._foreach_add_``, ``Tensor.add_`` called as a function) have no schema here;
    # Python's ``operator.and_`` and ``is_`` write nothing.
    name = getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.startswith("__") and \
            getattr(node.target, "__module__", None) not in ("_operator", "operator"):
        return True
    return bool(_written_positions(node.target))


def is_transform_call(node: fx.Node) -> bool:
    """True for a call into functorch, as Dynamo leaves ``vmap``, ``grad`` and ``jvp`` in
    a graph: a transform's level entered or left, a tensor wrapped for it or unwrapped.
    Entering and leaving return nothing but change the process's transform state."""
    if node.op != "call_function":
        return False
    return "functorch" in (getattr(node.target, "__module__", None) or "")


def eliminate_dead_code(graph: fx.Graph) -> None:
    """FX's dead-code elimination, keeping every node that ``might_write`` and every
    call into functorch (``is_transform_call``: nothing reads a level's entry, yet the
    calls after it need it)."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op in ("placeholder", "output") or might_write(node):
            continue
        if is_transform_call(node):
            continue
        if node.op == "call_module" or node.is_impure():
            continue
        graph.erase_node(node)
