"""Every op and fused op: Triton kernel against the torch reference.

Without a GPU the kernels run on CPU through Triton's interpreter at small shapes (odd
hidden sizes, 1 and a few dozen tokens); with one, at full shapes too (up to 8192 tokens).
fp8 outputs are compared after dequantization: kernels and reference may land on
neighbouring fp8 values (the interpreter breaks rounding ties differently from the
hardware), so the tolerance is one e4m3 step.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before Triton decorates the kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the kernels need Triton (pip install -e '.[test]')")

from cachebuild.passes.ops import (  # noqa: E402
    kernels,
    op,  # noqa: E402
    reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
FP8_STEP = 2.0 ** -3  # relative spacing of e4m3 values
FP8_TINY = 2.0 ** -9  # smallest e4m3 subnormal


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def scale_for(x: torch.Tensor) -> torch.Tensor:
    """A static scale that uses most of the fp8 range without saturating much."""
    return (x.float().abs().amax() / 400.0).reshape(1).to(DEVICE)


def rope_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def positions_for(tokens: int, max_pos: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, max_pos, (tokens,), generator=_gen(seed)).to(DEVICE)


def assert_fp8_close(actual: torch.Tensor, expected: torch.Tensor, scale) -> None:
    """Equal up to one e4m3 step after dequantization, and mostly bit-identical."""
    assert actual.dtype == expected.dtype == torch.float8_e4m3fn
    assert actual.shape == expected.shape
    scale = scale.float().cpu() if isinstance(scale, torch.Tensor) else scale
    a = actual.float().cpu() * scale
    e = expected.float().cpu() * scale
    tiny = FP8_TINY * (scale.max().item() if isinstance(scale, torch.Tensor) else scale)
    torch.testing.assert_close(a, e, rtol=FP8_STEP * 1.01, atol=tiny * 1.01)
    same = (actual.cpu().view(torch.uint8) == expected.cpu().view(torch.uint8)).float().mean()
    assert same > 0.95, f"only {same:.1%} of fp8 values identical"


def assert_same(actual, expected, fp8_scale=None) -> None:
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e, fp8_scale)
        return
    if expected.dtype == torch.float8_e4m3fn:
        assert_fp8_close(actual, expected, fp8_scale)
    else:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        if expected.dtype == torch.bfloat16:
            # A GPU's fma and the reference's separate multiply-add can land one bf16 step
            # apart where rotary terms cancel near zero: allow one step at magnitude 1.
            torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=1.6e-2, atol=2.0 ** -7)
        else:
            torch.testing.assert_close(actual.cpu(), expected.cpu())


TOKENS = [1, 33]
HIDDEN = [96, 257]  # not powers of two; 257 also leaves a mostly empty tail block


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm(tokens, hidden, dtype):
    x = randn(tokens, hidden, dtype=dtype, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=1)
    assert_same(kernels.rms_norm_triton(x, w, EPS), reference.rms_norm(x, w, EPS))


def test_rms_norm_leading_dims_and_strided_rows():
    x = randn(2, 5, 160)
    w = randn(80, seed=1)
    # A slice of the last dim: rows are strided, the last dim is not contiguous overall.
    part = x[..., 40:120]
    assert_same(kernels.rms_norm_triton(part, w, EPS), reference.rms_norm(part, w, EPS))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm(tokens, hidden):
    x, r = randn(tokens, hidden), randn(tokens, hidden, seed=2, scale=4.0)
    w = randn(hidden, seed=1)
    assert_same(kernels.fused_add_rms_norm_triton(x, r, w, EPS),
                reference.fused_add_rms_norm(x, r, w, EPS))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_static_scaled_fp8_quant(tokens, hidden, dtype):
    x = randn(tokens, hidden, dtype=dtype, scale=10.0)
    s = scale_for(x)
    assert_same(kernels.static_scaled_fp8_quant_triton(x, s),
                reference.static_scaled_fp8_quant(x, s), s)


def test_static_quant_saturates():
    x = torch.tensor([[-1000.0, -1.0, 0.0, 3.0, 1000.0]], device=DEVICE)
    s = torch.tensor([0.5], device=DEVICE)
    out = kernels.static_scaled_fp8_quant_triton(x, s).float().cpu()
    assert out.tolist() == [[-448.0, -2.0, 0.0, 6.0, 448.0]]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_dynamic_per_token_fp8_quant(tokens, hidden):
    x = randn(tokens, hidden, scale=5.0)
    x[0] = 0  # an all-zero row takes the minimum scale
    q, s = kernels.dynamic_per_token_fp8_quant_triton(x)
    q_ref, s_ref = reference.dynamic_per_token_fp8_quant(x)
    assert s.shape == s_ref.shape == (tokens, 1)
    torch.testing.assert_close(s.cpu(), s_ref.cpu())
    assert_fp8_close(q, q_ref, s_ref)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("d", [77, 128])
def test_silu_and_mul(tokens, d):
    x = randn(tokens, 2 * d, scale=2.0)
    assert_same(kernels.silu_and_mul_triton(x), reference.silu_and_mul(x))


ROPE_CASES = [  # (q heads, kv heads, head_size, rotary_dim)
    (4, 2, 40, 40),
    (3, 1, 64, 32),  # partial rotary: the last 32 elements pass through
]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("nq", "nkv", "head", "rot"), ROPE_CASES)
@pytest.mark.parametrize("three_d", [False, True])
def test_rotary_embedding(tokens, nq, nkv, head, rot, three_d):
    q, k = randn(tokens, nq * head), randn(tokens, nkv * head, seed=1)
    if three_d:
        q, k = q.view(tokens, nq, head), k.view(tokens, nkv, head)
    cache, pos = rope_cache(64, rot), positions_for(tokens, 64)
    assert_same(kernels.rotary_embedding_triton(pos, q, k, cache, head),
                reference.rotary_embedding(pos, q, k, cache, head))


def test_rotary_positions_outside_the_cache_read_its_edge_rows():
    # A stored graph may pass any positions: the launcher clamps them into the cache, so
    # they read its first or last row, never memory around it.
    q, k = randn(4, 2 * 16), randn(4, 16, seed=1)
    cache = rope_cache(8, 16)
    pos = torch.tensor([-(2 ** 40), -1, 8, 2 ** 40], device=DEVICE)
    assert_same(kernels.rotary_embedding_triton(pos, q, k, cache, 16),
                reference.rotary_embedding(pos.clamp(0, 7), q, k, cache, 16))


@pytest.mark.parametrize("call", [
    lambda: kernels.rms_norm_triton(randn(3, 32), randn(31), EPS),
    lambda: kernels.fused_add_rms_norm_triton(randn(3, 32), randn(2, 32), randn(32), EPS),
    lambda: kernels.qk_norm_rope_triton(randn(3, 64), positions_for(2, 8), randn(16),
                                        randn(16), rope_cache(8, 16), 2, 1, 16, EPS),
    lambda: kernels.qk_norm_rope_triton(randn(3, 64), positions_for(3, 8), randn(16),
                                        randn(16), rope_cache(8, 16), 4, 1, 16, EPS),
    lambda: kernels.qk_norm_rope_triton(randn(3, 64), positions_for(3, 8), randn(8),
                                        randn(8), rope_cache(8, 16), 2, 1, 16, EPS),
], ids=["rms-weight", "residual-shape", "rope-rows", "rope-heads", "rope-weights"])
def test_launchers_refuse_sizes_that_do_not_fit_their_tensors(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_static_fp8_quant(tokens, hidden):
    x, w = randn(tokens, hidden, scale=3.0), randn(hidden, seed=1)
    s = scale_for(reference.rms_norm(x, w, EPS))
    fused = kernels.rms_norm_static_fp8_quant_triton(x, w, s, EPS)
    assert_same(fused, reference.rms_norm_static_fp8_quant(x, w, s, EPS), s)
    unfused = kernels.static_scaled_fp8_quant_triton(kernels.rms_norm_triton(x, w, EPS), s)
    assert_same(fused, unfused, s)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm_static_fp8_quant(tokens, hidden):
    x, r, w = randn(tokens, hidden), randn(tokens, hidden, seed=2), randn(hidden, seed=1)
    s = scale_for(reference.fused_add_rms_norm(x, r, w, EPS)[0])
    fused = kernels.fused_add_rms_norm_static_fp8_quant_triton(x, r, w, s, EPS)
    assert_same(fused, reference.fused_add_rms_norm_static_fp8_quant(x, r, w, s, EPS), s)
    normed, summed = kernels.fused_add_rms_norm_triton(x, r, w, EPS)
    assert_same(fused, (kernels.static_scaled_fp8_quant_triton(normed, s), summed), s)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("d", [77, 128])
def test_silu_and_mul_static_fp8_quant(tokens, d):
    x = randn(tokens, 2 * d, scale=2.0)
    s = scale_for(reference.silu_and_mul(x))
    fused = kernels.silu_and_mul_static_fp8_quant_triton(x, s)
    assert_same(fused, reference.silu_and_mul_static_fp8_quant(x, s), s)
    assert_same(fused, kernels.static_scaled_fp8_quant_triton(kernels.silu_and_mul_triton(x), s),
                s)


def _qk_norm_rope_inputs(tokens, nq, nkv, head, rot):
    qkv = randn(tokens, (nq + 2 * nkv) * head, scale=2.0)
    return (qkv, positions_for(tokens, 64), randn(head, seed=4), randn(head, seed=5),
            rope_cache(64, rot), nq, nkv, head, EPS)


def _qk_norm_rope_unfused(impl, qkv, pos, qw, kw, cache, nq, nkv, head, eps):
    """The sequence the pass replaces: split, per-head norm, rotary."""
    q = qkv[:, :nq * head].reshape(-1, nq, head)
    k = qkv[:, nq * head:(nq + nkv) * head].reshape(-1, nkv, head)
    q = impl("rms_norm")(q, qw, eps).reshape(-1, nq * head)
    k = impl("rms_norm")(k, kw, eps).reshape(-1, nkv * head)
    return impl("rotary_embedding")(pos, q, k, cache, head)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("nq", "nkv", "head", "rot"), ROPE_CASES)
def test_qk_norm_rope(tokens, nq, nkv, head, rot):
    args = _qk_norm_rope_inputs(tokens, nq, nkv, head, rot)
    fused = kernels.qk_norm_rope_triton(*args)
    assert_same(fused, reference.qk_norm_rope(*args))

    def triton_impl(name):
        return getattr(kernels, f"{name}_triton")

    assert_same(fused, _qk_norm_rope_unfused(triton_impl, *args))


def test_reference_fused_ops_equal_unfused_sequences_exactly():
    x, r, w = randn(9, 257, scale=3.0), randn(9, 257, seed=2), randn(257, seed=1)
    s = scale_for(x)

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    def equal(a, b):
        assert torch.equal(bits(a), bits(b))

    equal(reference.rms_norm_static_fp8_quant(x, w, s, EPS),
          reference.static_scaled_fp8_quant(reference.rms_norm(x, w, EPS), s))
    q, summed = reference.fused_add_rms_norm_static_fp8_quant(x, r, w, s, EPS)
    normed, summed_ref = reference.fused_add_rms_norm(x, r, w, EPS)
    equal(q, reference.static_scaled_fp8_quant(normed, s))
    equal(summed, summed_ref)
    equal(reference.silu_and_mul_static_fp8_quant(x[:, :256], s),
          reference.static_scaled_fp8_quant(reference.silu_and_mul(x[:, :256]), s))
    args = _qk_norm_rope_inputs(5, 4, 2, 40, 40)
    for a, b in zip(reference.qk_norm_rope(*args),
                    _qk_norm_rope_unfused(lambda n: getattr(reference, n), *args), strict=True):
        equal(a, b)


def _op_cases():
    x, r, w = randn(6, 96), randn(6, 96, seed=2), randn(96, seed=1)
    s = scale_for(x)
    qkv_args = _qk_norm_rope_inputs(6, 4, 2, 40, 40)
    q, k = randn(6, 160), randn(6, 80, seed=1)
    return {
        "rms_norm": (x, w, EPS),
        "fused_add_rms_norm": (x, r, w, EPS),
        "static_scaled_fp8_quant": (x, s),
        "dynamic_per_token_fp8_quant": (x,),
        "silu_and_mul": (x,),
        "rotary_embedding": (positions_for(6, 64), q, k, rope_cache(64, 40), 40),
        "rms_norm_static_fp8_quant": (x, w, s, EPS),
        "fused_add_rms_norm_static_fp8_quant": (x, r, w, s, EPS),
        "silu_and_mul_static_fp8_quant": (x, s),
        "qk_norm_rope": qkv_args,
    }


@pytest.mark.parametrize("name", list(_op_cases()))
def test_registered_op(name):
    """The op dispatches to the reference on CPU and to the kernel on CUDA, its fake
    implementation agrees with both, and torch.library's own checks pass."""
    args = _op_cases()[name]
    result = op(name)(*args)
    expected = getattr(reference, name)(*args)
    scale = None
    if name == "dynamic_per_token_fp8_quant":
        scale = expected[1]
    elif "fp8" in name:
        scale = next(a for a in args if isinstance(a, torch.Tensor) and a.numel() == 1)
    assert_same(result, expected, scale)
    torch.library.opcheck(op(name), args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64, 512, 8192])
def test_full_shapes_on_gpu(tokens):
    hidden = 4096
    x, r = randn(tokens, hidden), randn(tokens, hidden, seed=2)
    w = randn(hidden, seed=1)
    s = scale_for(x)
    assert_same(kernels.rms_norm_static_fp8_quant_triton(x, w, s, EPS),
                reference.rms_norm_static_fp8_quant(x, w, s, EPS), s)
    assert_same(kernels.fused_add_rms_norm_static_fp8_quant_triton(x, r, w, s, EPS),
                reference.fused_add_rms_norm_static_fp8_quant(x, r, w, s, EPS), s)
    g = randn(tokens, 2 * 12288, seed=3)
    assert_same(kernels.silu_and_mul_static_fp8_quant_triton(g, s),
                reference.silu_and_mul_static_fp8_quant(g, s), s)
    q, sc = kernels.dynamic_per_token_fp8_quant_triton(x)
    q_ref, sc_ref = reference.dynamic_per_token_fp8_quant(x)
    assert_fp8_close(q, q_ref, sc_ref)
    args = _qk_norm_rope_inputs(tokens, 32, 8, 128, 128)
    assert_same(kernels.qk_norm_rope_triton(*args), reference.qk_norm_rope(*args))
