"""tools/bench_passes.py runs end to end in its smoke mode (CPU, Triton's interpreter)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_passes_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(ROOT / "tools" / "bench_passes.py"), "--smoke", "--json",
            str(out)]
    if torch.cuda.is_available():
        args.remove("--smoke")
        args += ["--tokens", "1,64"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    ops = {row["op"] for row in results["kernels"]}
    assert len(ops) == 4
    assert len(results["kernels"]) == 8
    assert all(row["fused_ms"] > 0 and row["floor_ms"] > 0 for row in results["kernels"])
