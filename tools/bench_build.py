"""Cold build and second-process load of cachebuild vs plain torch.compile, by depth (CPU).

Side by side in one run on ``examples/llama.py`` scaled for CPU (hidden 256, 8 heads,
2 KV heads, MLP 688) at several depths (default 2, 8 and 22 layers). Every measurement
runs in a fresh process and times the compile call to the first output (32 tokens),
then checks that output against eager (rtol = atol = 1e-3):

- ``torch.compile cold``: ``torch.compile(model, dynamic=True)``, empty Inductor cache;
- ``torch.compile warm``: the same in a new process reusing that Inductor cache dir;
- ``cachebuild cold``: ``cachebuild.compile(model, config(), {0: 0, 1: 0},
  store=LocalStore(empty dir))``, empty Inductor cache;
- ``cachebuild 2nd process``: a new process with the same store and an empty Inductor cache.

The AOTI probe verdict is computed once before anything is timed, so that it does not
land in the first cold build. Goals: 22 layers cold <= 1.3x 2 layers cold, and the
second process >= 10x faster than its cold build.

``--child MODE`` runs one measurement and prints one JSON line; ``tools/bench_warm.py``
uses the same child. Usage::

    python tools/bench_build.py [--layers 2 8 22] [--repeat 2] [--markdown] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchlib import add_output_options, cpu_model, present, render_table

ROOT = Path(__file__).resolve().parent.parent
SIZE_ENV = {"LLAMA_HIDDEN": "256", "LLAMA_HEADS": "8", "LLAMA_KV_HEADS": "2", "LLAMA_MLP": "688"}
TOKENS = 32
TOL = 1e-3


# --------------------------------------------------------------------------- child


def child(mode: str, store_dir: str, artifact: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line on stdout.

    Modes: ``torch`` (torch.compile, dynamic=True), ``cachebuild``, ``aot_save``
    (torch.compile(...).aot_compile, save to ``artifact``), ``aot_load``
    (torch.compiler.load_compiled_function from ``artifact``).
    """
    import torch

    sys.path.insert(0, str(ROOT))
    import examples.llama as llama

    torch.manual_seed(0)
    model = llama.make_model()
    ids, pos = llama.example_inputs(model, tokens=TOKENS)
    report: dict[str, Any] = {"mode": mode}
    with torch.no_grad():
        if mode == "torch":
            t0 = time.perf_counter()
            compiled = torch.compile(model, dynamic=True)
            out = compiled(ids, pos)
            seconds = time.perf_counter() - t0
        elif mode == "cachebuild":
            import cachebuild
            from cachebuild.store.local import LocalStore

            t0 = time.perf_counter()
            compiled = cachebuild.compile(model, llama.config(), {0: 0, 1: 0},
                                          store=LocalStore(store_dir))
            out = compiled(ids, pos)
            seconds = time.perf_counter() - t0
            s = cachebuild.stats()
            report.update(built=s["built"], loaded=s["loaded"], unique=s["unique"],
                          traced=s.get("traced"))
        elif mode == "aot_save":
            t0 = time.perf_counter()
            # dynamic=True fails in aot_compile_fullgraph on this model (an uncaught
            # TensorifyScalarRestartAnalysis); mark the token dim dynamic instead.
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
            fn = torch.compile(model.forward, fullgraph=True).aot_compile(((ids, pos), {}))
            fn.save_compiled_function(artifact)
            out = fn(model, ids, pos) if _takes_self(fn) else fn(ids, pos)
            seconds = time.perf_counter() - t0
        elif mode == "aot_load":
            t0 = time.perf_counter()
            with open(artifact, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
            out = fn(model, ids, pos) if _takes_self(fn) else fn(ids, pos)
            seconds = time.perf_counter() - t0
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        ref = model(ids, pos)
    err = (out - ref).abs().max().item()
    report.update(seconds=seconds, max_abs_err=err,
                  matches=bool(torch.allclose(out, ref, rtol=TOL, atol=TOL)))
    print(json.dumps(report), flush=True)


def _takes_self(fn: Any) -> bool:
    """An AOT-compiled bound ``forward`` is called with the module as its first argument."""
    code = getattr(getattr(fn, "_artifacts", None), "original_code", None)
    names = getattr(code, "co_varnames", ())
    return bool(names) and names[0] == "self"


# --------------------------------------------------------------------------- parent


def machine() -> dict[str, str]:
    import torch

    cpu = cpu_model()
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "nproc": str(os.cpu_count()), "arch": platform.machine(), "cpu": cpu,
            "torch": torch.__version__, "python": platform.python_version()}


def start() -> dict[str, str]:
    """Before measuring: where (``machine()``), and the AOTI probe's verdict, computed now."""
    info = machine()
    log(prime_probe())
    return info


def prime_probe() -> str:
    """Compute (or read) the AOTI toolchain verdict now, outside every timed region."""
    sys.path.insert(0, str(ROOT))
    from cachebuild.backends.probe import verdict

    return verdict("cpu").describe()


def run_child(mode: str, layers: int, inductor_dir: Path, store_dir: Path | None = None,
              artifact: Path | None = None, timeout: float = 900) -> dict[str, Any]:
    """One fresh process of ``child``; its JSON report (or an ``error``) plus ``wall_s``."""
    env = dict(os.environ, **SIZE_ENV, LLAMA_LAYERS=str(layers),
               TORCHINDUCTOR_CACHE_DIR=str(inductor_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", mode,
             str(store_dir or ""), str(artifact or "")],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-12:]
        return {"mode": mode, "error": f"exit {proc.returncode}", "stderr_tail": tail,
                "wall_s": wall}
    report = json.loads(lines[-1])
    report["wall_s"] = wall
    return report


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["seconds"] for r in runs if "seconds" in r]
    out: dict[str, Any] = {"runs": runs, "n": len(ok)}
    if ok:
        out["min"] = min(ok)
        out["median"] = statistics.median(ok)
    out["matches"] = all(r.get("matches") for r in runs) and bool(ok)
    out["errors"] = [r for r in runs if "error" in r]
    return out


