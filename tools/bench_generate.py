"""Generation after a warm restart, side by side: time to first token, decode step latency,
tokens/s and prefill latency per serving mode (the generation benchmark).

Each mode runs in a fresh process that does what a server does (``genserve.py``: import,
build the model of ``examples/generate.py``, by default the TinyLlama shape: hidden 2048,
22 layers, 32 heads, 4 KV heads, MLP 5632, bf16, a paged KV cache per layer; compile;
capture), then serves:

- one request (a 64-token prompt): seconds from process start and from the compile call
  to its first token;
- a prefill of 512 tokens (8 prompts of 64), 6 times: the median of the last 5 (CUDA
  events; the first one of a size may capture it);
- per decode batch of 1, 8 and 32 sequences (64-token prompts prefilled together, 32 decode
  steps marked as decode, ``cachebuild.decoding``): the median decode step (CUDA events
  around the forward), the median host time to issue a step (the CPU's share: with graphs
  that is what runs between replays), and tokens/s over the steps with the engine's host
  work. The first step's logits are checked against eager's at bf16 tolerance (the check's
  time is not counted).

cachebuild modes also give which graphs served the calls (full, piecewise, none) and
graph misses. ``cb_build_<flavour>`` is ``cachebuild warm examples/generate.py`` on an
empty store (timed), which the ``cb_*`` modes of that flavour then load.

    python tools/bench_generate.py [--layers 22] [--modes ...] [--json-out FILE]
    python tools/bench_generate.py --device cpu --layers 1 --hidden 64 --modes eager,cb_build_eager_fusion,cb_fp_eager_fusion
    python tools/bench_generate.py --from-json FILE   # the tables of a saved (or cut) run
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
from bench_serve import build  # noqa: E402
from benchlib import primed  # noqa: E402

#: The cachebuild modes first (what the goals are about), torch.compile's and eager's after.
DEFAULT_MODES = ("cb_build_aoti,cb_fp_aoti,cb_warm_aoti,cb_full_aoti,torch_cold,torch_warm,"
                 "eager")
BATCHES = (1, 8, 32)
STEPS = 32
PREFILL_RUNS = 6


def child(mode: str, started: float) -> dict[str, Any]:
    """One server start and its measurements, in this process."""
    import torch

    server = genserve.start(mode, started)
    t = server.t
    with torch.no_grad():
        engine = server.engine()
        engine.generate([list(range(1, genserve.PROMPT + 1))], 1)  # prefill, one token
        server.timer.sync()
        t["first_token"] = time.time() - started
        t["compile_call_to_first_token"] = time.time() - t.pop("call_start")
        t["prefill_512_ms"] = _prefill(server, 8)
        for batch in BATCHES:
            t[f"batch_{batch}"] = _decode(server, batch)
        runtime = server.runtime()
        if runtime is not None and runtime.capturer is not None:
            state = server.forward.capture_state()
            t["served"] = state.served
            t["graph_kinds"] = state.kinds
            t["graph_misses"] = sum(r.misses for r in runtime.replayers())
            t["capture"] = {k: v for k, v in state.__dict__.items()
                            if k not in ("per_size", "served", "kinds")}
    t["compilers_imported"] = sorted({".".join(m.split(".")[:2]) for m in sys.modules
                                      if m.startswith(("torch._dynamo", "torch._inductor"))})
    if server.mode.engine == "cachebuild":
        import cachebuild

        t["stats"] = cachebuild.stats()
    return t


def _prefill(server: genserve.Server, prompts: int) -> float:
    """Median milliseconds of a prefill of ``prompts`` prompts of PROMPT tokens (the first
    run left out: it may capture the size)."""
    import torch

    times = []
    for run in range(PREFILL_RUNS):
        engine = server.engine()
        g = torch.Generator().manual_seed(100 + run)
        vocab = server.model.embed.num_embeddings
        seqs = [server.generate.Sequence(
            torch.randint(0, vocab, (genserve.PROMPT,), generator=g).tolist())
            for _ in range(prompts)]
        rows = [(s, tok, i) for s in seqs for i, tok in enumerate(s.tokens)]
        _, ms = server.timer.around(lambda e=engine, r=rows: e._step(r))
        times.append(ms())
        for s in seqs:
            engine.free += s.blocks
    later = sorted(times[1:])
    return later[len(later) // 2]


def _decode(server: genserve.Server, batch: int) -> dict[str, Any]:
    """Prefill ``batch`` prompts, then STEPS decode steps: step latency on the device, host
    time to issue a step, tokens/s over the steps after the first (which may capture its
    size, and is checked against eager)."""
    engine, seqs, tokens = genserve.decode_batch(server, batch, seed=batch)
    step_ms, host_ms, checked = [], [], None
    wall = 0.0
    for step in range(STEPS):
        rows = genserve.next_rows(seqs, tokens)
        issued = time.perf_counter()
        logits, ms = server.timer.around(lambda r=rows: engine._step(r, decode=True))
        host_ms.append((time.perf_counter() - issued) * 1e3)
        if step == 0:  # eager's logits for the same step, on the same cache (not timed)
            checked = _worst(logits, server, engine, rows)
        tokens = logits.argmax(-1).tolist()
        step_ms.append(ms())
        if step == 0:  # tokens/s counts the steady steps: the first may capture its size
            server.timer.sync()
            wall = time.perf_counter()
    seconds = time.perf_counter() - wall
    for s in seqs:
        engine.free += s.blocks
    return {"step_ms": _median(step_ms), "host_ms": _median(host_ms),
            "tokens_per_s": batch * (STEPS - 1) / seconds, "worst_abs_err_step0": checked}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _worst(logits: Any, server: genserve.Server, engine: Any, rows: list[Any]) -> float:
    """Eager's logits for ``rows`` (whose slots the compiled step wrote already: eager
    writes the same values there again) against ``logits``."""
    import torch

    eager = type(engine)(server.model)
    eager.free = engine.free
    ref = eager._step(rows)
    torch.testing.assert_close(logits, ref, rtol=3e-2, atol=1e-1)
    return float((logits - ref).abs().max())


def run_mode(mode: str, env: dict[str, str]) -> dict[str, Any]:
    started = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--started", repr(started)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:400]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def show(results: dict[str, Any]) -> None:
    """The tables and the goals of a run (complete or cut short)."""
    head = (["mode", "first token s", "compile→first token s", "prefill 512 ms"]
            + [f"step ms @{b}" for b in BATCHES] + [f"host ms @{b}" for b in BATCHES]
            + [f"tok/s @{b}" for b in BATCHES] + ["served (full / piecewise / none)"])
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for mode, r in results.items():
        if not isinstance(r, dict) or "first_token" not in r:
            if isinstance(r, dict) and "error" in r:
                print(f"| {mode} | error: {r['error'][:120]} |")
            continue
        cells = [f"{r['first_token']:.2f}", f"{r['compile_call_to_first_token']:.2f}",
                 f"{r['prefill_512_ms']:.2f}"]
        cells += [f"{r[f'batch_{b}']['step_ms']:.2f}" for b in BATCHES]
        cells += [f"{r[f'batch_{b}']['host_ms']:.2f}" for b in BATCHES]
        cells += [f"{r[f'batch_{b}']['tokens_per_s']:.0f}" for b in BATCHES]
        served = r.get("served")
        cells.append(" / ".join(str(served[k]) for k in ("full", "piecewise", "none"))
                     if served else "–")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    for line in goals(results):
        print(line)


def goals(results: dict[str, Any]) -> list[str]:
    """The issue's goals, from whichever modes ran: full_and_piecewise's decode step at or
    below torch.compile's (warm) at every batch, its prefill within 5% of piecewise, its time
    to first token after a warm start at most a tenth of torch.compile's warm one."""
    fp = _first(results, "cb_fp_")
    piecewise, torch_warm = _first(results, "cb_warm_"), results.get("torch_warm")
    out = []
    if fp and _ok(torch_warm):
        steps = [(b, fp[f"batch_{b}"]["step_ms"], torch_warm[f"batch_{b}"]["step_ms"])
                 for b in BATCHES]
        met = all(a <= b for _, a, b in steps)
        out.append("goal decode step <= torch.compile's at every batch: "
                   + ", ".join(f"@{b} {a:.3f} vs {t:.3f} ms" for b, a, t in steps)
                   + (" — met" if met else " — NOT met"))
        ratio = fp["compile_call_to_first_token"] / torch_warm["compile_call_to_first_token"]
        out.append(f"goal first token after a warm start <= 1/10 of torch.compile's warm one "
                   f"(from the compile call): {fp['compile_call_to_first_token']:.2f} vs "
                   f"{torch_warm['compile_call_to_first_token']:.2f} s = {ratio:.3f}"
                   + (" — met" if ratio <= 0.1 else " — NOT met"))
    if fp and piecewise:
        ratio = fp["prefill_512_ms"] / piecewise["prefill_512_ms"]
        out.append(f"goal prefill of 512 within 5% of piecewise: {fp['prefill_512_ms']:.2f} vs "
                   f"{piecewise['prefill_512_ms']:.2f} ms = {ratio:.3f}"
                   + (" — met" if ratio <= 1.05 else " — NOT met"))
    return out


