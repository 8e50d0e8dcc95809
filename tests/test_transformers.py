"""A model this project did not write: a transformers Llama built from a config with
random weights, split at ``aten::scaled_dot_product_attention``, through both front doors
and both backends.

The wrapper serves it the way this project serves models: one flat sequence of tokens
(``input_ids [T]`` -> ``logits [T, vocab]``), with the batch dim added and removed
around the call. ``use_cache=False``: with the default, the traced forward builds a KV
cache object (tensor constants the piece graphs would have to carry) whose results the
wrapper throws away.
"""

from __future__ import annotations

import models
import pytest
import torch

import cachebuild
from cachebuild.building.planner import Planner
from cachebuild.tracing.trace import trace_model

transformers = pytest.importorskip("transformers")
#: Models of this module share forward code that Dynamo would answer from its cache.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

SDPA = "aten::scaled_dot_product_attention"
DYN = {0: 0}
VOCAB = 128


class TokensToLogits(torch.nn.Module):
    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids[None], use_cache=False).logits[0]


def llama(layers: int = 2, seed: int = 0) -> TokensToLogits:
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
        max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return TokensToLogits(transformers.LlamaForCausalLM(config)).eval()


def ids(tokens: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return (torch.randint(0, VOCAB, (tokens,), generator=g),)


def config(**overrides):
    values = {"splitting_ops": (SDPA,), "compile_ranges": ((1, 16), (17, 48)),
              "compile_sizes": (4,), "backend": "eager_fusion"}
    values.update(overrides)
    return cachebuild.CompileConfig(**values)


SIZES = (9, 1, 4, 16, 17, 48)



def test_uses_sdpa():
    model = llama()
    assert model.hf.config._attn_implementation == "sdpa"


def test_cachebuild_compile_eager_fusion(open_local, tmp_path):
    model = llama()
    compiled = cachebuild.compile(model, config(), DYN, store=open_local(tmp_path / "store"))
    before = cachebuild.stats()
    for size in SIZES:
        models.assert_matches_eager(compiled, model, ids(size))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["traced"] == 1 and delta["failed"] == 0
    entry = compiled.runtime.entry
    assert [p.compiled for p in entry.pieces] == [True, False, True, False, True]
    assert delta["unique"] == delta["built"] == 3 * 3  # 3 unique pieces × 3 buckets


def test_torch_compile_eager_fusion(open_local, tmp_path):
    model = llama(seed=1)
    compiled = torch.compile(model, backend=cachebuild.backend(config(), store=open_local(
        tmp_path / "store")), fullgraph=True)
    before = cachebuild.stats()
    for size in SIZES:
        models.assert_matches_eager(compiled, model, ids(size))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] > 0 and delta["failed"] == 0


def test_unique_targets_do_not_grow_with_depth():
    counts = []
    for layers in (2, 4):
        model = llama(layers=layers)
        traced = trace_model(model, ids(8), DYN)
        entry = Planner(model, config(), DYN, store=None).plan(traced, {})
        assert len([p for p in entry.pieces if p.compiled]) == layers + 1
        counts.append(len(entry.target_keys()))
    assert counts == [9, 9]


@pytest.mark.slow
def test_cachebuild_compile_aoti(open_local, tmp_path):
    model = llama(seed=2)
    cfg = config(backend="inductor", flavour="aoti", compile_ranges=((1, 32),), compile_sizes=())
    store = open_local(tmp_path / "store")
    compiled = cachebuild.compile(model, cfg, DYN, store=store)
    before = cachebuild.stats()
    for size in (5, 1, 32):
        models.assert_matches_eager(compiled, model, ids(size))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] == delta["unique"] == 3
    # A transformers model reads values while tracing: its entry comes with a guard seal.
    assert {r.kind for r in store.records()} == {"entry", "guards", "aoti-cpu"}