def bench_depth(layers: int, repeat: int, work: Path) -> dict[str, Any]:
    """torch.compile cold/warm and cachebuild cold/2nd process at one depth."""
    tc_cold, tc_warm, cb_cold, cb_warm = [], [], [], []
    for i in range(repeat):
        ind = work / f"L{layers}-torch-{i}"
        tc_cold.append(run_child("torch", layers, ind))
        tc_warm.append(run_child("torch", layers, ind))
        store = work / f"L{layers}-store-{i}"
        cb_cold.append(run_child("cachebuild", layers, work / f"L{layers}-cbind-{i}", store))
        cb_warm.append(run_child("cachebuild", layers, work / f"L{layers}-cbind2-{i}", store))
        log(f"  {layers} layers, round {i + 1}: torch cold {_s(tc_cold[-1])}, warm "
            f"{_s(tc_warm[-1])}; cachebuild cold {_s(cb_cold[-1])}, 2nd {_s(cb_warm[-1])}")
    return {"layers": layers, "torch_cold": summary(tc_cold), "torch_warm": summary(tc_warm),
            "cb_cold": summary(cb_cold), "cb_warm": summary(cb_warm)}


def _s(r: dict[str, Any]) -> str:
    return f"{r['seconds']:.2f} s" if "seconds" in r else f"ERROR ({r.get('error')})"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "error"
    if s["n"] == 1:
        return f"{s['min']:.2f}"
    return f"{s['min']:.2f} / {s['median']:.2f}"


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return a["min"] / b["min"] if a.get("n") and b.get("n") else None


def render(result: dict[str, Any], markdown: bool) -> str:
    rows = []
    for d in result["depths"]:
        cb_built = [r.get("built") for r in d["cb_cold"]["runs"]]
        cb_second = [r.get("built") for r in d["cb_warm"]["runs"]]
        speed = ratio(d["cb_cold"], d["cb_warm"])
        ok = all(d[k]["matches"] for k in ("torch_cold", "torch_warm", "cb_cold", "cb_warm"))
        rows.append([str(d["layers"]), fmt(d["torch_cold"]), fmt(d["torch_warm"]),
                     fmt(d["cb_cold"]), fmt(d["cb_warm"]),
                     f"{speed:.1f}x" if speed else "-",
                     f"{cb_built[0]} / {cb_second[0]}", "yes" if ok else "NO"])
    head = ["layers", "torch.compile cold (s)", "torch.compile warm cache (s)",
            "cachebuild cold (s)", "cachebuild 2nd process (s)", "cachebuild cold / 2nd",
            "targets built cold / 2nd", "matches eager"]
    lines = render_table(head, rows, markdown)
    lines.append("")
    lines.append(f"Times: compile call -> first output ({TOKENS} tokens), "
                 f"min / median of {result['repeat']} fresh processes.")
    lines += goals(result)
    return "\n".join(lines)


def goals(result: dict[str, Any]) -> list[str]:
    by = {d["layers"]: d for d in result["depths"]}
    out = []
    lo, hi = min(by), max(by)
    r = ratio(by[hi]["cb_cold"], by[lo]["cb_cold"])
    if r is not None:
        verdict = "met" if r <= 1.3 else "NOT met"
        out.append(f"Goal {hi} layers cold <= 1.3x {lo} layers cold: {r:.2f}x, {verdict}.")
        tr = ratio(by[hi]["torch_cold"], by[lo]["torch_cold"])
        if tr is not None:
            out.append(f"(torch.compile cold, same depths: {tr:.2f}x.)")
    for layers, d in sorted(by.items()):
        s = ratio(d["cb_cold"], d["cb_warm"])
        if s is not None:
            verdict = "met" if s >= 10 else "NOT met"
            out.append(f"Goal 2nd process >= 10x faster than cold, {layers} layers: "
                       f"{s:.1f}x, {verdict}.")
    return out


def show(result: dict[str, Any], markdown: bool) -> None:
    info = result["machine"]
    print(f"{info['date']}; {info['nproc']} x {info['cpu']} ({info['arch']}); "
          f"torch {info['torch']}; " + ", ".join(f"{k}={v}" for k, v in SIZE_ENV.items()))
    print(render(result, markdown))
    for d in result["depths"]:
        for key in ("torch_cold", "torch_warm", "cb_cold", "cb_warm"):
            for err in d[key]["errors"]:
                print(f"error, {d['layers']} layers, {key}: {err.get('error')}\n  "
                      + "\n  ".join(err.get("stderr_tail", [])))


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        args = sys.argv[2:] + ["", ""]
        child(args[0], args[1], args[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 22],
                        help="depths to measure (default: 2 8 22)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="fresh-process rounds per measurement (default: 2)")
    add_output_options(parser)
    args = parser.parse_args()

    def measure() -> dict[str, Any]:
        info = start()
        with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
            depths = [bench_depth(n, args.repeat, Path(tmp)) for n in args.layers]
        return {"machine": info, "repeat": args.repeat, "size": SIZE_ENV, "depths": depths}

    present(args, measure, show)


if __name__ == "__main__":
    main()
