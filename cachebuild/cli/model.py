"""Model commands: ``warm``, ``plan``, ``explain``.

``warm`` traces a MODEL.py once, plans its targets, builds every missing one in parallel
worker processes (each under the key's lock, so a concurrent ``warm`` or server never
builds the same target twice), and records the model's entry. ``plan`` and ``explain``
change nothing in the store.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from cachebuild.cli.common import open_store, printable, state_of, stderr, stdout
from cachebuild.errors import UsageError

if TYPE_CHECKING:
    from cachebuild.api import ModelSpec
    from cachebuild.build import BuildJob
    from cachebuild.entry import Entry
    from cachebuild.plan import Lookup, Planner
    from cachebuild.store.base import Store
    from cachebuild.store.options import StoreOptions

# torch and the build graph are imported inside the commands: `cachebuild ls` and
# `--help` should not pay for them.


def _console() -> Console:
    return stderr()


def check_device(device: str) -> str:
    """``device`` if this machine can place tensors on it, else a UsageError saying why."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"--device {device!r} is not a device: write e.g. cpu, cuda or "
                         "cuda:0") from None
    if dev.type == "meta":
        raise UsageError("--device meta holds no data to run a model with; use cpu or cuda")
    try:
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--device {device!r} is not usable here: {first}") from None
    return device


def _spec_on(spec: ModelSpec, device: str | None) -> ModelSpec:
    if device is None:
        return spec
    import torch

    from cachebuild.api import ModelSpec

    check_device(device)

    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in spec.example_inputs)
    return ModelSpec(spec.model.to(device), args, spec.dynamic_dims, spec.config)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


@dataclass
class Planned:
    spec: ModelSpec
    planner: Planner
    entry: Entry
    why: str  # "fresh" when the stored entry was used, else why the model was traced
    found: Lookup  # what the lookup of the stored entry found


def plan_model(ctx: click.Context, path: str, device: str | None = None) -> Planned:
    """Load MODEL.py and find its entry: the stored one if fresh, else a new trace."""
    from cachebuild.modelfile import load_spec
    from cachebuild.plan import Planner

    spec = _spec_on(load_spec(path), device)
    store = open_store(ctx)
    planner = Planner(spec.model, spec.config, spec.dynamic_dims, store, touch=False)
    found = planner.lookup(spec.example_inputs)
    entry = found.entry
    if entry is None:
        _console().print(f"tracing {Path(path).name} ({found.why})")
        entry = planner.trace(spec.example_inputs, found)
    return Planned(spec, planner, entry, found.why, found)


# -- building in worker processes ------------------------------------------------------

_WORKER: dict[str, Any] = {}


#: Warning classes (by name) a worker hands to the parent instead of printing: the parent
#: says each once, not once per worker.
_FORWARDED_WARNINGS = ("RemoteDownWarning", "UnsignedRemoteWarning")


def _worker_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
    if category.__name__ in _FORWARDED_WARNINGS:
        _WORKER.setdefault("warnings", []).append((category.__name__, str(message)))
    else:
        _WORKER["showwarning"](message, category, filename, lineno, file, line)


def _worker_init(model_path: str, options: StoreOptions) -> None:
    from cachebuild.modelfile import import_model
    from cachebuild.store.options import open_store as open_configured

    import_model(model_path)  # registers the model file's custom ops
    _WORKER["showwarning"] = warnings.showwarning
    warnings.showwarning = _worker_warning
    # The store the command line uses: with a remote, builds are single-flight across
    # machines (the lock is in Redis too) and what a worker builds is uploaded.
    _WORKER["store"] = open_configured(options)


def _worker_build(job: BuildJob) -> tuple[str, bool, float, str | None, list[tuple[str, str]]]:
    from cachebuild.build import Builder

    start = time.perf_counter()
    try:
        built = Builder(_WORKER["store"], job.config).build(job)
        error = None
    except Exception as e:  # reported per target; the other targets go on
        built, error = False, str(e)
    said = _WORKER.pop("warnings", [])
    return job.target.key, built, time.perf_counter() - start, error, said


def _warning_classes() -> dict[str, type[Warning]]:
    from cachebuild.store.remote import RemoteDownWarning
    from cachebuild.store.tiered import UnsignedRemoteWarning

    return {"RemoteDownWarning": RemoteDownWarning,
            "UnsignedRemoteWarning": UnsignedRemoteWarning}


def build_jobs(jobs: list[BuildJob], workers: int, model_path: str,
               options: StoreOptions, on_done: Any) -> None:
    """Build ``jobs`` in ``workers`` processes, calling ``on_done(job, built, s, error)``.

    ``options``: what each worker opens its store with (the command line's store). Remote-tier warnings raised in a worker are raised again here,
    so that a remote that goes down is reported once for the run, not once per worker.
    """
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_init,
                             initargs=(model_path, options)) as pool:
        futures = {pool.submit(_worker_build, job): job for job in jobs}
        for future in as_completed(futures):
            _, built, seconds, error, said = future.result()
            for name, message in said:
                warnings.warn(message, _warning_classes()[name], stacklevel=1)
            on_done(futures[future], built, seconds, error)


@click.command("warm")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Worker processes building targets (default: the CPUs this process may use).")
@click.option("--device", metavar="D", help="Move the model and inputs to D (e.g. cuda:0).")
@click.option("--dry-run", is_flag=True, help="Show what would be built; build nothing.")
@click.pass_context
def warm_command(ctx: click.Context, model: str, jobs: int | None, device: str | None,
                 dry_run: bool) -> None:
    """Build every missing target of MODEL.py ahead of deploy and record its entry.

    MODEL.py defines build() -> cachebuild.ModelSpec. A target that fails is reported with
    its piece, bucket, key and the compiler's message; the others still build (exit 1).
    """
    from cachebuild.build import jobs_of
    from cachebuild.explain import label

    start = time.perf_counter()
    planned = plan_model(ctx, model, device)
    store = planned.planner.store
    all_jobs = jobs_of(planned.entry, planned.spec.config)
    missing = [j for key, j in all_jobs.items() if not store.contains(key)]
    console = _console()
    if dry_run:
        _targets_table(planned, store, console)
        console.print(f"dry run: {len(missing)} of {len(all_jobs)} targets would be built")
        return
    failures: list[tuple[BuildJob, str]] = []
    built = 0
    if missing:
        workers = min(jobs or usable_cpus(), len(missing))
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("building", total=len(missing))

            def done(job: BuildJob, was_built: bool, seconds: float, error: str | None) -> None:
                nonlocal built
                built += was_built
                if error:
                    failures.append((job, error))
                progress.update(task, advance=1,
                                description=f"{label(job.target)} {seconds:.1f} s")

            build_jobs(missing, workers, str(Path(model).resolve()), state_of(ctx).options,
                       done)
    if planned.why != "fresh" and not planned.planner.record(planned.entry):
        console.print(f"[yellow]no entry recorded[/yellow] (no warm start without Dynamo): "
                      f"{planned.planner.unrecordable}")
    for job, error in failures:
        console.print(f"[red]failed[/red] {label(job.target)} key {job.target.key}: {error}")
    console.print(
        f"{len(all_jobs)} targets: {len(all_jobs) - len(missing)} already stored, {built} built, "
        f"{len(failures)} failed, in {time.perf_counter() - start:.1f} s; entry {planned.entry.key}"
    )
    if failures:
        ctx.exit(1)


#: The words ``plan`` and ``explain`` both use for a target: ``stored``; ``stale`` (not
#: stored, but the same piece and bucket of the model's previous entry is: something it
#: depends on changed); ``missing`` (not stored, never built).
STATES = ("stored", "stale", "missing")


def target_states(planned: Planned, store: Store) -> dict[str, str]:
    """The state of each target key of the planned entry (see ``STATES``)."""
    from cachebuild.targets import bucket_label

    previous = _previous_targets(store, planned.entry)
    states: dict[str, str] = {}
    for t in planned.entry.targets():
        if t.key in states:
            continue
        if store.contains(t.key):
            states[t.key] = "stored"
            continue
        old = previous.get((t.piece, bucket_label(t.bucket)))
        states[t.key] = "stale" if old and old != t.key and store.contains(old) else "missing"
    return states


def _previous_targets(store: Store, entry: Entry) -> dict[tuple[int, str], str]:
    """Target keys of the newest other stored entry of the same model class."""
    from cachebuild.entry import Entry
    from cachebuild.targets import bucket_label

    best = None
    for record in store.records():
        if record.kind != "entry" or record.key == entry.key:
            continue
        model = (record.manifest or {}).get("model")
        if not isinstance(model, dict) or model.get("class") != entry.factors["model"]["class"]:
            continue
        if best is None or record.created > best.created:
            best = record
    if best is None:
        return {}
    data = store.get(best.key, touch=False)
    if data is None:
        return {}
    old = Entry.from_bytes(data)
    return {(t.piece, bucket_label(t.bucket)): t.key for t in old.targets()}


def _targets_table(planned: Planned, store: Store, console: Console) -> None:
    from cachebuild.targets import bucket_label

    states = target_states(planned, store)
    table = Table(title=f"entry {planned.entry.key} ({'stored' if planned.why == 'fresh' else planned.why})")
    for column in ("piece", "bucket", "key", "state"):
        table.add_column(column)
    seen: set[str] = set()
    for t in planned.entry.targets():
        dup = " (shared)" if t.key in seen else ""
        seen.add(t.key)
        table.add_row(str(t.piece), bucket_label(t.bucket), t.key[:16] + dup, states[t.key])
    console.print(table)


@click.command("plan")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--device", metavar="D", help="Move the model and inputs to D first.")
@click.pass_context
def plan_command(ctx: click.Context, model: str, device: str | None) -> None:
    """Show MODEL.py's targets and their state (stored / missing / stale); build nothing."""
    planned = plan_model(ctx, model, device)
    _targets_table(planned, planned.planner.store, stdout())


@click.command("explain")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--device", metavar="D", help="Move the model and inputs to D first.")
@click.pass_context
def explain_command(ctx: click.Context, model: str, device: str | None) -> None:
    """For every missing target of MODEL.py, the nearest stored one and what differs."""
    from cachebuild.explain import explain, label

    planned = plan_model(ctx, model, device)
    store = planned.planner.store
    records = list(store.records(shared=True))  # a shared tier's manifests explain too
    stored = [(r.key, r.manifest) for r in records if r.kind != "entry" and r.manifest]
    console = stdout()
    if planned.why != "fresh":
        _explain_entry(planned, records, console)
    missing = 0
    seen: set[str] = set()
    states = target_states(planned, store)
    for t in planned.entry.targets():
        if t.key in seen or states[t.key] == "stored":
            continue
        seen.add(t.key)
        missing += 1
        why = explain(t.manifest, stored, t.sources)
        nearest = f"nearest {why.nearest[:16]}" if why.nearest else "no stored target"
        # Manifests may come from a shared tier: print them as plain, escaped text.
        line = f"{label(t)} ({t.key[:16]}) {states[t.key]}; {nearest}: " + "; ".join(
            printable(r, 300) for r in why.reasons)
        console.print(line, markup=False, emoji=False, highlight=False)
    if not missing:
        console.print("every target is stored")


def _explain_entry(planned: Planned, records: list[Any], console: Console) -> None:
    """Why the model's entry was not used: the values its trace read that differ now, or
    the nearest stored entry of the same class and what differs from it."""
    from cachebuild.entry import Entry
    from cachebuild.explain import nearest_entry

    found = planned.found
    head = f"entry {found.key[:16]} not used ({found.why.split(':')[0]})"
    if found.mismatches:
        console.print(f"{head}: " + "; ".join(m.describe() for m in found.mismatches))
        return
    nearest = nearest_entry(found.factors, records)
    if nearest is None:
        console.print(f"{head}; no stored entry of {found.factors['model']['class']}")
        return
    key, reasons = nearest
    data = planned.planner.store.get(key, touch=False)
    if data is not None:
        spec = planned.spec
        reasons += [m.describe() for m in Entry.from_bytes(data).guard_set().mismatches(
            spec.model, spec.example_inputs)]
    console.print(f"{head}; nearest entry {key[:16]}: " + "; ".join(reasons or ["identical"]))


COMMANDS = (warm_command, plan_command, explain_command)
