"""What compiling a model in pieces changes in Inductor's choices, and the pass that undoes it.

Inductor's post-grad patterns fold ``x + a @ b`` into ``addmm(x, a, b)`` unless every user
of the sum is pointwise; on a GPU the unfused add then rides along in its consumer's kernel
(torch's ``should_prefer_unfused_addmm``). ``addmm`` with a full-size ``x`` costs a copy of
``x`` into the result before cuBLAS adds into it: one more kernel, and one more node in a
CUDA graph. A decoder layer's residual sum is handed to the next piece, so in a piece it has
the graph's output among its users and becomes ``addmm``; the sum before it follows (the
new ``addmm`` is one of its users), and so does a sum read through ``_to_copy`` (an
exported graph's dtype cast, which torch does not count as pointwise). Compiled whole, as
torch.compile does, none of them is: measured on an H200 at 22 layers, the full decode graph
of ``examples/generate.py`` held 42 more kernels than torch.compile's, all such copies.

``unfuse_edge_addmm`` turns each such ``addmm`` on a GPU back into ``add(x, mm(a, b))``
where the sum has at least one consumer the add can fuse into and no user but those and
the output: what the whole model's compile would have chosen. ``EdgePass`` runs it as
Inductor's post-grad custom pass, ahead of the fusion passes a config enables.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

aten = torch.ops.aten


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _same_device_cast(node: torch.fx.Node) -> bool:
    """A ``_to_copy`` that changes only the dtype (the cast of an exported ``.to(dtype)``)."""
    if node.target is not aten._to_copy.default:
        return False
    src, out = _val(node.args[0]), _val(node)
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.device == out.device and set(node.kwargs) <= {"dtype", "device", "layout"})


def _fusable_use(user: torch.fx.Node) -> bool:
    """Whether an add feeding ``user`` can be fused into it (torch's rule, and a cast)."""
    from torch._inductor.utils import is_pointwise_use

    return is_pointwise_use(user, lambda target: target is aten._to_copy.default) and (
        user.target is not aten._to_copy.default or _same_device_cast(user))


def _unfusable(node: torch.fx.Node, gpu_only: bool) -> bool:
    """Whether ``node`` is an ``addmm`` of a full-size sum that compiling whole would leave
    as an add: see the module's docstring."""
    if node.target is not aten.addmm.default or len(node.args) != 3:
        return False
    if any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return False
    inp, out = _val(node.args[0]), _val(node)
    if not (isinstance(inp, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    # Compared without guards: a guard here would narrow the piece's dynamic sizes.
    if inp.dtype != out.dtype or inp.dim() != out.dim() or not statically_known_true(
            sym_eq(inp.shape, out.shape)):
        return False  # a bias row: cuBLAS adds it in its epilogue, no copy
    if gpu_only:
        from torch._inductor.utils import is_gpu

        if not is_gpu(out.device.type):
            return False
    users = list(node.users)
    fusable = [u for u in users if u.op != "output" and _fusable_use(u)]
    return bool(fusable) and all(u.op == "output" or u in fusable for u in users)


def unfuse_edge_addmm(graph: torch.fx.Graph, gpu_only: bool = True) -> int:
    """Rewrite every ``addmm`` of ``graph`` that only a piece's edge made one back into
    ``add(x, mm(a, b))``; returns how many. Latest first, so that a sum whose only
    non-pointwise user was a rewritten ``addmm`` is seen as the whole graph would see it.
    ``gpu_only``: leave CPU graphs alone (Inductor prefers ``addmm`` there)."""
    count = 0
    for node in reversed(list(graph.find_nodes(op="call_function", target=aten.addmm.default))):
        if not _unfusable(node, gpu_only):
            continue
        x, a, b = node.args
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (a, b))
            add = graph.call_function(aten.add.Tensor, (x, mm))
        mm.meta.update(node.meta)
        add.meta.update(node.meta)
        mm.meta.pop("val", None)
        fake_mode = getattr(_val(a), "fake_mode", None)
        if fake_mode is not None and isinstance(_val(b), torch.Tensor):
            with fake_mode:
                mm.meta["val"] = aten.mm.default(_val(a), _val(b))
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        count += 1
    return count


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()


class EdgePass(CustomGraphPass):
    """Inductor's post-grad custom pass for a piece: ``unfuse_edge_addmm``, then ``then``
    (the enabled fusion passes, if any). Its ``uuid`` covers this module's source and
    ``then``'s, so Inductor's caches are keyed by both."""

    def __init__(self, then: Any = None):
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        unfuse_edge_addmm(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> str:
        return _source_hash() + (f"+{self.then.uuid()}" if self.then is not None else "")

    def __repr__(self) -> str:
        return f"EdgePass(then={self.then!r})"
