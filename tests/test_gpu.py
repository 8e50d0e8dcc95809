"""The piecewise build graph on a CUDA GPU, with the machine's environment as it is.

``auto`` must pick AOTInductor (the probe finds a C++ compiler whose libraries load and
can be captured). A cold build, then warm processes: nothing built or traced, neither
Dynamo nor Inductor imported, outputs equal to eager at bf16 tolerance, and capture in
every graph mode at every default size with replays equal to eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import llama
import cachebuild
from cachebuild.store import LocalStore
torch.manual_seed(0)
model = llama.make_model()
base = llama.config()
cfg = cachebuild.CompileConfig(splitting_ops=base.splitting_ops, compile_ranges=base.compile_ranges,
                               cudagraph_mode=sys.argv[3])
compiled = cachebuild.compile(model, cfg, {0: 0, 1: 0}, store=LocalStore(sys.argv[2]))
ids, pos = llama.example_inputs(model, 8)
with torch.no_grad():
    compiled(ids, pos)  # load (or build), and capture every default size in a graph mode
    rt = compiled.runtime
    sizes = list(rt.captured_sizes) or [1, 2, 7, 64]
    worst = 0.0
    for tokens in sizes + [3, 100, 300]:  # captured sizes, then three that are not
        ids, pos = llama.example_inputs(model, tokens)
        out = compiled(ids, pos).clone()
        ref = model(ids, pos)
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=5e-2)
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
# looked at before anything below imports Dynamo to read its counters
compilers = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
compiles = {}
if compilers:
    from torch._dynamo.utils import counters
    compiles = {"dynamo_unique_graphs": counters["stats"]["unique_graphs"],
                "inductor_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}
store = LocalStore(sys.argv[2])
kinds = sorted({store.get_record(k).kind for k in rt.entry.target_keys()})
report = compiled.capture_report
print(json.dumps({
    "stats": cachebuild.stats(), "kinds": kinds, "worst": worst, "sizes": list(rt.captured_sizes),
    "compilers": compilers[:5], "compiles": compiles,
    "copies": max((len(c.copies) for g in rt.graphed for c in g.graphs.values()), default=0),
    "replays": [g.replays for g in rt.graphed],
    "capture_s": report and report.seconds, "split": report and report.split,
    "graphs": report and report.graphs, "pool_bytes": report and report.pool_bytes}))
"""


def run(store: Path, mode: str, layers: int = 2) -> dict:
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": str(layers)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples"), str(store), mode],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """One cold build (no graphs) into a store every test of this module then loads."""
    store = tmp_path_factory.mktemp("gpu") / "store"
    cold = run(store, "none")
    return store, cold


def test_auto_picks_aoti_and_a_warm_process_imports_no_compiler(warmed):
    from cachebuild.backends.probe import cached_verdicts

    store, cold = warmed
    for verdict in cached_verdicts():
        print(verdict.describe())
    assert cold["kinds"] == ["aoti-cuda"], cold["kinds"]
    assert cold["stats"]["built"] == cold["stats"]["unique"] > 0
    assert cold["stats"]["fallbacks"] == 0
    warm = run(store, "none")
    assert warm["stats"]["built"] == 0 and warm["stats"]["traced"] == 0
    assert warm["stats"]["loaded"] == warm["stats"]["unique"]
    assert warm["compilers"] == [], warm["compilers"]
    print(f"cold {cold['stats']['seconds']}, warm {warm['stats']['seconds']}, "
          f"worst |out-eager| {warm['worst']:.3g}")


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_capture_after_warm_load_in_every_graph_mode(warmed, mode):
    store, _ = warmed
    warm = run(store, mode)
    assert warm["stats"]["built"] == 0 and warm["stats"]["traced"] == 0
    assert warm["kinds"] == ["aoti-cuda"]
    assert len(warm["sizes"]) == 51
    # capture after a warm load imports no compiler, let alone compiles with one
    assert warm["compilers"] == [], warm["compilers"]
    # every captured size replayed once; the three others ran without graphs
    assert all(r >= 51 for r in warm["replays"]), warm["replays"]
    if mode == "piecewise":
        # a piece copies only what an eager splitting op produced (the attention output);
        # ids and positions have fixed addresses that every piece reads in place
        assert warm["copies"] == 1, warm["copies"]
    else:
        assert warm["copies"] == 2, warm["copies"]  # full: the two call arguments
    print(f"{mode}: capture of 51 sizes {warm['capture_s']:.2f} s ({warm['graphs']} graphs: "
          f"{ {k: round(v, 2) for k, v in warm['split'].items()} }), graph pool "
          f"{warm['pool_bytes']} bytes, worst |out-eager| {warm['worst']:.3g}")
