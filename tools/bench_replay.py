"""Replay at 1 token in warm processes started one after another after a build (GPU).

Piecewise replay at 1 token is bound by the CPU (per layer: a graph launch, the eager
attention op, a copy), so whatever slows the CPU shows there first. This builds the
example's AOTI targets with ``cachebuild warm``, then starts several warm processes back
to back; each loads, captures, and times 200 replays at 1 token together with a few CPU
costs of its own (the attention op, SDPA alone, one piece graph's launch, a bare
``torch.empty``). Variants import Dynamo or Inductor first, to see whether a compiler's
import changes anything.

    python tools/bench_replay.py [--variants plain,dynamo,inductor,plain]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def child(variant: str) -> dict[str, Any]:
    if variant == "dynamo":
        import torch._dynamo  # noqa: F401
    if variant == "inductor":
        import torch._inductor.compile_fx  # noqa: F401
    import dataclasses

    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import llama

    import cachebuild

    torch.manual_seed(0)
    model = llama.make_model()
    config = dataclasses.replace(llama.config(), cudagraph_mode="piecewise", flavour="aoti")
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0})

    def median_ms(fn: Any, n: int = 200) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return sorted(times)[n // 2]

    def cpu_us(fn: Any, n: int = 500) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    out: dict[str, Any] = {"variant": variant}
    with torch.no_grad():
        compiled(*llama.example_inputs(model, 8))  # load; graphs are captured behind
        compiled.wait_captured()
        a, b = llama.example_inputs(model, 1)
        out["replay_ms_1"] = median_ms(lambda: compiled(a, b))
        q = torch.randn(1, model.layers[0].heads, model.layers[0].head_dim, device="cuda",
                        dtype=torch.bfloat16)
        k = torch.randn(1, model.layers[0].kv_heads, model.layers[0].head_dim, device="cuda",
                        dtype=torch.bfloat16)
        out["attention_cpu_us"] = cpu_us(lambda: torch.ops.cachebuild_examples.attention(q, k, k))
        q4, k4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out["sdpa_cpu_us"] = cpu_us(lambda: sdpa(q4, k4, k4, is_causal=True, enable_gqa=True))
        piece = compiled.runtime.capturer.pieces_at[1][1]  # a piece's graph at 1 token
        out["piece_launch_cpu_us"] = cpu_us(lambda: piece.api.replay(piece.graph))
        out["empty_cpu_us"] = cpu_us(lambda: torch.empty(1, 32, 64, device="cuda",
                                                         dtype=torch.bfloat16))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="plain,dynamo,inductor,plain")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-replay-{os.getpid()}"
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": str(args.layers),
           "LLAMA_HIDDEN": "2048", "LLAMA_HEADS": "32", "LLAMA_KV_HEADS": "4",
           "LLAMA_MLP": "5632", "LLAMA_VOCAB": "32000", "LLAMA_FLAVOUR": "aoti",
           "PYTHONUNBUFFERED": "1",
           "CACHEBUILD_DIR": str(work / "store"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "warm",
                           str(ROOT / "examples" / "llama.py")], env=env, capture_output=True,
                          text=True)
    print(f"cachebuild warm: exit {proc.returncode} in {time.time() - start:.1f} s", flush=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    for variant in args.variants.split(","):
        started = time.time()
        run = subprocess.run([sys.executable, __file__, "--child", variant], env=env,
                             capture_output=True, text=True)
        result = (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                  else {"variant": variant, "error": run.stderr[-500:]})
        result["started_after_build_s"] = round(started - start, 1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
