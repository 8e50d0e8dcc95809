"""Triton kernels for the custom ops, and the Python launchers the CUDA registrations call.

Each ``<op>_triton`` launcher takes the op's arguments and returns new tensors exactly
like the reference in ``reference``; with ``TRITON_INTERPRET=1`` they also run on CPU
tensors, which is how the kernels are tested without a GPU. Arithmetic is in float32 and
values are rounded to the input dtype where the reference rounds them.

Only long-standing ``tl`` APIs are used (loads/stores with masks, ``tl.sum``/``tl.max``,
``tl.rsqrt``, ``tl.sigmoid``, bitcasts, ``.to(tl.float8e4nv)``), so the kernels build on Triton 3.6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cachebuild.passes.ops.reference import FP8_DTYPE, FP8_MAX, MIN_TOKEN_SCALE

# ---------------------------------------------------------------------------- kernels


@triton.jit
def _to_fp8(y, FP8_LIMIT: tl.constexpr):
    """Saturate to ±FP8_LIMIT and convert to e4m3, rounding to nearest even.

    The rounding is done in float32 bit arithmetic first so that the final conversion is
    exact: every backend then agrees with torch bit for bit (Triton's interpreter rounds
    some values wrongly when converting directly).
    """
    y = tl.minimum(tl.maximum(y, -FP8_LIMIT), FP8_LIMIT)
    # Normal range: keep 3 of float32's 23 mantissa bits, ties to even; a carry into the
    # exponent is the correct result.
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal range (|y| < 2^-6): multiples of 2^-9; adding 1.5 * 2^14 makes float32's
    # own round-to-nearest-even do it. Sign reapplied so -0 stays -0.
    magnitude = (tl.abs(y) + 24576.0) - 24576.0
    subnormal = tl.where(y < 0, -magnitude, magnitude)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal).to(tl.float8e4nv)


@triton.jit
def _round(y, DTYPE: tl.constexpr):
    """``y`` (float32) converted to DTYPE, rounding to nearest even.

    bfloat16 is rounded in float32 bit arithmetic first so that the conversion is exact:
    Triton's interpreter truncates instead of rounding, and this keeps every backend equal
    to torch bit for bit.
    """
    if DTYPE == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return y.to(DTYPE)


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride,
                     res_out_ptr, res_out_stride, scale_ptr, hidden, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                     FP8_LIMIT: tl.constexpr):
    # One program per row; the whole row stays in registers (hidden sizes up to ~16k).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
        summed = _round(x + r, x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    if QUANT:
        # Round to the activation dtype first: the unfused norm would write it so.
        y = _round(y, x_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.load(scale_ptr).to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, _to_fp8(y / scale, FP8_LIMIT), mask=mask)
    else:
        tl.store(out_ptr + row * out_stride + offs, _round(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, scale_ptr, d,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr, FP8_LIMIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    a = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * x_stride + d + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    if QUANT:
        y = _round(y, x_ptr.dtype.element_ty).to(tl.float32)
        scale = tl.load(scale_ptr).to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, _to_fp8(y / scale, FP8_LIMIT), mask=mask)
    else:
        tl.store(out_ptr + row * out_stride + offs, _round(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _static_quant_kernel(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr,
                         FP8_LIMIT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    tl.store(out_ptr + offs, _to_fp8(x / scale, FP8_LIMIT), mask=mask)


@triton.jit
def _dynamic_quant_kernel(x_ptr, x_stride, out_ptr, out_stride, scale_out_ptr, hidden,
                          BLOCK: tl.constexpr, FP8_LIMIT: tl.constexpr,
                          MIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_LIMIT, MIN_SCALE)
    tl.store(scale_out_ptr + row, scale)
    tl.store(out_ptr + row * out_stride + offs, _to_fp8(x / scale, FP8_LIMIT), mask=mask)


@triton.jit
def _rope_heads(pos, in_ptr, in_stride, out_ptr, out_stride, w_ptr, cache_ptr, cache_stride,
                token, head0, num_heads, head_size, half, eps,
                BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                HAS_PASS: tl.constexpr, NORM: tl.constexpr):
    # A [BLOCK_H heads, BLOCK_R] tile of each rotated half; BLOCK_P covers the elements
    # past the rotary dim, which pass through (only normalized when NORM).
    heads = head0 + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    head_mask = heads < num_heads
    rmask = head_mask[:, None] & (r < half)[None, :]
    base_in = in_ptr + token * in_stride + heads[:, None] * head_size
    base_out = out_ptr + token * out_stride + heads[:, None] * head_size
    x1 = tl.load(base_in + r[None, :], mask=rmask, other=0.0).to(tl.float32)
    x2 = tl.load(base_in + half + r[None, :], mask=rmask, other=0.0).to(tl.float32)
    if HAS_PASS:
        p = 2 * half + tl.arange(0, BLOCK_P)
        pmask = head_mask[:, None] & (p < head_size)[None, :]
        xp = tl.load(base_in + p[None, :], mask=pmask, other=0.0).to(tl.float32)
    if NORM:
        sumsq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if HAS_PASS:
            sumsq += tl.sum(xp * xp, axis=1)
        rstd = tl.rsqrt(sumsq / head_size + eps)[:, None]
        w1 = tl.load(w_ptr + r, mask=r < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + r, mask=r < half, other=0.0).to(tl.float32)[None, :]
        # Round to the activation dtype as the unfused norm's output would be.
        x1 = _round(x1 * rstd * w1, in_ptr.dtype.element_ty).to(tl.float32)
        x2 = _round(x2 * rstd * w2, in_ptr.dtype.element_ty).to(tl.float32)
        if HAS_PASS:
            wp = tl.load(w_ptr + p, mask=p < head_size, other=0.0).to(tl.float32)[None, :]
            xp = _round(xp * rstd * wp, in_ptr.dtype.element_ty).to(tl.float32)
    cos = tl.load(cache_ptr + pos * cache_stride + r, mask=r < half, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + half + r, mask=r < half, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(base_out + r[None, :], _round(x1 * cos - x2 * sin, dtype), mask=rmask)
    tl.store(base_out + half + r[None, :], _round(x2 * cos + x1 * sin, dtype), mask=rmask)
    if HAS_PASS:
        tl.store(base_out + p[None, :], _round(xp, dtype), mask=pmask)


@triton.jit
def _rope_kernel(pos_ptr, q_ptr, q_stride, k_ptr, k_stride, q_out_ptr, q_out_stride,
                 k_out_ptr, k_out_stride, q_w_ptr, k_w_ptr, cache_ptr, cache_stride,
                 num_heads_q, num_heads_kv, head_size, half, eps,
                 BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                 HAS_PASS: tl.constexpr, NORM: tl.constexpr):
    # Grid: (tokens, q head blocks + k head blocks): one launch serves both q and k.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(num_heads_q, BLOCK_H)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    if block < q_blocks:
        _rope_heads(pos, q_ptr, q_stride, q_out_ptr, q_out_stride, q_w_ptr, cache_ptr,
                    cache_stride, token, block * BLOCK_H, num_heads_q, head_size, half, eps,
                    BLOCK_H, BLOCK_R, BLOCK_P, HAS_PASS, NORM)
    else:
        _rope_heads(pos, k_ptr, k_stride, k_out_ptr, k_out_stride, k_w_ptr, cache_ptr,
                    cache_stride, token, (block - q_blocks) * BLOCK_H, num_heads_kv,
                    head_size, half, eps, BLOCK_H, BLOCK_R, BLOCK_P, HAS_PASS, NORM)


# ---------------------------------------------------------------------------- launchers


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit stride along the last dim (copy if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _require(ok: bool, what: str) -> None:
    """The kernels read and write by sizes they are given: each launcher checks them
    against the tensors first, so a call with mismatched shapes (as a stored graph may
    make) is an error, never a read or write past a tensor."""
    if not ok:
        raise ValueError(what)


def _check_scale(scale: torch.Tensor) -> torch.Tensor:
    if scale.numel() != 1:
        raise ValueError(f"static fp8 scale must have one element, got shape {tuple(scale.shape)}")
    return scale.reshape(1).to(torch.float32)


def _norm(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          scale: torch.Tensor | None, epsilon: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = input.shape[-1]
    _require(weight.numel() == hidden, f"rms_norm weight of {weight.numel()} elements for "
                                       f"rows of {hidden}")
    _require(residual is None or residual.shape == input.shape,
             "rms_norm residual and input shapes differ")
    x = _rows(input)
    out = torch.empty(input.shape, dtype=FP8_DTYPE if scale is not None else input.dtype,
                      device=input.device)
    res_out = torch.empty_like(input) if residual is not None else None
    if x.shape[0] == 0:
        return out, res_out
    r = _rows(residual) if residual is not None else x
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        x, x.stride(0), r, r.stride(0), weight.contiguous(), out, hidden,
        res_out if res_out is not None else out, hidden,
        _check_scale(scale) if scale is not None else weight, hidden, float(epsilon),
        BLOCK=block, HAS_RESIDUAL=residual is not None, QUANT=scale is not None,
        FP8_LIMIT=FP8_MAX, num_warps=_row_warps(block))
    return out, res_out


def rms_norm_triton(input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    return _norm(input, None, weight, None, epsilon)[0]


def fused_add_rms_norm_triton(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, res_out = _norm(input, residual, weight, None, epsilon)
    return out, res_out


def rms_norm_static_fp8_quant_triton(input: torch.Tensor, weight: torch.Tensor,
                                     scale: torch.Tensor, epsilon: float) -> torch.Tensor:
    return _norm(input, None, weight, scale, epsilon)[0]


def fused_add_rms_norm_static_fp8_quant_triton(input: torch.Tensor, residual: torch.Tensor,
                                               weight: torch.Tensor, scale: torch.Tensor,
                                               epsilon: float
                                               ) -> tuple[torch.Tensor, torch.Tensor]:
    out, res_out = _norm(input, residual, weight, scale, epsilon)
    return out, res_out


def static_scaled_fp8_quant_triton(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = input.contiguous()
    out = torch.empty(input.shape, dtype=FP8_DTYPE, device=input.device)
    n = x.numel()
    if n:
        block = 1024
        _static_quant_kernel[(triton.cdiv(n, block),)](
            x, out, _check_scale(scale), n, BLOCK=block, FP8_LIMIT=FP8_MAX, num_warps=4)
    return out


def dynamic_per_token_fp8_quant_triton(input: torch.Tensor
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = input.shape[-1]
    x = _rows(input)
    out = torch.empty(input.shape, dtype=FP8_DTYPE, device=input.device)
    scales = torch.empty((*input.shape[:-1], 1), dtype=torch.float32, device=input.device)
    if x.shape[0]:
        block = triton.next_power_of_2(hidden)
        _dynamic_quant_kernel[(x.shape[0],)](
            x, x.stride(0), out, hidden, scales, hidden, BLOCK=block, FP8_LIMIT=FP8_MAX,
            MIN_SCALE=MIN_TOKEN_SCALE, num_warps=_row_warps(block))
    return out, scales


def _silu_and_mul(input: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    d = input.shape[-1] // 2
    x = _rows(input)
    out = torch.empty((*input.shape[:-1], d),
                      dtype=FP8_DTYPE if scale is not None else input.dtype, device=input.device)
    if x.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            x, x.stride(0), out, d, _check_scale(scale) if scale is not None else x, d,
            BLOCK=block, QUANT=scale is not None, FP8_LIMIT=FP8_MAX, num_warps=4)
    return out


def silu_and_mul_triton(input: torch.Tensor) -> torch.Tensor:
    return _silu_and_mul(input, None)


def silu_and_mul_static_fp8_quant_triton(input: torch.Tensor, scale: torch.Tensor
                                         ) -> torch.Tensor:
    return _silu_and_mul(input, scale)


def _launch_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 q_out: torch.Tensor, k_out: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, cos_sin_cache: torch.Tensor,
                 num_heads_q: int, num_heads_kv: int, head_size: int, epsilon: float) -> None:
    tokens = positions.numel()
    rot = cos_sin_cache.shape[-1]
    if rot % 2 or rot > head_size:
        raise ValueError(f"rotary dim {rot} must be even and at most head_size {head_size}")
    _require(cos_sin_cache.dim() == 2 and (tokens == 0 or cos_sin_cache.shape[0] > 0)
             and head_size > 0 and num_heads_q >= 0
             and num_heads_kv >= 0, "rope sizes do not fit the cos/sin cache")
    _require(q.shape[0] == tokens and k.shape[0] == tokens and q_out.shape[0] == tokens
             and k_out.shape[0] == tokens, "rope rows differ from the positions")
    _require(q.shape[1] >= num_heads_q * head_size and k.shape[1] >= num_heads_kv * head_size
             and q_out.shape[1] >= num_heads_q * head_size
             and k_out.shape[1] >= num_heads_kv * head_size, "rope heads exceed the rows")
    _require(q_weight is None or (q_weight.numel() >= head_size and k_weight is not None
                                  and k_weight.numel() >= head_size),
             "rope norm weights are shorter than a head")
    if tokens == 0:
        return
    half = rot // 2
    rest = head_size - rot
    block_h = min(triton.next_power_of_2(max(num_heads_q, num_heads_kv)), 16)
    grid = (tokens, triton.cdiv(num_heads_q, block_h) + triton.cdiv(num_heads_kv, block_h))
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    # Positions come from the caller (a stored graph may pass any): clamped into the
    # cache on the device, so a bad one reads a wrong row, never memory past the cache.
    # Checking them on the host would need a sync, which CUDA graph capture forbids; a
    # clamp here leaves the kernel itself as it was.
    rows = positions.reshape(-1).clamp(0, cache.shape[0] - 1)
    norm = q_weight is not None
    _rope_kernel[grid](
        rows, q, q.stride(0), k, k.stride(0), q_out, q_out.stride(0),
        k_out, k_out.stride(0), q_weight if norm else cache, k_weight if norm else cache,
        cache, cache.stride(0), num_heads_q, num_heads_kv, head_size, half, float(epsilon),
        BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(max(half, 1)),
        BLOCK_P=triton.next_power_of_2(max(rest, 1)), HAS_PASS=rest > 0, NORM=norm,
        num_warps=4)


def rotary_embedding_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                            cos_sin_cache: torch.Tensor, head_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = positions.numel()
    q = _rows(query.reshape(tokens, -1))
    k = _rows(key.reshape(tokens, -1))
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    _launch_rope(positions, q, k, q_out, k_out, None, None, cos_sin_cache,
                 q.shape[1] // head_size, k.shape[1] // head_size, head_size, 0.0)
    return q_out.reshape(query.shape), k_out.reshape(key.shape)


def qk_norm_rope_triton(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads_q: int,
                        num_heads_kv: int, head_size: int, epsilon: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rows(qkv)
    q_size, kv_size = num_heads_q * head_size, num_heads_kv * head_size
    q_out = torch.empty((x.shape[0], q_size), dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty((x.shape[0], kv_size), dtype=qkv.dtype, device=qkv.device)
    # k starts q_size elements into each row: pass that view, its data pointer is offset.
    _launch_rope(positions, x, x[:, q_size:], q_out, k_out, q_weight.contiguous(),
                 k_weight.contiguous(), cos_sin_cache, num_heads_q, num_heads_kv, head_size,
                 epsilon)
    return q_out, k_out
