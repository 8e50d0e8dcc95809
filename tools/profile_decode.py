"""Where a decode step's time goes, per serving mode: torch.profiler with CUDA activity
around a few decode steps of ``examples/generate.py`` at the benchmark's shape.

Each mode (``genserve.py``'s names) runs in a fresh process: start the server, prefill a
batch, decode a few steps (each size captured, as its policy says), then profile
``--steps`` decode steps, each inside a ``decode_step`` range. Per mode the summary says,
per step: the device time (CUDA events) and the host time to issue it; graph replays
(``cudaGraphLaunch``) and kernel launches from the CPU (``cudaLaunchKernel`` and the
like); kernels run on the device (inside graphs included, where the profiler sees them);
the device's busy time and what share of the step it idled; the CPU time between graph
replays (mean and total gap from one replay's launch to the next); and the CPU ops with
the most self time. The summary goes to ``--out`` (Markdown) and ``--json-out``; traces
(Chrome format) go beside them with ``--traces``.

    python tools/profile_decode.py [--modes cb_fp_aoti,cb_warm_aoti,cb_full_aoti,torch_warm,eager]
        [--batch 8] [--steps 5] [--work DIR] [--out decode_profile.md]

``--work`` reuses a folder ``bench_generate.py --work`` filled (its stores and the
torch.compile Inductor cache): modes whose store or cache is missing there are built first
(``cb_build_<flavour>`` is added; ``torch_warm`` is run cold).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import genserve  # noqa: E402

DEFAULT_MODES = "cb_fp_aoti,cb_warm_aoti,cb_full_aoti,torch_warm,eager"
#: Runtime calls that launch work from the CPU, by what they launch.
GRAPH_LAUNCH = ("cudaGraphLaunch",)
KERNEL_LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaMemcpyAsync", "cudaMemsetAsync")


def child(mode: str, batch: int, steps: int, trace: str | None) -> dict[str, Any]:
    """Profile ``steps`` decode steps of ``batch`` sequences in mode ``mode``, here."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    server = genserve.start(mode, time.time())
    cuda = server.timer.cuda
    with torch.no_grad():
        engine, seqs, tokens = genserve.decode_batch(server, batch, seed=batch)
        for _ in range(3):  # the size captured (lazy) and warm
            tokens = engine._step(genserve.next_rows(seqs, tokens), decode=True)
            tokens = tokens.argmax(-1).tolist()
        server.timer.sync()
        device_ms, host_ms = [], []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                rows = genserve.next_rows(seqs, tokens)
                issued = time.perf_counter()
                with record_function("decode_step"):
                    logits, ms = server.timer.around(lambda r=rows: engine._step(r, decode=True))
                host_ms.append((time.perf_counter() - issued) * 1e3)
                tokens = logits.argmax(-1).tolist()
                device_ms.append(ms())
            server.timer.sync()
    if trace:
        prof.export_chrome_trace(trace)
    summary = summarize(prof.events(), steps)
    summary.update({"mode": mode, "batch": batch, "steps": steps,
                    "device_ms": sorted(device_ms)[len(device_ms) // 2],
                    "host_ms": sorted(host_ms)[len(host_ms) // 2]})
    runtime = server.runtime()
    if runtime is not None and runtime.capturer is not None:
        summary["served"] = server.forward.capture_state().served
    return summary


def summarize(events: Any, steps: int) -> dict[str, Any]:
    """Per-step counts and times from a profile's events (``FunctionEvent``s)."""
    from torch.autograd import DeviceType

    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name == "decode_step" and e.device_type == DeviceType.CPU)
    if not ranges:
        return {"error": "no decode_step range in the profile"}
    lo, hi = ranges[0][0], ranges[-1][1]

    def inside(e: Any) -> bool:
        return lo <= e.time_range.start <= hi

    cpu = [e for e in events if e.device_type == DeviceType.CPU and inside(e)]
    # the device's events but the step ranges' own annotation on the GPU timeline
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.name != "decode_step"]
    graph_launches = sorted(e.time_range.start for e in cpu if e.name in GRAPH_LAUNCH)
    gaps = [b - a for a, b in zip(graph_launches, graph_launches[1:], strict=False)
            if any(s <= a and b <= t for s, t in ranges)]  # within one step
    busy = _union([(k.time_range.start, k.time_range.end) for k in kernels])
    step_us = sum(t - s for s, t in ranges)
    self_cpu: dict[str, list[float]] = {}
    for e in cpu:
        if e.name == "decode_step":
            continue
        entry = self_cpu.setdefault(e.name, [0.0, 0])
        entry[0] += e.self_cpu_time_total
        entry[1] += 1
    top = sorted(self_cpu.items(), key=lambda kv: -kv[1][0])[:12]
    by_kernel: dict[str, list[float]] = {}
    for k in kernels:  # which kernels the device ran, by name: a mode's extra work shows here
        entry = by_kernel.setdefault(k.name[:90], [0.0, 0])
        entry[0] += k.time_range.end - k.time_range.start
        entry[1] += 1
    return {
        "graph_replays_per_step": len(graph_launches) / steps,
        "cpu_kernel_launches_per_step": sum(e.name in KERNEL_LAUNCH for e in cpu) / steps,
        "kernels_per_step": len(kernels) / steps,
        "device_busy_us_per_step": busy / steps,
        "device_idle_share": max(0.0, 1 - busy / step_us) if step_us and kernels else None,
        "host_us_between_replays_mean": sum(gaps) / len(gaps) if gaps else None,
        "host_us_between_replays_per_step": sum(gaps) / steps if gaps else 0.0,
        "step_range_us": step_us / steps,
        "top_cpu_ops": [{"op": name, "self_us_per_step": total / steps, "calls_per_step": n / steps}
                        for name, (total, n) in top],
        "kernels": {name: {"device_us_per_step": total / steps, "per_step": n / steps}
                    for name, (total, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])},
    }


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length covered by ``spans``."""
    total, end = 0.0, float("-inf")
    for s, t in sorted(spans):
        if t <= end:
            continue
        total += t - max(s, end)
        end = t
    return total


def render(results: dict[str, Any]) -> str:
    """The summary as Markdown: one table of per-step figures, then each mode's top ops."""
    lines = ["| mode | device ms | host ms | graph replays | CPU launches | kernels | device "
             "busy µs | device idle | µs between replays (mean / per step) | served |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"| {mode} | error: {r['error'][:160]} |")
            continue
        gap = r["host_us_between_replays_mean"]
        idle = r["device_idle_share"]
        lines.append(
            f"| {mode} | {r['device_ms']:.3f} | {r['host_ms']:.3f} | "
            f"{r['graph_replays_per_step']:.0f} | {r['cpu_kernel_launches_per_step']:.0f} | "
            f"{r['kernels_per_step']:.0f} | {r['device_busy_us_per_step']:.0f} | "
            f"{'–' if idle is None else f'{idle:.0%}'} | "
            f"{'–' if gap is None else f'{gap:.1f}'} / {r['host_us_between_replays_per_step']:.0f} | "
            f"{r.get('served', '–')} |")
    for mode, r in results.items():
        if "top_cpu_ops" not in r:
            continue
        lines += ["", f"{mode}: CPU ops with the most self time per step"]
        lines += [f"    {o['self_us_per_step']:9.1f} µs  {o['calls_per_step']:6.1f} calls  {o['op']}"
                  for o in r["top_cpu_ops"]]
    lines += _kernel_table(results)
    return "\n".join(lines) + "\n"


def _kernel_table(results: dict[str, Any]) -> list[str]:
    """Kernels per step and their device time, by name, side by side for every mode: where
    two modes' device work differs. The 25 names with the most device time in any mode."""
    modes = [m for m, r in results.items() if r.get("kernels")]
    if not modes:
        return []
    worst: dict[str, float] = {}
    for m in modes:
        for name, k in results[m]["kernels"].items():
            worst[name] = max(worst.get(name, 0.0), k["device_us_per_step"])
    names = sorted(worst, key=lambda n: -worst[n])[:25]
    lines = ["", "Kernels per step (count × device µs), by name:", "",
             "| kernel | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for name in names:
        cells = []
        for m in modes:
            k = results[m]["kernels"].get(name)
            cells.append(f"{k['per_step']:.0f} × {k['device_us_per_step']:.0f}" if k else "–")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=DEFAULT_MODES)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--work", type=Path, help="a bench_generate.py --work folder to reuse")
    p.add_argument("--out", type=Path, default=Path("decode_profile.md"))
    p.add_argument("--json-out", type=Path)
    p.add_argument("--traces", type=Path, help="write each mode's Chrome trace in this folder")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--trace", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.steps, args.trace)))
        return
    from bench_serve import build
    from benchlib import primed

    modes, work, env = genserve.setup(p, args, "profile-decode-")
    primed(env, work, args.device)
    results: dict[str, Any] = {}
    for mode in modes:
        parsed = genserve.parse(mode)
        menv, store = genserve.mode_env(env, work, mode)
        if store is not None and not store.exists():
            print(f"building the {parsed.flavour} store first", file=sys.stderr, flush=True)
            build(work, menv, parsed.flavour, "generate.py")
        if parsed.engine == "build":
            continue
        argv = [sys.executable, __file__, "--child", mode, "--batch", str(args.batch),
                "--steps", str(args.steps)]
        if args.traces:
            args.traces.mkdir(parents=True, exist_ok=True)
            argv += ["--trace", str(args.traces / f"{mode}.json")]
        proc = subprocess.run(argv, capture_output=True, text=True, env=menv)
        if proc.returncode != 0:
            results[mode] = {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:400]}
        else:
            results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        brief = {k: v for k, v in results[mode].items() if k not in ("top_cpu_ops", "kernels")}
        print(mode, json.dumps(brief), flush=True)
        header = (f"Decode step profile: batch {args.batch}, {args.steps} steps profiled, "
                  f"{args.layers} layers, hidden {args.hidden}, {args.device}\n\n")
        args.out.write_text(header + render(results))
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))
    print(args.out.read_text() if args.out.exists() else "nothing profiled")


if __name__ == "__main__":
    main()
