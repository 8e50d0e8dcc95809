"""Benchmark each fused kernel against its unfused sequence and its bandwidth floor.

Per fused op and token count (default 1, 64, 512, 8192 tokens; hidden 4096; Qwen3-8B's
head layout for QK-norm + RoPE): the median time of the fused Triton kernel, of the
unfused sequence of kernels it replaces, and the bytes-moved floor: the bytes the fused op
must read and write divided by the device's copy bandwidth, measured in the same run.
Both sides call the Triton launchers directly (``cachebuild.passes.ops.kernels``), so the
comparison is kernel against kernels.

With ``--e2e`` it also measures the Qwen3-shaped example (``examples/qwen3_fp8.py``) end to
end: Inductor with the passes on and off, CUDA-graph replay latency per token count.

Times are medians from ``triton.testing.do_bench`` (``--cudagraph``: from
``do_bench_cudagraph``, launches captured in a CUDA graph, as a piecewise runtime replays
them). ``--smoke`` runs tiny shapes on CPU through Triton's interpreter (wall-clock
medians), which checks the script and the kernels but measures nothing meaningful.

    python tools/bench_passes.py                     # on a GPU
    python tools/bench_passes.py --e2e --json out.json
    python tools/bench_passes.py --smoke             # anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,64,512,8192", help="comma-separated token counts")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--mlp", type=int, default=None,
                   help="SiLU-and-mul output width (default: --hidden)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--cudagraph", action="store_true",
                   help="time CUDA-graph replays (do_bench_cudagraph) instead of launches")
    p.add_argument("--e2e", action="store_true", help="also time the Qwen3 example end to end")
    p.add_argument("--skip-kernels", action="store_true", help="only the end-to-end part")
    p.add_argument("--e2e-tokens", default="1,512")
    p.add_argument("--e2e-layers", type=int, default=8)
    p.add_argument("--e2e-engine", choices=["cachebuild", "torch"], default="cachebuild",
                   help="compile the example with cachebuild (default) or torch.compile")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU through Triton's interpreter: checks, no figures")
    p.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.e2e_tokens = "1,5", "1,5"
        args.hidden, args.mlp, args.heads, args.kv_heads, args.head_dim = 96, 40, 4, 2, 16
        args.e2e_layers = 2
    args.mlp = args.mlp or args.hidden
    return args


# ---------------------------------------------------------------------------- timing


def make_timer(device: str, cudagraph: bool) -> Callable[[Callable[[], Any]], float]:
    """A function that returns the median milliseconds of one call of ``fn``."""
    if device == "cuda":
        import triton.testing

        if cudagraph:
            return lambda fn: float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
        return lambda fn: float(triton.testing.do_bench(fn, return_mode="median"))

    def wall_clock(fn: Callable[[], Any], repeat: int = 3) -> float:
        fn()  # warm-up: the interpreter and torch's first-call paths
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return wall_clock


def copy_bandwidth(device: str, timer: Callable[[Callable[[], Any]], float],
                   nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


# ---------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One fused op at one size: the fused call, the unfused sequence, the bytes the fused
    op must move, and a check that both compute the same values."""

    name: str
    fused: Callable[[], Any]
    unfused: Callable[[], Any]
    nbytes: int


