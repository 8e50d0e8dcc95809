"""Generation with a KV cache, token-equal to eager, cold and warm in fresh processes.

Hugging Face: ``generate`` greedy over ``NEW_TOKENS`` tokens with the static cache
(written in place inside the compiled graph) and with the default dynamic cache, through
``torch.compile(model.forward, backend=cachebuild.backend(...))`` as transformers
documents it, for every family of ``hf_families`` that generates; the Inductor flavours on
Llama. Each child computes eager's tokens itself, then the compiled model's; the second
child must build nothing.

vLLM-style: ``examples/generate.py`` (a paged cache written by a splitting op) warmed by
``cachebuild warm`` and served by ``python examples/generate.py``, which exits 1 unless its
tokens equal eager's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import models
import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Runs in a fresh process: for each family of FAMILIES and each cache of CACHES, eager's
#: greedy tokens and the compiled model's (BACKEND, FLAVOUR, the store STORE).
CHILD = """
import dataclasses, json, os

import hf_families as H
from cachebuild.store import LocalStore

import cachebuild

store = LocalStore(os.environ["STORE"])
config = H.generation_config(os.environ["BACKEND"], os.environ["FLAVOUR"])
found = {}
for name in os.environ["FAMILIES"].split(","):
    for cache in os.environ["CACHES"].split(","):
        if cache == "served":  # the static cache as buffers, through cachebuild.compile,
            # decode steps from full graphs and the prompt from piecewise ones
            want = H.greedy_served(H.StaticServed(H.generator_model(name)).eval())
            served = H.StaticServed(H.generator_model(name)).eval()
            graphs = dataclasses.replace(config, cudagraph_mode="full_and_piecewise",
                                         capture_sizes=(1, H.PROMPT))
            compiled = cachebuild.compile(served, graphs, {0: 0, 1: 0}, store=store)
            found[f"{name}/served"] = [want, H.greedy_served(compiled)]
            found[f"{name}/served graphs"] = compiled.capture_state().served
            continue
        cache = None if cache == "dynamic" else cache
        model = H.generator_model(name)
        want = H.greedy(model, cache)
        H.compile_forward(model, config, store)
        found[f"{name}/{cache}"] = [want, H.greedy(model, cache)]
