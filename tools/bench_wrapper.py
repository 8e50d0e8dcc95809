"""What AOTInductor's C++ options cost at build and at run: cheaper wrapper builds.

``examples/llama.py`` scaled for CPU (as ``tools/bench_build.py``; ``--device cuda``: at
TinyLlama's shape in bf16), flavour ``aoti``, built once per variant of Inductor's options
(``CompileConfig.inductor_options``, so each variant has keys of its own) into an empty
store and an empty work folder, one target at a time (``cachebuild.warm(jobs=1)``), in a
fresh process; each built target's phases come from the build clock and are summed. Then
a second fresh process loads the model from that store (compile call to first output) and
times the forward, best of ``--reps`` calls at 1 and 32 tokens, checked against eager.

Variants (``--variants``, default all):

- ``default``: Inductor's own (wrapper at ``-O1``, precompiled AOTI headers, line tables
  and frame pointers);
- ``wrapper_O0``: ``aot_inductor.compile_wrapper_opt_level = "O0"``;
- ``no_line_tables``: ``aot_inductor.enable_line_tables = False``;
- ``no_pch``: ``aot_inductor.precompile_headers = False``.

A variant is worth taking when its build is faster and its load and forward are not
slower. Usage::

    python tools/bench_wrapper.py [--variants default wrapper_O0] [--layers 2] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_build import GPU_SIZE_ENV, SIZE_ENV, log, start
from benchlib import add_output_options, present, render_table

ROOT = Path(__file__).resolve().parent.parent

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "wrapper_O0": {"aot_inductor.compile_wrapper_opt_level": "O0"},
    "no_line_tables": {"aot_inductor.enable_line_tables": False},
    "no_pch": {"aot_inductor.precompile_headers": False},
}


def child(step: str, variant: str, store_dir: str, reps: int) -> None:
    """``build`` or ``run`` one variant in this (fresh) process; one JSON line."""
    import dataclasses

    import torch

    sys.path.insert(0, str(ROOT))
    import cachebuild
    import examples.llama as llama
    from cachebuild.store import LocalStore

    torch.manual_seed(0)
    model = llama.make_model()
    config = dataclasses.replace(llama.config(), flavour="aoti",
                                 inductor_options=VARIANTS[variant])
    store = LocalStore(store_dir)
    if step == "build":
        from cachebuild.warming import warm

        spec = cachebuild.ModelSpec(model, llama.example_inputs(model), {0: 0, 1: 0}, config)
        t0 = time.perf_counter()
        report = warm(spec, store=store, jobs=1)
        phases: dict[str, float] = {}
        for target in report.built:
            for name, value in target.phases.items():
                phases[name] = phases.get(name, 0.0) + value
        print(json.dumps({"seconds": time.perf_counter() - t0, "built": len(report.built),
                          "failed": [t.error for t in report.failed], "phases": phases,
                          "model_phases": dict(report.phases)}))
        return
    t0 = time.perf_counter()
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    out = {}
    with torch.no_grad():
        ids, pos = llama.example_inputs(model, tokens=32)
        first = compiled(ids, pos)
        out["load_s"] = time.perf_counter() - t0
        ref = model(ids, pos)
        tol = 3e-2 if ref.dtype == torch.bfloat16 else 1e-3
        out["matches"] = bool(torch.allclose(first.float(), ref.float(), rtol=tol, atol=tol))
        for tokens in (1, 32):
            ids, pos = llama.example_inputs(model, tokens=tokens)
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                compiled(ids, pos)
                if first.is_cuda:
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            out[f"forward_{tokens}_ms"] = best * 1000
    out["built"] = cachebuild.stats()["built"]
    print(json.dumps(out))


def run_child(step: str, variant: str, store: Path, inductor: Path, layers: int, reps: int,
              size: dict[str, str]) -> dict[str, Any]:
    env = dict(os.environ, **size, LLAMA_LAYERS=str(layers),
               TORCHINDUCTOR_CACHE_DIR=str(inductor),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", step,
                           variant, str(store), str(reps)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}",
                "stderr_tail": proc.stderr.strip().splitlines()[-12:]}
    return json.loads(lines[-1])


CXX = ("cxx_headers", "cxx_isa", "cxx_wrapper", "cxx_kernels", "cxx_link")


def show(result: dict[str, Any], markdown: bool) -> None:
    info = result["machine"]
    print(f"{info['date']}; {info['nproc']} x {info['cpu']}; torch {info['torch']}; "
          f"{result['layers']} layers; " + ", ".join(f"{k}={v}" for k, v in result["size"].items()))
    rows = []
    for name, r in result["variants"].items():
        b, run = r["build"], r["run"]
        if "error" in b or "error" in run:
            rows.append([name, "error", "", "", "", "", "", ""])
            continue
        p = b["phases"]
        rows.append([name, f"{b['seconds']:.1f}", f"{sum(p.get(k, 0) for k in CXX):.1f}",
                     f"{p.get('cxx_wrapper', 0):.1f}", f"{p.get('lowering', 0):.1f}",
                     f"{run['load_s']:.2f}", f"{run['forward_1_ms']:.2f} / "
                     f"{run['forward_32_ms']:.2f}", "yes" if run["matches"] else "NO"])
    head = ["variant", "warm -j 1 (s)", "C++ total (s)", "C++ wrapper (s)", "lowering (s)",
            "load to first output (s)", "forward 1 / 32 tokens (ms)", "matches eager"]
    print("\n".join(render_table(head, rows, markdown)))
    print("C++ total: headers, ISA checks, wrapper, kernels and link, summed over the "
          "targets built; forward: best of the timed calls, loaded from the store.")
    for name, r in result["variants"].items():
        for step in ("build", "run"):
            if "error" in r[step]:
                print(f"error, {name} {step}: {r[step]['error']}\n  "
                      + "\n  ".join(r[step].get("stderr_tail", [])))


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=50, help="forward calls timed (best of)")
    parser.add_argument("--device", default="cpu")
    add_output_options(parser)
    args = parser.parse_args()
    size = dict(GPU_SIZE_ENV, LLAMA_DEVICE=args.device) if args.device.startswith("cuda") \
        else dict(SIZE_ENV)

    def measure() -> dict[str, Any]:
        variants = {}
        with tempfile.TemporaryDirectory(prefix="bench-wrapper-") as tmp:
            info = start(args.device, Path(tmp))  # bytecode and probe, once, for every child
            for name in args.variants:
                store, ind = Path(tmp) / f"{name}-store", Path(tmp) / f"{name}-inductor"
                built = run_child("build", name, store, ind, args.layers, args.reps, size)
                ran = run_child("run", name, store, Path(tmp) / f"{name}-inductor2",
                                args.layers, args.reps, size)
                log(f"  {name}: build {built}, run {ran}")
                variants[name] = {"build": built, "run": ran}
        return {"machine": info, "layers": args.layers, "size": size, "variants": variants}

    present(args, measure, show)


if __name__ == "__main__":
    main()
