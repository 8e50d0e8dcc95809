"""On CPU a standalone artifact carries its built kernels: a warm load builds no C++."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"LLAMA_LAYERS": "2", "LLAMA_HIDDEN": "64", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2",
         "LLAMA_MLP": "128", "LLAMA_VOCAB": "128"}

CHILD = r"""
import dataclasses, json, sys, torch
sys.path.insert(0, sys.argv[1])
import torch._inductor.cpp_builder as cpp_builder

def refuse(self, *args, **kwargs):
    raise RuntimeError("C++ was built during a warm load: " + self.get_target_file_path())

if sys.argv[3] == "warm":
    cpp_builder.CppBuilder.build = refuse  # any compile of C++ now fails the load
import llama, cachebuild
from cachebuild.store import LocalStore
torch.manual_seed(0)
model = llama.make_model()
cfg = dataclasses.replace(llama.config(), flavour="standalone")
compiled = cachebuild.compile(model, cfg, {0: 0, 1: 0}, store=LocalStore(sys.argv[2]))
ids, pos = llama.example_inputs(model, 13)
with torch.no_grad():
    torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=1e-4, atol=1e-4)
print(json.dumps(cachebuild.stats()))
"""


@pytest.mark.slow
def test_standalone_warm_load_builds_no_cpp(tmp_path):
    # Both sides in fresh processes, as `cachebuild warm` and a server would be: nothing
    # a test before this one left in this process's Inductor state can leak into either.
    def run(phase: str, inductor_dir: str) -> dict:
        env = {**os.environ, **SMALL, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor_dir)}
        proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples"),
                               str(tmp_path / "store"), phase], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold = run("cold", "inductor-build")
    assert cold["built"] == 3
    # A fresh process with an empty Inductor cache: everything must come from the store.
    warm = run("warm", "fresh-inductor")
    assert warm["built"] == 0 and warm["traced"] == 0 and warm["loaded"] == 3
