"""What the first run of a model at a new shape costs on a GPU, and where it goes.

A server captures one CUDA graph per size, and the first run at each size (the warm-up
before a capture) costs tens of milliseconds more than the second, in eager and in
torch.compile alike. This profiles that first run (examples/llama.py, TinyLlama-shaped,
eager, bf16): for a few new sizes, the CPU time of the first and the second run, the ops
that took the most CPU time in the first (torch.profiler, CPU activity), and whether a
graph recorded at a new size *without* a run before it replays correctly and how long its
recording and first replay take.

    python tools/first_run.py [--layers 22] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def timed(fn: Any) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    os.environ.update(LLAMA_DEVICE="cuda", LLAMA_LAYERS=str(args.layers), LLAMA_HIDDEN="2048",
                      LLAMA_HEADS="32", LLAMA_KV_HEADS="4", LLAMA_MLP="5632", LLAMA_VOCAB="32000")
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT / "examples"))
    import llama

    torch.manual_seed(0)
    model = llama.make_model()
    out: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with torch.no_grad():
        for _ in range(2):
            model(*llama.example_inputs(model, 8))
        runs = {}
        for n in (24, 40, 72):
            a = llama.example_inputs(model, n)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                first = timed(lambda a=a: model(*a))
            second = timed(lambda a=a: model(*a))
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
            runs[n] = {"first_ms": round(first, 2), "second_ms": round(second, 2),
                       "top_self_cpu_ms": {e.key: round(e.self_cpu_time_total / 1e3, 2)
                                           for e in top}}
        out["runs"] = runs
        # A graph recorded at a new size with no run at that size before it.
        recorded = {}
        stream = torch.cuda.Stream()
        for n in (104, 136):
            a = llama.example_inputs(model, n)
            graph = torch.cuda.CUDAGraph()
            stream.wait_stream(torch.cuda.current_stream())

            def record(graph: Any = graph, a: Any = a) -> Any:
                with torch.cuda.stream(stream):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        return model(*a)
                    finally:
                        graph.capture_end()

            static: list[Any] = []
            record_ms = timed(lambda record=record, static=static: static.append(record()))
            replay_ms = timed(graph.replay)
            again_ms = timed(graph.replay)
            ref = model(*a)
            err = float((static[0].float() - ref.float()).abs().max())
            recorded[n] = {"record_ms": round(record_ms, 2), "first_replay_ms": round(replay_ms, 2),
                           "second_replay_ms": round(again_ms, 2), "worst_abs_err": err}
        out["recorded_without_a_run"] = recorded
    print(json.dumps(out, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
