"""Cutting a traced graph at splitting ops into pieces.

Every call of a splitting op becomes a piece of its own that runs eagerly; the runs of
nodes between them become compiled pieces. Compiled pieces are normalised so that equal
layers look equal: SymInt inputs are recomputed from a tensor input's size inside the
piece (pieces take tensors only, which AOTInductor needs too), and every piece returns
a tuple.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from cachebuild.errors import UsageError
from cachebuild.graph.effects import (
    Effects,
    eliminate_dead_code,
    graph_effects,
    might_write,
    storage_of,
)
from cachebuild.graph.facts import (
    InputMeta,
    copy_graph,
    fake_mode_of,
    meta_of,
    record_example_values,
)
from cachebuild.tracing.trace import TracedGraph
from cachebuild.tracing.transforms import desugar


@dataclass
class Piece:
    """One piece of the split graph.

    ``compiled`` pieces become targets; the others are splitting-op calls run eagerly.
    ``single_output`` records that the stitching graph expects a bare value, not a tuple.
    ``size_input`` is ``(input index, dim)`` of an input whose dim is the dynamic dim
    (dim -1: the input is the size): where the runtime reads the size to pick a bucket
    (None if the piece is static).
    ``written``: the inputs the piece writes in place (the runtime hands it those very
    tensors, never copies).
    """

    index: int
    name: str
    gm: fx.GraphModule
    compiled: bool
    input_metas: list[InputMeta]
    single_output: bool
    size_input: tuple[int, int] | None
    written: list[int] = field(default_factory=list)


@dataclass
class SplitPlan:
    """The stitching graph and its pieces; ``written_inputs``: positions of the graph
    inputs that some piece writes in place."""

    stitch: fx.GraphModule
    pieces: list[Piece]
    written_inputs: list[int] = field(default_factory=list)

    @property
    def compiled_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if p.compiled]


def op_names(target: Any) -> set[str]:
    """The names a user may give for a graph target (``ns::op``, ``ns::op.overload``)."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target.name().split(".")[0]
        return {target.name(), packet}
    if isinstance(target, torch._ops.OpOverloadPacket):
        qual = target._qualified_op_name
        return {qual} | {f"{qual}.{o}" for o in target.overloads()}
    name = getattr(target, "__name__", None)
    # torch-level functions in a Dynamo graph (torch._C._nn.scaled_dot_product_attention)
    # answer to the aten op of the same name.
    if callable(target) and name and hasattr(torch.ops.aten, name):
        packet = getattr(torch.ops.aten, name)
        return {f"aten::{name}"} | {f"aten::{name}.{o}" for o in packet.overloads()}
    return set()


def is_splitting(node: fx.Node, splitting_ops: set[str]) -> bool:
    return node.op == "call_function" and bool(op_names(node.target) & splitting_ops)


def graph_op_names(graph: fx.Graph) -> list[str]:
    """Custom and aten op names a graph contains (for the unknown-op error)."""
    found = set()
    for node in graph.nodes:
        if node.op == "call_function":
            names = op_names(node.target)
            found |= {n for n in names if "." not in n.split("::")[1]}
    return sorted(found)


def _registered(name: str) -> bool:
    ns, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        if overload:
            getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return False
    return True


def check_splitting_ops(splitting_ops: tuple[str, ...]) -> None:
    """ConfigError for a splitting op that no library in this process registered.

    Checked where a config is used, before tracing: the config itself is a plain value
    that imports no op library, and the model's module registers its ops when imported.
    """
    from cachebuild.errors import ConfigError

    for name in splitting_ops:
        if not _registered(name):
            raise ConfigError(f"splitting op {name} is not a registered operator: check its "
                              "name, and import the library that defines it before compiling")


