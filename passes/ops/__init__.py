"""The custom ops the passes match and emit, registered in the ``cachebuild`` namespace.

Every op is functional (returns new tensors, mutates nothing), so AOT autograd needs no
``auto_functionalized`` wrapper and the passes see plain calls. Each op has:

- a reference implementation in torch ops (``reference``), registered for every device
  as ``CompositeExplicitAutograd``;
- a Triton implementation (``kernels.<op>_triton``), registered for CUDA, imported on
  first use so that loading the ops imports no Triton;
- a fake (meta) implementation for tracing.

Outputs are contiguous on every path. Call them as ``torch.ops.cachebuild.<op>``.

Schemas::

    rms_norm(input, weight, epsilon) -> out
    fused_add_rms_norm(input, residual, weight, epsilon) -> (out, residual_out)
    static_scaled_fp8_quant(input, scale) -> fp8
    dynamic_per_token_fp8_quant(input) -> (fp8, scales[..., 1])
    silu_and_mul(input) -> out
    rotary_embedding(positions, query, key, cos_sin_cache, head_size) -> (query, key)
    rms_norm_static_fp8_quant(input, weight, scale, epsilon) -> fp8
    fused_add_rms_norm_static_fp8_quant(input, residual, weight, scale, epsilon)
        -> (fp8, residual_out)
    silu_and_mul_static_fp8_quant(input, scale) -> fp8
    qk_norm_rope(qkv, positions, q_weight, k_weight, cos_sin_cache, num_heads_q,
                 num_heads_kv, head_size, epsilon) -> (q, k)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from cachebuild.passes.ops import reference
from cachebuild.passes.ops.reference import FP8_DTYPE

NAMESPACE = "cachebuild"

SCHEMAS: dict[str, str] = {
    "rms_norm": "(Tensor input, Tensor weight, float epsilon) -> Tensor",
    "fused_add_rms_norm":
        "(Tensor input, Tensor residual, Tensor weight, float epsilon) -> (Tensor, Tensor)",
    "static_scaled_fp8_quant": "(Tensor input, Tensor scale) -> Tensor",
    "dynamic_per_token_fp8_quant": "(Tensor input) -> (Tensor, Tensor)",
    "silu_and_mul": "(Tensor input) -> Tensor",
    "rotary_embedding": "(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, "
                        "int head_size) -> (Tensor, Tensor)",
    "rms_norm_static_fp8_quant":
        "(Tensor input, Tensor weight, Tensor scale, float epsilon) -> Tensor",
    "fused_add_rms_norm_static_fp8_quant":
        "(Tensor input, Tensor residual, Tensor weight, Tensor scale, float epsilon) "
        "-> (Tensor, Tensor)",
    "silu_and_mul_static_fp8_quant": "(Tensor input, Tensor scale) -> Tensor",
    "qk_norm_rope": "(Tensor qkv, Tensor positions, Tensor q_weight, Tensor k_weight, "
                    "Tensor cos_sin_cache, int num_heads_q, int num_heads_kv, int head_size, "
                    "float epsilon) -> (Tensor, Tensor)",
}

# The ops that replace a sequence of other ops; each pass emits one of them.
FUSED_OPS = ("rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
             "silu_and_mul_static_fp8_quant", "qk_norm_rope")


def _contiguous(result: Any) -> Any:
    if isinstance(result, tuple):
        return tuple(t.contiguous() for t in result)
    return result.contiguous()


def _reference_impl(name: str) -> Callable[..., Any]:
    fn = getattr(reference, name)

    def impl(*args: Any) -> Any:
        return _contiguous(fn(*args))

    impl.__name__ = f"{name}_reference"
    return impl


def _triton_impl(name: str) -> Callable[..., Any]:
    def impl(*args: Any) -> Any:
        kernels = importlib.import_module("cachebuild.passes.ops.kernels")
        return getattr(kernels, f"{name}_triton")(*args)

    impl.__name__ = f"{name}_cuda"
    return impl


def _fake_rows(t: torch.Tensor, last: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.new_empty((*t.shape[:-1], last), dtype=dtype or t.dtype)


_FAKES: dict[str, Callable[..., Any]] = {
    "rms_norm": lambda input, weight, epsilon: input.new_empty(input.shape),
    "fused_add_rms_norm": lambda input, residual, weight, epsilon: (
        input.new_empty(input.shape), input.new_empty(input.shape)),
    "static_scaled_fp8_quant": lambda input, scale: input.new_empty(input.shape,
                                                                    dtype=FP8_DTYPE),
    "dynamic_per_token_fp8_quant": lambda input: (
        input.new_empty(input.shape, dtype=FP8_DTYPE),
        _fake_rows(input, 1, torch.float32)),
    "silu_and_mul": lambda input: _fake_rows(input, input.shape[-1] // 2),
    "rotary_embedding": lambda positions, query, key, cos_sin_cache, head_size: (
        query.new_empty(query.shape), key.new_empty(key.shape)),
    "rms_norm_static_fp8_quant": lambda input, weight, scale, epsilon: input.new_empty(
        input.shape, dtype=FP8_DTYPE),
    "fused_add_rms_norm_static_fp8_quant": lambda input, residual, weight, scale, epsilon: (
        input.new_empty(input.shape, dtype=FP8_DTYPE), input.new_empty(input.shape)),
    "silu_and_mul_static_fp8_quant": lambda input, scale: _fake_rows(
        input, input.shape[-1] // 2, FP8_DTYPE),
    "qk_norm_rope": lambda qkv, positions, q_weight, k_weight, cos_sin_cache, num_heads_q,
    num_heads_kv, head_size, epsilon: (
        _fake_rows(qkv, num_heads_q * head_size), _fake_rows(qkv, num_heads_kv * head_size)),
}

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def _register() -> None:
    for name, schema in SCHEMAS.items():
        _LIB.define(name + schema)
        _LIB.impl(name, _reference_impl(name), "CompositeExplicitAutograd")
        _LIB.impl(name, _triton_impl(name), "CUDA")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _FAKES[name], lib=_LIB)


_register()


def op(name: str) -> torch._ops.OpOverload:
    """The default overload of one of the ops above, e.g. ``op("rms_norm")``."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def triton_impl(name: str) -> Callable[..., Any]:
    """The Triton launcher of op ``name`` (imports Triton); runs on CPU tensors under
    ``TRITON_INTERPRET=1``."""
    kernels = importlib.import_module("cachebuild.passes.ops.kernels")
    return getattr(kernels, f"{name}_triton")
