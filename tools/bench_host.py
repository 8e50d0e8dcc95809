"""What the piecewise replay path costs the CPU per decode step, beyond the work itself.

``examples/generate.py``'s paged model (tiny, ``eager_fusion`` pieces, on the CPU, where a
"replay" runs the piece: ``ReplayCapture``), one decode batch, served three ways in one
process: the stitched forward calling the pieces directly (no graph machinery: the floor),
piecewise replays (static argument buffers, a replayer per piece), and a full graph
(in ``full_and_piecewise``, a call marked as decode; and the same in ``full`` mode).
For each: the median host time of a step and the Python function calls it makes
(``sys.setprofile``: a count, the same on every machine). The difference between the
piecewise path and the floor is what cachebuild adds between piece replays; on a GPU the
same path runs with each piece a graph launch (``bench_generate.py``'s host ms,
``profile_decode.py``'s gaps between replays).

    python tools/bench_host.py [--layers 2] [--batch 8] [--steps 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def calls_in(fn: Any) -> int:
    """Python function calls (and C functions called from Python) ``fn()`` makes."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def median_us(fn: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    os.environ.update({"LLAMA_DEVICE": "cpu", "LLAMA_LAYERS": str(args.layers),
                       "LLAMA_HIDDEN": "64", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2",
                       "LLAMA_MLP": "128", "LLAMA_VOCAB": "256", "GEN_BLOCKS": "64",
                       "GEN_MAX_BLOCKS": "4"})
    sys.path.insert(0, str(ROOT / "examples"))
    import generate
    import torch

    import cachebuild
    from cachebuild.calls import decoding
    from cachebuild.store import LocalStore

    torch.set_num_threads(1)  # the host's own cost: no intra-op threads to wait for
    torch.manual_seed(0)
    model = generate.make_model()
    config = cachebuild.CompileConfig(
        splitting_ops=(generate.WRITE, generate.ATTEND), compile_ranges=((1, 64),),
        backend="eager_fusion", cudagraph_mode="full_and_piecewise", capture="lazy",
        capture_sizes=(args.batch,), decode_sizes=(args.batch,))
    store = LocalStore(Path(tempfile.mkdtemp(prefix="bench-host-")) / "store")
    compiled = cachebuild.compile(model, config, generate.DYNAMIC, store=store)
    b = args.batch
    call = (torch.randint(0, 256, (b,)), torch.full((b,), 5), 16 + torch.arange(b),
            torch.ones(b, 4, dtype=torch.int64))
    runtime = compiled.prepare(*call)
    assert runtime is not None and runtime.capturer is not None
    rows: dict[str, Any] = {}
    with torch.no_grad():
        for decode in (False, True):  # captures the piecewise graphs, then the full one
            with decoding(decode):
                for _ in range(2):
                    runtime(*call)

        def piecewise() -> Any:
            return runtime(*call)

        def full() -> Any:
            with decoding():
                return runtime(*call)

        def floor() -> Any:
            return runtime.capturer.exact(call)

        for name, fn in (("stitched forward, pieces called directly", floor),
                         ("piecewise replay", piecewise), ("full graph", full)):
            fn()
            rows[name] = (median_us(fn, args.steps), calls_in(fn))
    served = compiled.capture_state().served
    assert served["full"] > 0 and served["piecewise"] > 0, served
    # The same full graph in cudagraph_mode "full": what the decode mark and the route to
    # the full graph cost full_and_piecewise (the difference between the two rows).
    only_full = cachebuild.compile(generate.make_model(), dataclasses.replace(
        config, cudagraph_mode="full", decode_sizes=None), generate.DYNAMIC, store=store)
    full_runtime = only_full.prepare(*call)
    assert full_runtime is not None
    with torch.no_grad():
        def full_mode() -> Any:
            with decoding():
                return full_runtime(*call)

        for _ in range(3):
            full_mode()
        rows["full graph, cudagraph_mode full"] = (median_us(full_mode, args.steps),
                                                   calls_in(full_mode))
    assert only_full.capture_state().served["full"] > 0
    print(f"paged model, {args.layers} layers (hidden 64), decode batch {b}, CPU, "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}; median of "
          f"{args.steps} steps")
    print("| path | host µs per step | Python calls per step |")
    print("|---|---|---|")
    for name, (us, n) in rows.items():
        print(f"| {name} | {us:.0f} | {n} |")
    floor_us, floor_calls = rows["stitched forward, pieces called directly"]
    pw_us, pw_calls = rows["piecewise replay"]
    print(f"piecewise replay path adds {pw_us - floor_us:.0f} µs and {pw_calls - floor_calls} "
          f"calls per step over the stitched forward ({args.layers + 1} pieces)")


if __name__ == "__main__":
    main()
