"""What holding a model's guards on every call costs, against a 1-token decode step.

``cachebuild.compile`` checks, before every call, that the values its trace read (about
2,000 for a 22-layer Llama) are unchanged (``cachebuild/tracing/guard_watch.py``). This measures,
on a warm process serving ``examples/generate.py``'s paged Llama:

- ``check``: the per-call check alone (``runtime.mismatches``: the guards, and which
  weights are one tensor), mean over many calls;
- ``step``: a decode step at batch 1, 8 and 32 through the compiled module (check
  included), median over ``--steps`` calls (CUDA events on a GPU);
- ``step_unchecked``: the same step through the runtime directly (no check);
- the ratio check / step (the goal: under 1% of a 1-token step with full graphs on a GPU).

Defaults: on CUDA 22 layers (the TinyLlama shape), bf16, full graphs; on CPU 2 layers, no
graphs. The backend is ``eager_fusion`` unless ``--backend`` says (the check does not
depend on it; the step does). The store is a fresh temporary one.

    python tools/bench_guards.py [--device cuda] [--layers 22] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--backend", default="eager_fusion")
    parser.add_argument("--graphs", default=None, help="full, piecewise or none")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    layers = args.layers or (22 if cuda else 2)
    os.environ.update({"LLAMA_DEVICE": args.device, "LLAMA_LAYERS": str(layers),
                       "LLAMA_BACKEND": args.backend,
                       "GEN_GRAPHS": args.graphs or ("full" if cuda else "none"),
                       "GEN_CAPTURE": args.batches})
    if cuda:
        os.environ.update({"LLAMA_HIDDEN": "2048", "LLAMA_HEADS": "32", "LLAMA_KV_HEADS": "4",
                           "LLAMA_MLP": "5632", "LLAMA_VOCAB": "32000"})
    os.environ.setdefault("CACHEBUILD_DIR", tempfile.mkdtemp(prefix="cachebuild-guards-"))
    sys.path.insert(0, str(ROOT / "examples"))
    import generate
    import torch

    import cachebuild
    from cachebuild import compat

    torch.manual_seed(0)
    spec = generate.build()
    config = spec.config
    compiled = cachebuild.compile(spec.model, config=config, dynamic_dims=spec.dynamic_dims)
    model = spec.model
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "layers": layers,
        "torch": torch.__version__, "python": sys.version.split()[0],
        "graphs": config.cudagraph_mode, "backend": args.backend,
        "watch": type(compat.dict_watcher()).__name__, "date": time.strftime("%Y-%m-%d"),
        "batches": {}}
    with torch.no_grad():
        compiled(*spec.example_inputs)
        compiled.wait_captured()
        runtime = compiled.runtime
        guards = runtime.guards
        report["records"] = len(guards.guards)
        for batch in (int(b) for b in args.batches.split(",")):
            inputs = generate.example_inputs(model, tokens=batch)
            for _ in range(3):  # captured at its first call where the policy is lazy
                compiled(*inputs)
            compiled.wait_captured()
            n = 20000
            start = time.perf_counter()
            for _ in range(n):
                runtime.mismatches(model, inputs)
            check = (time.perf_counter() - start) / n
            step = _step(lambda inputs=inputs: compiled(*inputs), args.steps, cuda)
            bare = _step(lambda inputs=inputs: runtime(*inputs), args.steps, cuda)
            report["batches"][batch] = {
                "check_us": check * 1e6, "step_ms": step * 1e3, "step_unchecked_ms": bare * 1e3,
                "check_over_step_pct": 100 * check / step}
        replayers = compiled.runtime.replayers()
        report["graph_replays"] = sum(getattr(r, "replays", 0) for r in replayers)
        report["graph_misses"] = sum(getattr(r, "misses", 0) for r in replayers)
        report["read_per_call"] = guards.read_per_call
        report["full_checks"] = guards.full_checks
    print(json.dumps(report, indent=1))
    for batch, row in report["batches"].items():
        print(f"batch {batch:>3}: check {row['check_us']:.2f} us, step {row['step_ms']:.3f} ms "
              f"(unchecked {row['step_unchecked_ms']:.3f} ms): {row['check_over_step_pct']:.2f}%")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))


def _step(call, steps: int, cuda: bool) -> float:
    """Median seconds of ``call()``, CUDA events around it on a GPU."""
    import torch

    times = []
    for _ in range(steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            call()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
