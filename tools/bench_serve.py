"""The whole warm start of a server on a GPU, side by side (the GPU headline benchmark).

Each mode runs in a fresh process that does what a server does: import, build the model
(examples/llama.py, TinyLlama-shaped by default: hidden 2048, 22 layers, 32 heads, 4 KV
heads, MLP 5632, bf16), compile, capture CUDA graphs for the 51 default sizes, serve.

- ``eager``: no compile; the eager forward captured as full CUDA graphs, one per size,
  largest first into one pool, each size run twice before its capture (first and second
  run timed apart: what a first run at a new shape costs);
- ``torch_cold`` / ``torch_warm``: ``torch.compile(model, fullgraph=True)`` with the
  token dim dynamic, an empty / a warm Inductor cache; graphs captured the same way;
- ``aot_load``: torch's AOT precompile, loaded by ``torch.compiler.load_compiled_function``
  (where this torch has it);
- ``cb_build_<flavour>``: ``cachebuild warm`` on an empty store (the cold build, timed);
- ``cb_cold_<flavour>``: a server on an empty store of its own: it builds in-process (the
  "building process"), then captures and replays;
- ``cb_warm_<flavour>``: a server on the store ``cb_build_<flavour>`` filled, with the
  graph mode and capture policy given (``cb_warm_aoti/full+lazy``; default
  ``--graph-mode piecewise``, ``--capture background``). The ``aoti`` flavour calls no
  ``cachebuild.preload()`` (what a user who has not read the README does); ``standalone``
  does, as the README says;
- ``cb_profile``: ``cb_warm_aoti`` under cProfile, loading in the calling thread (written
  next to ``--json-out``; its timings are inflated by the profiler).

Before the modes, one throwaway process fills a shared bytecode cache
(``PYTHONPYCACHEPREFIX``), so that no mode compiles torch's Python sources, as none would on
an install that carries its ``.pyc`` files; then the AOTI toolchain probe runs once.

Per mode the timeline (seconds from process start): import done, model built, first
output (and "compile call → first output"), capture of the 51 default sizes (for
cachebuild: until every size is served from graphs, whatever the policy; a ``lazy`` mode
calls each size once), ready to serve (every size from graphs), the graph pool's size and
the static buffers'; replay latency (median of CUDA events) at 1 and 512 tokens. Every
output is checked against eager at bf16 tolerance. Also recorded: which compiler modules
the process imported, which threads are alive when it serves, and per size the first and
second run (eager, torch.compile) or the capture pass (cachebuild).

    python tools/bench_serve.py [--layers 22] [--graph-mode piecewise] [--capture background]
                                [--modes ...]
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

from benchlib import primed

ROOT = Path(__file__).resolve().parent.parent
SIZES_NOTE = "51 default capture sizes (1, 2, 4, 8..248 by 8, 256..512 by 16)"
DEFAULT_MODES = ("eager,torch_cold,torch_warm,cb_build_aoti,cb_warm_aoti,cb_warm_aoti/full,"
                 "cb_warm_aoti+eager,cb_warm_aoti/full+eager,cb_warm_aoti+lazy")


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


def _replay_ms(served: Any, example_inputs: Any, model: Any) -> dict[str, float]:
    """Median replay latency (CUDA events, 100 calls after 20) at 1 and 512 tokens, and
    this process's CPU time per call (more wall than CPU time: the CPU was shared)."""
    import torch

    out = {}
    for n in (1, 512):
        a, b = example_inputs(model, n)
        times = []
        for _ in range(20):
            served(a, b)
        torch.cuda.synchronize()
        cpu = time.process_time()
        for _ in range(100):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            served(a, b)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        out[f"replay_ms_{n}"] = sorted(times)[len(times) // 2]
        out[f"cpu_ms_{n}"] = (time.process_time() - cpu) * 10  # per call (100 calls)
    return out


def _replays(served: Any) -> int:
    """Graph replays so far (calls served from graphs: a fall-back to uncaptured runs
    shows)."""
    runtime = getattr(served, "runtime", None)
    if runtime is not None:
        return sum(r.replays for r in runtime.capturer.ready.values())
    return served.replays()


def _check(served: Any, model: Any, example_inputs: Any) -> float:
    """Outputs at 1, 7 and 512 tokens against eager (bf16 tolerance); the worst error."""
    import torch

    worst = 0.0
    for n in (1, 7, 512):
        a, b = example_inputs(model, n)
        o = served(a, b).clone()
        r = model(a, b)
        torch.testing.assert_close(o, r, rtol=3e-2, atol=5e-2)
        worst = max(worst, (o.float() - r.float()).abs().max().item())
    return worst


def parse_mode(mode: str, graph_mode: str, policy: str) -> tuple[str, str, str]:
    """``cb_warm_aoti/full+lazy`` → (``cb_warm_aoti``, ``full``, ``lazy``); the defaults
    where a suffix is left out."""
    name, _, given_policy = mode.partition("+")
    base, _, given_mode = name.partition("/")
    return base, given_mode or graph_mode, given_policy or policy


def capture_full_graphs(fn: Any, model: Any, example_inputs: Any, sizes: list[int]
                        ) -> tuple[Any, dict[str, Any]]:
    """What a server without cachebuild does: ``fn`` captured as one CUDA graph per size,
    largest first, into one pool; each size run twice before its capture (the first run
    and the second timed apart: what a first run at a new shape costs). The served
    callable and the capture's figures."""
    import torch

    from cachebuild.serving.cudagraphs import CudaGraphCapture, Replayer

    api = CudaGraphCapture("cuda")
    stream = torch.cuda.Stream()
    before = torch.cuda.memory_allocated()
    graphs, first, second = {}, {}, {}
    start = time.time()
    for n in sorted(sizes, reverse=True):
        a, b = example_inputs(model, n)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for runs in (first, second):
                t0 = time.perf_counter()
                fn(a, b)
                torch.cuda.synchronize()
                runs[n] = time.perf_counter() - t0
            graph, out = api.capture(fn, (a, b))
        torch.cuda.current_stream().wait_stream(stream)
        graphs[n] = Replayer(api, graph, out, fn, copies=[(0, a), (1, b)])
    torch.cuda.synchronize()
    figures = {"capture": time.time() - start, "graphs_captured": api.graphs,
               "capture_split": {"first_runs": sum(first.values()),
                                 "second_runs": sum(second.values()), **api.seconds},
               "first_run_ms": {n: round(v * 1e3, 2) for n, v in sorted(first.items())},
               "second_run_ms": {n: round(v * 1e3, 2) for n, v in sorted(second.items())},
               "pool_bytes": api.pool_bytes(),
               "memory_bytes": torch.cuda.memory_allocated() - before}

    def served(x: Any, y: Any) -> Any:
        graph = graphs.get(x.shape[0])
        return graph(x, y) if graph is not None else fn(x, y)

    served.replays = lambda: sum(g.replays for g in graphs.values())  # type: ignore[attr-defined]
    return served, figures


def child(mode: str, work: Path, graph_mode: str, policy: str, started: float,
          profile: Path | None = None) -> dict[str, Any]:
    """One server start in this process; returns its timeline."""
    t: dict[str, Any] = {"loadavg_at_start": os.getloadavg()}
    if mode == "cb_profile":
        os.environ["CACHEBUILD_LOAD_THREADS"] = "1"  # loads on this thread, where cProfile looks
    import threading

    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import llama

    import cachebuild
    from cachebuild.config import default_capture_sizes

    flavour = mode.rsplit("_", 1)[-1] if mode.startswith("cb_") else None
    if mode == "cb_warm_standalone":
        cachebuild.preload()
    t["import"] = time.time() - started
    torch.manual_seed(0)
    model = llama.make_model()
    torch.cuda.synchronize()
    t["model_built"] = time.time() - started
    ids, pos = llama.example_inputs(model, 8)
    dyn = {0: 0, 1: 0}
    sizes = list(default_capture_sizes())

    def cb_config(cudagraph_mode: str, capture: str) -> Any:
        return dataclasses.replace(llama.config(), cudagraph_mode=cudagraph_mode,
                                   capture=capture,
                                   flavour="aoti" if flavour == "profile" else flavour)

    call_start = time.time()
    with torch.no_grad():
        if mode.startswith("cb"):
            # One compile call: load (or build), the first output; graphs as the policy says.
            served = cachebuild.compile(model, cb_config(graph_mode, policy), dyn)
            with _profiled(profile and profile.with_name(profile.name + ".load.txt")):
                out = served(ids, pos)
            torch.cuda.synchronize()
            t["first_output"] = time.time() - started
            t["compile_to_first_output"] = time.time() - call_start
            with _profiled(profile and profile.with_name(profile.name + ".capture.txt")):
                if policy == "lazy":  # each size's first call captures it: serve each once
                    for n in sizes:
                        served(*llama.example_inputs(model, n))
                served.wait_captured()
                torch.cuda.synchronize()
            state = served.capture_state()
            t["capture"] = time.time() - started - t["first_output"]
            t["capture_split"] = {"passes": state.seconds, **state.split}
            t["graphs_captured"] = state.graphs
            t["sizes_captured"] = len(state.captured)
            t["sizes_failed"] = state.failed
            t["pool_bytes"] = state.pool_bytes
            t["buffer_bytes"] = state.buffer_bytes
            t["pass_ms"] = {n: round(v * 1e3, 2) for n, v in sorted(state.per_size.items())}
        else:
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
            out = fn(ids, pos)
            torch.cuda.synchronize()
            t["first_output"] = time.time() - started
            t["compile_to_first_output"] = time.time() - call_start
            served, figures = capture_full_graphs(fn, model, llama.example_inputs, sizes)
            t.update(figures)
        torch.cuda.synchronize()
        t["ready"] = time.time() - started
        t["ready_after_model_built"] = t["ready"] - t["model_built"]
        # what tracing or compiling needs (sympy: tracing's), before torch.testing imports it
        t["compilers_imported"] = sorted({".".join(m.split(".")[:2]) for m in sys.modules
                                          if m.startswith(("torch._dynamo", "torch._inductor"))
                                          or m == "sympy"})
        torch.testing.assert_close(out, model(ids, pos), rtol=3e-2, atol=5e-2)
        t["threads"] = sorted(th.name for th in threading.enumerate())
        t["worst_abs_err"] = _check(served, model, llama.example_inputs)
        replays = _replays(served)
        t.update(_replay_ms(served, llama.example_inputs, model))
        t["graph_replays_in_timing"] = _replays(served) - replays
        if "torch._dynamo" in sys.modules and mode.startswith(("cb_cold", "torch_cold")):
            from torch._dynamo.utils import compilation_time_metrics

            phases = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items()}
            t["compile_phases_s"] = dict(sorted(phases.items(), key=lambda kv: -kv[1])[:14])
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


