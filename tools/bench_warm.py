"""Warm start of cachebuild vs torch.compile and torch's AOT precompile (CPU mode).

Side by side in one run on ``examples/llama.py`` (default 8 layers, hidden 256: a size
that takes torch.compile tens of seconds cold on a small CPU box), each mode in a fresh
process, timing the compile call to the first output (32 tokens) and checking it
against eager (rtol = atol = 1e-3):

- ``torch.compile cold``: ``torch.compile(model, dynamic=True)``, empty Inductor cache;
- ``torch.compile warm caches``: a new process reusing that Inductor cache dir;
- ``AOT precompile (compile + save)``: ``torch.compile(model.forward, fullgraph=True)
  .aot_compile(((ids, pos), {}))`` with the token dim marked dynamic
  (``torch._dynamo.mark_dynamic``), then ``save_compiled_function``; with
  ``dynamic=True`` instead, torch 2.13's ``aot_compile_fullgraph`` fails on this model with
  an uncaught ``TensorifyScalarRestartAnalysis`` (plain torch.compile catches and restarts);
- ``AOT precompile load``: a new process, ``torch.compiler.load_compiled_function`` then
  the first call (the module is passed as ``self``), same Inductor cache dir;
- ``cachebuild cold``: ``cachebuild.compile`` into an empty store, empty Inductor cache;
- ``cachebuild warm``: a new process, same store, empty Inductor cache.

Where the installed torch lacks the AOT precompile API, or it fails on this model, the
row says so with the error. Goals: cachebuild warm >= 20x faster than torch.compile with
warm caches and >= 10x faster than the AOT precompile load.

The measuring child is ``tools/bench_build.py --child``. Usage::

    python tools/bench_warm.py [--layers 8] [--repeat 2] [--markdown] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from benchlib import add_output_options, present, render_table

_SPEC = importlib.util.spec_from_file_location(
    "bench_build", Path(__file__).resolve().parent / "bench_build.py")
assert _SPEC is not None and _SPEC.loader is not None
bb = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bb)

MODES = [("torch_cold", "torch.compile cold"),
         ("torch_warm", "torch.compile warm caches"),
         ("aot_save", "AOT precompile (compile + save)"),
         ("aot_load", "AOT precompile load"),
         ("cb_cold", "cachebuild cold"),
         ("cb_warm", "cachebuild warm")]


def has_aot_api() -> str | None:
    """None if this torch has the AOT precompile API, else why not."""
    import torch

    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function"
    try:
        import torch._dynamo.aot_compile  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile ({exc})"
    return None


def bench(layers: int, repeat: int, work: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in MODES}
    missing = has_aot_api()
    for i in range(repeat):
        ind = work / f"torch-{i}"
        runs["torch_cold"].append(bb.run_child("torch", layers, ind))
        runs["torch_warm"].append(bb.run_child("torch", layers, ind))
        if missing is None:
            aind, art = work / f"aot-{i}", work / f"aot-{i}.bin"
            runs["aot_save"].append(bb.run_child("aot_save", layers, aind, artifact=art))
            if "seconds" in runs["aot_save"][-1]:
                runs["aot_load"].append(bb.run_child("aot_load", layers, aind, artifact=art))
        store = work / f"store-{i}"
        runs["cb_cold"].append(bb.run_child("cachebuild", layers, work / f"cbind-{i}", store))
        runs["cb_warm"].append(bb.run_child("cachebuild", layers, work / f"cbind2-{i}", store))
        bb.log(f"  round {i + 1}: " + ", ".join(
            f"{name} {bb._s(runs[k][-1])}" for k, name in MODES if runs[k]))
    return {"layers": layers, "repeat": repeat, "aot_api_missing": missing,
            "modes": {k: bb.summary(v) for k, v in runs.items()}}


def render(result: dict[str, Any], markdown: bool) -> str:
    modes = result["modes"]
    warm = modes["cb_warm"]
    rows = []
    for key, name in MODES:
        s = modes[key]
        if s["n"]:
            r = bb.ratio(s, warm)
            rows.append([name, bb.fmt(s), f"{r:.1f}x" if r else "-",
                         "yes" if s["matches"] else "NO"])
        else:
            why = result["aot_api_missing"] if key.startswith("aot") else None
            err = (s["errors"][0].get("error") if s["errors"] else None)
            rows.append([name, "not measured", "-", why or err or "-"])
    head = ["mode", "compile call -> first output (s)", "vs cachebuild warm",
            "matches eager"]
    lines = render_table(head, rows, markdown)
    lines.append("")
    lines.append(f"{result['layers']} layers; min / median of {result['repeat']} "
                 "fresh processes (one figure when there was one run).")
    tc_cold = modes["torch_cold"]
    if tc_cold["n"] and tc_cold["min"] < 20:
        lines.append(f"Note: torch.compile cold took {tc_cold['min']:.1f} s (< 20 s); "
                     "use more --layers for the size the goal is stated at.")
    for key, goal in (("torch_warm", 20), ("aot_load", 10)):
        r = bb.ratio(modes[key], warm)
        name = dict(MODES)[key]
        if r is None:
            lines.append(f"Goal cachebuild warm >= {goal}x faster than {name}: not measured.")
        else:
            verdict = "met" if r >= goal else "NOT met"
            lines.append(f"Goal cachebuild warm >= {goal}x faster than {name}: {r:.1f}x, "
                         f"{verdict}.")
    built = [r.get("built") for r in modes["cb_warm"]["runs"]]
    lines.append(f"cachebuild warm: targets built {built} (0 expected).")
    return "\n".join(lines)


def show(result: dict[str, Any], markdown: bool) -> None:
    info = result["machine"]
    print(f"{info['date']}; {info['nproc']} x {info['cpu']} ({info['arch']}); "
          f"torch {info['torch']}; LLAMA_LAYERS={result['layers']}, "
          + ", ".join(f"{k}={v}" for k, v in bb.SIZE_ENV.items()))
    print(render(result, markdown))
    for key, name in MODES:
        for err in result["modes"][key]["errors"]:
            print(f"error, {name}: {err.get('error')}\n  "
                  + "\n  ".join(err.get("stderr_tail", [])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder depth (default: 8)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="fresh-process rounds per mode (default: 2)")
    add_output_options(parser)
    args = parser.parse_args()

    def measure() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
            info = bb.start("cpu", Path(tmp))
            result = bench(args.layers, args.repeat, Path(tmp))
        return {**result, "machine": info}

    present(args, measure, show)


if __name__ == "__main__":
    main()
