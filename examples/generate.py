"""Generation with a paged KV cache, served the way vLLM serves it.

The Llama of ``llama.py`` with vLLM's attention split in two splitting ops: ``kv_write``
writes each token's key and value into its layer's paged cache at its slot (the cache is
a buffer of the layer: a persistent input, which CUDA graphs read and write by address),
and ``paged_attention`` reads every token's context back through its sequence's block
table. One forward serves both phases: a prefill of any batch of prompts (the dynamic dim
is tokens) and a decode step (one token per sequence: the dynamic dim is sequences).
``Engine`` holds the block allocator and the loop: a prefill, then greedy or seeded
sampling steps, for a batch of prompts.

Size knobs: those of ``llama.py`` (``LLAMA_LAYERS``, ``LLAMA_HIDDEN``, ...,
``LLAMA_BACKEND``, ``LLAMA_FLAVOUR``, ``LLAMA_DEVICE``), and ``GEN_BLOCKS`` (64 blocks of
``GEN_BLOCK_SIZE`` 16 slots per layer), ``GEN_MAX_BLOCKS`` (16: blocks per sequence),
``GEN_GRAPHS`` (the graph mode on CUDA: full_and_piecewise, i.e. decode steps replay full
graphs and prefills piecewise ones; none on CPU), ``GEN_CAPTURE`` (the sizes captured:
1,2,4,8,16,32), ``GEN_DECODE`` (the decode batch sizes with full graphs: every captured
size up to 256).

    cachebuild warm examples/generate.py    # build every target ahead of time
    python examples/generate.py             # a server's start: warm load, generate
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402  (the model this example serves with a cache)

import cachebuild  # noqa: E402

WRITE = "cachebuild_paged::kv_write"
ATTEND = "cachebuild_paged::paged_attention"
#: A slot that is written nowhere: padding rows of a batch (vLLM's PAD_SLOT_ID).
PAD_SLOT = -1

_LIB = torch.library.Library("cachebuild_paged", "DEF")
_LIB.define("kv_write(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots) -> ()")
_LIB.define("paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, "
            "Tensor positions) -> Tensor")


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write k/v [T, KV, D] into ``kv_cache`` [2, blocks, block_size, KV, D] at each token's
    slot (block * block_size + offset). Rows at ``PAD_SLOT`` write into slot 0, of block 0,
    the null block that no sequence is given: no branch, no host sync."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    index = slots.clamp(min=0)
    flat[0].index_copy_(0, index, k)
    flat[1].index_copy_(0, index, v)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """q [T, H, D]; token t attends to the slots 0..positions[t] of its sequence, found
    through its row of ``block_table`` [T, max_blocks] → [T, H, D]."""
    tokens, heads, dim = q.shape
    kv_heads = kv_cache.shape[3]
    k = kv_cache[0][block_table].reshape(tokens, -1, kv_heads, dim)  # [T, S, KV, D]
    v = kv_cache[1][block_table].reshape(tokens, -1, kv_heads, dim)
    span = torch.arange(k.shape[1], device=q.device)
    mask = span[None, :] <= positions[:, None]  # [T, S]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], enable_gqa=True)
    return out[:, :, 0, :]


_LIB.impl("kv_write", kv_write, "CompositeExplicitAutograd")
_LIB.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake(WRITE, lib=_LIB)
def _(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    return None


@torch.library.register_fake(ATTEND, lib=_LIB)
def _(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
      positions: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class PagedLayer(llama.DecoderLayer):
    """A decoder layer whose attention goes through its paged cache (a buffer)."""

    def attach_cache(self, blocks: int, block_size: int) -> None:
        weight = self.qkv.weight
        self.register_buffer("kv_cache", torch.zeros(
            2, blocks, block_size, self.kv_heads, self.head_dim, dtype=weight.dtype,
            device=weight.device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                block_table: torch.Tensor) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(self.input_norm(x)).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = self.rotary(q.view(tokens, self.heads, d), positions)
        k = self.rotary(k.view(tokens, self.kv_heads, d), positions)
        torch.ops.cachebuild_paged.kv_write(k, v.view(tokens, self.kv_heads, d),
                                            self.kv_cache, slots)
        a = torch.ops.cachebuild_paged.paged_attention(q, self.kv_cache, block_table, positions)
        x = x + self.o_proj(a.reshape(tokens, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PagedLlama(llama.Llama):
    """forward(input_ids [T], positions [T], slots [T], block_table [T, max_blocks]) →
    logits [T, vocab]. Every argument has the token dim first."""

    def __init__(self, blocks: int, block_size: int, **shape: int) -> None:
        super().__init__(**shape, make_layer=lambda: PagedLayer(
            shape["hidden"], shape["heads"], shape["kv_heads"], shape["mlp"]))
        self.blocks, self.block_size = blocks, block_size

    def attach_caches(self) -> None:
        for layer in self.layers:
            layer.attach_cache(self.blocks, self.block_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                block_table: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, slots, block_table)
        return self.lm_head(self.norm(x))


DYNAMIC = {0: 0, 1: 0, 2: 0, 3: 0}


def make_model() -> PagedLlama:
    model = llama.make_model(PagedLlama, blocks=_env("GEN_BLOCKS", 64),
                             block_size=_env("GEN_BLOCK_SIZE", 16))
    model.attach_caches()
    return model


def capture_sizes() -> tuple[int, ...]:
    return tuple(int(s) for s in os.environ.get("GEN_CAPTURE", "1,2,4,8,16,32").split(","))


def decode_sizes() -> tuple[int, ...] | None:
    given = os.environ.get("GEN_DECODE")
    return tuple(int(s) for s in given.split(",")) if given else None


def config() -> cachebuild.CompileConfig:
    cuda = os.environ.get("LLAMA_DEVICE", "cpu").startswith("cuda")
    return cachebuild.CompileConfig(
        splitting_ops=(WRITE, ATTEND),
        compile_ranges=((1, _env("LLAMA_MAX_TOKENS", 512)),),
        flavour=os.environ.get("LLAMA_FLAVOUR", "auto"),
        backend=os.environ.get("LLAMA_BACKEND", "inductor"),
        cudagraph_mode=os.environ.get("GEN_GRAPHS", "full_and_piecewise" if cuda else "none"),
        capture_sizes=capture_sizes(),
        decode_sizes=decode_sizes(),
    )


def example_inputs(model: PagedLlama, tokens: int = 16) -> tuple[torch.Tensor, ...]:
    """A prefill of one ``tokens``-long prompt in blocks 1, 2, ... (compiling changes no
    cache: tracing and capture put back what they write)."""
    device = model.embed.weight.device
    ids = torch.randint(0, model.embed.num_embeddings, (tokens,), device=device)
    positions = torch.arange(tokens, device=device)
    table = ((1 + torch.arange(max_blocks(), device=device)) % model.blocks).expand(
        tokens, -1).contiguous()
    return ids, positions, positions + model.block_size, table


def max_blocks() -> int:
    return _env("GEN_MAX_BLOCKS", 16)


def build() -> cachebuild.ModelSpec:
    model = make_model()
    return cachebuild.ModelSpec(model, example_inputs(model), DYNAMIC, config())


# -- the engine ----------------------------------------------------------------------------

class CacheFull(Exception):
    """A request needs more cache than is free (or than a sequence may hold)."""


@dataclass
class Sequence:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


class Engine:
    """Prefill + decode over a paged cache for a batch of prompts.

    ``forward`` is the model or its compiled module (the same arguments). A decode batch
    is padded up to the next of ``pad_to`` (the captured sizes) with rows that write
    nowhere, so that every step replays a captured graph, and is marked as one
    (``cachebuild.decoding``): a uniform batch of one token per sequence, which the graph
    modes with full decode graphs replay whole, attention included.
    """

    def __init__(self, model: PagedLlama, forward: object = None,
                 pad_to: tuple[int, ...] = ()) -> None:
        caches = [layer.kv_cache for layer in model.layers]
        want = (2, model.blocks, model.block_size)
        for i, cache in enumerate(caches):
            if tuple(cache.shape[:3]) != want or cache.device != model.embed.weight.device:
                raise ValueError(f"layer {i}'s kv_cache is {tuple(cache.shape)} on "
                                 f"{cache.device}; the model expects {want} blocks on "
                                 f"{model.embed.weight.device}: call attach_caches()")
        self.model = model
        self.forward = forward or model
        self.pad_to = sorted(pad_to)
        self.free = list(range(1, model.blocks))  # block 0 is the padding rows' (kv_write)
        self.device = model.embed.weight.device

    def _slot(self, seq: Sequence, position: int) -> int:
        size = self.model.block_size
        while position // size >= len(seq.blocks):
            if len(seq.blocks) >= max_blocks():
                raise CacheFull(f"a sequence may hold {max_blocks() * size} tokens "
                                f"(GEN_MAX_BLOCKS blocks of {size}); it needs more")
            if not self.free:
                raise CacheFull(f"the KV cache is full ({self.model.blocks} blocks): raise "
                                "GEN_BLOCKS or generate fewer tokens at once")
            seq.blocks.append(self.free.pop(0))
        return seq.blocks[position // size] * size + position % size

    def _step(self, rows: list[tuple[Sequence, int, int]], decode: bool = False
              ) -> torch.Tensor:
        """One forward over ``rows`` of (sequence, token, position); logits per row.
        ``decode``: the rows are one new token for each of their sequences."""
        count = len(rows)
        padded = next((s for s in self.pad_to if s >= count), count)
        ids, positions, slots, table = [], [], [], []
        for seq, token, position in rows:
            ids.append(token)
            positions.append(position)
            slots.append(self._slot(seq, position))
            table.append(seq.blocks + [0] * (max_blocks() - len(seq.blocks)))
        for _ in range(padded - count):
            ids.append(0)
            positions.append(0)
            slots.append(PAD_SLOT)
            table.append([0] * max_blocks())
        args = [torch.tensor(v, device=self.device) for v in (ids, positions, slots, table)]
        with torch.no_grad(), cachebuild.decoding(decode):
            return self.forward(*args)[:count].float()

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
        """Generate ``max_new_tokens`` per prompt: greedy at temperature 0, else sampled
        from a generator seeded with ``seed`` (the same seed, the same tokens)."""
        generator = torch.Generator().manual_seed(seed)
        seqs = [Sequence(list(p)) for p in prompts]
        try:
            rows = [(s, t, i) for s in seqs for i, t in enumerate(s.tokens)]
            logits = self._step(rows)
            ends = [sum(len(s.tokens) for s in seqs[:i + 1]) - 1 for i in range(len(seqs))]
            last = logits[ends]
            for _ in range(max_new_tokens):
                for s, token in zip(seqs, _sample(last, temperature, generator), strict=True):
                    s.generated.append(token)
                if len(seqs[0].generated) == max_new_tokens:
                    break
                last = self._step([(s, s.generated[-1], len(s.tokens) + len(s.generated) - 1)
                                   for s in seqs], decode=True)
        finally:
            for s in seqs:
                self.free += s.blocks
        return [s.generated for s in seqs]


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> list[int]:
    """One token per row of ``logits``: the most likely at temperature 0, else drawn with
    ``generator`` (on the CPU, so a seed gives the same tokens on every device)."""
    if temperature <= 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits.cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()


def prompts(vocab: int, count: int = 3, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist()
            for n in [5 + 4 * i for i in range(count)]]


def main() -> None:
    """What a server does at start: build the model, compile (warm if warmed), generate;
    then the same with the eager model, which must give the same tokens."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = make_model()
    cfg = config()
    compiled = cachebuild.compile(model, cfg, dynamic_dims=DYNAMIC)
    batch = prompts(model.embed.num_embeddings)
    new_tokens = _env("GEN_NEW_TOKENS", 32)
    pad = cfg.capture_sizes if cfg.cudagraph_mode != "none" else ()
    t0 = time.perf_counter()
    tokens = Engine(model, compiled, pad).generate(batch, new_tokens)
    seconds = time.perf_counter() - t0
    reference = Engine(model).generate(batch, new_tokens)
    s = cachebuild.stats()
    state = compiled.capture_state()
    served = state.served if state is not None else {}
    replays = served.get("full", 0) + served.get("piecewise", 0)
    same = tokens == reference
    print(f"{len(batch)} prompts x {new_tokens} tokens in {seconds:.2f} s (main() "
          f"{time.perf_counter() - start:.2f} s); targets built {s['built']}, loaded "
          f"{s['loaded']}, traced {s['traced']}; graph replays {replays} (full "
          f"{served.get('full', 0)}, piecewise {served.get('piecewise', 0)}, calls without "
          f"graphs {served.get('none', 0)}); tokens "
          f"{'equal to' if same else 'DIFFERENT from'} eager's", file=sys.stderr)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
