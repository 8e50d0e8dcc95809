"""Reference implementations of the custom ops, in plain torch ops (any device).

These define the ops' numerics; the Triton kernels are tested against them. Arithmetic
is in float32 and every value a separate op would write to memory is rounded to the
input dtype where that op would round it, so a fused op equals its unfused sequence
bit for bit here, and pass on/off comparisons need no tolerance beyond the kernels'.

fp8 is ``torch.float8_e4m3fn``: values are divided by the scale and saturated to ±448.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# Smallest per-token scale: keeps an all-zero row from dividing by zero (vLLM's choice).
MIN_TOKEN_SCALE = 1.0 / (FP8_MAX * 512.0)


def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``input * rsqrt(mean(input², -1) + epsilon) * weight`` over the last dim."""
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x * rstd * weight.float()).to(input.dtype)


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(input + residual), input + residual)``; the sum is rounded to the input
    dtype first, as the residual stream is stored in it."""
    summed = (input.float() + residual.float()).to(input.dtype)
    return rms_norm(summed, weight, epsilon), summed


def static_scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``saturate(input / scale)`` as e4m3 fp8; ``scale`` is a one-element float32 tensor."""
    return (input.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dynamic_per_token_fp8_quant(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization: ``scale = max(amax(|row|) / 448, MIN_TOKEN_SCALE)``.

    Returns the fp8 tensor (shape of ``input``) and float32 scales of shape
    ``input.shape[:-1] + (1,)``.
    """
    x = input.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_TOKEN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` where ``a, b`` are the two halves of the last dim."""
    d = input.shape[-1] // 2
    x = input.float()
    return (torch.nn.functional.silu(x[..., :d]) * x[..., d:]).to(input.dtype)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, GPT-NeoX layout (the rotated halves are the first and second half
    of each head's first ``rotary_dim`` elements).

    ``query``/``key``: ``[num_tokens, num_heads * head_size]`` or
    ``[num_tokens, num_heads, head_size]``; ``positions``: ``[num_tokens]`` integers;
    ``cos_sin_cache``: ``[max_position, rotary_dim]``, cos in the first half, sin in the
    second. Elements past ``rotary_dim`` pass through. Returns new tensors shaped like the
    inputs.
    """
    return (_rope(positions, query, cos_sin_cache, head_size),
            _rope(positions, key, cos_sin_cache, head_size))


def _rope(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
          head_size: int) -> torch.Tensor:
    tokens = positions.numel()
    heads = x.float().reshape(tokens, -1, head_size)
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cos_sin = cos_sin_cache.float()[positions.reshape(-1)]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:rot]
    x1, x2 = heads[..., :half], heads[..., half:rot]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, heads[..., rot:]], dim=-1)
    return out.to(x.dtype).reshape(x.shape)


def rms_norm_static_fp8_quant(input: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              epsilon: float) -> torch.Tensor:
    """``static_scaled_fp8_quant(rms_norm(input, weight, epsilon), scale)``."""
    return static_scaled_fp8_quant(rms_norm(input, weight, epsilon), scale)


def fused_add_rms_norm_static_fp8_quant(input: torch.Tensor, residual: torch.Tensor,
                                        weight: torch.Tensor, scale: torch.Tensor,
                                        epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` whose normalized output is quantized: ``(fp8, residual)``."""
    normed, summed = fused_add_rms_norm(input, residual, weight, epsilon)
    return static_scaled_fp8_quant(normed, scale), summed


def silu_and_mul_static_fp8_quant(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``static_scaled_fp8_quant(silu_and_mul(input), scale)``."""
    return static_scaled_fp8_quant(silu_and_mul(input), scale)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads_q: int,
                 num_heads_kv: int, head_size: int, epsilon: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMS norm of q and k, then rotary embedding, on a packed ``qkv``.

    ``qkv``: ``[num_tokens, (num_heads_q + 2 * num_heads_kv) * head_size]`` (q, then k,
    then v along the last dim). Returns ``(q, k)`` as ``[num_tokens, heads * head_size]``;
    v is untouched and stays a slice of ``qkv``.
    """
    q_size, kv_size = num_heads_q * head_size, num_heads_kv * head_size
    q = rms_norm(qkv[:, :q_size].reshape(-1, num_heads_q, head_size), q_weight, epsilon)
    k = rms_norm(qkv[:, q_size:q_size + kv_size].reshape(-1, num_heads_kv, head_size),
                 k_weight, epsilon)
    q, k = rotary_embedding(positions, q.reshape(-1, q_size), k.reshape(-1, kv_size),
                            cos_sin_cache, head_size)
    return q, k
