"""What the correctness checks cost: build-time verification and the guard check.

Two figures, on a transformers Llama built from a small config with random weights (the
test suite's ``hf_families`` configs, ``--layers`` deep):

- **verification share**: each flavour builds the model in a fresh process and a fresh
  store; the share is the time spent proving the new targets against their pieces
  (``seconds["verify"]``) over that plus the build itself (``seconds["build"]``);
- **guard check**: the values the trace read, checked on the live model: in a fresh
  process at its warm start (``seconds["guards"]``: decoding the entry's guards included),
  and steady in one process (the best of ``--repeat`` checks).

Every compiled output is checked against eager. ``python tools/bench_checks.py
[--layers 2] [--flavours eager_fusion,aoti,standalone] [--markdown | --json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchlib import add_output_options, cpu_model, present, render_table

ROOT = Path(__file__).resolve().parent.parent

#: Runs in a fresh process: compiles LAYERS-deep Llama with BACKEND/FLAVOUR on STORE, runs
#: every size of the family against eager, prints this process's counters.
CHILD = """
import json, os

import torch

import cachebuild
import hf_families as H
from cachebuild.store import LocalStore

family = H.FAMILIES["llama"]
model = family.model(num_hidden_layers=int(os.environ["LAYERS"]))
config = H.compile_config(family, os.environ["BACKEND"], os.environ["FLAVOUR"])
compiled = cachebuild.compile(model, config, {0: 0}, store=LocalStore(os.environ["STORE"]))
with torch.no_grad():
    for size in family.sizes:
        H.assert_close(compiled(*H.ids(size)), model(*H.ids(size)))
print(json.dumps(cachebuild.stats()))
"""

FLAVOURS = {"eager_fusion": ("eager_fusion", "auto"), "aoti": ("inductor", "aoti"),
            "standalone": ("inductor", "standalone")}


def child(layers: int, flavour: str, store: Path) -> dict[str, Any]:
    backend, kind = FLAVOURS[flavour]
    env = {**os.environ, "LAYERS": str(layers), "BACKEND": backend, "FLAVOUR": kind,
           "STORE": str(store), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"),
                                                               os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        sys.exit(f"error: {flavour} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def steady_guard_check(layers: int, repeat: int) -> tuple[int, float]:
    """(number of guards, best seconds for one check of them all) in this process."""
    sys.path.insert(0, str(ROOT / "tests"))
    import hf_families as H

    from cachebuild.tracing.guards import GuardSet
    from cachebuild.tracing.trace import trace_model

    model = H.FAMILIES["llama"].model(num_hidden_layers=layers)
    args = H.ids(8)
    traced = trace_model(model, args, {0: 0}, (H.RANGE,))
    guards = GuardSet.from_data([g.to_data() for g in traced.guards])
    if guards.mismatches(model, args):
        sys.exit("error: the traced guards do not hold on the model they were traced on")
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        guards.values(model, args)
        best = min(best, time.perf_counter() - start)
    return len(guards), best


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    rows = []
    for flavour in args.flavours.split(","):
        with tempfile.TemporaryDirectory(prefix="cachebuild-bench-") as folder:
            built = child(args.layers, flavour, Path(folder))
            warm = child(args.layers, flavour, Path(folder))
        if warm["built"] or not built["built"]:
            sys.exit(f"error: {flavour}: the second process built {warm['built']} targets")
        seconds = built["seconds"]
        rows.append({"flavour": flavour, "targets": built["built"],
                     "build_s": seconds.get("build", 0.0), "verify_s": seconds.get("verify", 0.0),
                     "first_guard_check_s": warm["seconds"].get("guards", 0.0)})
        print(f"{flavour}: built {built['built']} targets", file=sys.stderr)
    count, steady = steady_guard_check(args.layers, args.repeat)
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "cpu": cpu_model(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "layers": args.layers, "rows": rows,
            "guards": count, "steady_guard_check_s": steady}


def show(result: dict[str, Any], markdown: bool) -> None:
    print(f"{result['date']}, {result['cpu']} ({result['cores']} cores), torch "
          f"{result['torch']}, Python {result['python']}; transformers Llama, "
          f"{result['layers']} layers")
    head = ["flavour", "targets", "build s", "verify s", "verify share",
            "guard check, fresh process (ms)"]
    rows = [[r["flavour"], str(r["targets"]), f"{r['build_s']:.2f}", f"{r['verify_s']:.3f}",
             f"{100 * r['verify_s'] / (r['build_s'] + r['verify_s']):.2f}%",
             f"{1000 * r['first_guard_check_s']:.2f}"] for r in result["rows"]]
    print("\n".join(render_table(head, rows, markdown)))
    print(f"steady guard check: {result['guards']} guards in "
          f"{1000 * result['steady_guard_check_s']:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--flavours", default="eager_fusion,aoti,standalone",
                        help="comma-separated: eager_fusion, aoti, standalone")
    parser.add_argument("--repeat", type=int, default=50,
                        help="steady guard checks timed, the best kept (default 50)")
    add_output_options(parser)
    args = parser.parse_args()
    present(args, lambda: measure(args), show)


if __name__ == "__main__":
    main()
