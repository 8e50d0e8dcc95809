"""The piecewise build graph on a CUDA GPU: cold build, then a warm process.

On builds where AOTInductor libraries cannot load (the ``auto`` probe says so), targets
are ``standalone`` artifacts; either way the output must match eager at bf16 tolerance.
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
compiled = cachebuild.compile(model, llama.config(), {0: 0, 1: 0}, store=LocalStore(sys.argv[2]))
worst = 0.0
with torch.no_grad():
    for tokens in (2, 7, 64, 300):
        ids, pos = llama.example_inputs(model, tokens)
        out, ref = compiled(ids, pos), model(ids, pos)
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
store = LocalStore(sys.argv[2])
kinds = sorted({store.get_record(k).kind for k in compiled.runtime.entry.target_keys()})
print(json.dumps({"stats": cachebuild.stats(), "kinds": kinds, "worst": worst}))
"""


def _run(tmp_path: Path) -> dict:
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": "3"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples"),
                           str(tmp_path / "store")], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cold_then_warm_on_gpu(tmp_path):
    cold = _run(tmp_path)
    assert cold["stats"]["built"] == cold["stats"]["unique"] > 0
    warm = _run(tmp_path)
    assert warm["stats"]["built"] == 0
    assert warm["stats"]["traced"] == 0
    assert warm["kinds"] == cold["kinds"]
    print("artifact kinds:", cold["kinds"], "cold:", cold["stats"]["seconds"],
          "warm:", warm["stats"]["seconds"])


CAPTURE_CHILD = r"""
import json, sys, time, torch
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
    compiled(ids, pos)  # load (or build) and capture every default size
    rt = compiled.runtime
    sizes = list(rt.captured_sizes)
    worst = 0.0
    for tokens in sizes + [3, 100, 300]:  # captured sizes, then three that are not
        ids, pos = llama.example_inputs(model, tokens)
        out = compiled(ids, pos).clone()
        ref = model(ids, pos)
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=5e-2)
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
compiles = {}
if "torch._dynamo" in sys.modules:
    from torch._dynamo.utils import counters
    compiles = {"dynamo_unique_graphs": counters["stats"]["unique_graphs"],
                "inductor_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}
s = cachebuild.stats()
# per graph and size: how many inputs a replay copies (model inputs are copied once per call)
copies = max(len(c.copies) for g in rt.graphed for c in g.graphs.values())
print(json.dumps({"built": s["built"], "traced": s["traced"], "sizes": sizes, "copies": copies,
                  "replays": [g.replays for g in rt.graphed], "worst": worst,
                  "capture_s": s["seconds"].get("capture"), "compiles": compiles,
                  "pool_bytes": getattr(compiled, "capture_report", None) and compiled.capture_report.pool_bytes}))
"""


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_capture_after_warm_load(tmp_path, mode):
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": "2"}

    def run() -> dict:
        proc = subprocess.run([sys.executable, "-c", CAPTURE_CHILD, str(ROOT / "examples"),
                               str(tmp_path / "store"), mode], capture_output=True, text=True,
                              env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    run()  # cold: builds, records the entry, captures
    warm = run()
    assert warm["built"] == 0 and warm["traced"] == 0
    assert len(warm["sizes"]) == 51
    # capture after a warm load compiles nothing of any kind
    assert all(v == 0 for v in warm["compiles"].values()), warm["compiles"]
    # every captured size replayed once; the three others ran without graphs (or padded)
    assert all(r >= 51 for r in warm["replays"]), warm["replays"]
    if mode == "piecewise":
        # a piece copies only what an eager splitting op produced (the attention output);
        # ids and positions have fixed addresses that every piece reads in place
        assert warm["copies"] == 1, warm["copies"]
    else:
        assert warm["copies"] == 2, warm["copies"]  # full: the two call arguments
    print(f"{mode}: capture of 51 sizes {warm['capture_s']:.2f} s, graph pool "
          f"{warm['pool_bytes']} bytes, worst |out-eager| {warm['worst']:.3g}")