print(json.dumps({"tokens": found, "stats": cachebuild.stats()}))
"""


def child_env(store: Path, families: list[str], caches: str, backend: str = "eager_fusion",
              flavour: str = "auto") -> dict[str, str]:
    return {"STORE": str(store), "FAMILIES": ",".join(families), "CACHES": caches,
            "BACKEND": backend, "FLAVOUR": flavour}


def generate_in_child(*args: object, **kwargs: object) -> dict:
    return models.run_python(CHILD, env=child_env(*args, **kwargs), timeout=1500)


def assert_token_equal(child: dict) -> None:
    tokens = {case: pair for case, pair in child["tokens"].items()
              if not case.endswith(" graphs")}
    wrong = {case: pair for case, pair in tokens.items() if pair[0] != pair[1]}
    assert not wrong, f"tokens differ from eager's: {wrong}"
    assert all(len(want) == 32 for want, _ in tokens.values())


@pytest.mark.slow
def test_every_family_generates_eagers_tokens_cold_and_warm(tmp_path):
    import hf_families as H

    cold = generate_in_child(tmp_path / "store", H.GENERATES, "static,dynamic")
    warm = generate_in_child(tmp_path / "store", H.GENERATES, "static,dynamic")
    assert cold["stats"]["built"] > 0
    assert warm["stats"]["built"] == 0 and warm["stats"]["failed"] == 0
    for child in (cold, warm):
        assert_token_equal(child)


@pytest.mark.slow
def test_a_static_cache_of_buffers_through_cachebuild_compile_cold_and_warm(tmp_path):
    cold = generate_in_child(tmp_path / "store", ["llama", "qwen2"], "served")
    warm = generate_in_child(tmp_path / "store", ["llama", "qwen2"], "served")
    assert cold["stats"]["traced"] == 2
    assert warm["stats"]["traced"] == 0 and warm["stats"]["built"] == 0
    assert cold["stats"]["built"] > 0
    assert warm["stats"]["built"] == 0 and warm["stats"]["failed"] == 0
    for child in (cold, warm):
        assert_token_equal(child)
        for family in ("llama", "qwen2"):
            # 31 decode steps: the first captures the full graph (lazy), the rest replay it;
            # the prompt's call captures its piecewise graphs
            assert child["tokens"][f"{family}/served graphs"] == {"full": 30, "piecewise": 0,
                                                                   "none": 2}


@pytest.mark.slow
def test_llama_generates_eagers_tokens_with_inductor_cold_and_warm(tmp_path):
    """Both Inductor flavours, side by side."""
    envs = [child_env(tmp_path / flavour, ["llama"], "static", "inductor", flavour)
            for flavour in ("aoti", "standalone")]
    cold = models.run_pythons(CHILD, envs, timeout=1500)
    warm = models.run_pythons(CHILD, envs, timeout=1500)
    for c, w in zip(cold, warm, strict=True):
        assert c["stats"]["built"] > 0 and c["stats"]["fallbacks"] == 0
        assert w["stats"]["built"] == 0
        assert_token_equal(c)
        assert_token_equal(w)


# -- the paged example ---------------------------------------------------------------------

BACKENDS = [("eager_fusion", "auto"), ("inductor", "aoti"), ("inductor", "standalone")]


def run_all(commands: list[tuple[list[str], dict[str, str]]], folder: Path
            ) -> list[tuple[int, str]]:
    """Run ``commands`` (argv, extra environment) side by side in the checkout; each one's
    exit code and stderr."""
    procs = []
    for i, (argv, env) in enumerate(commands):
        err = open(folder / f"{i}.err", "w+")
        procs.append((subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, text=True,
                                       stdout=subprocess.DEVNULL, stderr=err), err))
    done = []
    for proc, err in procs:
        proc.wait(timeout=1500)
        err.seek(0)
        done.append((proc.returncode, err.read()))
        err.close()
    return done


@pytest.mark.slow
def test_paged_example_warmed_then_served_gives_eagers_tokens(tmp_path):
    """``cachebuild warm examples/generate.py``, then ``python examples/generate.py``,
    with every backend (side by side)."""
    envs = [{"CACHEBUILD_DIR": str(tmp_path / flavour), "GEN_NEW_TOKENS": "32",
             "LLAMA_LAYERS": "1", "LLAMA_BACKEND": backend, "LLAMA_FLAVOUR": flavour}
            for backend, flavour in BACKENDS]
    cli = str(Path(sys.executable).with_name("cachebuild"))
    for code, err in run_all([([cli, "warm", "examples/generate.py"], e) for e in envs], tmp_path):
        assert code == 0, err[-3000:]
    served = run_all([([sys.executable, "examples/generate.py"], e) for e in envs], tmp_path)
    for (code, err), (backend, flavour) in zip(served, BACKENDS, strict=True):
        assert code == 0, f"{backend}/{flavour}: {err[-3000:]}"
        line = err.strip().splitlines()[-1]
        assert "targets built 0" in line and "traced 0" in line and "equal to eager's" in line


def test_paged_engine_samples_reproducibly_and_frees_its_blocks(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import generate
    finally:
        sys.path.remove(str(ROOT / "examples"))
    os.environ.setdefault("GEN_BLOCKS", "64")
    model = generate.make_model()
    engine = generate.Engine(model)
    batch = generate.prompts(model.embed.num_embeddings, count=2)
    free = len(engine.free)
    first = engine.generate(batch, 8, temperature=0.8, seed=3)
    assert engine.generate(batch, 8, temperature=0.8, seed=3) == first
    assert engine.generate(batch, 8, temperature=0.8, seed=4) != first
    assert len(engine.free) == free  # every block back: a long run does not grow
    with pytest.raises(generate.CacheFull, match="GEN_MAX_BLOCKS"):
        engine.generate([[1] * 300], 1)
    assert len(engine.free) == free
    model.layers[0].kv_cache = model.layers[0].kv_cache[:, :4]
    with pytest.raises(ValueError, match="attach_caches"):
        generate.Engine(model)
    assert json.dumps(first)


@pytest.mark.slow
def test_a_sliding_window_static_cache_builds_once_for_every_length(tmp_path, monkeypatch,
                                                                    caplog, fresh_dynamo):
    """Mistral's sliding-window static cache counts tokens in a Python int, which Dynamo
    hands the backend as an input and takes back bumped. No tensor reads it, so the count
    is worked out on each call and one build serves every cache length: decoding further
    builds nothing and warns of nothing, and the tokens are eager's."""
    import hf_families as H

    import cachebuild
    from cachebuild.store import LocalStore

    monkeypatch.setattr(H, "NEW_TOKENS", 3)
    model = H.generator_model("mistral")
    short = H.greedy(model, "static")
    monkeypatch.setattr(H, "NEW_TOKENS", 10)
    want = H.greedy(model, "static")
    H.compile_forward(model, H.generation_config(), LocalStore(tmp_path / "store"))
    monkeypatch.setattr(H, "NEW_TOKENS", 3)
    assert H.greedy(model, "static") == short
    built = cachebuild.stats()["built"]
    monkeypatch.setattr(H, "NEW_TOKENS", 10)
    with caplog.at_level("WARNING", logger="cachebuild"):
        assert H.greedy(model, "static") == want  # past the window, lengths never seen
    assert cachebuild.stats()["built"] == built
    assert not [r for r in caplog.records if "new variant" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only"])
def test_paged_model_with_full_decode_graphs_equals_eager_call_by_call(open_local, tmp_path,
                                                                       monkeypatch, mode):
    """The paged model served as test_generate_gpu.py serves it, on the CPU: prefills and
    decode steps, logits and KV caches equal to eager's after every call, and decode steps
    served by the full graphs (``ReplayCapture`` here)."""
    import paged

    import cachebuild

    model, eager = paged.make_pair("cpu", monkeypatch)
    compiled = cachebuild.compile(model, paged.config(mode, "lazy"), paged.generate.DYNAMIC,
                                  store=open_local(tmp_path / "store"))
    paged.serve_beside_eager(compiled, model, eager)
    want = (paged.SERVED["lazy"] if mode == "full_and_piecewise"
            else {"full": 3, "piecewise": 0, "none": 5})
    assert compiled.capture_state().served == want
