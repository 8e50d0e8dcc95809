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
from collections.abc import Iterator
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

from cachebuild.cli.common import (
    MAX_JOBS,
    MAX_WORLD_SIZE,
    open_store,
    printable,
    safe_text,
    state_of,
    stderr,
    stdout,
)
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
    why: str  # "fresh" when the stored (or pending) entry was used, else why it was traced
    found: Lookup  # what the lookup of the stored entry found
    rank: int | None = None  # the rank it was planned as (``--world-size``), else None


def plan_model(ctx: click.Context, path: str, device: str | None = None,
               pending: dict[str, Entry] | None = None, rank: int | None = None) -> Planned:
    """Load MODEL.py and find its entry: the stored one (or one in ``pending``, planned for
    another rank) if fresh, else a new trace."""
    from cachebuild.modelfile import load_spec
    from cachebuild.plan import Planner

    spec = _spec_on(load_spec(path), device)
    store = open_store(ctx)
    planner = Planner(spec.model, spec.config, spec.dynamic_dims, store, touch=False)
    found = planner.lookup(spec.example_inputs, pending)
    entry = found.entry
    if entry is None:
        who = f" as rank {rank}" if rank is not None else ""
        _console().print(f"tracing {Path(path).name}{who} ({found.why})")
        entry = planner.trace(spec.example_inputs, found)
    return Planned(spec, planner, entry, found.why, found, rank)


def plan_group(ctx: click.Context, path: str, device: str | None,
               world_size: int | None) -> Iterator[Planned]:
    """``plan_model(...)``, or with ``world_size`` one Planned per rank, each planned in
    this process under torch's fake process group as that rank (``distributed.fake_world``:
    no GPUs, no other processes), and handed out while that rank's group is up (what the
    caller checks on the rank's model sees it as the rank). A rank whose model equals an
    earlier rank's (an equal shard) takes that rank's entry without tracing."""
    if world_size is None:
        yield plan_model(ctx, path, device)
        return
    from cachebuild.distributed import fake_world

    pending: dict[str, Entry] = {}
    for rank in range(world_size):
        with fake_world(rank, world_size):
            p = plan_model(ctx, path, device, pending, rank)
            if p.found.entry is None:
                pending[p.entry.key] = p.entry
            yield p


