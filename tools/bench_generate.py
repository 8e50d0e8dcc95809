"""Generation on a GPU after a warm restart, side by side: time to first token, decode step
latency and tokens/s (the issue's generation benchmark).

Each mode runs in a fresh process that does what a server does: import, build the model
(``examples/generate.py``: the TinyLlama shape by default, hidden 2048, 22 layers, 32
heads, 4 KV heads, MLP 5632, bf16, a paged KV cache per layer), compile, capture CUDA
graphs for the decode batch sizes (1, 2, 4, 8, 16, 32), then serve:

- ``eager``: no compile; the eager forward captured as whole CUDA graphs per batch size;
- ``torch_cold`` / ``torch_warm``: ``torch.compile(model, fullgraph=True)`` with the token
  dim dynamic, an empty / a warm Inductor cache (the one ``torch_cold`` filled); graphs
  captured the same way as eager's;
- ``cb_build_<flavour>``: ``cachebuild warm examples/generate.py`` on an empty store (timed);
- ``cb_warm_<flavour>`` / ``cb_full_<flavour>``: a server on that store, its graphs
  captured piecewise / whole by cachebuild, with the default capture policy (a model that
  writes its cache is captured ``lazy``: each decode size by its first step) or the one
  named after a ``+`` (``cb_full_aoti+eager``: every size in ``prepare``).

Per mode: seconds from process start to the model built, to ready (compiled and
captured) and to the first token of one request (a 64-token prompt); then, per decode batch
of 1, 8 and 32 sequences (64-token prompts, prefilled together), the median decode step
(CUDA events around the forward, 32 steps) and tokens/s over those steps including the
engine's host work (batch tensors, sampling). The first step's logits are checked against
eager's at bf16 tolerance.

    python tools/bench_generate.py [--layers 22] [--modes ...] [--json-out FILE]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import build  # noqa: E402
from benchlib import Graphed, primed  # noqa: E402

DEFAULT_MODES = "eager,torch_cold,torch_warm,cb_build_aoti,cb_warm_aoti,cb_full_aoti"
DECODE_SIZES = (1, 2, 4, 8, 16, 32)
BATCHES = (1, 8, 32)
PROMPT, STEPS = 64, 32


def child(mode: str, started: float) -> dict[str, Any]:
    """One server start and its measurements, in this process."""
    t: dict[str, Any] = {}
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import generate

    import cachebuild

    t["import"] = time.time() - started
    torch.manual_seed(0)
    model = generate.make_model()
    torch.cuda.synchronize()
    t["model_built"] = time.time() - started
    vocab = model.embed.num_embeddings
    call_start = time.time()
    with torch.no_grad():
        if mode.startswith("cb_"):
            mode, _, policy = mode.partition("+")
            flavour = mode.rsplit("_", 1)[-1]
            graphs = "full" if mode.startswith("cb_full") else "piecewise"
            config = dataclasses.replace(generate.config(), flavour=flavour,
                                         cudagraph_mode=graphs, capture=policy or "auto")
            compiled = cachebuild.compile(model, config, dynamic_dims=generate.DYNAMIC)
            # load; the model writes its cache, so each decode size is captured by its
            # first step (the "lazy" policy "auto" turns into for such a model)
            compiled.prepare(*generate.example_inputs(model))
            forward: Any = compiled
        else:
            fn: Any = model
            if mode.startswith("torch"):
                fn = torch.compile(model, fullgraph=True)
                args = generate.example_inputs(model)
                for a in args:
                    torch._dynamo.mark_dynamic(a, 0)
                fn(*args)
            forward = Graphed(fn, lambda a: a[0].shape[0])
            engine = generate.Engine(model, forward, DECODE_SIZES)
            for size in sorted(DECODE_SIZES, reverse=True):
                engine._step([(generate.Sequence([0]), 0, 0)] * size)  # captures the size
            for layer in model.layers:
                layer.kv_cache.zero_()
            forward.capturing = False
        torch.cuda.synchronize()
        t["ready"] = time.time() - started
        engine = generate.Engine(model, forward, DECODE_SIZES)
        engine.generate([list(range(1, PROMPT + 1))], 1)  # one request: prefill, one token
        torch.cuda.synchronize()
        t["first_token"] = time.time() - started
        t["compile_call_to_first_token"] = time.time() - call_start
        for batch in BATCHES:
            t[f"batch_{batch}"] = _decode(generate, model, forward, batch, vocab)
        runtime = getattr(forward, "runtime", None)
        if runtime is not None:
            replayers = runtime.replayers()
            t["graph_replays"] = sum(r.replays for r in runtime.capturer.ready.values())
            t["graph_misses"] = sum(r.misses for r in replayers)
            t["capture"] = {k: v for k, v in forward.capture_state().__dict__.items()
                            if k != "per_size"}
    t["compilers_imported"] = sorted({".".join(m.split(".")[:2]) for m in sys.modules
                                      if m.startswith(("torch._dynamo", "torch._inductor"))})
    t["stats"] = cachebuild.stats() if mode.startswith("cb_") else None
    return t


def _decode(generate: Any, model: Any, forward: Any, batch: int, vocab: int) -> dict[str, Any]:
    """Prefill ``batch`` prompts, then STEPS decode steps: step latency and tokens/s."""
    import torch

    engine = generate.Engine(model, forward, DECODE_SIZES)
    g = torch.Generator().manual_seed(batch)
    seqs = [generate.Sequence(torch.randint(0, vocab, (PROMPT,), generator=g).tolist())
            for _ in range(batch)]
    rows = [(s, tok, i) for s in seqs for i, tok in enumerate(s.tokens)]
    last = engine._step(rows)[[PROMPT * (i + 1) - 1 for i in range(batch)]]
    tokens = last.argmax(-1).tolist()
    step_ms, checked = [], None
    torch.cuda.synchronize()
    wall = time.perf_counter()
    for step in range(STEPS):
        for s, tok in zip(seqs, tokens, strict=True):
            s.generated.append(tok)
        decode = [(s, s.generated[-1], len(s.tokens) + len(s.generated) - 1) for s in seqs]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = engine._step(decode)
        end.record()
        if step == 0:  # eager's logits for the same step, on the same cache
            checked = _worst(logits, model, engine, decode)
        tokens = logits.argmax(-1).tolist()
        end.synchronize()
        step_ms.append(start.elapsed_time(end))
    seconds = time.perf_counter() - wall
    for s in seqs:
        engine.free += s.blocks
    return {"step_ms": sorted(step_ms)[len(step_ms) // 2], "tokens_per_s": batch * STEPS / seconds,
            "worst_abs_err_step0": checked}


def _worst(logits: Any, model: Any, engine: Any, decode: list[Any]) -> float:
    """Eager's logits for ``decode`` (whose slots the compiled step wrote already: eager
    writes the same values there again) against ``logits``."""
    import torch

    ref = generate_eager(model, engine, decode)
    torch.testing.assert_close(logits, ref, rtol=3e-2, atol=1e-1)
    return float((logits - ref).abs().max())


def generate_eager(model: Any, engine: Any, decode: list[Any]) -> Any:
    eager = type(engine)(model)
    eager.free = engine.free
    return eager._step(decode)


def run_mode(mode: str, env: dict[str, str]) -> dict[str, Any]:
    started = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--started", repr(started)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:400]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--modes", default=DEFAULT_MODES)
    p.add_argument("--json-out", type=Path, help="write all results here as JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.started)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    env = {**os.environ, "LLAMA_DEVICE": "cuda", "LLAMA_LAYERS": str(args.layers),
           "LLAMA_HIDDEN": str(args.hidden), "LLAMA_HEADS": "32", "LLAMA_KV_HEADS": "4",
           "LLAMA_MLP": str(args.hidden * 11 // 4), "LLAMA_VOCAB": "32000",
           "LLAMA_MAX_TOKENS": str(max(BATCHES) * PROMPT), "GEN_BLOCKS": "320",
           "GEN_MAX_BLOCKS": "8", "GEN_CAPTURE": ",".join(map(str, DECODE_SIZES)),
           "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-prime")}
    results: dict[str, Any] = {"toolchain": primed(env, work)}
    for mode in args.modes.split(","):
        menv = dict(env)
        flavour = mode.partition("+")[0].rsplit("_", 1)[-1]
        menv["TORCHINDUCTOR_CACHE_DIR"] = str(work / ("inductor-torch" if mode.startswith("torch")
                                                      else f"inductor-{mode}"))
        if mode.startswith("cb_"):
            menv["CACHEBUILD_DIR"] = str(work / f"store-{flavour}")
            menv["LLAMA_FLAVOUR"] = flavour
        if mode.startswith("cb_build"):
            results[mode] = build(work, menv, flavour, "generate.py")
        else:
            results[mode] = run_mode(mode, menv)
        print(mode, json.dumps(results[mode]), flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))
    head = ["mode", "ready s", "first token s", "compile→first token s"] + [
        f"step ms @{b}" for b in BATCHES] + [f"tok/s @{b}" for b in BATCHES]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for mode, r in results.items():
        if not isinstance(r, dict) or "ready" not in r:
            continue
        cells = [f"{r['ready']:.2f}", f"{r['first_token']:.2f}",
                 f"{r['compile_call_to_first_token']:.2f}"]
        cells += [f"{r[f'batch_{b}']['step_ms']:.2f}" for b in BATCHES]
        cells += [f"{r[f'batch_{b}']['tokens_per_s']:.0f}" for b in BATCHES]
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
