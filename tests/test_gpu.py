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