def _cases(k: Any, tokens: int, args: argparse.Namespace, device: str) -> list[Case]:
    dtype = getattr(torch, args.dtype)
    e = torch.tensor([], dtype=dtype).element_size()
    h, d = args.hidden, args.mlp
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    x, r, w = randn(tokens, h), randn(tokens, h), randn(h)
    gate_up = randn(tokens, 2 * d)
    scale = torch.tensor([0.02], device=device)
    eps = 1e-6
    nq, nkv, hd = args.heads, args.kv_heads, args.head_dim
    qkv = randn(tokens, (nq + 2 * nkv) * hd)
    qw, kw = randn(hd), randn(hd)
    max_pos = 4096
    inv = 1.0 / 1e6 ** (torch.arange(0, hd, 2, device=device).float() / hd)
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), generator=g, device=device)
    q_size, kv_size = nq * hd, nkv * hd

    def qk_unfused() -> Any:
        q = k.rms_norm_triton(qkv[:, :q_size].view(tokens, nq, hd), qw, eps)
        kk = k.rms_norm_triton(qkv[:, q_size:q_size + kv_size].view(tokens, nkv, hd), kw, eps)
        return k.rotary_embedding_triton(positions, q.view(tokens, q_size),
                                         kk.view(tokens, kv_size), cache, hd)

    return [
        Case("rms_norm + static fp8 quant",
             lambda: k.rms_norm_static_fp8_quant_triton(x, w, scale, eps),
             lambda: k.static_scaled_fp8_quant_triton(k.rms_norm_triton(x, w, eps), scale),
             tokens * h * (e + 1) + h * e),
        Case("add + rms_norm + static fp8 quant",
             lambda: k.fused_add_rms_norm_static_fp8_quant_triton(x, r, w, scale, eps),
             lambda: _quant_first(k, k.fused_add_rms_norm_triton(x, r, w, eps), scale),
             tokens * h * (3 * e + 1) + h * e),
        Case("silu_and_mul + static fp8 quant",
             lambda: k.silu_and_mul_static_fp8_quant_triton(gate_up, scale),
             lambda: k.static_scaled_fp8_quant_triton(k.silu_and_mul_triton(gate_up), scale),
             tokens * d * (2 * e + 1)),
        Case("qk rms_norm + rope",
             lambda: k.qk_norm_rope_triton(qkv, positions, qw, kw, cache, nq, nkv, hd, eps),
             qk_unfused,
             # read and write q and k; one cos/sin row and one position per token
             2 * tokens * (q_size + kv_size) * e + tokens * (hd * 4 + 8) + 2 * hd * e),
    ]


