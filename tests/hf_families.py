"""Model families from transformers, built from tiny configs with random weights.

Each family is served the way this project serves models: one flat sequence of tokens
(``input_ids [T]``) in, ``logits [T, vocab]`` out (an encoder: hidden states
``[T, hidden]``), with the batch dim added and removed around the call, split at
``aten::scaled_dot_product_attention``. ``cache=True`` keeps transformers' default
``use_cache=True`` and returns the whole model output (a ``ModelOutput`` holding a
``DynamicCache``).

Imported by tests and, by name (``import hf_families``), by the child processes they
start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

import cachebuild

SDPA = "aten::scaled_dot_product_attention"
VOCAB = 64
#: The compile range every family is built for (one bucket) and the sizes checked in it.
RANGE = (1, 24)
SIZES = (1, 9, 24)


class Served(torch.nn.Module):
    """``input_ids [T]`` → logits ``[T, vocab]`` (or hidden states for an encoder)."""

    def __init__(self, hf: torch.nn.Module, cache: bool = False) -> None:
        super().__init__()
        self.hf = hf
        self.cache = cache

    def forward(self, input_ids: torch.Tensor) -> Any:
        if self.cache:
            return self.hf(input_ids=input_ids[None])
        if not hasattr(self.hf, "lm_head"):  # an encoder
            return self.hf(input_ids=input_ids[None]).last_hidden_state[0]
        return self.hf(input_ids=input_ids[None], use_cache=False).logits[0]


def _decoder(**values: Any) -> dict[str, Any]:
    base = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": VOCAB,
            "max_position_embeddings": 64, "attn_implementation": "sdpa",
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    base.update(values)
    return base


@dataclass(frozen=True)
class Family:
    """How to build one family's model; ``inductor`` is the flavour its matrix case uses."""

    name: str
    config_class: Callable[..., Any]
    model_class: Callable[..., Any]
    values: dict[str, Any] = field(default_factory=dict)
    inductor: str = "aoti"
    compile_range: tuple[int, int] = RANGE
    sizes: tuple[int, ...] = SIZES

    def config(self, **overrides: Any) -> Any:
        return self.config_class(**{**self.values, **overrides})

    def model(self, seed: int = 0, cache: bool = False, **overrides: Any) -> Served:
        torch.manual_seed(seed)
        hf = self.model_class(self.config(**overrides))
        return Served(hf, cache).eval()


T = transformers
FAMILIES = {f.name: f for f in [
    Family("llama", T.LlamaConfig, T.LlamaForCausalLM, _decoder()),
    Family("qwen2", T.Qwen2Config, T.Qwen2ForCausalLM, _decoder()),
    Family("qwen3", T.Qwen3Config, T.Qwen3ForCausalLM, _decoder(head_dim=16)),
    # The window (4) is inside the range: every size the range holds is past it.
    Family("mistral", T.MistralConfig, T.MistralForCausalLM, _decoder(sliding_window=4),
           compile_range=(4, 24), sizes=(4, 9, 24)),
    Family("gemma", T.GemmaConfig, T.GemmaForCausalLM, _decoder(head_dim=16)),
    # AOTI pieces read the strides the splitting op hands them wrongly on Phi-3 (the
    # lead's fix); its matrix case uses the standalone flavour.
    Family("phi3", T.Phi3Config, T.Phi3ForCausalLM, _decoder(), inductor="standalone"),
    Family("gpt2", T.GPT2Config, T.GPT2LMHeadModel,
           {"n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": VOCAB, "n_positions": 64,
            "attn_implementation": "sdpa", "bos_token_id": 1, "eos_token_id": 2}),
    Family("qwen2_moe", T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
           _decoder(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, decoder_sparse_step=1)),
    Family("bert", T.BertConfig, T.BertModel,
           {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
            "attn_implementation": "sdpa"}),
]}


def ids(tokens: int, seed: int = 0) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + tokens)
    return (torch.randint(3, VOCAB, (tokens,), generator=g),)


def compile_config(family: Family, backend: str = "eager_fusion",
                   flavour: str = "auto") -> cachebuild.CompileConfig:
    return cachebuild.CompileConfig(splitting_ops=(SDPA,), compile_ranges=(family.compile_range,),
                                    backend=backend, flavour=flavour)


#: Float32 tolerance between a compiled model and eager.
TOL = {"rtol": 1e-4, "atol": 1e-4}


