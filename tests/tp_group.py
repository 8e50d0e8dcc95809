"""A tensor-parallel group of real processes, started the way torchrun starts one.

Each rank is a fresh interpreter with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port); all start at once, so a
cold group really does race for the store's build locks. Every rank runs
``examples/llama_tp.py``'s shard of a tiny Llama through ``cachebuild.compile`` (gloo on
CPU, NCCL on CUDA) and compares its output at several sizes with the unsharded model run
eagerly, then reports its counters and its entry's targets as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import models

EXAMPLE = models.TESTS_DIR.parent / "examples" / "llama_tp.py"

#: A tiny Llama: 2 layers, 4 heads, 2 KV heads, MLP 96; one compile range 1-32.
TINY = {"LLAMA_LAYERS": "2", "LLAMA_HIDDEN": "64", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2",
        "LLAMA_MLP": "96", "LLAMA_VOCAB": "128", "LLAMA_MAX_TOKENS": "32",
        "LLAMA_BACKEND": "eager_fusion"}

#: The sizes every rank runs at (inside the compile range), in the same order.
SIZES = (1, 5, 32)

RANK_CHILD = """
import json, os

import torch
import torch.distributed as dist

import cachebuild
from cachebuild.modelfile import import_model
from cachebuild.store import LocalStore

tp = import_model(os.environ["MODEL"])
cuda = os.environ.get("LLAMA_DEVICE", "cpu").startswith("cuda")
device = tp.rank_device(int(os.environ["LOCAL_RANK"]))
if cuda:
    torch.cuda.set_device(device)
tp.init_group(device)
full = tp.make_full()
model = tp.make_model(full)
config = tp.config()
if os.environ.get("CUDAGRAPHS"):
    import dataclasses
    config = dataclasses.replace(config, cudagraph_mode="piecewise",
                                 capture_sizes=tuple(json.loads(os.environ["SIZES"])))
store = LocalStore(os.environ["STORE"])
if os.environ.get("FRONT_DOOR") == "torch.compile":
    compiled = torch.compile(model, backend=cachebuild.backend(config, store=store),
                             dynamic=True, fullgraph=True)
else:
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
low_precision = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
tol = ({"rtol": 3e-2, "atol": 5e-2} if low_precision else
       {"rtol": 1e-3, "atol": 1e-3} if cuda else {"rtol": 1e-4, "atol": 1e-4})
worst = 0.0
with torch.no_grad():
    # with graphs, twice: a size's first call captures it, the second replays its graphs
    for tokens in json.loads(os.environ["SIZES"]) * (2 if os.environ.get("CUDAGRAPHS") else 1):
        torch.manual_seed(tokens)  # the same tokens on every rank
        ids, pos = tp.example_inputs(model, tokens)
        out = compiled(ids, pos).clone()
        ref = full(ids, pos)
        torch.testing.assert_close(out, ref, **tol)
        worst = max(worst, float((out.float() - ref.float()).abs().max()))
runtime = getattr(compiled, "runtime", None)  # None through torch.compile's front door
keys = runtime.entry.target_keys() if runtime else sorted(
    r.key for r in store.records() if r.kind != "entry")
report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "stats": cachebuild.stats(),
          "entry": runtime.entry.key if runtime else None, "keys": keys, "worst": worst,
          "kinds": sorted({store.get_record(k).kind for k in keys}),
          "captured": list(runtime.captured_sizes) if runtime else [],
          "replays": sum(r.replays for r in runtime.replayers()) if runtime else 0}
dist.barrier()
dist.destroy_process_group()
print(json.dumps(report))
"""


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous of one group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(world: int, env: dict[str, str], code: str = RANK_CHILD) -> list[subprocess.Popen]:
    """Start ``world`` ranks of ``code`` at once, each with torchrun's environment."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port, **env}
        procs.append(models.start_python(code, env=rank_env))
    return procs


def finish_group(procs: list[subprocess.Popen], timeout: float = 600) -> list[dict[str, Any]]:
    """Every rank's JSON report; the first rank that fails stops the group (the others
    would wait for it in a collective) and fails the test with its stderr."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = next((p for p in procs if p.returncode not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            p = failed or procs[0]
            err = p.stderr.read() if p.stderr else ""
            raise AssertionError(f"rank {procs.index(p)} failed ({p.returncode}):\n{err[-4000:]}")
        time.sleep(0.1)
    reports = []
    for rank, p in enumerate(procs):
        out, err = p.communicate()
        assert p.returncode == 0, f"rank {rank} failed ({p.returncode}):\n{err[-4000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def run_group(world: int, store: Path, env: dict[str, str] | None = None,
              sizes: tuple[int, ...] = SIZES, timeout: float = 600) -> list[dict[str, Any]]:
    """Start a group of ``world`` ranks of the tiny Llama on ``store`` and wait for it."""
    group_env = {**TINY, "MODEL": str(EXAMPLE), "STORE": str(store),
                 "SIZES": json.dumps(list(sizes)), **(env or {})}
    return finish_group(start_group(world, group_env), timeout)


def summed(reports: list[dict[str, Any]], counter: str) -> int:
    """A counter summed over the ranks of a group."""
    return sum(r["stats"][counter] for r in reports)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """``cachebuild ARGS`` in a fresh process with the tiny Llama's sizes; its stdout and
    stderr (it must succeed)."""
    child_env = {**os.environ, **TINY, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", *args], env=child_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"cachebuild {' '.join(args)} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr
