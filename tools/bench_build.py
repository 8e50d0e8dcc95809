"""Cold build and second-process load of cachebuild vs plain torch.compile, by depth.

Side by side in one run on ``examples/llama.py``, on CPU scaled down (hidden 256, 8 heads,
2 KV heads, MLP 688; default depths 2, 8 and 22) or, with ``--device cuda``, at TinyLlama's
shape in bf16 (hidden 2048, 32 heads, 4 KV heads, MLP 5632; ``--layers 22``). Every
measurement runs in a fresh process and times the compile call to the first output (32
tokens), then checks that output against eager (rtol = atol = 1e-3; 3e-2 in bf16):

- ``torch.compile cold``: ``torch.compile(model, dynamic=True)``, empty Inductor cache;
- ``torch.compile warm``: the same in a new process reusing that Inductor cache dir;
- ``cachebuild cold``: ``cachebuild.compile(model, config(), {0: 0, 1: 0},
  store=LocalStore(empty dir))``, empty Inductor cache (its missing targets build in
  worker processes: ``CACHEBUILD_BUILD_JOBS``, default the CPUs and memory available);
  with the defaults, on a CPU, it serves standalone pieces first (``while_building``
  ``"auto"``) while its AOTI packages build: the process then also reports when those
  are stored (``stored_s``), its own targets, which the 2nd process loads;
- ``cachebuild 2nd process``: a new process with the same store and an empty Inductor cache;
- ``cachebuild warm -j J`` (``--warm-jobs``, default 1 and the default job count):
  ``cachebuild.warm(examples/llama.py, jobs=J)`` into an empty store, then the first
  output of a compile from it; it records each built target's phases (export, lowering,
  Triton, C++ wrapper/kernels/link, packaging, proof, store; summed over the targets)
  and the model's (trace, split);
- ``cachebuild serve`` (``--serve``): a cold server with ``while_building="eager_fusion"``:
  its first output (eager_fusion pieces), then its first output on its own targets
  (built in worker processes meanwhile);
- ``edit rebuild`` (``--edit``): after the last ``warm -j J``, a copy of the model file
  with one line edited (the final norm's epsilon, which only the last piece reads) is
  warmed into that same store in a fresh process, as a user's next ``cachebuild warm``
  after an edit: its seconds (against that cold warm's), the targets it built, and its
  output from the store against the edited model run eagerly.
- ``watched edit`` (with ``--edit``): the same edit saved under ``cachebuild -v warm
  --watch`` (into copies of that store and environment folder, before the edit above):
  the seconds from the save to the round's ``warmed again`` line, once its round was
  ready; then the edited model loaded from that store in a fresh process (nothing built)
  against eager.

- ``fresh machine`` (``--fresh``): ``cachebuild cold``, ``cachebuild warm`` (the
  default job count) and ``torch.compile cold`` as a first run on a new machine has
  them: HOME and XDG_CACHE_HOME point at a new empty folder per run and
  ``CACHEBUILD_PROBE_DIR`` is unset, so the toolchain probe, the ISA checks and the
  precompiled headers (and torch.compile's Triton driver modules) are all paid in the
  timed region, as they are once per machine and user. With ``--fresh`` it is the
  headline, reported beside the primed figures.

For every other measurement the AOTI probe verdict is computed once before anything is
timed, into a probe folder every child shares (``CACHEBUILD_PROBE_DIR``), so that it
lands in no cold build: in real use a machine probes once per environment, not per model
(the primed case). Goals: 22 layers cold <= 1.3x 2 layers cold, the second
process >= 10x faster than its cold build, and (issue 24) cachebuild cold <= torch.compile
cold on a GPU, <= 1.5x on CPU, and a one-line edit rebuilt in <= 20% of a cold warm.

``--child MODE`` runs one measurement and prints one JSON line; ``tools/bench_warm.py``
uses the same child. Usage::

    python tools/bench_build.py [--layers 2 8 22] [--repeat 2] [--markdown] [--json]
    python tools/bench_build.py --device cuda --layers 22 --repeat 3 --serve --edit --markdown
    python tools/bench_build.py --layers 2 --repeat 1 --fresh --markdown    # a new machine
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

from benchlib import add_output_options, cpu_model, present, primed, render_table

ROOT = Path(__file__).resolve().parent.parent
SIZE_ENV = {"LLAMA_HIDDEN": "256", "LLAMA_HEADS": "8", "LLAMA_KV_HEADS": "2", "LLAMA_MLP": "688"}
#: TinyLlama-1.1B's shape, for a GPU run (bf16 there by default).
GPU_SIZE_ENV = {"LLAMA_HIDDEN": "2048", "LLAMA_HEADS": "32", "LLAMA_KV_HEADS": "4",
                "LLAMA_MLP": "5632", "LLAMA_DEVICE": "cuda"}
TOKENS = 32
TOL = 1e-3
BF16_TOL = 3e-2


# --------------------------------------------------------------------------- child


def child(mode: str, store_dir: str, artifact: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line on stdout.

    Modes: ``torch`` (torch.compile, dynamic=True), ``cachebuild``, ``warm:J``,
    ``serve``, ``rewarm`` (``cachebuild.warm`` of the model file ``artifact``, then a
    compile from the store), ``aot_save`` (torch.compile(...).aot_compile, save to
    ``artifact``), ``aot_load`` (torch.compiler.load_compiled_function from ``artifact``).
    """
    import torch

    if os.environ.get("BENCH_TIMELINE"):  # what happened when, for --timeline
        import logging

        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(relativeCreated)9.0f ms %(processName)s %(name)s: "
                                   "%(message)s")
    sys.path.insert(0, str(ROOT))
    if mode == "rewarm":
        from cachebuild.modelfile import import_model

        llama = import_model(artifact)
    else:
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
            from cachebuild.store import LocalStore

            t0 = time.perf_counter()
            compiled = cachebuild.compile(model, llama.config(), {0: 0, 1: 0},
                                          store=LocalStore(store_dir))
            out = compiled(ids, pos)
            seconds = time.perf_counter() - t0
            s = cachebuild.stats()
            report.update(built=s["built"], loaded=s["loaded"], unique=s["unique"],
                          traced=s.get("traced"))
            if compiled.swap is not None:  # served interim pieces: when its own are stored
                report["stored_ok"] = compiled.wait_built() and compiled.swap.error is None
                report["stored_s"] = time.perf_counter() - t0
                report["served_with"] = "standalone pieces, then its own"
        elif mode.startswith("warm:") or mode == "rewarm":
            path = artifact if mode == "rewarm" else str(ROOT / "examples" / "llama.py")
            report.update(_warm_then_load(mode, path, model, ids, pos, store_dir, llama))
            out, seconds = report.pop("out"), report["seconds"]
        elif mode == "serve":
            report.update(_serve_while_building(model, ids, pos, store_dir, llama))
            out, seconds = report.pop("out"), report["seconds"]
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
    tol = BF16_TOL if ref.dtype == torch.bfloat16 else TOL
    err = (out.float() - ref.float()).abs().max().item()
    report.update(seconds=seconds, max_abs_err=err,
                  matches=bool(torch.allclose(out, ref, rtol=tol, atol=tol))
                  and report.get("matches", True))
    print(json.dumps(report), flush=True)


def _warm_then_load(mode: str, path: str, model: Any, ids: Any, pos: Any, store_dir: str,
                    llama: Any) -> dict[str, Any]:
    """``warm:J``: ``cachebuild.warm`` of the model file ``path`` with J jobs (0 or
    ``rewarm``: the default) into ``store_dir``, timed, then a compile from that store to
    its first output."""
    import cachebuild
    from cachebuild.building.pool import jobs_here
    from cachebuild.store import LocalStore
    from cachebuild.warming import warm

    jobs = (int(mode.split(":", 1)[1]) or None) if mode.startswith("warm:") else None
    store = LocalStore(store_dir)
    t0 = time.perf_counter()
    report = warm(path, store=store, jobs=jobs)
    seconds = time.perf_counter() - t0
    phases: dict[str, float] = {}
    reused = 0
    for target in report.built:
        reused += target.reused
        for name, value in target.phases.items():
            phases[name] = phases.get(name, 0.0) + value
    t1 = time.perf_counter()
    compiled = cachebuild.compile(model, llama.config(), {0: 0, 1: 0}, store=store)
    out = compiled(ids, pos)
    return {"seconds": seconds, "load_s": time.perf_counter() - t1, "out": out,
            "jobs": jobs or jobs_here(len(report.targets)), "built": len(report.built),
            "failed": len(report.failed), "stored": len(report.stored),
            "target_phases": phases, "cxx_reused": reused,
            "model_phases": dict(report.phases), "build_s": sum(t.seconds for t in report.built)}


def _serve_while_building(model: Any, ids: Any, pos: Any, store_dir: str,
                          llama: Any) -> dict[str, Any]:
    """A cold server that serves eager_fusion pieces while its own build: the seconds to
    its first output, and to its first output on its own targets."""
    import dataclasses

    import torch

    import cachebuild
    from cachebuild.store import LocalStore

    config = dataclasses.replace(llama.config(), while_building="eager_fusion")
    t0 = time.perf_counter()
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=LocalStore(store_dir))
    first = compiled(ids, pos).clone()
    seconds = time.perf_counter() - t0
    built = compiled.wait_built()
    out = compiled(ids, pos)  # the first call on its own targets
    swapped = time.perf_counter() - t0
    ref = model(ids, pos)
    tol = BF16_TOL if ref.dtype == torch.bfloat16 else TOL
    swap = compiled.swap
    return {"seconds": seconds, "swapped_s": swapped, "out": out, "built_ok": built,
            "swap_error": swap.error if swap is not None else "nothing built meanwhile",
            "matches": bool(torch.allclose(first.float(), ref.float(), rtol=tol, atol=tol)),
            "swaps": cachebuild.stats()["swaps"]}


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


def start(device: str, work: Path) -> dict[str, str]:
    """Before measuring: where (``machine()``), and everything a first process pays once
    per machine, done now outside every timed region: torch's bytecode compiled into one
    cache (``PYTHONPYCACHEPREFIX``) and the AOTI probe's verdict computed into one folder
    (``CACHEBUILD_PROBE_DIR``), both in ``work`` unless set, which every child uses (but
    the ``--fresh`` ones, which pay the probe as a new machine does)."""
    info = machine()
    if device.startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor-prime"))
    info["toolchain"] = primed(env, work, device)
    for name in ("PYTHONPYCACHEPREFIX", "CACHEBUILD_PROBE_DIR"):
        os.environ[name] = env[name]
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return info


def without_objects(folder: Path) -> Path:
    """A copy, at ``folder``, of the primed environment folder (``CACHEBUILD_PROBE_DIR``)
    without the C++ objects builds keep there (its files hard-linked, not copied): the
    toolchain's verdict and precompiled headers as on a machine that has built other
    models, but nothing of this one. Every store on a machine shares those objects, so a
    cold build measured with the folder an earlier child filled would reuse that child's
    compiles and be no cold build."""
    import shutil

    from cachebuild.backends.environment import OBJECTS

    primed_dir = Path(os.environ["CACHEBUILD_PROBE_DIR"])
    skip = {primed_dir / name for name in OBJECTS}
    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:  # another filesystem
            shutil.copy2(source, target)

    shutil.copytree(primed_dir, folder, copy_function=link,
                    ignore=lambda d, names: [n for n in names if Path(d) / n in skip])
    return folder


def run_child(mode: str, layers: int, inductor_dir: Path, store_dir: Path | None = None,
              artifact: Path | None = None, timeout: float = 900,
              size: dict[str, str] | None = None, home: Path | None = None,
              environment: Path | None = None) -> dict[str, Any]:
    """One fresh process of ``child``; its JSON report (or an ``error``) plus ``wall_s``.
    ``home``: run it as on a new machine, with HOME and XDG_CACHE_HOME there (a new empty
    folder) and no shared probe folder. ``environment``: its environment folder instead
    of the shared one (``without_objects``). With ``$BENCH_TIMELINE`` (``--timeline``)
    set, the child logs what it does, timed from its start, and its standard error is
    kept there."""
    env = dict(os.environ, **(size or SIZE_ENV), LLAMA_LAYERS=str(layers),
               TORCHINDUCTOR_CACHE_DIR=str(inductor_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if environment is not None:
        env["CACHEBUILD_PROBE_DIR"] = str(environment)
    if home is not None:
        home.mkdir(mode=0o700, parents=True)
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
        env.pop("CACHEBUILD_PROBE_DIR", None)
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
    if os.environ.get("BENCH_TIMELINE"):
        timeline = Path(os.environ["BENCH_TIMELINE"])
        timeline.mkdir(parents=True, exist_ok=True)
        label = f"L{layers}-{mode.replace(':', '')}{'-fresh' if home else ''}"
        count = sum(1 for p in timeline.glob(f"{label}*.log")
                    if p.stem == label or p.stem.removeprefix(f"{label}-").isdigit())
        (timeline / f"{label}{f'-{count}' if count else ''}.log").write_text(proc.stderr)
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


def bench_depth(layers: int, repeat: int, work: Path, warm_jobs: list[int] = (),
                serve: bool = False, size: dict[str, str] | None = None,
                edit: bool = False, fresh: bool = False) -> dict[str, Any]:
    """torch.compile cold/warm and cachebuild cold/2nd process at one depth; and
    ``cachebuild warm`` at each of ``warm_jobs`` (0: the default count) and a cold server
    serving while it builds (``serve``), each into an empty store and Inductor cache; and
    (``edit``) the rebuild after a one-line edit, into the last warm's store; and
    (``fresh``) cachebuild cold and ``cachebuild warm`` as on a new machine (a new HOME
    each, no probe folder anywhere)."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in COLUMNS}
    for i in range(repeat):
        if fresh:
            runs.setdefault("fresh_cold", []).append(run_child(
                "cachebuild", layers, work / f"L{layers}-fcind-{i}", work / f"L{layers}-fstore-{i}",
                size=size, home=work / f"L{layers}-fhome-{i}"))
            runs.setdefault("fresh_warm", []).append(run_child(
                "warm:0", layers, work / f"L{layers}-fwind-{i}", work / f"L{layers}-fwstore-{i}",
                size=size, home=work / f"L{layers}-fwhome-{i}"))
            # torch.compile's own first run pays its per-user caches too (Triton's driver
            # modules, built into ~/.triton on first use)
            runs.setdefault("fresh_torch", []).append(run_child(
                "torch", layers, work / f"L{layers}-ftind-{i}", size=size,
                home=work / f"L{layers}-fthome-{i}"))
            log(f"  {layers} layers, round {i + 1}, fresh machine: cachebuild cold "
                f"{_s(runs['fresh_cold'][-1])}, warm {_s(runs['fresh_warm'][-1])}; "
                f"torch.compile cold {_s(runs['fresh_torch'][-1])}")
        ind = work / f"L{layers}-torch-{i}"
        runs["torch_cold"].append(run_child("torch", layers, ind, size=size))
        runs["torch_warm"].append(run_child("torch", layers, ind, size=size))
        store = work / f"L{layers}-store-{i}"
        # Each cold build with an environment folder of its own, without the objects
        # earlier children kept; its second process and its edit reuse that folder.
        environment = without_objects(work / f"L{layers}-env-{i}")
        runs["cb_cold"].append(run_child("cachebuild", layers, work / f"L{layers}-cbind-{i}",
                                         store, size=size, environment=environment))
        runs["cb_warm"].append(run_child("cachebuild", layers, work / f"L{layers}-cbind2-{i}",
                                         store, size=size, environment=environment))
        said = [f"torch cold {_s(runs['torch_cold'][-1])}, warm {_s(runs['torch_warm'][-1])}",
                f"cachebuild cold {_s(runs['cb_cold'][-1])}, 2nd {_s(runs['cb_warm'][-1])}"]
        for jobs in warm_jobs:
            name = f"warm_j{jobs}"
            runs.setdefault(name, []).append(run_child(
                f"warm:{jobs}", layers, work / f"L{layers}-wind-{jobs}-{i}",
                work / f"L{layers}-wstore-{jobs}-{i}", size=size,
                environment=without_objects(work / f"L{layers}-wenv-{jobs}-{i}")))
            said.append(f"warm -j {runs[name][-1].get('jobs', jobs or 'default')} "
                        f"{_s(runs[name][-1])}")
        if edit and warm_jobs:
            jobs = warm_jobs[-1]
            # The watched edit first, then the store and environment folder put back as
            # the cold warm left them, at the same paths (a C++ object is reused only
            # where its compile names the same files), for the edit below.
            folders = [work / f"L{layers}-{name}-{jobs}-{i}" for name in ("wind", "wstore", "wenv")]
            kept = [_copy(folder, "kept") for folder in folders if folder.exists()]
            r = watch_edit(layers, *folders[:2], work / f"L{layers}-watch-{i}", size, folders[2])
            for copy in kept:
                _put_back(copy, copy.with_name(copy.name.removesuffix("-kept")))
            r["cold_warm_s"] = runs[f"warm_j{jobs}"][-1].get("seconds")
            runs.setdefault("watch_edit", []).append(r)
            said.append(f"watched edit {_s(r)} ({r.get('built')} built)")
            edited = edited_model(work / f"L{layers}-edit-{i}")
            r = run_child("rewarm", layers, work / f"L{layers}-wind-{jobs}-{i}",
                          work / f"L{layers}-wstore-{jobs}-{i}", edited, size=size,
                          environment=work / f"L{layers}-wenv-{jobs}-{i}")
            r["cold_warm_s"] = runs[f"warm_j{jobs}"][-1].get("seconds")
            runs.setdefault("edit", []).append(r)
            said.append(f"edit rebuild {_s(r)} ({r.get('built')} built)")
        if serve:
            runs.setdefault("serve", []).append(run_child(
                "serve", layers, work / f"L{layers}-sind-{i}", work / f"L{layers}-sstore-{i}",
                size=size, environment=without_objects(work / f"L{layers}-senv-{i}")))
            r = runs["serve"][-1]
            said.append(f"serving while building: first output {_s(r)}, own targets at "
                        f"{r.get('swapped_s', float('nan')):.2f} s")
        log(f"  {layers} layers, round {i + 1}: " + "; ".join(said))
    return {"layers": layers, **{k: summary(v) for k, v in runs.items()}}


#: The line ``--edit`` changes in a copy of examples/llama.py, and what it becomes: the
#: final norm's epsilon, read by the last piece only.
EDIT = ("self.norm = nn.RMSNorm(hidden, eps=1e-5)", "self.norm = nn.RMSNorm(hidden, eps=1e-6)")


def edited_model(folder: Path) -> Path:
    """A copy of examples/llama.py in ``folder`` with the ``EDIT`` line changed."""
    text = (ROOT / "examples" / "llama.py").read_text()
    if text.count(EDIT[0]) != 1:
        raise SystemExit(f"examples/llama.py no longer has the line --edit changes: {EDIT[0]}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama.py"
    path.write_text(text.replace(EDIT[0], EDIT[1]))
    return path


def _copy(folder: Path, suffix: str) -> Path:
    """A copy of ``folder`` beside it (``folder-suffix``)."""
    import shutil

    target = folder.with_name(f"{folder.name}-{suffix}")
    shutil.copytree(folder, target, symlinks=True)
    return target


def _put_back(copy: Path, folder: Path) -> None:
    """``folder`` as ``copy`` holds it (``copy`` moved there)."""
    import shutil

    shutil.rmtree(folder)
    copy.rename(folder)


def watch_edit(layers: int, inductor_dir: Path, store_dir: Path, folder: Path,
               size: dict[str, str] | None, environment: Path) -> dict[str, Any]:
    """``cachebuild -v warm --watch`` of a copy of examples/llama.py into a warmed store:
    once its next round is ready, the ``EDIT`` line is changed, and the seconds from that
    write to the round's ``warmed again`` line are the edit's, as a user who saves the
    file sees them; then the edited model is loaded from the store in a fresh process
    (``rewarm``: nothing to build) and checked against eager."""
    import re
    import signal

    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "llama.py"
    text = (ROOT / "examples" / "llama.py").read_text()
    model.write_text(text)
    env = dict(os.environ, **(size or SIZE_ENV), LLAMA_LAYERS=str(layers),
               TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), CACHEBUILD_PROBE_DIR=str(environment),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild.cli", "-v", "--cache-dir",
                             str(store_dir), "warm", str(model), "--watch"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen: list[str] = []

    def until(text: str) -> list[str]:
        got = []
        for line in proc.stdout:  # type: ignore[union-attr]
            got.append(line)
            seen.append(line)
            if text in line:
                return got
        raise RuntimeError(f"ended before {text!r}")

    report: dict[str, Any] = {"mode": "watch_edit"}
    try:
        until("ready for the next edit")
        t0 = time.perf_counter()
        model.write_text(text.replace(EDIT[0], EDIT[1]))
        lines = until("warmed again")
        report["seconds"] = time.perf_counter() - t0
        said = "".join(lines)
        counts = re.search(r"(\d+) already stored, (\d+) built, (\d+) failed", said)
        if counts:
            report.update(stored=int(counts[1]), built=int(counts[2]), failed=int(counts[3]))
        phases = re.search(r"^  (export .*)$", said, re.M)
        model_line = re.search(r"^model: (.*)$", said, re.M)
        report["phases_said"] = phases[1] if phases else ""
        report["model_said"] = model_line[1] if model_line else ""
        report["round_said"] = lines[-1].strip()
    except RuntimeError as e:
        report.update(error=str(e), stderr_tail=seen[-12:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if "error" in report:
        return report
    check = run_child("rewarm", layers, inductor_dir, store_dir, model, size=size,
                      environment=environment)
    report["matches"] = bool(check.get("matches")) and check.get("built") == 0
    if "error" in check or check.get("built"):
        report["check"] = check
    return report


#: The measurements every depth has.
COLUMNS = ("torch_cold", "torch_warm", "cb_cold", "cb_warm")
#: A first run on a new machine's (``--fresh``).
FRESH = ("fresh_cold", "fresh_warm", "fresh_torch")


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
    extra = [k for d in result["depths"] for k in d
             if k.startswith("warm_j") or k in ("serve", "edit", "watch_edit")]
    fresh = any("fresh_cold" in d for d in result["depths"])
    extra = sorted(set(extra), key=extra.index)
    for d in result["depths"]:
        cb_built = [r.get("built") for r in d["cb_cold"]["runs"]]
        cb_second = [r.get("built") for r in d["cb_warm"]["runs"]]
        speed = ratio(d["cb_cold"], d["cb_warm"])
        ok = all(d[k]["matches"] for k in (*COLUMNS, *extra, *FRESH) if k in d)
        vs_torch = ratio(d["cb_cold"], d["torch_cold"])
        rows.append([str(d["layers"]),
                     *(fmt(d.get(k, {})) for k in FRESH if fresh),
                     fmt(d["torch_cold"]), fmt(d["torch_warm"]),
                     fmt(d["cb_cold"]), f"{vs_torch:.2f}x" if vs_torch else "-",
                     fmt(d["cb_warm"]), f"{speed:.1f}x" if speed else "-",
                     *(fmt(d[k]) if k in d else "-" for k in extra),
                     f"{cb_built[0]} / {cb_second[0]}", "yes" if ok else "NO"])
    head = ["layers",
            *(("fresh machine: cachebuild cold (s)", "fresh machine: cachebuild warm (s)",
               "fresh machine: torch.compile cold (s)") if fresh else ()),
            "torch.compile cold (s)", "torch.compile warm cache (s)",
            "cachebuild cold (s)", "cachebuild cold / torch.compile cold",
            "cachebuild 2nd process (s)", "cachebuild cold / 2nd",
            *(_extra_head(k, result) for k in extra),
            "targets built cold / 2nd", "matches eager"]
    lines = render_table(head, rows, markdown)
    lines.append("")
    for d in result["depths"]:
        if "fresh_cold" in d:  # the headline: what a first run on a new machine costs
            lines.append(f"{d['layers']} layers, fresh machine (no environment folder): "
                         f"cachebuild cold {fmt(d['fresh_cold'])} s, cachebuild warm "
                         f"{fmt(d['fresh_warm'])} s, torch.compile cold "
                         f"{fmt(d.get('fresh_torch', {}))} s; primed (environment folder "
                         f"made before): cachebuild cold {fmt(d['cb_cold'])} s.")
        for name, label in (("fresh_cold", "fresh machine"), ("cb_cold", "primed")):
            for r in d.get(name, {}).get("runs", []):
                if "stored_s" in r:  # the default on a CPU: standalone pieces first
                    lines.append(f"{d['layers']} layers, {label}: cachebuild cold served "
                                 f"standalone pieces at {r['seconds']:.2f} s; its own "
                                 f"targets stored at {r['stored_s']:.2f} s"
                                 f"{'' if r.get('stored_ok') else ' (their build FAILED)'}")
    lines.append(f"Times: compile call -> first output ({TOKENS} tokens), "
                 f"min / median of {result['repeat']} fresh processes; `warm -j J`: "
                 "cachebuild.warm into an empty store.")
    for d in result["depths"]:
        for k in extra:
            for r in d.get(k, {}).get("runs", []):
                if k == "serve" and "swapped_s" in r:
                    lines.append(f"{d['layers']} layers, serving while building: first "
                                 f"output {r['seconds']:.2f} s, first on its own targets "
                                 f"{r['swapped_s']:.2f} s ({r.get('swap_error') or 'swapped'})")
                if k == "watch_edit" and "seconds" in r:
                    lines.append(f"{d['layers']} layers, rebuild after a one-line edit under "
                                 f"`warm --watch`: {r['seconds']:.2f} s from the save, "
                                 f"{r.get('built')} built and {r.get('stored')} already stored "
                                 f"({r.get('phases_said')}; model: {r.get('model_said')})")
                if "target_phases" not in r:
                    continue
                phases = ", ".join(f"{n} {v:.1f}" for n, v in r["target_phases"].items())
                model = ", ".join(f"{n} {v:.1f}" for n, v in r["model_phases"].items())
                if k == "edit":
                    lines.append(f"{d['layers']} layers, rebuild after a one-line edit: "
                                 f"{r['seconds']:.2f} s, {r['built']} built and "
                                 f"{r['stored']} already stored ({phases} s; "
                                 f"{r['cxx_reused']} C++ objects reused); model: {model} s")
                else:
                    lines.append(f"{d['layers']} layers, warm -j {r['jobs']}: {r['built']} "
                                 f"targets, {r['build_s']:.1f} s of builds ({phases} s; "
                                 f"{r['cxx_reused']} C++ objects reused); model: {model} s; "
                                 f"then first output in {r['load_s']:.2f} s")
    lines += goals(result)
    return "\n".join(lines)


def _extra_head(key: str, result: dict[str, Any]) -> str:
    if key == "serve":
        return "cachebuild serve while building, first output (s)"
    if key == "edit":
        return "cachebuild rebuild after a one-line edit (s)"
    if key == "watch_edit":
        return "the same edit under warm --watch (s)"
    jobs = next((r.get("jobs") for d in result["depths"] for r in d.get(key, {}).get("runs", [])
                 if r.get("jobs")), key[len("warm_j"):])
    return f"cachebuild warm -j {jobs} (s)"


def goals(result: dict[str, Any]) -> list[str]:
    by = {d["layers"]: d for d in result["depths"]}
    out = []
    lo, hi = min(by), max(by)
    r = ratio(by[hi]["cb_cold"], by[lo]["cb_cold"]) if hi != lo else None
    if r is not None:
        verdict = "met" if r <= 1.3 else "NOT met"
        out.append(f"Goal {hi} layers cold <= 1.3x {lo} layers cold: {r:.2f}x, {verdict}.")
        tr = ratio(by[hi]["torch_cold"], by[lo]["torch_cold"])
        if tr is not None:
            out.append(f"(torch.compile cold, same depths: {tr:.2f}x.)")
    goal = 1.0 if result.get("device", "cpu").startswith("cuda") else 1.5
    for layers, d in sorted(by.items()):
        r = ratio(d.get("fresh_cold", {}), d.get("fresh_torch", {}))
        if r is not None:
            verdict = "met" if r <= goal else "NOT met"
            out.append(f"Goal first-ever cold start (probe included) <= {goal}x torch.compile's "
                       f"first-ever cold start, {layers} layers: {r:.2f}x "
                       f"({d['fresh_cold']['min']:.1f} of {d['fresh_torch']['min']:.1f} s), "
                       f"{verdict}.")
    for layers, d in sorted(by.items()):
        r = ratio(d["cb_cold"], d["torch_cold"])
        if r is not None:
            verdict = "met" if r <= goal else "NOT met"
            out.append(f"Goal cachebuild cold <= {goal}x torch.compile cold, {layers} layers: "
                       f"{r:.2f}x, {verdict}.")
    for layers, d in sorted(by.items()):
        for key, how in (("edit", "a new `cachebuild warm`"), ("watch_edit", "`warm --watch`")):
            for r in d.get(key, {}).get("runs", []):
                if r.get("seconds") and r.get("cold_warm_s"):
                    share = r["seconds"] / r["cold_warm_s"]
                    verdict = "met" if share <= 0.2 else "NOT met"
                    out.append(f"Goal one-line edit rebuilt in <= 20% of a cold warm, "
                               f"{layers} layers, {how}: {share:.0%} ({r['seconds']:.1f} of "
                               f"{r['cold_warm_s']:.1f} s), {verdict}.")
    for layers, d in sorted(by.items()):
        s = ratio(d["cb_cold"], d["cb_warm"])
        if s is not None:
            verdict = "met" if s >= 10 else "NOT met"
            out.append(f"Goal 2nd process >= 10x faster than cold, {layers} layers: "
                       f"{s:.1f}x, {verdict}.")
    return out


def show(result: dict[str, Any], markdown: bool) -> None:
    info = result["machine"]
    gpu = f"{info['gpu']}; " if info.get("gpu") else ""
    print(f"{info['date']}; {gpu}{info['nproc']} x {info['cpu']} ({info['arch']}); "
          f"torch {info['torch']}; " + ", ".join(f"{k}={v}" for k, v in result.get(
              "size", SIZE_ENV).items()))
    print(render(result, markdown))
    for d in result["depths"]:
        for key in [k for k in d if isinstance(d[k], dict) and "errors" in d[k]]:
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
    parser.add_argument("--device", default="cpu",
                        help="cpu (the scaled-down shape, float32) or cuda (TinyLlama's "
                             "shape, bf16); default cpu")
    parser.add_argument("--warm-jobs", type=int, nargs="*", default=[1, 0], metavar="J",
                        help="`cachebuild warm` job counts to measure, 0 for the default "
                             "(default: 1 0; none: skip)")
    parser.add_argument("--serve", action="store_true",
                        help="also measure a cold server serving while it builds")
    parser.add_argument("--fresh", action="store_true",
                        help="also measure a first run on a new machine (a new HOME per "
                             "run, no probe folder anywhere), reported as the headline")
    parser.add_argument("--edit", action="store_true",
                        help="also measure the rebuild after a one-line edit of the model "
                             "(into the last --warm-jobs store), by a new `cachebuild warm` "
                             "and under `cachebuild warm --watch`")
    parser.add_argument("--timeline", type=Path, metavar="DIR",
                        help="keep each child's log, what it did when (INFO, timed from "
                             "its start), in DIR")
    add_output_options(parser)
    args = parser.parse_args()
    if args.timeline:
        os.environ["BENCH_TIMELINE"] = str(args.timeline.absolute())
    size = dict(GPU_SIZE_ENV) if args.device.startswith("cuda") else dict(SIZE_ENV)
    if args.device.startswith("cuda"):
        size["LLAMA_DEVICE"] = args.device

    def measure() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
            info = start(args.device, Path(tmp))
            depths = [bench_depth(n, args.repeat, Path(tmp), args.warm_jobs, args.serve, size,
                                  args.edit, args.fresh) for n in args.layers]
        return {"machine": info, "repeat": args.repeat, "size": size, "device": args.device,
                "depths": depths}

    present(args, measure, show)


if __name__ == "__main__":
    main()
