"""The eager_fusion backend: fusion passes without code generation.

For hardware with no Inductor codegen. The piece is functionalised and lowered to aten
ops (AOT-autograd's ``make_fx`` + functionalization, with the dynamic dim symbolic so
one graph serves the whole bucket), the fusion passes rewrite it, and the rewritten
graph is the artifact, stored as data (``fxjson``). Loading it compiles nothing.
"""

from __future__ import annotations

import json
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree

from cachebuild import keep
from cachebuild.backends.protocol import (
    Artifact,
    Backend,
    BuildRequest,
    check_kept_symbolic,
    range_symbols,
    symbolic_fake_inputs,
)
from cachebuild.graph.facts import device_of, unpin_device
from cachebuild.store.interface import ArtifactSource
from cachebuild.trust import allowed
from cachebuild.trust.fxjson import GraphFormatError, data_to_module, graph_to_data

#: 2: lowered to aten before functionalisation (sizes stay symbolic); 3: outputs laid out
#: as eager lays them out (``match_output_layouts``).
VERSION = "3"

aten = torch.ops.aten


class EagerFusionBackend(Backend):
    name = "eager_fusion"
    generates_code = False  # graphs rewritten and stored as data: no compiler runs

    def factors(self, config: Any) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION}

    def toolchain(self, config: Any, device: str, probe_dir: Any) -> dict[str, Any]:
        return {}  # no code generation: nothing about the machine's compilers matters

    def compile(self, request: BuildRequest) -> Artifact:
        from torch.fx.experimental.proxy_tensor import make_fx

        fake_mode, fake_args = symbolic_fake_inputs(request.input_metas, request.bucket)
        symbols = range_symbols(fake_args, request.input_metas)  # before tracing can pin them
        with fake_mode, torch.no_grad():
            # Lower to aten first, then functionalise the aten graph: functionalising the
            # piece directly runs composite ops (a biased linear on a 3-D input) through
            # kernels that read concrete sizes, which pins the range's size to its hint.
            # Forwards, not modules: a module's __call__ would trace torch's global module
            # hooks (the caller's, for its own modules) into the piece.
            # The first lowering runs under the autocast of the calls the piece serves
            # (the build enters it), which records its casts as ops; they are not applied
            # again (a forward's own ``with torch.autocast(enabled=False)`` block would be
            # cast over).
            aten = make_fx(lambda *args: request.gm.forward(*args),
                           tracing_mode="symbolic")(*fake_args)
            with keep.autocast(None):
                fn = torch.func.functionalize(lambda *args: aten.forward(*args),
                                              remove="mutations_and_views")
                lowered = make_fx(fn, tracing_mode="symbolic")(*fake_args)
                match_output_layouts(lowered, aten)
        check_kept_symbolic(fake_mode.shape_env, symbols, request.bucket)
        # Lowering writes the build's GPU into the ops it creates (full, arange...): name
        # it by type, so the graph runs on whichever GPU is current where it is loaded.
        unpin_device(lowered, device_of(request.input_metas))
        inline_constants(lowered)
        if request.passes is not None:
            request.passes(lowered.graph)
        lowered.graph.eliminate_dead_code()
        lowered.recompile()
        data: dict[str, Any] = {"nodes": graph_to_data(lowered.graph)}
        if torch._C._is_any_autocast_enabled():
            data["autocast"] = True  # its casts are in the graph: run it with none applied
        return Artifact("fx-graph", json.dumps(data).encode())

    def load(self, kind: str, key: str, source: ArtifactSource, device: str) -> Any:
        if kind != "fx-graph":
            raise ValueError(f"eager_fusion cannot load artifacts of kind {kind!r}")
        data = source.get(key)
        if data is None:
            return None
        try:
            stored = json.loads(data)
            nodes, cast = stored["nodes"], stored.get("autocast", False) is True
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise GraphFormatError(f"stored graph of target {key} is not graph data") from None
        try:
            # Its forward, not the module: a module's __call__ would run torch's global
            # module hooks (the caller's, for its own modules) on the piece and its weights.
            forward = data_to_module(nodes).forward
        except GraphFormatError as e:
            raise GraphFormatError(f"stored graph of target {key} was not loaded: {e}") from None
        return _without_autocast(forward) if cast else forward


def _without_autocast(forward: Any) -> Any:
    """``forward`` run with autocast off: a graph lowered under autocast holds its casts
    (those of the ops eager ran, composite ops taken apart after them), which autocast
    applied again around the lowered ops would not repeat exactly."""
    def run(*args: Any) -> Any:
        with keep.autocast(None):
            return forward(*args)

    return run


