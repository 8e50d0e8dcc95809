"""Tensor-parallel cold and warm starts: one compile per node, not one per rank.

On ``examples/llama_tp.py`` (sizes from its knobs; defaults: 2 layers, hidden 256), with
every rank a fresh process started the way torchrun starts it (gloo on CPU, NCCL with
``--device cuda``, rank r on ``cuda:r``):

- ``one rank cold``: what one rank's build costs alone. One process, rank 0 of the world
  size under torch's fake process group (its collectives communicate nothing, so its
  output is not checked), compiles into an empty store: it builds exactly the targets the
  group needs (same keys).
- ``group cold, one store``: the N ranks start at once on one empty store (each unique
  target built by one process while the others wait on its lock). Goal: at most 1.2x one
  rank's cold start, not Nx.
- ``group cold, a store per rank``: the N ranks each build into a store of their own,
  which is what per-rank caches do (the Nx baseline; on a box with fewer cores than
  ranks the builds also contend for CPUs).
- ``group warm`` against ``one rank warm``: every rank's warm start from the group's
  store, against the one process's warm start from its own.
- Bytes in the store: the group's against one rank's (goal: equal where shards are).

Times are from spawning the process(es) to the first output (the slowest rank for a
group), and the compile call to the first output in the rank; every rank of a group also
reports its largest difference from the unsharded model run eagerly (relative to the
largest output). Usage::

    python tools/bench_tp.py [--world-size 2] [--device cpu|cuda] [--backend eager_fusion]
        [--flavour auto] [--markdown] [--json] [--from-json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import add_output_options, cpu_model, present, render_table

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama_tp.py"

CHILD = """
import json, os, sys, time

import torch
import torch.distributed as dist

import cachebuild
from cachebuild.modelfile import import_model
from cachebuild.store import LocalStore

tp = import_model(os.environ["MODEL"])
world = int(os.environ["WORLD_SIZE"])
fake = os.environ.get("FAKE") == "1"
device = tp.rank_device(0 if fake else int(os.environ["LOCAL_RANK"]))
if device.type == "cuda":
    torch.cuda.set_device(device)
if fake:  # one rank alone: the group's targets, collectives that communicate nothing
    from cachebuild import compat
    compat.init_fake_world(0, world)
else:
    tp.init_group(device)
full = tp.make_full()  # in every mode alike (only a group's outputs are checked with it)
model = tp.make_model(full)
compiled = cachebuild.compile(model, tp.config(), {0: 0, 1: 0},
                              store=LocalStore(os.environ["STORE"]))
torch.manual_seed(1)
ids, pos = tp.example_inputs(model, tokens=32)
start = time.perf_counter()
with torch.no_grad():
    out = compiled(ids, pos)
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    done = time.time()
    # Against the unsharded model: the largest difference relative to its largest output.
    error = None
    if not fake:
        ref = full(ids, pos).float()
        error = float((out.float() - ref).abs().max() / ref.abs().max())
s = cachebuild.stats()
report = {"first_output_at": done, "compile_to_first": first, "built": s["built"],
          "loaded": s["loaded"], "traced": s["traced"], "unique": s["unique"], "error": error}
if not fake:
    dist.barrier()
    dist.destroy_process_group()
print(json.dumps(report))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, stores: list[Path], env: dict[str, str], scratch: Path,
         fake: bool = False) -> dict[str, Any]:
    """Start ``len(stores)`` processes at once (rank r on ``stores[r]``); the slowest one's
    time from spawn to first output, and every report. Each process gets empty Inductor
    and Triton caches of its own (under ``scratch``): no build is helped by another's."""
    port = str(_free_port())
    base = {**os.environ, **env, "MODEL": str(EXAMPLE), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "FAKE": "1" if fake else "0",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    caches = [Path(tempfile.mkdtemp(prefix="caches-", dir=scratch)) for _ in stores]
    spawned = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r),
                                   "STORE": str(store),
                                   "TORCHINDUCTOR_CACHE_DIR": str(caches[r] / "inductor"),
                                   "TRITON_CACHE_DIR": str(caches[r] / "triton")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, store in enumerate(stores)]
    reports = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"rank {r} failed:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    errors = [r["error"] for r in reports if r["error"] is not None]
    return {"seconds": max(r["first_output_at"] for r in reports) - spawned,
            "compile_to_first": max(r["compile_to_first"] for r in reports),
            "built": sum(r["built"] for r in reports), "ranks": reports,
            "error": max(errors) if errors else None}


