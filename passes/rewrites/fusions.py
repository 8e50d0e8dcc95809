"""The four fusion passes over the ``torch.ops.cachebuild`` custom ops.

Each pass finds an op sequence whose intermediate results nobody else reads and replaces
it with the fused op computing the same values (``reference`` defines the ops so that the
fused op equals the sequence bit for bit). Graphs may be torch level (Dynamo) or aten
level (AOT autograd, Inductor post-grad); ``matching`` hides the difference. Replaced
nodes are erased; anything else left unused is the clean-up pass's job.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import torch
import torch.fx

from cachebuild.passes.ops import op
from cachebuild.passes.rewrites.manager import FusionPass
from cachebuild.passes.rewrites.matching import (
    call_args,
    copy_meta,
    dim_equals,
    erase_if_dead,
    fake_value,
    getitem_users,
    insert_getitems,
    is_call,
    last_dim_slice,
    only_user,
    ready_before,
    reshape_source,
    set_tuple_val,
    shape_of,
)

# Source that decides what every fusion emits: the ops' schemas and registrations, their
# reference numerics, the Triton kernels, and the graph-reading helpers.
_EMITTED = (
    "cachebuild.passes.ops",
    "cachebuild.passes.ops.reference",
    "cachebuild.passes.ops.kernels",
    "cachebuild.passes.rewrites.matching",
)


class _QuantOfFusion(FusionPass):
    """Shared shape of the fusions ``static_scaled_fp8_quant(producer(...))`` where the
    producer returns one tensor read only by the quantization."""

    producer: ClassVar[str]
    fused: ClassVar[str]

    def fused_args(self, producer_args: dict[str, Any], scale: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def __call__(self, graph: torch.fx.Graph) -> int:
        quant_op, producer_op, fused_op = (op("static_scaled_fp8_quant"), op(self.producer),
                                           op(self.fused))
        matches = 0
        for node in list(graph.nodes):
            if not is_call(node, quant_op):
                continue
            q = call_args(node, quant_op)
            produced = q["input"]
            if not is_call(produced, producer_op) or only_user(produced) is not node:
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(
                    fused_op, self.fused_args(call_args(produced, producer_op), q["scale"]))
            copy_meta(fused, node)
            node.replace_all_uses_with(fused)
            erase_if_dead(graph, [node, produced])
            matches += 1
        return matches


class RMSNormQuantFusion(_QuantOfFusion):
    """``static_scaled_fp8_quant(rms_norm(x, w, eps), s)`` →
    ``rms_norm_static_fp8_quant(x, w, s, eps)``."""

    name: ClassVar[str] = "rms_quant"
    source_modules: ClassVar[tuple[str, ...]] = _EMITTED
    producer: ClassVar[str] = "rms_norm"
    fused: ClassVar[str] = "rms_norm_static_fp8_quant"

    def fused_args(self, producer_args: dict[str, Any], scale: Any) -> tuple[Any, ...]:
        a = producer_args
        return (a["input"], a["weight"], scale, a["epsilon"])


class ActQuantFusion(_QuantOfFusion):
    """``static_scaled_fp8_quant(silu_and_mul(x), s)`` →
    ``silu_and_mul_static_fp8_quant(x, s)``."""

    name: ClassVar[str] = "act_quant"
    source_modules: ClassVar[tuple[str, ...]] = _EMITTED
    producer: ClassVar[str] = "silu_and_mul"
    fused: ClassVar[str] = "silu_and_mul_static_fp8_quant"

    def fused_args(self, producer_args: dict[str, Any], scale: Any) -> tuple[Any, ...]:
        return (producer_args["input"], scale)


class AddRMSNormQuantFusion(FusionPass):
    """``fused_add_rms_norm`` whose normalized output is read only by
    ``static_scaled_fp8_quant`` → ``fused_add_rms_norm_static_fp8_quant``; the residual
    output keeps all its readers."""

    name: ClassVar[str] = "add_rms_quant"
    source_modules: ClassVar[tuple[str, ...]] = _EMITTED

    def __call__(self, graph: torch.fx.Graph) -> int:
        quant_op, norm_op = op("static_scaled_fp8_quant"), op("fused_add_rms_norm")
        fused_op = op("fused_add_rms_norm_static_fp8_quant")
        matches = 0
        for node in list(graph.nodes):
            if not is_call(node, quant_op):
                continue
            q = call_args(node, quant_op)
            first = q["input"]
            if not (isinstance(first, torch.fx.Node) and first.target is operator.getitem
                    and first.args[1] == 0 and only_user(first) is node):
                continue
            norm = first.args[0]
            if not is_call(norm, norm_op):
                continue
            items = getitem_users(norm)
            if items is None or items.get(0) != [first] or not ready_before(q["scale"], norm):
                continue
            a = call_args(norm, norm_op)
            with graph.inserting_before(norm):
                fused = graph.call_function(fused_op, (a["input"], a["residual"], a["weight"],
                                                       q["scale"], a["epsilon"]))
            residual_val = fake_value(items[1][0]) if items.get(1) else None
            vals = [fake_value(node), residual_val]
            set_tuple_val(fused, vals)
            out, residual = insert_getitems(graph, fused, 2, vals)
            node.replace_all_uses_with(out)
            for old in items.get(1, []):
                old.replace_all_uses_with(residual)
            erase_if_dead(graph, [node, first, *items.get(1, []), norm])
            matches += 1
        return matches


class QKNormRoPEFusion(FusionPass):
    """Per-head ``rms_norm`` of q and k sliced from a packed qkv, then ``rotary_embedding``
    → ``qk_norm_rope(qkv, ...)``.

    Matches: q = qkv[:, :nq*d], k = qkv[:, nq*d:(nq+nkv)*d] (by split or slice), each
    reshaped so the last dim is the head (d), normalized with one epsilon, reshaped back to
    ``[tokens, heads*d]`` and rotated by one ``rotary_embedding`` call. Needs shape metadata
    (fake tensors), which every traced graph carries.
    """

    name: ClassVar[str] = "qk_norm_rope"
    source_modules: ClassVar[tuple[str, ...]] = _EMITTED

    @staticmethod
    def norm_of_slice(rotary_input: Any, head_size: int) -> tuple[Any, ...] | None:
        """Match ``reshapes(rms_norm(reshapes(slice of qkv)))`` feeding a rotary input, every
        intermediate read once, the norm over ``head_size`` elements.

        Returns the norm node, the reshapes after it, the slice (tensor, start, length) and the
        nodes between the slice and the norm.
        """
        norm_op = op("rms_norm")
        if not isinstance(rotary_input, torch.fx.Node):
            return None
        norm, after = reshape_source(rotary_input)
        if not is_call(norm, norm_op) or any(len(n.users) != 1 for n in [norm, *after]):
            return None
        norm_shape = shape_of(norm)
        if norm_shape is None or not dim_equals(norm_shape[-1], head_size):
            return None
        sliced, before = reshape_source(call_args(norm, norm_op)["input"])
        found = last_dim_slice(sliced)
        if found is None or any(len(n.users) != 1 for n in before):
            return None
        if found[2] % head_size:
            return None
        return norm, after, found, [*before, sliced]

    def __call__(self, graph: torch.fx.Graph) -> int:
        rope_op, norm_op, fused_op = op("rotary_embedding"), op("rms_norm"), op("qk_norm_rope")
        matches = 0
        for node in list(graph.nodes):
            if not is_call(node, rope_op):
                continue
            r = call_args(node, rope_op)
            head = r["head_size"]
            if not isinstance(head, int):
                continue
            q_match = self.norm_of_slice(r["query"], head)
            k_match = self.norm_of_slice(r["key"], head)
            if q_match is None or k_match is None:
                continue
            (q_norm, q_after, (qkv, q_start, q_len), q_before) = q_match
            (k_norm, k_after, (k_qkv, k_start, k_len), k_before) = k_match
            q_args, k_args = call_args(q_norm, norm_op), call_args(k_norm, norm_op)
            q_shape, k_shape = shape_of(r["query"]), shape_of(r["key"])
            if (k_qkv is not qkv or q_start != 0 or k_start != q_len
                    or q_args["epsilon"] != k_args["epsilon"]
                    or q_shape is None or len(q_shape) != 2
                    or k_shape is None or len(k_shape) != 2):
                continue
            items = getitem_users(node)
            if items is None:
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(fused_op, (
                    qkv, r["positions"], q_args["weight"], k_args["weight"],
                    r["cos_sin_cache"], q_len // head, k_len // head, head,
                    q_args["epsilon"]))
            old_vals = fake_value(node)
            vals = list(old_vals) if isinstance(old_vals, (tuple, list)) else [None, None]
            set_tuple_val(fused, vals)
            new_items = insert_getitems(graph, fused, 2, vals)
            for index, olds in items.items():
                for old in olds:
                    old.replace_all_uses_with(new_items[index])
            erase_if_dead(graph, [*[n for olds in items.values() for n in olds], node,
                                  *reversed(q_after), q_norm, *q_before,
                                  *reversed(k_after), k_norm, *k_before])
            matches += 1
        return matches