def _quant_first(k: Any, pair: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return k.static_scaled_fp8_quant_triton(pair[0], scale), pair[1]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return torch.allclose(a.float(), b.float(), rtol=0.13, atol=1e-2)


def bench_kernels(args: argparse.Namespace, device: str,
                  timer: Callable[[Callable[[], Any]], float], bandwidth: float
                  ) -> list[dict[str, Any]]:
    from cachebuild.passes.ops import kernels

    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for case in _cases(kernels, tokens, args, device):
            if not _same(case.fused(), case.unfused()):
                raise SystemExit(f"{case.name} at {tokens} tokens: fused != unfused")
            fused_ms, unfused_ms = timer(case.fused), timer(case.unfused)
            floor_ms = case.nbytes / bandwidth * 1e3
            rows.append({"op": case.name, "tokens": tokens, "fused_ms": fused_ms,
                         "unfused_ms": unfused_ms, "floor_ms": floor_ms, "bytes": case.nbytes,
                         "speedup": unfused_ms / fused_ms, "of_floor": fused_ms / floor_ms})
            r = rows[-1]
            print(f"{case.name:36s} {tokens:6d}  fused {fused_ms * 1e3:10.2f} us  "
                  f"unfused {unfused_ms * 1e3:10.2f} us  floor {floor_ms * 1e3:9.2f} us  "
                  f"speedup {r['speedup']:5.2f}x  fused/floor {r['of_floor']:6.2f}", flush=True)
    return rows


# ---------------------------------------------------------------------------- end to end


def _load_example() -> Any:
    from cachebuild.modelfile import import_model

    return import_model(ROOT / "examples" / "qwen3_fp8.py")


#: Largest relative L2 difference between the outputs with passes on and off. Fused and
#: unfused kernels round intermediates differently; a value that lands one fp8 step apart
#: moves the next layer's inputs, so the difference grows with depth on random weights
#: (measured on an H200 at 512 tokens: 1 layer 1.8e-3, 2 layers 1.4e-2, 4 layers 3.6e-2,
#: 8 layers 6.1e-2). The passes' correctness is tested layer by layer; this guards the
#: benchmark against timing a broken model.
E2E_REL_TOLERANCE = 0.1


def bench_e2e(args: argparse.Namespace, device: str,
              timer: Callable[[Callable[[], Any]], float]) -> list[dict[str, Any]]:
    """Replay latency of the compiled example with all passes on vs off.

    ``cachebuild`` engine: ``cachebuild.compile`` split at attention, full CUDA graphs of
    the token counts (build time does not grow with depth: the layers share targets).
    ``torch`` engine: ``torch.compile`` of the whole model with the passes as Inductor's
    post-grad pass, captured in one CUDA graph per token count.
    """
    import tempfile

    import cachebuild
    from cachebuild.passes import PassConfig, PassManager
    from cachebuild.store import LocalStore

    qwen3 = _load_example()
    cfg = qwen3.Qwen3Config(layers=args.e2e_layers, hidden=args.hidden, heads=args.heads,
                            kv_heads=args.kv_heads, head_dim=args.head_dim, mlp=args.mlp,
                            vocab=32000 if device == "cuda" else 128)
    model = qwen3.make_model(cfg, device=device, dtype=getattr(torch, args.dtype))
    token_counts = [int(t) for t in args.e2e_tokens.split(",")]
    times: dict[tuple[int, str], float] = {}
    outputs: dict[tuple[int, str], torch.Tensor] = {}
    for name, passes in (("on", PassConfig.all_fusions()), ("off", PassConfig())):
        started = time.perf_counter()
        print(f"e2e ({args.e2e_engine}): compiling {cfg.layers} layers with passes {name}",
              flush=True)
        torch._dynamo.reset()
        manager = PassManager.from_config(passes)
        if args.e2e_engine == "cachebuild":
            config = dataclasses.replace(
                qwen3.config(passes), capture_sizes=tuple(token_counts),
                cudagraph_mode="full" if device == "cuda" else "none")
            store = LocalStore(tempfile.mkdtemp(prefix="bench-passes-"))
            compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
        else:
            compiled = torch.compile(model, fullgraph=True, options={
                "post_grad_custom_post_pass": manager.as_inductor_pass()})
        for tokens in token_counts:
            ids, positions = qwen3.example_inputs(model, tokens)
            with torch.no_grad():
                if args.e2e_engine == "cachebuild":
                    run = functools.partial(compiled, ids, positions)
                else:
                    torch._dynamo.mark_dynamic(ids, 0)
                    torch._dynamo.mark_dynamic(positions, 0)
                    run = _replayable(compiled, ids, positions, device)
                outputs[tokens, name] = run().clone()
                times[tokens, name] = timer(run)
            counts = (dict(manager.total_counts) if args.e2e_engine == "torch"
                      else {"built": cachebuild.stats()["built"]})
            print(f"e2e {tokens:6d} tokens  passes {name:3s}  {times[tokens, name] * 1e3:10.2f} us  "
                  f"{counts}  ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = []
    for tokens in token_counts:
        # Fused and unfused kernels quantize differently rounded intermediates, so single fp8
        # values land one e4m3 step (12.5 %) apart and the difference carries through the
        # layers: compare the outputs as a whole (relative L2 error), not element by element.
        on_out, off_out = outputs[tokens, "on"].float(), outputs[tokens, "off"].float()
        rel = ((on_out - off_out).norm() / off_out.norm()).item()
        print(f"e2e {tokens:6d} tokens  relative L2 difference on vs off {rel:.2e}", flush=True)
        if not rel < E2E_REL_TOLERANCE:
            raise SystemExit(f"passes on and off disagree at {tokens} tokens: relative L2 "
                             f"difference {rel:.3g} >= {E2E_REL_TOLERANCE}")
        on, off = times[tokens, "on"], times[tokens, "off"]
        rows.append({"tokens": tokens, "layers": cfg.layers, "engine": args.e2e_engine,
                     "on_ms": on, "off_ms": off, "speedup": off / on, "rel_l2": rel})
    return rows


def _replayable(compiled: Callable[..., torch.Tensor], ids: torch.Tensor,
                positions: torch.Tensor, device: str) -> Callable[[], torch.Tensor]:
    """On CUDA: the compiled forward captured in a CUDA graph (returns the replay);
    elsewhere: the compiled forward itself."""
    if device != "cuda":
        return lambda: compiled(ids, positions)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            compiled(ids, positions)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(ids, positions)

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


# ---------------------------------------------------------------------------- main


def _timer_name(device: str, cudagraph: bool) -> str:
    if device != "cuda":
        return "wall-clock median"
    return ("do_bench_cudagraph" if cudagraph else "do_bench") + " median"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not args.smoke:
            print("no GPU: run with --smoke (figures from the interpreter mean nothing)",
                  file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is imported
    timer = make_timer(device, args.cudagraph)
    bandwidth = copy_bandwidth(device, timer, 1 << 20 if args.smoke else 1 << 30)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; dtype {args.dtype}; "
          f"timer {_timer_name(device, args.cudagraph)}", flush=True)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "smoke": args.smoke, "dtype": args.dtype,
        "copy_bandwidth_gbps": bandwidth / 1e9, "cudagraph": args.cudagraph,
        "kernels": [] if args.skip_kernels else bench_kernels(args, device, timer, bandwidth),
    }
    if args.e2e:
        # A replay is already one graph launch: time it as it is (not inside another graph).
        results["e2e"] = bench_e2e(args, device, make_timer(device, cudagraph=False))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