def assert_close(out: Any, ref: Any) -> None:
    """Outputs equal within float32 tolerance, through model outputs and caches."""
    if hasattr(ref, "to_tuple"):
        assert type(out) is type(ref)
        out, ref = out.to_tuple(), ref.to_tuple()
    if isinstance(ref, transformers.DynamicCache):
        assert type(out) is type(ref) and len(out.layers) == len(ref.layers)
        for a, b in zip(out.layers, ref.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, **TOL)
            torch.testing.assert_close(a.values, b.values, **TOL)
        return
    if isinstance(ref, (tuple, list)):
        assert len(out) == len(ref)
        for a, b in zip(out, ref, strict=True):
            assert_close(a, b)
        return
    torch.testing.assert_close(out, ref, **TOL)


def check_sizes(compiled: Any, model: torch.nn.Module, sizes: tuple[int, ...]) -> None:
    with torch.no_grad():
        for size in sizes:
            assert_close(compiled(*ids(size)), model(*ids(size)))


# -- generation ---------------------------------------------------------------------------

#: Families whose transformers classes generate with a static cache (BERT is an encoder).
GENERATES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "gpt2", "qwen2_moe"]
#: Tokens a generation test asks for, greedy, after a prompt of ``PROMPT`` tokens.
NEW_TOKENS = 32
PROMPT = 7


def generator_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The family's causal LM itself (what ``generate`` is called on), with room in its
    positions for a prompt and ``NEW_TOKENS``."""
    family = FAMILIES[name]
    torch.manual_seed(seed)
    room = {"n_positions": 128} if name == "gpt2" else {"max_position_embeddings": 128}
    return family.model_class(family.config(**room)).eval()


def greedy(model: torch.nn.Module, cache: str | None, seed: int = 0) -> list[int]:
    """Greedy ``generate`` of ``NEW_TOKENS`` after a seeded prompt, with the cache
    implementation ``cache`` (None: transformers' default, a dynamic cache)."""
    prompt = ids(PROMPT, seed)[0][None]
    options: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS,
                               "do_sample": False, "pad_token_id": 0}
    if cache is not None:
        options["cache_implementation"] = cache
    with torch.no_grad():
        return model.generate(prompt, **options)[0, PROMPT:].tolist()


def compile_forward(model: torch.nn.Module, config: cachebuild.CompileConfig,
                    store: Any = None) -> None:
    """``model.forward`` through torch.compile with cachebuild's backend, as transformers'
    documentation compiles a model for generation."""
    model.forward = torch.compile(model.forward, backend=cachebuild.backend(config, store=store))


def generation_config(backend: str = "eager_fusion", flavour: str = "auto"
                      ) -> cachebuild.CompileConfig:
    """One range for every Dynamo graph a generation hands over (prefill and decode)."""
    return cachebuild.CompileConfig(splitting_ops=(SDPA,), compile_ranges=((1, 128),),
                                    backend=backend, flavour=flavour)


class StaticServed(torch.nn.Module):
    """A causal LM with a static cache of its own, served through ``cachebuild.compile``:
    ``forward(input_ids [T], positions [T])`` → logits ``[T, vocab]`` of one sequence,
    written into the cache at ``positions``. The cache's tensors are buffers of this
    module, so a warm process binds them like weights."""

    def __init__(self, hf: torch.nn.Module, max_len: int = 64) -> None:
        super().__init__()
        self.hf = hf
        config = hf.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.cache = transformers.StaticCache(config=config, max_cache_len=max_len)
        self.cache.early_initialization(1, config.num_key_value_heads, head_dim,
                                        torch.float32, torch.device("cpu"))
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"keys_{i}", layer.keys, persistent=False)
            self.register_buffer(f"values_{i}", layer.values, persistent=False)
            self.register_buffer(f"length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids[None], position_ids=positions[None],
                       past_key_values=self.cache, use_cache=True).logits[0]


def greedy_served(forward: Any, seed: int = 0) -> list[int]:
    """Greedy decoding of ``NEW_TOKENS`` through a ``StaticServed`` forward: the prompt,
    then one token per call, marked as a decode batch (``cachebuild.decoding``)."""
    prompt = ids(PROMPT, seed)[0]
    out: list[int] = []
    tokens, positions = prompt, torch.arange(PROMPT)
    with torch.no_grad():
        for step in range(NEW_TOKENS):
            with cachebuild.decoding(step > 0):
                out.append(int(forward(tokens, positions)[-1].argmax()))
            tokens, positions = torch.tensor([out[-1]]), torch.tensor([PROMPT + step])
    return out