def match_output_layouts(lowered: torch.fx.GraphModule, reference: torch.fx.GraphModule) -> None:
    """Make each output of ``lowered`` laid out as ``reference``'s (the same piece, not
    functionalised) is: values are eager's either way, strides must be too (a caller's
    ``.stride()`` or ``.is_contiguous()``, a ``view`` that eager's layout refuses).

    Functionalising with views removed turns a returned view of a value the piece made
    (``h[:, :8]``, ``h.t()``, q, k and v split from one projection) into a copy
    (``slice_copy``, ``permute_copy``): such an output is taken as the view again, of the
    same value, as eager returns it. An op on a view (``h.t() * 3``) runs on that copy and
    lays its result out contiguous where eager keeps its input's dimension order: where
    eager's layout is dense, the output is copied contiguous in eager's order and viewed
    back, as Inductor lays out what it returns. Runs under the trace's fake mode (the new
    nodes get their fake values)."""
    graph = lowered.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    ref_node = next(n for n in reference.graph.nodes if n.op == "output")
    got, spec = pytree.tree_flatten(out_node.args[0])
    want = pytree.tree_leaves(ref_node.args[0])
    if len(got) != len(want):
        return
    views: dict[torch.fx.Node, torch.fx.Node | None] = {}
    for i, (node, ref) in enumerate(zip(got, want, strict=True)):
        eager = ref.meta.get("val") if isinstance(ref, torch.fx.Node) else None
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"),
                                                                  torch.Tensor):
            continue
        with graph.inserting_before(out_node):
            if _same_layout(node.meta["val"], eager):
                continue
            got[i] = _as_view(graph, node, views) or got[i]
            order = _dim_order(eager)
            if order is None or _same_layout(got[i].meta["val"], eager):
                continue
            back = [order.index(d) for d in range(len(order))]
            permuted = _call(graph, aten.permute.default, got[i], order)
            dense = _call(graph, aten.clone.default, permuted,
                          memory_format=torch.contiguous_format)
            got[i] = _call(graph, aten.permute.default, dense, back)
    out_node.args = (pytree.tree_unflatten(got, spec),)
    lowered.recompile()


def _call(graph: torch.fx.Graph, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """A new node of ``graph`` calling ``target``, with its fake value."""
    node = graph.call_function(target, args, kwargs)
    values = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (args, kwargs))
    node.meta["val"] = target(*values[0], **values[1])
    return node


def _as_view(graph: torch.fx.Graph, node: torch.fx.Node,
             made: dict[torch.fx.Node, torch.fx.Node | None]) -> torch.fx.Node | None:
    """A new node taking ``node``'s value as the view it was before functionalisation
    made it a copy (``slice_copy`` → ``slice``, an item of ``split_with_sizes_copy`` →
    of ``split_with_sizes``), of a value the piece made (never of an input: a view of
    an input would alias memory the caller owns); None where ``node`` is no such copy."""
    if node in made:
        return made[node]
    made[node] = None
    if node.op != "call_function" or not node.args or not isinstance(node.args[0],
                                                                       torch.fx.Node):
        return None
    base = node.args[0]
    if node.target is operator.getitem:
        view = _as_view(graph, base, made)
        made[node] = None if view is None else _call(graph, operator.getitem, view,
                                                     *node.args[1:])
        return made[node]
    target = _view_of(node.target)
    if target is None or base.op == "placeholder":
        return None
    inner = _as_view(graph, base, made) or base  # a copy of an input's view is the piece's
    made[node] = _call(graph, target, inner, *node.args[1:], **node.kwargs)
    return made[node]


def _view_of(target: Any) -> Any:
    """The admitted view operator whose copy ``target`` is (``aten.slice_copy.Tensor`` →
    ``aten.slice.Tensor``), or None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    namespace, _, name = target._schema.name.partition("::")
    if namespace != "aten" or not name.endswith("_copy"):
        return None
    packet = getattr(aten, name.removesuffix("_copy"), None)
    view = getattr(packet, target._overloadname, None)
    if not isinstance(view, torch._ops.OpOverload) or not view.is_view:
        return None
    return view if allowed.op_refusal(view) is None else None


def _hints(values: Any) -> list[Any]:
    return [v.node.hint if isinstance(v, torch.SymInt) else v for v in values]


def _same_layout(a: torch.Tensor, b: Any) -> bool:
    """Equal sizes and equal strides where a stride matters (a dim of size one has none
    that does), at the traced sizes; asks no shape environment (which would add guards).
    True where ``b`` is no tensor (nothing to match)."""
    if not isinstance(b, torch.Tensor):
        return True
    sizes = _hints(a.shape)
    return sizes == _hints(b.shape) and all(
        n == 1 or x == y for n, x, y in zip(sizes, _hints(a.stride()), _hints(b.stride()),
                                            strict=True))


def _dim_order(t: Any) -> list[int] | None:
    """``t``'s dimensions from outermost to innermost in memory, where ``t`` is dense (at
    its traced sizes); else None."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    sizes, strides = _hints(t.shape), _hints(t.stride())
    if None in sizes or None in strides:
        return None
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):  # dense: each dim's stride is the product of those inside it
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order


#: Tensor constants up to this many elements are written into the stored graph as data.
MAX_INLINE_ELEMENTS = 1024


def inline_constants(gm: torch.fx.GraphModule) -> None:
    """Replace the small tensor constants that tracing lifted into attributes (an empty
    cache tensor, a mask pattern) by ``torch.tensor(data, dtype=...)`` calls, so the graph
    can be stored as data. Larger constants stay attributes (and fail to store, with a
    message saying the piece reads an attribute)."""
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or value.numel() > MAX_INLINE_ELEMENTS:
            continue
        with gm.graph.inserting_before(node):
            const = gm.graph.call_function(
                torch.tensor, (value.tolist(),),
                {"dtype": value.dtype, "device": torch.device(value.device.type)})
        node.replace_all_uses_with(const)
        gm.graph.erase_node(node)
        delattr(gm, node.target)