def _store_bytes(paths: list[Path]) -> int:
    from cachebuild.store import LocalStore

    total = 0
    for path in paths:
        with LocalStore(path) as store:
            total += sum(r.size for r in store.records())
    return total


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    n = args.world_size
    env = {"LLAMA_DEVICE": args.device, "LLAMA_BACKEND": args.backend,
           "LLAMA_FLAVOUR": args.flavour}
    if args.dist_backend:
        env["LLAMA_DIST_BACKEND"] = args.dist_backend
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        root = Path(tmp)
        # The probe's verdicts where every rank reads them (this process included: the
        # variable wins over any folder it is given).
        env["CACHEBUILD_PROBE_DIR"] = os.environ["CACHEBUILD_PROBE_DIR"] = str(root / "probe")
        # Bytecode for what a rank imports, written before any row is timed (a machine
        # without .pyc files would charge them to the first row).
        subprocess.run([sys.executable, "-c", "import torch._dynamo, torch._inductor.compile_fx, "
                        "torch.distributed, cachebuild.building.build, cachebuild.serving.runtime"], check=True)
        if args.backend == "inductor":
            # The probe (which C++ compiler makes AOTI libraries that load) runs once per
            # machine, not per build: run it up front so that no row pays for it.
            from cachebuild.backends.probe import verdict

            verdict("cuda:0" if args.device.startswith("cuda") else "cpu", root / "probe")
        one = root / "one"
        rows = {
            "one_cold": _run(n, [one], env, root, fake=True),
            "group_cold": _run(n, [root / "group"] * n, env, root),
            "private_cold": _run(n, [root / f"rank{r}" for r in range(n)], env, root),
            "group_warm": _run(n, [root / "group"] * n, env, root),
            "one_warm": _run(n, [one], env, root, fake=True),
        }
        sizes = {"one": _store_bytes([one]), "group": _store_bytes([root / "group"]),
                 "private": _store_bytes([root / f"rank{r}" for r in range(n)])}
    knobs = {k: v for k, v in os.environ.items() if k.startswith("LLAMA_")}
    return {"date": datetime.date.today().isoformat(), "machine": cpu_model(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "world_size": n, "device": args.device, "backend": args.backend,
            "flavour": args.flavour, "knobs": knobs,
            "dist_backend": args.dist_backend or ("nccl" if args.device.startswith("cuda") else "gloo"), "rows": rows, "bytes": sizes,
            "command": "python tools/bench_tp.py " + " ".join(sys.argv[1:])}


def show(result: dict[str, Any], markdown: bool) -> None:
    rows = result["rows"]
    n = result["world_size"]
    one_cold, one_warm = rows["one_cold"]["seconds"], rows["one_warm"]["seconds"]
    labels = [("one_cold", "one rank cold (fake process group)", one_cold),
              ("group_cold", f"group of {n} cold, one store", one_cold),
              ("private_cold", f"group of {n} cold, a store per rank", one_cold),
              ("one_warm", "one rank warm", one_warm),
              ("group_warm", f"group of {n} warm", one_warm)]
    table = []
    for key, label, base in labels:
        r = rows[key]
        error = "-" if r.get("error") is None else f"{r['error']:.1e}"
        table.append([label, f"{r['seconds']:.1f}", f"{r['compile_to_first']:.2f}",
                      str(r["built"]), f"{r['seconds'] / base:.2f}x", error])
    print(f"{result['date']}, {result['machine']} ({result['cores']} cores"
          f"{', ' + result['gpu'] if result.get('gpu') else ''}), Python {result['python']}, "
          f"torch {result['torch']}; {result['backend']} ({result['flavour']}), "
          f"{result['device']}, {result.get('dist_backend', '')}; {result['command']}")
    for line in render_table(["start", "spawn to first output (s)", "compile call to first "
                              "output (s)", "targets built", "vs one rank",
                              "max error vs unsharded"], table, markdown):
        print(line)
    b = result["bytes"]
    print(f"bytes in the store: one rank {b['one']}, group of {n} on one store {b['group']} "
          f"({b['group'] / b['one']:.2f}x), a store per rank {b['private']} "
          f"({b['private'] / b['one']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="cpu",
                        help="cpu (gloo), cuda (NCCL, rank r on cuda:r) or cuda:0 (every rank "
                             "on GPU 0: with --dist-backend gloo)")
    parser.add_argument("--dist-backend", choices=["nccl", "gloo"], default=None,
                        help="the process group's backend (default: NCCL on CUDA, gloo on CPU)")
    parser.add_argument("--backend", default="eager_fusion", choices=["eager_fusion", "inductor"])
    parser.add_argument("--flavour", default="auto", choices=["auto", "aoti", "standalone"])
    add_output_options(parser)
    args = parser.parse_args()
    present(args, lambda: measure(args), show)


if __name__ == "__main__":
    main()