def run_mode(mode: str, work: Path, env: dict[str, str], graph_mode: str, policy: str,
             profile: Path | None = None) -> dict[str, Any]:
    started = time.time()
    extra = ["--profile", str(profile)] if profile is not None else []
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--work", str(work),
                           "--graph-mode", graph_mode, "--capture", policy,
                           "--started", repr(started), *extra],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: After a parallel build, the next process runs every line of CPU work about 1.5 times
#: slower for tens of seconds (measured on the H200 machine: plain ``torch.empty`` included),
#: so a mode that follows a build waits for the machine to settle first.
SETTLE_LOAD, SETTLE_MAX_S = 1.0, 90.0


def settle() -> float:
    """Wait until the 1-minute load average is below SETTLE_LOAD (at most SETTLE_MAX_S)."""
    start = time.time()
    while os.getloadavg()[0] > SETTLE_LOAD and time.time() - start < SETTLE_MAX_S:
        time.sleep(2)
    return time.time() - start


def build(work: Path, env: dict[str, str], flavour: str,
          model_file: str = "llama.py") -> dict[str, Any]:
    """``cachebuild warm`` of an example on an empty store (its own); timed."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "warm",
                           str(ROOT / "examples" / model_file)],
                          capture_output=True, text=True, env=env)
    seconds = time.time() - start
    said = (proc.stdout + proc.stderr).strip().splitlines() or ["(no output)"]
    if proc.returncode != 0:
        return {"error": said[-1][:300], "seconds": seconds}
    return {"seconds": seconds, "summary": said[-1][:300], "settled_s": settle()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--graph-mode", choices=["piecewise", "full"], default="piecewise",
                   help="how cachebuild captures graphs in the timeline (default: piecewise)")
    p.add_argument("--capture", choices=["background", "eager", "lazy"], default="background",
                   help="cachebuild's capture policy in the timeline (default: background)")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help="comma-separated; a cachebuild mode may name its graph mode and "
                        "capture policy: cb_warm_aoti/full+lazy")
    p.add_argument("--json-out", type=Path, help="write all results here as JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--started", type=float, help=argparse.SUPPRESS)
    p.add_argument("--profile", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.work, args.graph_mode, args.capture,
                               args.started, args.profile)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": str(args.layers),
           "LLAMA_HIDDEN": str(args.hidden), "LLAMA_HEADS": "32", "LLAMA_KV_HEADS": "4",
           "LLAMA_MLP": str(args.hidden * 11 // 4), "LLAMA_VOCAB": "32000",
           "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-prime")}
    # Shared with other runs on this machine where set (a probe verdict, torch's bytecode).
    results: dict[str, Any] = {"toolchain": primed(env, work)}
    for spec in args.modes.split(","):
        mode, graph_mode, policy = parse_mode(spec, args.graph_mode, args.capture)
        menv = dict(env)
        flavour = mode.rsplit("_", 1)[-1]
        menv["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{mode}")
        if mode == "torch_warm":
            menv["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-torch_cold")
        if mode.startswith(("cb_build", "cb_warm")):  # the store cb_build fills, cb_warm reads
            menv["CACHEBUILD_DIR"] = str(work / f"store-{flavour}")
            menv["LLAMA_FLAVOUR"] = flavour
            menv["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-cb-{flavour}")
        if mode.startswith("cb_cold") or mode == "cb_profile":
            menv["CACHEBUILD_DIR"] = str(work / ("store-cold-" + flavour if mode != "cb_profile"
                                                 else "store-aoti"))
        if mode == "aot_load":
            why = prepare_aot(work)
            if why:
                results[spec] = {"error": f"AOT precompile failed: {why}"}
                print(spec, results[spec], flush=True)
                continue
        if mode.startswith("cb_build"):
            results[spec] = build(work, menv, flavour)
        else:
            profile = None
            if mode == "cb_profile":
                profile = (args.json_out or work / "serve.json").with_name("profile")
            results[spec] = run_mode(mode, work, menv, graph_mode, policy, profile)
        print(spec, json.dumps(results[spec]), flush=True)
        if args.json_out:  # after every mode: a run cut short keeps what it measured
            args.json_out.write_text(json.dumps(results, indent=1))
    keys = ["import", "model_built", "compile_to_first_output", "capture", "ready",
            "ready_after_model_built", "pool_bytes", "replay_ms_1", "replay_ms_512"]
    print("| mode | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for mode, r in results.items():
        if not isinstance(r, dict):
            continue
        cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "-"))
                 for k in keys]
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
