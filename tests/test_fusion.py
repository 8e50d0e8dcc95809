"""The fusion passes on the Qwen3-shaped example: match counts per pass and outputs equal
with the passes on and off, on torch-level (Dynamo) and aten-level graphs, through
Inductor, and through cachebuild's two backends."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cachebuild.passes import PassConfig, PassManager
from cachebuild.passes.ops import FUSED_OPS, op
from cachebuild.passes.rewrites.matching import is_call

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "qwen3_fp8.py"
FLAGS = ["rms_quant", "add_rms_quant", "act_quant", "qk_norm_rope"]
LAYERS = 2


def _load_example():
    name = "cachebuild_example_qwen3_fp8"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


qwen3 = _load_example()
SMALL = qwen3.Qwen3Config(layers=LAYERS, hidden=96, heads=4, kv_heads=2, head_dim=32, mlp=80,
                          vocab=128, max_positions=64)


@pytest.fixture(scope="module")
def model():
    return qwen3.make_model(SMALL, device="cpu", dtype=torch.bfloat16)


def inputs(m, tokens=7):
    return qwen3.example_inputs(m, tokens)


def lower(m, args, level: str) -> torch.fx.GraphModule:
    """The model's graph at one of the levels the passes meet."""
    if level == "dynamo":
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm

        torch._dynamo.reset()
        torch.compile(m, backend=capture, fullgraph=True, dynamic=True)(*args)
        return graphs[0]
    # The module's tensors become graph constants (they are real, the inputs fake).
    if level == "aten":  # views kept
        return make_fx(m, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
    # "aten_no_views": functionalized with views replaced by copies (eager_fusion's input)
    return make_fx(torch.func.functionalize(m, remove="mutations_and_views"),
                   tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)


def fused_calls(graph: torch.fx.Graph) -> dict[str, int]:
    return {name: sum(is_call(n, op(name)) for n in graph.nodes) for name in FUSED_OPS}




@pytest.mark.parametrize("level", ["dynamo", "aten", "aten_no_views"])
def test_all_passes_match_every_layer_and_keep_outputs(model, level):
    args = inputs(model)
    expected = qwen3.expected_matches(LAYERS)
    gm = lower(model, args, level)
    manager = PassManager.from_config(PassConfig.all_fusions())
    counts = manager(gm)
    assert {k: counts[k] for k in FLAGS} == expected
    calls = fused_calls(gm.graph)
    assert calls == {
        "rms_norm_static_fp8_quant": expected["rms_quant"],
        "fused_add_rms_norm_static_fp8_quant": expected["add_rms_quant"],
        "silu_and_mul_static_fp8_quant": expected["act_quant"],
        "qk_norm_rope": expected["qk_norm_rope"],
    }
    # Nothing left to fuse: every rms_norm / silu_and_mul / rotary was absorbed.
    for name in ("rms_norm", "silu_and_mul", "rotary_embedding"):
        assert not any(is_call(n, op(name)) for n in gm.graph.nodes), name
    if level != "dynamo":
        with torch.no_grad():
            # The fused references equal their unfused sequences bit for bit.
            assert torch.equal(gm(*args), model(*args))


@pytest.mark.parametrize("flag", FLAGS)
def test_each_pass_alone(model, flag):
    args = inputs(model, tokens=5)
    gm = lower(model, args, "aten_no_views")
    config = PassConfig(**{flag: True})
    counts = PassManager.from_config(config)(gm)
    assert counts[flag] == qwen3.expected_matches(LAYERS)[flag]
    assert set(counts) == {flag, "cleanup"}
    with torch.no_grad():
        assert torch.equal(gm(*args), model(*args))


def test_passes_off_change_nothing(model):
    args = inputs(model)
    gm = lower(model, args, "aten_no_views")
    before = [(n.op, n.target) for n in gm.graph.nodes]
    counts = PassManager.from_config(PassConfig(cleanup=False))(gm)
    assert counts == {}
    assert [(n.op, n.target) for n in gm.graph.nodes] == before


def test_no_match_when_intermediate_is_read_elsewhere():
    """A norm whose output is also returned must stay: fusing would lose that value."""
    w, s = torch.ones(40), torch.tensor([0.05])

    def f(x):
        y = torch.ops.cachebuild.rms_norm(x, w, 1e-6)
        return torch.ops.cachebuild.static_scaled_fp8_quant(y, s), y

    gm = make_fx(f, tracing_mode="symbolic", _allow_non_fake_inputs=True)(torch.randn(3, 40))
    assert PassManager.from_config(PassConfig(rms_quant=True))(gm)["rms_quant"] == 0


def test_qk_norm_rope_matches_slices_and_rejects_wrong_offsets():
    heads, kv, d = 2, 1, 16
    qw, kw = torch.randn(d), torch.randn(d)
    cache = qwen3.rope_cache(d, 32, 10000.0)

    def f(qkv, pos, k_start):
        q = qkv[:, :heads * d]
        k = qkv[:, k_start:k_start + kv * d]
        q = torch.ops.cachebuild.rms_norm(q.reshape(-1, heads, d), qw, 1e-6)
        k = torch.ops.cachebuild.rms_norm(k.reshape(-1, kv, d), kw, 1e-6)
        return torch.ops.cachebuild.rotary_embedding(
            pos, q.reshape(-1, heads * d), k.reshape(-1, kv * d), cache, d)

    qkv, pos = torch.randn(5, (heads + 2 * kv) * d), torch.arange(5)
    def with_k_at(k_start):
        return lambda a, b: f(a, b, k_start)

    for k_start, matches in ((heads * d, 1), (heads * d + kv * d, 0)):
        g = make_fx(with_k_at(k_start), tracing_mode="symbolic",
                    _allow_non_fake_inputs=True)(qkv, pos)
        assert PassManager.from_config(PassConfig(qk_norm_rope=True))(g)["qk_norm_rope"] == matches
        torch.testing.assert_close(g(qkv, pos), f(qkv, pos, k_start), rtol=0, atol=0)


def test_uuids_differ_per_pass_and_are_stable():
    manager = PassManager.from_config(PassConfig.all_fusions())
    uuids = {p.name: p.uuid() for p in manager.passes}
    assert len(set(uuids.values())) == len(uuids)
    again = {p.name: p.uuid() for p in PassManager.from_config(PassConfig.all_fusions()).passes}
    assert uuids == again


@pytest.mark.slow
def test_inductor_post_grad_pass_on_example(model):
    args = inputs(model, tokens=9)
    with torch.no_grad():
        eager = model(*args)
        results, managers = {}, {}
        for name, config in (("on", PassConfig.all_fusions()), ("off", PassConfig())):
            managers[name] = PassManager.from_config(config)
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, dynamic=True, options={
                "post_grad_custom_post_pass": managers[name].as_inductor_pass()})
            results[name] = compiled(*args)
    counts = managers["on"].total_counts
    assert {k: counts[k] for k in FLAGS} == qwen3.expected_matches(LAYERS)
    torch.testing.assert_close(results["on"], results["off"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results["on"], eager, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "flavour"), [("eager_fusion", "auto"),
                                                   ("inductor", "standalone"),
                                                   ("inductor", "auto")])
def test_cachebuild_backends_on_example(model, backend, flavour, tmp_path):
    import cachebuild
    from cachebuild.store import StoreOptions, open_store

    args = inputs(model, tokens=9)
    on = dataclasses.replace(qwen3.config(backend=backend), flavour=flavour)
    off = dataclasses.replace(on, passes=PassConfig())
    outputs = {}
    with torch.no_grad():
        eager = model(*args)
        for name, config in (("on", on), ("off", off)):
            torch._dynamo.reset()
            store = open_store(StoreOptions(tmp_path / name))
            compiled = cachebuild.compile(model, config=config, dynamic_dims={0: 0, 1: 0},
                                          store=store)
            outputs[name] = compiled(*args)
    torch.testing.assert_close(outputs["on"], outputs["off"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outputs["on"], eager, rtol=2e-2, atol=2e-2)