def _ok(r: Any) -> bool:
    return isinstance(r, dict) and "first_token" in r


def _first(results: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    """The first measured mode whose name starts with ``prefix`` and names no policy."""
    return next((r for m, r in results.items()
                 if m.startswith(prefix) and "+" not in m and _ok(r)), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the tool")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help="comma-separated, in order (default: %(default)s); see genserve.py")
    p.add_argument("--json-out", type=Path, help="write all results here as JSON, after each mode")
    p.add_argument("--from-json", type=Path, help="print the tables of a saved run instead")
    p.add_argument("--work", type=Path, help="keep stores and caches in this folder (default: "
                   "a new temporary one), e.g. for profile_decode.py --work")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.started)))
        return
    if args.from_json:
        show(json.loads(args.from_json.read_text()))
        return
    modes, work, env = genserve.setup(p, args, "bench-generate-")
    results: dict[str, Any] = {"toolchain": primed(env, work, args.device)}
    for mode in modes:
        parsed = genserve.parse(mode)
        menv, _ = genserve.mode_env(env, work, mode)
        if parsed.engine == "build":
            results[mode] = build(work, menv, parsed.flavour, "generate.py")
        else:
            results[mode] = run_mode(mode, menv)
        print(mode, json.dumps(results[mode]), flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))
    show(results)


if __name__ == "__main__":
    main()
