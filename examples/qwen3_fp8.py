"""A Qwen3-shaped decoder with fp8 linear layers, written with cachebuild's custom ops.

Per layer: RMS norm (fused with the residual add after the first layer), static per-tensor
fp8 quantization, fp8 QKV projection, per-head QK-norm and rotary embedding on the packed
qkv, grouped-query attention (an opaque custom op, the splitting op), fp8 output
projection, residual add + RMS norm, fp8 gate/up projection, SiLU-and-mul, fp8 down
projection. Every fusion pass has matches in it; per model of L layers:

    rms_quant 1 · add_rms_quant 2L - 1 · act_quant L · qk_norm_rope L

fp8 linears use per-tensor static scales for activations and weights:
``torch._scaled_mm`` on CUDA, dequantize + matmul elsewhere. Weights are random (a key
never depends on weight values), quantized with their own amax.

Size knobs (environment variables, small CPU defaults): ``QWEN3_LAYERS`` (2),
``QWEN3_HIDDEN`` (256), ``QWEN3_HEADS`` (4), ``QWEN3_KV_HEADS`` (2), ``QWEN3_HEAD_DIM``
(64), ``QWEN3_MLP`` (768), ``QWEN3_VOCAB`` (1024), ``QWEN3_DEVICE`` (cpu),
``QWEN3_DTYPE`` (float32 on CPU, bfloat16 on CUDA), ``QWEN3_MAX_TOKENS`` (512: the
compile range), ``QWEN3_BACKEND`` (inductor). Qwen3-8B itself: hidden 4096, 36 layers,
32 heads, 8 KV heads, head dim 128, MLP 12288.

    cachebuild warm examples/qwen3_fp8.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import cachebuild
from cachebuild.compat import fp8_scaled_mm
from cachebuild.passes import PassConfig

OPS = torch.ops.cachebuild
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


@torch.library.custom_op("cachebuild_examples::qwen3_attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention over one sequence: q [T, H, D], k/v [T, KV, D] →
    [T, H * D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1).reshape(q.shape[0], -1).contiguous()


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@dataclass(frozen=True)
class Qwen3Config:
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    mlp: int = 768
    vocab: int = 1024
    eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_positions: int = 4096

    @classmethod
    def from_env(cls) -> Qwen3Config:
        def env(name: str, default: int) -> int:
            return int(os.environ.get(f"QWEN3_{name}", default))

        d = cls()
        return cls(layers=env("LAYERS", d.layers), hidden=env("HIDDEN", d.hidden),
                   heads=env("HEADS", d.heads), kv_heads=env("KV_HEADS", d.kv_heads),
                   head_dim=env("HEAD_DIM", d.head_dim), mlp=env("MLP", d.mlp),
                   vocab=env("VOCAB", d.vocab))


class Fp8Linear(nn.Module):
    """``y = x @ W.T`` for an fp8 ``x`` quantized with the static ``input_scale``; ``W`` is
    stored in fp8 with a per-tensor ``weight_scale``."""

    def __init__(self, in_features: int, out_features: int, out_dtype: torch.dtype,
                 input_amax: float) -> None:
        super().__init__()
        w = torch.randn(out_features, in_features) / in_features ** 0.5
        weight_scale = w.abs().amax() / FP8_MAX
        self.register_buffer("weight", (w / weight_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))
        self.register_buffer("weight_scale", weight_scale.reshape(1).float())
        self.register_buffer("input_scale", torch.tensor([input_amax / FP8_MAX]))
        self.out_dtype = out_dtype

    def forward(self, x_fp8: torch.Tensor) -> torch.Tensor:
        if x_fp8.is_cuda:
            return fp8_scaled_mm(x_fp8, self.weight.t(), self.input_scale.reshape(()),
                                 self.weight_scale.reshape(()), self.out_dtype)
        x = x_fp8.to(torch.float32) * self.input_scale
        w = self.weight.to(torch.float32) * self.weight_scale
        return (x @ w.t()).to(self.out_dtype)


def rope_cache(head_dim: int, max_positions: int, theta: float) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: cos in the first half, sin in the second."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_size, self.kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=dtype))
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype))
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, dtype=dtype))
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=dtype))
        # Activation ranges assumed by the static scales: normalized activations stay
        # within ~±8; attention outputs are averages of values; the MLP product is wider.
        self.qkv_proj = Fp8Linear(cfg.hidden, self.q_size + 2 * self.kv_size, dtype, 8.0)
        self.o_proj = Fp8Linear(self.q_size, cfg.hidden, dtype, 8.0)
        self.gate_up = Fp8Linear(cfg.hidden, 2 * cfg.mlp, dtype, 8.0)
        self.down = Fp8Linear(cfg.mlp, cfg.hidden, dtype, 16.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, tokens = self.cfg, x.shape[0]
        if residual is None:
            residual = x
            h = OPS.rms_norm(x, self.input_norm, cfg.eps)
        else:
            h, residual = OPS.fused_add_rms_norm(x, residual, self.input_norm, cfg.eps)
        qkv = self.qkv_proj(OPS.static_scaled_fp8_quant(h, self.qkv_proj.input_scale))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = OPS.rms_norm(q.view(tokens, cfg.heads, cfg.head_dim), self.q_norm, cfg.eps)
        k = OPS.rms_norm(k.view(tokens, cfg.kv_heads, cfg.head_dim), self.k_norm, cfg.eps)
        q, k = OPS.rotary_embedding(positions, q.view(tokens, self.q_size),
                                    k.view(tokens, self.kv_size), cos_sin_cache, cfg.head_dim)
        a = torch.ops.cachebuild_examples.qwen3_attention(
            q.view(tokens, cfg.heads, cfg.head_dim), k.view(tokens, cfg.kv_heads, cfg.head_dim),
            v.view(tokens, cfg.kv_heads, cfg.head_dim))
        o = self.o_proj(OPS.static_scaled_fp8_quant(a, self.o_proj.input_scale))
        h, residual = OPS.fused_add_rms_norm(o, residual, self.post_norm, cfg.eps)
        gate_up = self.gate_up(OPS.static_scaled_fp8_quant(h, self.gate_up.input_scale))
        act = OPS.static_scaled_fp8_quant(OPS.silu_and_mul(gate_up), self.down.input_scale)
        return self.down(act), residual


class Qwen3(nn.Module):
    def __init__(self, cfg: Qwen3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dtype)
        self.layers = nn.ModuleList(Qwen3Layer(cfg, dtype) for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden, dtype=dtype))
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache",
                             rope_cache(cfg.head_dim, cfg.max_positions, cfg.rope_theta))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin_cache)
        x, _ = OPS.fused_add_rms_norm(x, residual, self.norm, self.cfg.eps)
        return self.lm_head(x)


def expected_matches(layers: int) -> dict[str, int]:
    """How many times each fusion pass matches the whole model (no split)."""
    return {"rms_quant": 1, "add_rms_quant": 2 * layers - 1, "act_quant": layers,
            "qk_norm_rope": layers}


def make_model(cfg: Qwen3Config | None = None, device: str | None = None,
               dtype: torch.dtype | None = None, seed: int = 0) -> Qwen3:
    """The model with random weights, in inference mode (no parameter needs a gradient)."""
    cfg = cfg or Qwen3Config.from_env()
    device = device or os.environ.get("QWEN3_DEVICE", "cpu")
    default_dtype = "bfloat16" if device.startswith("cuda") else "float32"
    dtype = dtype or getattr(torch, os.environ.get("QWEN3_DTYPE", default_dtype))
    torch.manual_seed(seed)
    model = Qwen3(cfg, dtype).to(device).eval()
    model.requires_grad_(False)
    return model


def example_inputs(model: Qwen3, tokens: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    device = model.embed.weight.device
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab, (tokens,), generator=generator).to(device)
    return ids, torch.arange(tokens, device=device)


def config(passes: PassConfig | None = None, backend: str | None = None
           ) -> cachebuild.CompileConfig:
    """Split at attention, one compile range, every fusion pass on by default."""
    return cachebuild.CompileConfig(
        splitting_ops=("cachebuild_examples::qwen3_attention",),
        compile_ranges=((1, int(os.environ.get("QWEN3_MAX_TOKENS", 512))),),
        backend=backend or os.environ.get("QWEN3_BACKEND", "inductor"),
        passes=passes if passes is not None else PassConfig.all_fusions(),
    )


def build() -> cachebuild.ModelSpec:
    model = make_model()
    return cachebuild.ModelSpec(model, example_inputs(model), {0: 0, 1: 0}, config())


if __name__ == "__main__":
    model = make_model()
    ids, pos = example_inputs(model)
    with torch.no_grad():
        print(model(ids, pos).shape)
