"""A TinyLlama-shaped decoder, served the way vLLM serves it: one flat batch of tokens.

Attention is an opaque custom op (``cachebuild_examples::attention``), the splitting op:
the graph is cut there, and every layer's "rest" compiles to one shared target.

Size knobs (environment variables; with the small defaults, ``cachebuild warm`` builds its
3 targets with Inductor in under two minutes on a 2-core CPU (the first time on a
machine; less once its compiler probe is done), and a warm start then reaches its first
output in about a quarter of a second):
``LLAMA_LAYERS`` (2), ``LLAMA_HIDDEN`` (256), ``LLAMA_HEADS`` (8), ``LLAMA_KV_HEADS`` (2),
``LLAMA_MLP`` (688), ``LLAMA_VOCAB`` (1024), ``LLAMA_DEVICE`` (cpu), ``LLAMA_DTYPE``
(float32 on CPU, bfloat16 on CUDA), ``LLAMA_MAX_TOKENS`` (512: the compile range),
``LLAMA_COMPILE_SIZES`` (none: comma-separated exact sizes with their own targets),
``LLAMA_FLAVOUR`` (auto: the inductor artifact flavour, or aoti, standalone),
``LLAMA_BACKEND`` (inductor, or eager_fusion: no code generation).
The TinyLlama shape itself: hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632.

    cachebuild warm examples/llama.py      # build every target ahead of time
    python examples/llama.py               # a server's start: warm load, then run
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import cachebuild
from cachebuild.errors import CachebuildError


@torch.library.custom_op("cachebuild_examples::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one sequence: q [T, H, D], k/v [T, KV, D] → [T, H, D].

    Batched 4-D inputs with ``enable_gqa`` let SDPA pick a fused kernel on CUDA (flash);
    3-D inputs send it to its math path, about twenty kernel launches per call, which a
    piecewise runtime pays on the CPU at every layer.
    """
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).contiguous()


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.post_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate_up = nn.Linear(hidden, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)
        self.rotary = Rotary(self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1)
        q = self.rotary(q.view(tokens, self.heads, self.head_dim), positions)
        k = self.rotary(k.view(tokens, self.kv_heads, self.head_dim), positions)
        v = v.view(tokens, self.kv_heads, self.head_dim)
        a = torch.ops.cachebuild_examples.attention(q, k, v)
        x = x + self.o_proj(a.reshape(tokens, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """``make_layer`` builds each decoder layer (a shard of one, in ``llama_tp.py``)."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, mlp: int,
                 vocab: int, make_layer: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        make_layer = make_layer or (lambda: DecoderLayer(hidden, heads, kv_heads, mlp))
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(make_layer() for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))


def make_model(cls: type[Llama] = Llama, **extra: int) -> Llama:
    """A ``cls`` of the shape, device and dtype the environment asks for (``extra``: more
    arguments for ``cls``), in eval mode."""
    device = os.environ.get("LLAMA_DEVICE", "cpu")
    default_dtype = "bfloat16" if device.startswith("cuda") else "float32"
    dtype = getattr(torch, os.environ.get("LLAMA_DTYPE", default_dtype))
    with torch.device(device):
        model = cls(layers=_env("LLAMA_LAYERS", 2), hidden=_env("LLAMA_HIDDEN", 256),
                    heads=_env("LLAMA_HEADS", 8), kv_heads=_env("LLAMA_KV_HEADS", 2),
                    mlp=_env("LLAMA_MLP", 688), vocab=_env("LLAMA_VOCAB", 1024), **extra)
    return model.to(dtype).eval()


def example_inputs(model: Llama, tokens: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    device = model.embed.weight.device
    ids = torch.randint(0, model.embed.num_embeddings, (tokens,), device=device)
    return ids, torch.arange(tokens, device=device)


def config() -> cachebuild.CompileConfig:
    sizes = os.environ.get("LLAMA_COMPILE_SIZES", "")
    return cachebuild.CompileConfig(
        splitting_ops=("cachebuild_examples::attention",),
        compile_ranges=((1, _env("LLAMA_MAX_TOKENS", 512)),),
        compile_sizes=tuple(int(s) for s in sizes.split(",") if s.strip()),
        flavour=os.environ.get("LLAMA_FLAVOUR", "auto"),
        backend=os.environ.get("LLAMA_BACKEND", "inductor"),
    )


def build() -> cachebuild.ModelSpec:
    model = make_model()
    return cachebuild.ModelSpec(model, example_inputs(model), {0: 0, 1: 0}, config())


def main() -> None:
    """What a server does at start: build the model, compile (warm if warmed), run."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = make_model()
    compiled = cachebuild.compile(model, config(), dynamic_dims={0: 0, 1: 0})
    ids, pos = example_inputs(model, tokens=32)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = compiled(ids, pos)  # the first call loads (or builds) the compiled pieces
        first = time.perf_counter() - t0
        since_main = time.perf_counter() - start
        ref = model(ids, pos)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    s = cachebuild.stats()
    print(f"compile call -> first output: {first:.2f} s (main() -> first output "
          f"{since_main:.2f} s); "
          f"targets built {s['built']}, loaded {s['loaded']}, traced {s['traced']}; "
          f"output matches eager", file=sys.stderr)


if __name__ == "__main__":
    # A server's log: each warning (a remote store that is down, say) on one line.
    warnings.formatwarning = lambda message, category, *_, **__: (
        f"warning: {category.__name__}: {message}\n")
    try:
        main()
    except CachebuildError as e:  # bad settings, an unsafe store: one line that says what to do
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
