"""Writes in place under CUDA graphs, on a GPU: every pattern of ``inplace_models`` in the
model that has them all, with AOTI pieces, captured piecewise and whole, replayed call after
call with outputs and state equal to eager's; the paged example served with full decode
graphs and piecewise prefill graphs under every capture policy, logits and KV caches equal
to eager's after every call; and the paged example generating on the GPU with its decode
batches replayed from graphs, token-equal to eager, cold and warm, in every graph mode; and
no residual sum of its CUDA packages left as an ``addmm`` (the edge pass).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


# -- full graphs for decode, piecewise for prefill -------------------------------------------

@pytest.mark.parametrize("policy", ["lazy", "eager", "background"])
def test_full_and_piecewise_on_cuda_equals_eager_in_outputs_and_cache(open_local, tmp_path,
                                                                      monkeypatch, policy):
    """The paged model on the GPU under each capture policy: prefills (piecewise graphs)
    and decode steps (full graphs, attention and the cache write inside), logits and every
    layer's KV cache equal to eager's after every call; the capture state counts which
    graphs served which calls."""
    import paged

    import cachebuild

    model, eager = paged.make_pair("cuda", monkeypatch)
    compiled = cachebuild.compile(model, paged.config("full_and_piecewise", policy),
                                  generate_dims(), store=open_local(tmp_path / "store"))
    paged.serve_beside_eager(compiled, model, eager)
    state = compiled.capture_state()
    # the model writes its cache: no passes on dummy inputs beside it
    assert state.policy == ("eager" if policy == "eager" else "lazy")
    assert state.served == paged.SERVED[state.policy], state.served
    assert state.kinds["full"] == ([1, 2, 4] if policy == "eager" else [4]), state.kinds
    assert state.failed == {} and state.full_failed == {}
    assert sum(r.misses for r in compiled.runtime.replayers()) == 0
    print(f"full_and_piecewise/{policy}: served {state.served}, graphs {state.kinds}, pool "
          f"{state.pool_bytes / 2**20:.0f} MiB")


def test_full_decode_only_on_cuda_serves_decode_steps_from_graphs(open_local, tmp_path,
                                                                 monkeypatch):
    import paged

    import cachebuild

    model, eager = paged.make_pair("cuda", monkeypatch)
    compiled = cachebuild.compile(model, paged.config("full_decode_only", "lazy"),
                                  generate_dims(), store=open_local(tmp_path / "store"))
    paged.serve_beside_eager(compiled, model, eager)
    assert compiled.capture_state().served == {"full": 3, "piecewise": 0, "none": 5}


def generate_dims() -> dict[int, int]:
    import paged

    return paged.generate.DYNAMIC


# -- writes in place, the example -----------------------------------------------------------


def run_example(store: Path, **env: str) -> subprocess.CompletedProcess:
    child_env = {**os.environ, "CACHEBUILD_DIR": str(store), "LLAMA_DEVICE": "cuda",
                 "GEN_NEW_TOKENS": "32", **env}
    return subprocess.run([sys.executable, "examples/generate.py"], cwd=ROOT, env=child_env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def example_store(tmp_path_factory):
    """One store for the paged example's runs: graph modes are run-time choices, so the
    first run builds and the others load."""
    return tmp_path_factory.mktemp("paged") / "store"


@pytest.mark.parametrize("graphs", ["full_and_piecewise", "piecewise", "full"])
def test_paged_example_on_cuda_is_token_equal_cold_and_warm(graphs, example_store):
    # float32: greedy tokens of a random model are ties away from flipping in bf16
    env = {"GEN_GRAPHS": graphs, "LLAMA_DTYPE": "float32"}
    cold = run_example(example_store, **env)
    assert cold.returncode == 0, cold.stderr[-3000:]
    warm = run_example(example_store, **env)
    assert warm.returncode == 0, warm.stderr[-3000:]
    line = warm.stderr.strip().splitlines()[-1]
    print(f"{graphs}: {line}")
    assert "targets built 0" in line and "traced 0" in line and "equal to eager's" in line
    # 31 decode steps of 3 sequences (padded to 4): the first captures the size's graph
    # (lazy), the rest replay it; the prefill (27 tokens, padded to 32) captures its size
    # and is not replayed
    kind = "full" if graphs != "piecewise" else "piecewise"
    assert f"{kind} 30" in line, line


def test_no_residual_sum_is_an_addmm_in_the_examples_cuda_packages(example_store):
    """A piece's output must not make Inductor choose other kernels than compiling the
    model whole would: no ``addmm`` (a copy of the residual, then a GEMM adding into it) in
    the wrapper code of any AOTI package of the paged example (``backends/edges.py``)."""
    import re
    import zipfile

    from cachebuild.store import LocalStore

    if not example_store.exists():
        run_example(example_store, LLAMA_DTYPE="float32")
    store = LocalStore(example_store)
    try:
        packages = [r.key for r in store.records(kind="aoti-cuda")]
        assert packages, "the example built no AOTI package"
        for key in packages:
            with zipfile.ZipFile(store.materialize(key, ".pt2")) as z:
                wrappers = [n for n in z.namelist() if n.endswith(".cpp")]
                assert wrappers, z.namelist()
                code = "".join(z.read(n).decode(errors="replace") for n in wrappers)
            assert not re.search(r"aoti_torch_\w+_addmm_out\(", code), key
            assert re.search(r"aoti_torch_\w+_mm_out\(", code), key  # the GEMMs, unfused
    finally:
        store.close()


@pytest.fixture(scope="module")
def patterns_store(tmp_path_factory):
    """One store for both graph modes of the model with every pattern: the first builds."""
    return tmp_path_factory.mktemp("patterns") / "store"


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_all_patterns_replay_eagers_outputs_and_state_on_cuda(open_local, mode, patterns_store):
    import inplace_models as im

    import cachebuild

    def on_gpu(cls):
        return im.make(cls).cuda()

    def sequence(fn, model):
        shared = [t.cuda() for t in im.call_args(im.AllPatterns, 5)]
        results, start = [], 0
        with torch.no_grad():
            for size in (5, 4, 1, 3, 4, 1):
                args = [t.cuda() for t in im.call_args(im.AllPatterns, size, start)]
                args = (*args[:2], *shared[2:])
                out = fn(*args)
                results.append([t.clone() for t in im.flat(out)]
                               + [t.clone() for t in im.state(model, args)])
                start += size
        return results

    eager = on_gpu(im.AllPatterns)
    want = sequence(eager, eager)
    model = on_gpu(im.AllPatterns)
    config = im.config(backend="inductor", flavour="aoti", cudagraph_mode=mode,
                       capture_sizes=(1, 4, 8))
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0},
                                  store=open_local(patterns_store))
    got = sequence(compiled, model)
    im.assert_same(got, want)
    assert sum(r.replays for r in compiled.runtime.replayers()) >= 2  # 4 and 1, again