def _to_record(group: list[Planned]) -> list[Planned]:
    """The planned entries that are new (traced here), each once."""
    out: dict[str, Planned] = {}
    for p in group:
        if p.found.entry is None:
            out.setdefault(p.entry.key, p)
    return list(out.values())


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``ranks 0-2, 5``; ``[3]`` → ``rank 3``."""
    parts: list[str] = []
    for r in sorted(set(ranks)):
        if parts and parts[-1].split("-")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + ", ".join(parts)


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
@click.option("--jobs", "-j", type=click.IntRange(min=1, max=MAX_JOBS), default=None,
              help="Worker processes building targets (default: the CPUs this process may use).")
@click.option("--device", metavar="D", help="Move the model and inputs to D (e.g. cuda:0).")
@click.option("--dry-run", is_flag=True, help="Show what would be built; build nothing.")
@click.option("--world-size", type=click.IntRange(min=1, max=MAX_WORLD_SIZE), default=None,
              metavar="N",
              help="MODEL.py is tensor-parallel: plan each of N ranks in this process under "
                   "torch's fake process group (no GPUs, no other processes) and build "
                   "each unique target once for the whole group.")
@click.pass_context
def warm_command(ctx: click.Context, model: str, jobs: int | None, device: str | None,
                 dry_run: bool, world_size: int | None) -> None:
    """Build every missing target of MODEL.py ahead of deploy and record its entry.

    MODEL.py defines build() -> cachebuild.ModelSpec. A target that fails is reported with
    its piece, bucket, key and the compiler's message; the others still build (exit 1).
    With --world-size N, build() is called once per rank, with torch.distributed's rank
    and world size set as torchrun would (a fake process group), and every rank's entry
    is recorded.
    """
    from cachebuild.build import jobs_of
    from cachebuild.explain import label

    start = time.perf_counter()
    group = list(plan_group(ctx, model, device, world_size))
    store = group[0].planner.store
    all_jobs: dict[str, BuildJob] = {}
    for p in group:
        for key, job in jobs_of(p.entry, p.spec.config).items():
            all_jobs.setdefault(key, job)
    missing = [j for key, j in all_jobs.items() if not store.contains(key)]
    console = _console()
    if dry_run:
        _group_table(group, store, console)
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
    for planned in _to_record(group):
        if not planned.planner.record(planned.entry):
            console.print(f"[yellow]no entry recorded[/yellow] (no warm start without Dynamo): "
                          f"{planned.planner.unrecordable}")
    for job, error in failures:
        console.print(f"[red]failed[/red] {label(job.target)} key {job.target.key}: {error}")
    console.print(
        f"{len(all_jobs)} targets: {len(all_jobs) - len(missing)} already stored, {built} built, "
        f"{len(failures)} failed, in {time.perf_counter() - start:.1f} s; {_entries_said(group)}"
    )
    if failures:
        ctx.exit(1)


def _entries_said(group: list[Planned]) -> str:
    """``entry KEY``, or for a world size each distinct entry with the ranks it serves."""
    if len(group) == 1 and group[0].rank is None:
        return f"entry {group[0].entry.key}"
    ranks: dict[str, list[int]] = {}
    for p in group:
        ranks.setdefault(p.entry.key, []).append(p.rank or 0)
    return "entries " + ", ".join(f"{key} ({rank_ranges(r)})" for key, r in ranks.items())



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
    try:
        old = Entry.from_bytes(data)
        return {(t.piece, bucket_label(t.bucket)): t.key for t in old.targets()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}  # not an entry this version reads: nothing to compare with


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


def _target_users(group: list[Planned]) -> dict[str, list[int]]:
    """Target key → the ranks whose entry uses it, in order of first use."""
    users: dict[str, list[int]] = {}
    for p in group:
        for t in p.entry.targets():
            ranks = users.setdefault(t.key, [])
            if (p.rank or 0) not in ranks:
                ranks.append(p.rank or 0)
    return users


def _per_entry(group: list[Planned]) -> list[Planned]:
    """One Planned per distinct entry (ranks with equal shards share one), in order."""
    first: dict[str, Planned] = {}
    for p in group:
        first.setdefault(p.entry.key, p)
    return list(first.values())


def _group_table(group: list[Planned], store: Store, console: Console) -> None:
    """The targets table of one model, or of every rank of a world size: each unique
    target once, with the ranks that share it (a rank with an uneven shard has its own)."""
    from cachebuild.targets import bucket_label

    if len(group) == 1 and group[0].rank is None:
        _targets_table(group[0], store, console)
        return
    users = _target_users(group)
    first: dict[str, tuple[Planned, Any]] = {}
    for p in group:
        for t in p.entry.targets():
            first.setdefault(t.key, (p, t))
    states = {p.entry.key: target_states(p, store) for p in _per_entry(group)}
    entries = len(states)
    table = Table(title=f"{len(group)} ranks: {entries} entr{'y' if entries == 1 else 'ies'}, "
                        f"{len(users)} unique targets")
    for column in ("piece", "bucket", "key", "used by", "state"):
        table.add_column(column)
    for key, ranks in users.items():
        p, t = first[key]
        table.add_row(str(t.piece), bucket_label(t.bucket), key[:16], rank_ranges(ranks),
                      states[p.entry.key][key])
    console.print(table)


_WORLD_SIZE = click.option(
    "--world-size", type=click.IntRange(min=1, max=MAX_WORLD_SIZE), default=None, metavar="N",
    help="MODEL.py is tensor-parallel: plan each of N ranks under torch's fake process group.")


@click.command("plan")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--device", metavar="D", help="Move the model and inputs to D first.")
@_WORLD_SIZE
@click.pass_context
def plan_command(ctx: click.Context, model: str, device: str | None,
                 world_size: int | None) -> None:
    """Show MODEL.py's targets and their state (stored / missing / stale); build nothing.
    With --world-size, each unique target of the group once, with the ranks using it."""
    group = list(plan_group(ctx, model, device, world_size))
    _group_table(group, group[0].planner.store, stdout())


@click.command("explain")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--device", metavar="D", help="Move the model and inputs to D first.")
@_WORLD_SIZE
@click.pass_context
def explain_command(ctx: click.Context, model: str, device: str | None,
                    world_size: int | None) -> None:
    """For every missing target of MODEL.py, the nearest stored one and what differs
    (with --world-size: of every rank, naming the ranks a target serves)."""
    from cachebuild.explain import explain, label

    console = stdout()
    records: list[Any] | None = None
    group: list[Planned] = []
    for planned in plan_group(ctx, model, device, world_size):
        group.append(planned)
        if records is None:  # a shared tier's manifests explain too
            records = list(planned.planner.store.records(shared=True))
        if planned.why != "fresh" and planned.found.key not in {p.found.key for p in group[:-1]}:
            _explain_entry(planned, records, console)  # with this rank's group up
    store = group[0].planner.store
    stored = [(r.key, r.manifest) for r in records or [] if r.kind != "entry" and r.manifest]
    users = _target_users(group)
    missing = 0
    seen: set[str] = set()
    for planned in _per_entry(group):
        states = target_states(planned, store)
        for t in planned.entry.targets():
            if t.key in seen or states[t.key] == "stored":
                continue
            seen.add(t.key)
            missing += 1
            why = explain(t.manifest, stored, t.sources)
            nearest = f"nearest {why.nearest[:16]}" if why.nearest else "no stored target"
            who = f" for {rank_ranges(users[t.key])}" if planned.rank is not None else ""
            # Manifests may come from a shared tier: print them as plain, escaped text.
            line = f"{label(t)} ({t.key[:16]}) {states[t.key]}{who}; {nearest}: " + "; ".join(
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
        console.print(f"{head}: " + "; ".join(safe_text(m.describe(), 300)
                                              for m in found.mismatches))
        return
    nearest = nearest_entry(found.factors, records)
    if nearest is None:
        console.print(f"{head}; no stored entry of {found.factors['model']['class']}")
        return
    key, reasons = nearest
    data = planned.planner.store.get(key, touch=False)
    try:
        stored = Entry.from_bytes(data) if data is not None else None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        stored = None  # not an entry this version reads: its factors are all there is
    if stored is not None:
        spec = planned.spec
        reasons += [safe_text(m.describe(), 300) for m in stored.guard_set().mismatches(
            spec.model, spec.example_inputs)]
    console.print(f"{head}; nearest entry {key[:16]}: " + "; ".join(reasons or ["identical"]))


COMMANDS = (warm_command, plan_command, explain_command)
