"""The Llama example (``examples/llama.py``) sharded for tensor parallelism, any world size.

Every rank holds its shard of each layer: the fused QKV projection and the gate/up
projection are column-parallel (each rank computes its heads and its slice of the MLP),
the output and down projections are row-parallel and followed by an all-reduce (torch's
functional collectives, which Dynamo keeps in the graph). Embedding, norms and the LM
head are replicated, so every rank's output is the whole model's. Attention stays the
splitting op. Shards are as even as the sizes allow: with 8 heads, 2 KV heads and world
size 4 each KV head is replicated on two ranks; with world size 3 the ranks' shards differ
(uneven shards), and so do their targets.

    torchrun --nproc-per-node 2 examples/llama_tp.py      # gloo on CPU, NCCL with LLAMA_DEVICE=cuda
    cachebuild warm --world-size 2 examples/llama_tp.py   # build every rank's targets once, no GPUs

Size knobs are those of ``examples/llama.py`` (``LLAMA_LAYERS``, ``LLAMA_HIDDEN``, ...,
``LLAMA_DEVICE``: ``cuda`` puts rank r on ``cuda:r``, ``cuda:0`` puts every rank there;
``LLAMA_DIST_BACKEND``: ``gloo`` lets ranks share one GPU). ``main()`` builds the whole model
from one seed on every rank, shards it, and checks each rank's output against the whole
model run eagerly.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

import cachebuild
from cachebuild.modelfile import import_model

# The same module `cachebuild warm examples/llama.py` imports: one definition of the
# attention op per process.
llama = import_model(Path(__file__).with_name("llama.py"))


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, count)`` of part ``index`` when ``n`` items are cut into ``parts`` parts
    as evenly as possible (the first ``n % parts`` parts get one more)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``world`` holds of one layer: its query heads, KV heads and
    MLP columns, each as ``(start, count)``."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]

    @classmethod
    def of(cls, heads: int, kv_heads: int, mlp: int, rank: int, world: int) -> Shard:
        group = heads // kv_heads
        if kv_heads >= world:  # whole KV groups per rank
            kv = split(kv_heads, world, rank)
            q = (kv[0] * group, kv[1] * group)
        else:  # each KV head replicated on world // kv_heads ranks, its queries split
            if world % kv_heads:
                raise ValueError(f"world size {world} must be a multiple of the {kv_heads} "
                                 "KV heads when it exceeds them")
            replicas = world // kv_heads
            kv = (rank // replicas, 1)
            start, count = split(group, replicas, rank % replicas)
            if count == 0:
                raise ValueError(f"world size {world} leaves rank {rank} without query heads")
            q = (kv[0] * group + start, count)
        return cls(q, kv, split(mlp, world, rank))


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks (a functional collective: it stays in the traced graph)."""
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


class TPDecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int, shard: Shard) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.heads, self.kv_heads = shard.q_heads[1], shard.kv_heads[1]
        self.input_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, (self.heads + 2 * self.kv_heads) * self.head_dim,
                             bias=False)  # column-parallel
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)  # row-parallel
        self.post_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate_up = nn.Linear(hidden, 2 * shard.mlp[1], bias=False)  # column-parallel
        self.down = nn.Linear(shard.mlp[1], hidden, bias=False)  # row-parallel
        self.rotary = llama.Rotary(self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = self.rotary(q.view(tokens, self.heads, d), positions)
        k = self.rotary(k.view(tokens, self.kv_heads, d), positions)
        a = torch.ops.cachebuild_examples.attention(q, k, v.view(tokens, self.kv_heads, d))
        x = x + all_reduce(self.o_proj(a.reshape(tokens, -1)))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + all_reduce(self.down(F.silu(gate) * up))

    @torch.no_grad()
    def load_from(self, full: nn.Module, shard: Shard) -> None:
        """Copy this rank's slices of an unsharded ``llama.DecoderLayer``."""
        d, heads, kv_heads = self.head_dim, full.heads, full.kv_heads
        q0, nq = shard.q_heads
        k0, nk = shard.kv_heads
        w = full.qkv.weight
        q = w[q0 * d:(q0 + nq) * d]
        k = w[(heads + k0) * d:(heads + k0 + nk) * d]
        v = w[(heads + kv_heads + k0) * d:(heads + kv_heads + k0 + nk) * d]
        self.qkv.weight.copy_(torch.cat([q, k, v]))
        self.o_proj.weight.copy_(full.o_proj.weight[:, q0 * d:(q0 + nq) * d])
        m0, nm = shard.mlp
        mlp = full.down.weight.shape[1]
        gate_up = full.gate_up.weight
        self.gate_up.weight.copy_(torch.cat([gate_up[m0:m0 + nm], gate_up[mlp + m0:mlp + m0 + nm]]))
        self.down.weight.copy_(full.down.weight[:, m0:m0 + nm])
        self.input_norm.load_state_dict(full.input_norm.state_dict())
        self.post_norm.load_state_dict(full.post_norm.state_dict())


class LlamaTP(llama.Llama):
    """Rank ``rank``'s shard of ``llama.Llama``: its layers are shards, its ``forward`` (the
    unsharded model's) is the whole model's output."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, mlp: int,
                 vocab: int, rank: int, world: int) -> None:
        shard = Shard.of(heads, kv_heads, mlp, rank, world)
        super().__init__(layers, hidden, heads, kv_heads, mlp, vocab,
                         make_layer=lambda: TPDecoderLayer(hidden, heads, kv_heads, mlp, shard))
        self.shard = shard

    @torch.no_grad()
    def load_from(self, full: nn.Module) -> LlamaTP:
        """Take this rank's shard of an unsharded ``llama.Llama``'s weights; returns self."""
        self.embed.load_state_dict(full.embed.state_dict())
        for mine, theirs in zip(self.layers, full.layers, strict=True):
            mine.load_from(theirs, self.shard)
        self.norm.load_state_dict(full.norm.state_dict())
        self.lm_head.load_state_dict(full.lm_head.state_dict())
        return self


def sizes() -> dict[str, int]:
    """The model's sizes, from the same knobs (and defaults) as ``examples/llama.py``."""
    env = llama._env
    return {"layers": env("LLAMA_LAYERS", 2), "hidden": env("LLAMA_HIDDEN", 256),
            "heads": env("LLAMA_HEADS", 8), "kv_heads": env("LLAMA_KV_HEADS", 2),
            "mlp": env("LLAMA_MLP", 688), "vocab": env("LLAMA_VOCAB", 1024)}


def rank_device(rank: int) -> torch.device:
    """``LLAMA_DEVICE`` (cpu); ``cuda`` alone means this rank's GPU, ``cuda:rank``."""
    device = torch.device(os.environ.get("LLAMA_DEVICE", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


def init_group(device: torch.device) -> None:
    """The default process group: ``LLAMA_DIST_BACKEND`` if set, else NCCL on CUDA and gloo
    on CPU. gloo also reduces CUDA tensors, so ranks can share one GPU with it (no CUDA
    graphs then: gloo's collectives cannot be captured)."""
    backend = os.environ.get("LLAMA_DIST_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)


def _dtype(device: torch.device) -> torch.dtype:
    default = "bfloat16" if device.type == "cuda" else "float32"
    return getattr(torch, os.environ.get("LLAMA_DTYPE", default))


def make_model(full: nn.Module | None = None) -> LlamaTP:
    """This rank's shard (rank and world size from the initialised process group), with
    ``full``'s weights if given, else random ones (enough to warm it)."""
    if not dist.is_initialized():
        raise RuntimeError("llama_tp.py is tensor-parallel: start it with torchrun "
                           "--nproc-per-node N, or warm it with `cachebuild warm --world-size N`")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(rank)
    with torch.device(device):
        model = LlamaTP(**sizes(), rank=rank, world=world)
    if full is not None:
        model.load_from(full)
    return model.to(_dtype(device)).eval()


def make_full(seed: int = 0) -> nn.Module:
    """The unsharded model every rank derives its shard from (the same weights on every
    rank: the same seed), on this rank's device."""
    torch.manual_seed(seed)
    device = rank_device(dist.get_rank() if dist.is_initialized() else 0)
    with torch.device(device):
        full = llama.Llama(**sizes())
    return full.to(_dtype(device)).eval()


def example_inputs(model: LlamaTP, tokens: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return llama.example_inputs(model, tokens)


def config() -> cachebuild.CompileConfig:
    return llama.config()


def build() -> cachebuild.ModelSpec:
    model = make_model()
    return cachebuild.ModelSpec(model, example_inputs(model), {0: 0, 1: 0}, config())


def main() -> None:
    """A tensor-parallel server's start on every rank: compile (warm if warmed), run, and
    check the output against the unsharded model run eagerly."""
    start = time.perf_counter()
    device = rank_device(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(device)
    try:
        full = make_full()
        model = make_model(full)
        compiled = cachebuild.compile(model, config(), dynamic_dims={0: 0, 1: 0})
        torch.manual_seed(1)  # the same tokens on every rank
        ids, pos = example_inputs(model, tokens=32)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = compiled(ids, pos)
            first = time.perf_counter() - t0
            ref = full(ids, pos)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        s = cachebuild.stats()
        print(f"rank {dist.get_rank()}/{dist.get_world_size()}: compile call -> first output "
              f"{first:.2f} s (main() {time.perf_counter() - start:.2f} s); targets built "
              f"{s['built']}, loaded {s['loaded']}, traced {s['traced']}; output matches the "
              "unsharded model", file=sys.stderr)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
