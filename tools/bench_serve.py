"""The whole warm start of a server on a GPU, side by side (the GPU headline benchmark).

Each mode runs in a fresh process that does what a server does: import, build the model
(examples/llama.py, TinyLlama-shaped by default: hidden 2048, 22 layers, 32 heads, 4 KV
heads, MLP 5632, bf16), compile, capture CUDA graphs for the 51 default sizes, serve.

- ``eager``: no compile; the eager forward captured as full CUDA graphs;
- ``torch_cold`` / ``torch_warm``: ``torch.compile(model, fullgraph=True)`` with the
  token dim dynamic, an empty / a warm Inductor cache; graphs captured the same way;
- ``aot_load``: torch's AOT precompile (``aot_compile`` + ``save_compiled_function``,
  made in a preparation process), loaded by ``torch.compiler.load_compiled_function``;
- ``cb_cold``: ``cachebuild warm`` then the server with the store it filled (both timed);
- ``cb_warm``: the server again, with ``cachebuild.preload()`` before the model is built;
- ``cb_profile``: ``cb_warm`` under cProfile, loading in the calling thread: where the
  compile call → first output goes, and where the CPU time of 200 replays at 1 token goes
  (written next to ``--json-out``; its timings are inflated by the profiler).

Before the modes, one throwaway process fills a shared bytecode cache
(``PYTHONPYCACHEPREFIX``), so that no mode compiles torch's Python sources, as none would on
an install that carries its ``.pyc`` files.

Per mode the timeline (seconds from process start): import done, model built, first
output (and "compile call → first output"), capture of 51 sizes, ready to serve; and
replay latency (median of CUDA events) at 1 and 512 tokens. Every output is checked
against eager at bf16 tolerance.

    python tools/bench_serve.py [--layers 22] [--graph-mode piecewise] [--markdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES_NOTE = "51 default capture sizes (1, 2, 4, 8..248 by 8, 256..512 by 16)"


def _profiled(profile_to: Path | None) -> Any:
    """A context manager: cProfile into ``profile_to`` (top 45 by cumulative and own time)."""
    import contextlib

    @contextlib.contextmanager
    def run() -> Any:
        if profile_to is None:
            yield
            return
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            text = io.StringIO()
            for order in ("cumulative", "tottime"):
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(45)
            profile_to.write_text(text.getvalue())

    return run()


def child(mode: str, work: Path, graph_mode: str, started: float,
          profile: Path | None = None) -> dict[str, Any]:
    """One server start in this process; returns its timeline."""
    t: dict[str, Any] = {}
    if mode == "cb_profile":
        os.environ["CACHEBUILD_LOAD_THREADS"] = "1"  # loads on this thread, where cProfile looks
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import llama

    import cachebuild
    from cachebuild.config import default_capture_sizes
    from cachebuild.graphs import CudaGraphCapture, GraphedCallable

    if mode in ("cb_warm", "cb_profile"):
        cachebuild.preload()
    t["import"] = time.time() - started
    torch.manual_seed(0)
    model = llama.make_model()
    torch.cuda.synchronize()
    t["model_built"] = time.time() - started
    ids, pos = llama.example_inputs(model, 8)
    dyn = {0: 0, 1: 0}
    call_start = time.time()
    with torch.no_grad():
        if mode == "eager":
            fn = model
        elif mode in ("torch_cold", "torch_warm"):
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
            fn = torch.compile(model, fullgraph=True)
        elif mode == "aot_load":
            with open(work / "aot.bin", "rb") as f:
                loaded = torch.compiler.load_compiled_function(f)

            def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return loaded(model, a, b)
        else:
            cfg = dataclasses.replace(llama.config(), cudagraph_mode="none")
            fn = cachebuild.compile(model, cfg, dyn)
        with _profiled(profile and profile.with_name(profile.name + ".load.txt")):
            out = fn(ids, pos)
        torch.cuda.synchronize()
        t["first_output"] = time.time() - started
        t["compile_to_first_output"] = time.time() - call_start
        torch.testing.assert_close(out, model(ids, pos), rtol=3e-2, atol=5e-2)

        # Capture: full graphs of whatever the mode serves with, largest size first.
        cap_start = time.time()
        capture = CudaGraphCapture("cuda")
        sizes = sorted(default_capture_sizes(), reverse=True)
        if mode.startswith("cb"):
            # The same entry and targets (run-time policies are not in the key), now with
            # graphs captured by cachebuild itself.
            cfg = dataclasses.replace(llama.config(), cudagraph_mode=graph_mode)
            served = cachebuild.compile(model, cfg, dyn)
            served(ids, pos)
            t["capture_included_load"] = True
        else:
            served = GraphedCallable(fn, lambda a: a[0].shape[0], [False, False], capture,
                                     capturing=True)
            for n in sizes:
                served(*llama.example_inputs(model, n))
            served.capturing = False
        torch.cuda.synchronize()
        t["capture"] = time.time() - cap_start
        t["ready"] = time.time() - started
        worst = 0.0
        for n in (1, 7, 512):
            a, b = llama.example_inputs(model, n)
            o = served(a, b).clone()
            r = model(a, b)
            torch.testing.assert_close(o, r, rtol=3e-2, atol=5e-2)
            worst = max(worst, (o.float() - r.float()).abs().max().item())
        t["worst_abs_err"] = worst
        for n in (1, 512):
            a, b = llama.example_inputs(model, n)
            times = []
            for _ in range(20):
                served(a, b)
            torch.cuda.synchronize()
            for _ in range(100):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                served(a, b)
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            t[f"replay_ms_{n}"] = sorted(times)[len(times) // 2]
        if profile is not None:
            a, b = llama.example_inputs(model, 1)
            with _profiled(profile.with_name(profile.name + ".replay1.txt")):
                for _ in range(200):
                    served(a, b)
                torch.cuda.synchronize()
    t["stats"] = cachebuild.stats() if mode.startswith("cb") else None
    return t


def prepare_aot(work: Path) -> str | None:
    """Make the AOT precompile artifact in its own process; None or why it failed."""
    code = (
        "import sys, torch; sys.path.insert(0, {!r}); import llama\n"
        "torch.manual_seed(0); m = llama.make_model(); ids, pos = llama.example_inputs(m, 8)\n"
        "torch._dynamo.mark_dynamic(ids, 0); torch._dynamo.mark_dynamic(pos, 0)\n"
        "c = torch.compile(m.forward, fullgraph=True, dynamic=True)\n"
        "with torch.no_grad(): f = c.aot_compile(((ids, pos), {{}}))\n"
        "f.save_compiled_function({!r})\n"
    ).format(str(ROOT / "examples"), str(work / "aot.bin"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]
    return None


PRIME = """
import sys, torch
sys.path.insert(0, {examples!r})
import llama, cachebuild
import torch._inductor.compile_fx
from torch._inductor import CompiledArtifact, standalone_compile
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).to("cuda")
torch.compile(m)(torch.randn(8, 64, device="cuda"))
"""


def prime_bytecode(env: dict[str, str]) -> float:
    """Fill the bytecode cache (``PYTHONPYCACHEPREFIX``) that every mode then reads.

    An installed torch normally carries its ``.pyc`` files (pip compiles at install);
    an install without them makes every process compile torch's sources again, seconds
    that no mode would pay on a normal install. One throwaway process that imports and
    compiles a tiny model writes them for all.
    """
    start = time.time()
    code = PRIME.format(examples=str(ROOT / "examples"))
    subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True)
    return time.time() - start


def run_mode(mode: str, work: Path, env: dict[str, str], graph_mode: str,
             profile: Path | None = None) -> dict[str, Any]:
    started = time.time()
    extra = ["--profile", str(profile)] if profile is not None else []
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--work", str(work),
                           "--graph-mode", graph_mode, "--started", repr(started), *extra],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--graph-mode", choices=["piecewise", "full"], default="piecewise",
                   help="how cachebuild captures graphs (default: piecewise)")
    p.add_argument("--modes", default="eager,torch_cold,torch_warm,aot_load,cb_cold,cb_warm")
    p.add_argument("--json-out", type=Path, help="write all results here as JSON")
    p.add_argument("--variants", nargs="?", const="mode,depth,sizes", default="",
                   help="also cachebuild warm: 'mode' in the other graph mode, 'depth' at twice "
                        "the layers, 'sizes' with 8 exact compile sizes besides the range "
                        "(comma-separated; alone: all three)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--started", type=float, help=argparse.SUPPRESS)
    p.add_argument("--profile", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.work, args.graph_mode, args.started,
                               args.profile)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": str(args.layers),
           "LLAMA_HIDDEN": str(args.hidden), "LLAMA_HEADS": "32", "LLAMA_KV_HEADS": "4",
           "LLAMA_MLP": str(args.hidden * 11 // 4), "LLAMA_VOCAB": "32000",
           "CACHEBUILD_DIR": str(work / "store"), "PYTHONUNBUFFERED": "1",
           "PYTHONPYCACHEPREFIX": str(work / "pycache"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-prime")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # else the cache stays empty
    print(f"bytecode cache primed in {prime_bytecode(env):.1f} s", flush=True)
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        if mode in ("torch_cold", "aot_load"):
            env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{mode}")
        if mode == "torch_warm":
            env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-torch_cold")
        if mode.startswith("cb"):
            env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cb")
        if mode == "aot_load":
            why = prepare_aot(work)
            if why:
                results[mode] = {"error": f"AOT precompile failed: {why}"}
                print(mode, results[mode], flush=True)
                continue
        if mode == "cb_cold":
            start = time.time()
            proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "warm",
                                   str(ROOT / "examples" / "llama.py")],
                                  capture_output=True, text=True, env=env)
            warm_s = time.time() - start
            if proc.returncode != 0:
                results[mode] = {"error": proc.stderr.strip().splitlines()[-1][:300]}
                continue
        profile = None
        if mode == "cb_profile":
            profile = (args.json_out or work / "serve.json").with_name("profile")
        results[mode] = run_mode(mode, work, env, args.graph_mode, profile)
        if mode == "cb_cold" and "error" not in results[mode]:
            results[mode]["cachebuild_warm_s"] = warm_s
        print(mode, json.dumps(results[mode]), flush=True)
        if args.json_out:  # after every mode: a run cut short keeps what it measured
            args.json_out.write_text(json.dumps(results, indent=1))
    if args.variants:
        other = "full" if args.graph_mode == "piecewise" else "piecewise"
        variants = {"mode": (f"cb_warm_{other}", {}, other),
                    "depth": (f"cb_warm_{2 * args.layers}_layers",
                              {"LLAMA_LAYERS": str(2 * args.layers)}, args.graph_mode),
                    "sizes": ("cb_warm_8_sizes", {"LLAMA_COMPILE_SIZES": "1,2,4,8,16,32,64,128"},
                              args.graph_mode)}
        chosen = [variants[v] for v in args.variants.split(",") if v]
        for name, extra, graph_mode in chosen:
            venv = {**env, **extra}
            proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "warm",
                                   str(ROOT / "examples" / "llama.py")],
                                  capture_output=True, text=True, env=venv)
            if proc.returncode != 0:
                results[name] = {"error": proc.stderr.strip().splitlines()[-1][:300]}
            else:
                results[name] = run_mode("cb_warm", work, venv, graph_mode)
            print(name, json.dumps(results[name]), flush=True)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1))
    keys = ["import", "model_built", "compile_to_first_output", "capture", "ready",
            "replay_ms_1", "replay_ms_512"]
    print("| mode | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for mode, r in results.items():
        cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys]
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
