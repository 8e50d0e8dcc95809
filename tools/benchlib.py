"""What the benchmarks in tools/ share: where a figure was measured, and their tables.

The scripts run as ``python tools/<script>.py``, so this folder is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: What a first process imports and compiles, run once before anything is timed.
PRIME = """
import sys, torch
sys.path.insert(0, {examples!r})
import llama, cachebuild
import torch._inductor.compile_fx
from torch._inductor import CompiledArtifact, standalone_compile
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).to({device!r})
torch.compile(m)(torch.randn(8, 64, device={device!r}))
from cachebuild.backends.probe import verdict
print(verdict({device!r}).describe())
"""


def prime(env: dict[str, str], device: str = "cuda") -> tuple[float, str]:
    """Fill the bytecode cache (``PYTHONPYCACHEPREFIX``) that every measured process then
    reads, and run the AOTI toolchain probe once (its verdict is cached for all of them);
    the seconds it took and the verdict.

    An installed torch normally carries its ``.pyc`` files (pip compiles at install);
    an install without them makes every process compile torch's sources again, seconds
    that no measurement would pay on a normal install.
    """
    start = time.time()
    code = PRIME.format(examples=str(ROOT / "examples"), device=device)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"priming failed: {proc.stderr[-2000:]}")
    return time.time() - start, proc.stdout.strip().splitlines()[-1]


def primed(env: dict[str, str], work: Path, device: str = "cuda") -> str:
    """``env`` made ready for every measured process (a shared bytecode cache and probe
    verdict, where the caller's environment names none, in ``work``), primed; the
    toolchain's verdict."""
    env.setdefault("PYTHONPYCACHEPREFIX", str(work / "pycache"))
    env.setdefault("CACHEBUILD_PROBE_DIR", str(work / "probe"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # else the cache stays empty
    seconds, toolchain = prime(env, device)
    print(f"bytecode cache primed and toolchain probed in {seconds:.1f} s: {toolchain}",
          file=sys.stderr, flush=True)
    return toolchain


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def render_table(head: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> list[str]:
    """``rows`` under ``head``, as a Markdown table or as aligned plain-text columns."""
    if markdown:
        return (["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
                + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    return (["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
            + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows])


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--markdown, --json and --from-json, as every benchmark here takes them."""
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    parser.add_argument("--from-json", metavar="FILE",
                        help="render a saved --json result instead of measuring")


def present(args: argparse.Namespace, measure: Callable[[], dict[str, Any]],
           show: Callable[[dict[str, Any], bool], None]) -> None:
    """What the output options ask for: a saved result rendered (--from-json), or a new
    one measured and printed as JSON (--json) or as a table."""
    if args.from_json:
        show(json.loads(Path(args.from_json).read_text()), args.markdown)
        return
    result = measure()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    show(result, args.markdown)


class Graphed:
    """``fn`` served from one CUDA graph per size, the way a server without cachebuild
    captures its model: while ``capturing``, a call of a new size runs ``fn`` for real on a
    side stream (its answer, and the warm-up) and then records it on static copies of its
    arguments (all graphs in one pool); later calls of that size copy their arguments in
    and replay. ``size_of(args)`` reads a call's size."""

    def __init__(self, fn: Callable[..., Any], size_of: Callable[..., int]) -> None:
        import torch

        from cachebuild.serving.cudagraphs import CudaGraphCapture

        self.fn, self.size_of = fn, size_of
        self.api = CudaGraphCapture("cuda")
        self.stream = torch.cuda.Stream()
        self.graphs: dict[int, Any] = {}
        self.capturing = True

    def __call__(self, *args: Any) -> Any:
        import torch

        from cachebuild.serving.cudagraphs import Replayer

        graph = self.graphs.get(self.size_of(args))
        if graph is not None:
            return graph(*args)
        if not self.capturing:
            return self.fn(*args)
        statics = [a.clone() for a in args]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = self.fn(*args)
            recorded, static_out = self.api.capture(self.fn, statics)
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graphs[self.size_of(args)] = Replayer(self.api, recorded, static_out, self.fn,
                                                   copies=list(enumerate(statics)))
        return out

    def replays(self) -> int:
        return sum(g.replays for g in self.graphs.values())