def split_graph(traced: TracedGraph, splitting_ops: tuple[str, ...]) -> SplitPlan:
    """Split ``traced`` at every call of a splitting op.

    Writes in place survive the split exactly (``effects``): every writer is kept, a node
    that returned its argument is read as that argument, and a view whose memory is
    written, or is a graph input, is taken again where it is used rather than handed from
    one piece to another (a compiled piece hands over fresh tensors only, so a view made
    in it would no longer share its base's memory). Views the model returns of such
    memory are taken in a last eager piece.
    """
    # Outside inference mode (a caller's first call may be in it): what a piece writes is
    # seen by version counters, which tensors made in that mode do not keep. Without
    # autograd all the same (leaving inference mode turns it on), as the trace ran: a
    # write into a weight that requires grad, made under the caller's no_grad, is fine.
    with torch.inference_mode(False), torch.no_grad():
        return _split_graph(traced, splitting_ops)


def _split_graph(traced: TracedGraph, splitting_ops: tuple[str, ...]) -> SplitPlan:
    wanted = set(splitting_ops)
    gm = fx.GraphModule(traced.gm, copy_graph(traced.gm.graph))  # traced.gm stays as traced
    fake_mode = fake_mode_of(traced.fake_inputs)
    desugar(gm, traced.fake_inputs, fake_mode)  # vmap and friends as the ops they run
    graph = gm.graph
    seen: set[str] = set()
    for node in graph.nodes:
        if node.op == "call_function":
            seen |= op_names(node.target) & wanted
    # A registered op the graph does not call is fine (a config lists every op a family
    # of models may split at); an op no library registered, or none found in a whole
    # forward, is a mistake (a graph between two graph breaks may call none: one piece).
    unknown = {name for name in wanted - seen if not _registered(name)} or (
        wanted if wanted and not seen and traced.whole else set())
    if unknown:
        raise UsageError(
            f"splitting op(s) {sorted(unknown)} not found in the traced graph; it contains: "
            + ", ".join(graph_op_names(graph))
        )

    effects = graph_effects(gm, traced.fake_inputs, fake_mode)
    _check_writes(gm, effects)
    read_as: dict[fx.Node, fx.Node] = {}
    for node, argument in effects.same.items():
        # A chain (``n += 1`` twice: the second returns what the first returned) is read as
        # its first argument, not as a node whose uses are already gone.
        argument = read_as.get(argument, argument)
        if not is_splitting(node, wanted):
            node.replace_all_uses_with(argument)
            read_as[node] = argument

    part: dict[fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting(node, wanted):
            current += 1
            part[node] = current
            current += 1
        elif node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and is_splitting(node.args[0], wanted):
            # An item of what a splitting op returns as a tuple (flash attention's output
            # and its log-sum-exp): taken beside it, so that pieces hand over tensors.
            part[node] = part[node.args[0]]
        else:
            part[node] = current
    _check_reshapes(graph, effects, part, read_as, wanted)
    eager_parts = {part[n] for n in part if is_splitting(n, wanted)}
    tail = current + 1
    if _take_views_where_used(graph, effects, part, tail, wanted):
        eager_parts.add(tail)
    eliminate_dead_code(graph)
    graph.lint()  # every node after what it reads
    gm.recompile()

    stitch = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    if not _values_from_pieces(stitch, traced.fake_inputs):
        record_example_values(stitch, traced.fake_inputs)
    _check_still_symbolic(traced)

    pieces = []
    written_by_shape: dict[str, list[int]] = {}  # pieces alike write alike: run one of each
    for node in stitch.graph.nodes:
        if node.op != "call_module":
            continue
        sub: fx.GraphModule = getattr(stitch, node.target)
        index = int(node.target.removeprefix("submod_"))
        compiled = index not in eager_parts
        fake_args = [a.meta["example_value"] if isinstance(a, fx.Node) else a for a in node.args]
        kept = _normalise(sub, fake_args) if compiled else list(range(len(node.args)))
        node.args = tuple(node.args[i] for i in kept)
        fake_args = [fake_args[i] for i in kept]
        metas = [meta_of(a) for a in fake_args]
        shape = _shape_of(sub, metas, fake_args)
        if shape not in written_by_shape:
            written_by_shape[shape] = graph_effects(sub, fake_args, fake_mode).written_inputs
        pieces.append(Piece(
            index=len(pieces),
            name=node.target,
            gm=sub,
            compiled=compiled,
            input_metas=metas,
            single_output=not isinstance(node.meta["example_value"], (tuple, list)),
            size_input=None,  # below, once every piece is known
            written=list(written_by_shape[shape]),
        ))
    dims = _dim_symbols(pieces)  # a size one piece reads from a tensor, another is given
    for p in pieces:
        p.size_input = _size_input(p.input_metas, dims)
    stitch.recompile()
    return SplitPlan(stitch=stitch, pieces=pieces, written_inputs=effects.written_inputs)


def _values_from_pieces(stitch: fx.GraphModule, fake_inputs: list[Any]) -> bool:
    """Give each node of ``stitch`` its fake value (``meta["example_value"]``) from the
    values the trace left on its pieces' nodes, which split_module copies: what a piece
    returns is what its returned nodes held. Running the stitch again on fake inputs
    (``record_example_values``) would make the same values, at the cost of every op of the
    model run once more (most of a split). False, with nothing set, where a value the
    stitch needs is not there (a node a rewrite made): then it is to be run."""
    values: dict[fx.Node, Any] = {}
    placeholders = iter(fake_inputs)
    for node in stitch.graph.nodes:
        if node.op == "placeholder":
            values[node] = next(placeholders, None)
        elif node.op == "call_module":
            sub = getattr(stitch, node.target)
            out = next(n for n in sub.graph.nodes if n.op == "output")
            missing = [n for n in out.all_input_nodes if "example_value" not in n.meta]
            if missing:
                return False
            values[node] = fx.node.map_aggregate(
                out.args[0], lambda a: a.meta["example_value"] if isinstance(a, fx.Node) else a)
        elif node.op == "call_function" and node.target is operator.getitem \
                and node.args[0] in values and isinstance(node.args[1], int):
            values[node] = values[node.args[0]][node.args[1]]
        elif node.op != "output":
            return False
    for node, value in values.items():
        node.meta["example_value"] = value
    return True


def _shape_of(gm: fx.GraphModule, metas: list[Any], fake_args: list[Any]) -> str:
    """What decides which inputs ``gm`` writes when run on ``fake_args``: its nodes (their
    operations and what they read, by position; not the inputs' names, which a decoder's
    layers do not share), its inputs' metadata, and which inputs share memory."""
    index: dict[fx.Node, int] = {}
    parts = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        target = "" if node.op == "placeholder" else repr(node.target)
        parts.append(repr((node.op, target,
                           fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{index[a]}"))))
    first: dict[Any, int] = {}  # storage → the first input holding it
    shared = [first.setdefault(storage_of(a), i) if isinstance(a, torch.Tensor) else -1
              for i, a in enumerate(fake_args)]
    return "\n".join([*parts, repr(metas), repr(shared)])


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    return f"{target} (node {node.name})"


def _check_writes(gm: fx.GraphModule, effects: Effects) -> None:
    """UsageError for a write that cannot be kept exact: into a tensor the graph holds as
    a constant (it would be written once per process, not per model)."""
    for node, bases in effects.writes.items():
        for base in bases:
            if base.op == "get_attr":
                raise UsageError(
                    f"the forward writes in place into the constant tensor {base.target} "
                    f"with {_describe(node)}: register it as a buffer of the model, or pass it "
                    "as an argument")


def _check_reshapes(graph: fx.Graph, effects: Effects, part: dict[fx.Node, int],
                    read_as: dict[fx.Node, fx.Node], splitting: set[str]) -> None:
    """UsageError for a layout changed in place (``h.unsqueeze_(0)``) that a piece after
    the change would see otherwise than eager does: a tensor reshaped in another piece
    than the one that makes it, or that the graph is given (the pieces between hand it
    over with the layout the trace saw last, after the change), or one that shares its
    memory with a value taken before the change and used in another piece (a view there
    is taken again from the reshaped tensor)."""
    if not effects.reshapes:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node, tensors in effects.reshapes.items():
        for tensor in tensors:
            made = read_as.get(tensor, tensor)
            base = effects.base.get(made, made)
            if made.op == "placeholder" or part.get(made) != part.get(node):
                where = _made_where(made, node, part, splitting)
            else:
                taken = [n for n in effects.base if effects.base[n] is base
                         and n is not base and order[n] < order[node]
                         and any(part.get(u) != part[node] for u in n.users)]
                if not taken:
                    continue
                where = ("a view used after a split, where it is taken again without the "
                         "change" if taken[0] is made else
                         f"which {taken[0].name}, taken from its memory before that, shares, "
                         "used after a split")
            raise UsageError(
                f"the forward changes the layout of a tensor in place across a split: "
                f"{_describe(node)} reshapes {made.name}, {where}; pieces hand over "
                "tensors as they are made: change the layout out of place "
                "(h = h.unsqueeze(0) rather than h.unsqueeze_(0)), or where nothing "
                "made before it is used after a split")


def _made_where(made: fx.Node, node: fx.Node, part: dict[fx.Node, int],
                splitting: set[str]) -> str:
    """Where ``made`` comes from, for a reshape of it in a later piece (``node``)."""
    if made.op == "placeholder":
        return "given to the graph"
    if is_splitting(made, splitting):
        return f"made by {_describe(made)}"
    between = sorted({_describe(n) for n, p in part.items()
                      if is_splitting(n, splitting) and part.get(made, 0) < p < part[node]})
    return f"made before {', '.join(between)}"


def _take_views_where_used(graph: fx.Graph, effects: Effects, part: dict[fx.Node, int],
                           tail: int, splitting: set[str]) -> bool:
    """Make every user in another part than a view's take that view itself, where the
    view's memory matters: it is a graph input's, or some node writes it, or the model
    returns it more than once. Users of the graph's output take theirs in part ``tail``.
    Returns True if ``tail`` got any node."""
    written = effects.written
    output = next(n for n in graph.nodes if n.op == "output")
    returned: dict[fx.Node, int] = {}
    for value in output.all_input_nodes:
        base = effects.base.get(value)
        if base is not None:
            returned[base] = returned.get(base, 0) + 1

    def retake(node: fx.Node) -> bool:  # a view that can be taken again anywhere
        return (node.op in ("call_function", "call_method") and effects.is_alias(node)
                and not is_splitting(node, splitting) and not might_write(node))

    def matters(node: fx.Node, to_output: bool) -> bool:
        base = effects.base[node]
        return (base.op == "placeholder" or base in written
                or (to_output and returned.get(base, 0) > 1))

    def clone(node: fx.Node, where: int, before: fx.Node, made: dict[fx.Node, fx.Node]
              ) -> fx.Node:
        """A copy of ``node`` in part ``where`` right before ``before``, with the views it
        is taken from (those of other parts) copied there too."""
        if node in made:
            return made[node]

        def arg(a: fx.Node) -> fx.Node:
            return clone(a, where, before, made) if retake(a) and part.get(a) != where else a

        with graph.inserting_before(before):
            copy = graph.node_copy(node, arg)
        part[copy] = where
        effects.base[copy] = effects.base[node]
        made[node] = copy
        return copy

    used_tail = False
    for node in list(graph.nodes):
        if node not in part or not retake(node):
            continue
        crossing: dict[int, list[fx.Node]] = {}
        for user in node.users:
            where = tail if user is output else part[user]
            if where != part[node] and matters(node, user is output):
                crossing.setdefault(where, []).append(user)
        if not crossing:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        for where, users in crossing.items():
            # Before the part's first user in graph order (the order of ``users`` is the
            # order uses were added in, which rewriting changes).
            copy = clone(node, where, min(users, key=order.__getitem__), {})
            used_tail |= where == tail
            for user in users:
                user.replace_input_with(node, copy)
    return used_tail


def _normalise(gm: fx.GraphModule, fake_args: list[Any]) -> list[int]:
    """Make a compiled piece take tensors only and return a tuple; return kept inputs.

    A SymInt input is recomputed inside the piece from the sizes of its tensor inputs:
    ``x.size(d)`` for a symbol that dim ``d`` of ``x`` carries, and arithmetic over such
    sizes for an expression (``2*s0``, the token count times top-k of a mixture of
    experts). One whose symbols no tensor input carries stays an input.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sources: dict[str, tuple[fx.Node, int]] = {}
    for ph, fake in zip(placeholders, fake_args, strict=True):
        if isinstance(fake, torch.Tensor):
            for d, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and getattr(size.node.expr, "is_Symbol", False):
                    sources.setdefault(str(size.node.expr), (ph, d))
    kept = []
    first_body = next(n for n in graph.nodes if n.op != "placeholder")
    sizes: dict[str, fx.Node] = {}

    def size_of(symbol: str) -> fx.Node:
        if symbol not in sizes:
            node, dim = sources[symbol]
            with graph.inserting_before(first_body):
                sizes[symbol] = graph.call_method("size", (node, dim))
        return sizes[symbol]

    for i, (ph, fake) in enumerate(zip(placeholders, fake_args, strict=True)):
        expr = fake.node.expr if isinstance(fake, torch.SymInt) else None
        if expr is None or not {str(s) for s in expr.free_symbols} <= set(sources):
            kept.append(i)
            continue
        with graph.inserting_before(first_body):
            value = _emit(graph, expr, size_of)
        if value is None:
            kept.append(i)
            continue
        ph.replace_all_uses_with(value)
        graph.erase_node(ph)
    out = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(out.args[0], (tuple, list)):
        out.args = ((out.args[0],),)
    eliminate_dead_code(graph)
    graph.lint()
    gm.recompile()
    return kept


def _emit(graph: fx.Graph, expr: Any, size_of: Any) -> Any:
    """FX nodes computing the sympy integer expression ``expr`` (None if it has a form
    not handled: then the value stays a piece input)."""
    import operator

    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

    if expr.is_Symbol:
        return size_of(str(expr))
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        op = operator.add if isinstance(expr, sympy.Add) else operator.mul
        parts = [_emit(graph, a, size_of) for a in expr.args]
        if any(p is None for p in parts):
            return None
        value = parts[0]
        for p in parts[1:]:
            value = graph.call_function(op, (value, p))
        return value
    binary = {FloorDiv: operator.floordiv, Mod: operator.mod, PythonMod: operator.mod}
    for kind, op in binary.items():
        if isinstance(expr, kind):
            a, b = (_emit(graph, x, size_of) for x in expr.args)
            return None if a is None or b is None else graph.call_function(op, (a, b))
    return None


def _check_still_symbolic(traced: TracedGraph) -> None:
    """Splitting runs the graph on fake values; a dynamic size that came out of it fixed
    would leave every piece valid at the traced size only (and wrong at any other)."""
    for meta, fake in zip(traced.input_metas, traced.fake_inputs, strict=True):
        for was, now in zip(meta.shape, meta_of(fake).shape, strict=True):
            if isinstance(was, str) and not isinstance(now, str):
                raise RuntimeError(f"splitting fixed the dynamic size {was} to {now}")


def _size_input(metas: list[InputMeta], dims: set[str]) -> tuple[int, int] | None:
    """Where a piece's call gives the dynamic size: a tensor input's dim, else an input
    that is the size itself (dim -1: a piece that computes from the token count alone,
    ``x.shape[0] > 3`` after the last splitting op), where it is a symbol ``dims`` holds
    (the sizes of the split's tensors, not a stride Dynamo made symbolic)."""
    for i, m in enumerate(metas):
        if m.kind == "tensor":
            for d, size in enumerate(m.shape):
                if _symbol(size):
                    return (i, d)
    for i, m in enumerate(metas):
        if m.kind == "symint" and _symbol(m.shape[0]) and m.shape[0] in dims:
            return (i, -1)
    return None


def _symbol(size: Any) -> bool:
    return isinstance(size, str) and size.isidentifier()


def _dim_symbols(pieces: list[Piece]) -> set[str]:
    """The symbols that are a tensor's size in some piece's inputs."""
    return {d for p in pieces for m in p.input_metas if m.kind == "tensor"
            for d in m.shape if _symbol(d)}
