"""Warming and planning as library calls: ``cachebuild.warm`` and ``cachebuild.plan``.

``warm(model)`` traces a model once (or finds its stored entry), plans its targets, builds
every missing one and records the entry, so that a server started later loads everything
and traces nothing. ``plan(model)`` says what ``warm`` would do, changing nothing. Both
return a typed report; the ``warm`` and ``plan`` commands print one.

``model`` is a MODEL.py path (a file whose ``build()`` returns a ``ModelSpec``), a
``build`` function, or a ``ModelSpec``. A model file's targets build in worker processes
(each under the key's lock, so a concurrent ``warm`` or server never builds one twice),
which import the file to have its ops; a spec or a function builds in this process, one
target after another, with whatever this process registered (ops, backends, passes). With
``world_size``, ``build()`` is called once per rank under torch's fake process group
(``distributed.fake_world``: no GPUs, no other processes) and every rank's entry recorded.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from cachebuild.api import ModelSpec
from cachebuild.backends import get_backend
from cachebuild.errors import ToolchainRefuted, UsageError

#: What a long wait is doing, as each phase starts (the command line shows it at once).
progress = logging.getLogger("cachebuild.progress")
log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from cachebuild.building.build import BuildJob
    from cachebuild.building.entry import Entry
    from cachebuild.building.planner import Lookup, Planner
    from cachebuild.building.pool import BuildPool
    from cachebuild.config import CompileConfig
    from cachebuild.store import StoreOptions
    from cachebuild.store.interface import Store

#: What ``warm`` and ``plan`` take: a MODEL.py path, a ``build`` function, or a spec.
ModelSource: TypeAlias = "ModelSpec | str | os.PathLike | Callable[[], ModelSpec]"

#: The words ``plan`` and ``explain`` use for a target: ``stored``; ``stale`` (not stored,
#: but the same piece and bucket of the model's previous entry is: something it depends on
#: changed); ``missing`` (not stored, never built). ``warm`` reports ``stored``, ``built``
#: or ``failed``.
STATES = ("stored", "stale", "missing")


# -- reports -------------------------------------------------------------------------------

@dataclass
class TargetReport:
    """One unique target: its key, the pieces and ranks using it, and its state."""

    key: str
    bucket: str  # "range 1-64", "size 8"
    pieces: list[int]
    state: str  # plan: stored / stale / missing; warm: stored / built / failed
    ranks: list[int] = field(default_factory=list)  # ranks using it (with a world size)
    seconds: float = 0.0  # building it (warm)
    error: str | None = None  # why it failed (warm)
    #: where building it went (warm): seconds per phase (``clock.PHASES``)
    phases: dict[str, float] = field(default_factory=dict)
    reused: int = 0  # C++ objects its build took from the work folder's cache (warm)

    @property
    def label(self) -> str:
        return f"piece {self.pieces[0]} {self.bucket}"


@dataclass
class EntryReport:
    """One model entry: its key, the ranks it serves, and whether it was stored already
    (``why`` is ``"fresh"``) or why it was traced."""

    key: str
    why: str
    ranks: list[int] = field(default_factory=list)
    recorded: bool | None = None  # warm: stored now (False: the trace cannot be recorded)
    unrecordable: str | None = None  # why not


@dataclass
class PlanReport:
    """What a model needs: its entries (one, or one per distinct rank) and every unique
    target with its state."""

    entries: list[EntryReport]
    targets: list[TargetReport]
    world_size: int | None = None

    @property
    def entry_key(self) -> str:
        """The key of the model's entry (with a world size: rank 0's)."""
        return self.entries[0].key

    def with_state(self, state: str) -> list[TargetReport]:
        return [t for t in self.targets if t.state == state]


@dataclass
class WarmReport(PlanReport):
    """What ``warm`` did: each target ``stored`` (already there), ``built`` or
    ``failed``, the entries recorded, and the seconds it took."""

    seconds: float = 0.0
    dry_run: bool = False
    #: the model's own phases in this process: ``trace`` and ``split`` (absent: not traced)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def built(self) -> list[TargetReport]:
        return self.with_state("built")

    @property
    def stored(self) -> list[TargetReport]:
        return self.with_state("stored")

    @property
    def failed(self) -> list[TargetReport]:
        return self.with_state("failed")

    @property
    def ok(self) -> bool:
        return not self.failed


# -- models ----------------------------------------------------------------------------------

@dataclass
class Source:
    """A model to warm: how to get its spec, and the model file worker processes import to
    have its ops (None: build in this process)."""

    build: Callable[[], ModelSpec]
    file: Path | None
    name: str  # for messages: the file's name, or the model class's


def source_of(model: ModelSource) -> Source:
    """``model`` (a MODEL.py path, a ``build`` function or a spec) as a Source."""
    from cachebuild.modelfile import check_model_file, load_spec

    if isinstance(model, ModelSpec):
        return Source(lambda: model, None, type(model.model).__name__)
    if isinstance(model, str | os.PathLike):
        path = check_model_file(model)
        return Source(lambda: load_spec(path), path, path.name)
    if callable(model):
        def build() -> ModelSpec:
            spec = model()
            if not isinstance(spec, ModelSpec):
                raise UsageError(f"{getattr(model, '__qualname__', model)!r} returned "
                                 f"{type(spec).__name__}, not a cachebuild.ModelSpec")
            return spec

        return Source(build, None, getattr(model, "__qualname__", "build"))
    raise UsageError(f"cannot warm {type(model).__name__}: give a MODEL.py path, a build() "
                     "function or a cachebuild.ModelSpec")


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

    check_device(device)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in spec.example_inputs)
    return ModelSpec(spec.model.to(device), args, spec.dynamic_dims, spec.config)


# -- planning ----------------------------------------------------------------------------------

@dataclass
class Planned:
    spec: ModelSpec
    planner: Planner
    entry: Entry
    why: str  # "fresh" when the stored (or pending) entry was used, else why it was traced
    found: Lookup  # what the lookup of the stored entry found
    rank: int | None = None  # the rank it was planned as (``world_size``), else None


Say = Callable[[str], None]


def plan_model(source: Source, store: Store, device: str | None = None,
               pending: dict[str, Entry] | None = None, rank: int | None = None,
               say: Say | None = None,
               on_trace: Callable[[CompileConfig, Callable[[], bool]], None] | None = None,
               touch: bool = False) -> Planned:
    """Build the model's spec and find its entry: the stored one (or one in ``pending``,
    planned for another rank) if fresh, else a new trace (``say`` is told why, and
    ``on_trace(config, edited)`` called first: ``edited()`` says whether the model was
    warmed before and its code changed since, ``nearest.edited_since``, a store scan).
    ``touch``: a stored entry found counts as used (``warm``), not only looked at."""
    from cachebuild.building.planner import Planner

    progress.info("importing %s and building its model", source.name)
    spec = _spec_on(source.build(), device)
    progress.info("looking up the entry of %s", source.name)
    planner = Planner(spec.model, spec.config, spec.dynamic_dims, store, touch=touch)
    found = planner.lookup(spec.example_inputs, pending)
    entry = found.entry
    if entry is None:
        if say is not None:
            from cachebuild.building.notice import reason

            who = f" as rank {rank}" if rank is not None else ""
            say(f"tracing {source.name}{who}: {reason(found.why, store, found.factors)}")
        if on_trace is not None:
            from cachebuild.building.nearest import edited_since

            on_trace(spec.config, lambda: edited_since(found.why, store, found.factors))
        progress.info("tracing %s%s", source.name, f" as rank {rank}" if rank is not None
                      else "")
        entry = planner.trace(spec.example_inputs, found)
    return Planned(spec, planner, entry, found.why, found, rank)


def plan_group(source: Source, store: Store, device: str | None = None,
               world_size: int | None = None, say: Say | None = None,
               on_trace: Callable[[CompileConfig, Callable[[], bool]], None] | None = None,
               touch: bool = False) -> Iterator[Planned]:
    """``plan_model(...)``, or with ``world_size`` one Planned per rank, each planned in
    this process under torch's fake process group as that rank, and handed out while that
    rank's group is up (what the caller checks on the rank's model sees it as the rank).
    A rank whose model equals an earlier rank's (an equal shard) takes that rank's entry
    without tracing."""
    if world_size is None:
        yield plan_model(source, store, device, say=say, on_trace=on_trace, touch=touch)
        return
    from cachebuild.tracing.distributed import fake_world

    pending: dict[str, Entry] = {}
    for rank in range(world_size):
        with fake_world(rank, world_size):
            p = plan_model(source, store, device, pending, rank, say, on_trace, touch)
            if p.found.entry is None:
                pending[p.entry.key] = p.entry
            yield p


def target_states(planned: Planned, store: Store) -> dict[str, str]:
    """The state of each target key of the planned entry (see ``STATES``)."""
    from cachebuild.tracing.targets import bucket_label

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
    from cachebuild.building.entry import read_entry
    from cachebuild.building.nearest import entries_of
    from cachebuild.tracing.targets import bucket_label

    others = [r for r in entries_of(store, entry.factors["model"]["class"])
              if r.key != entry.key]
    if not others:
        return {}
    data = store.get(max(others, key=lambda r: r.created).key, touch=False)
    old = read_entry(data) if data is not None else None  # None: another format
    if old is None:
        return {}
    return {(t.piece, bucket_label(t.bucket)): t.key for t in old.targets()}


def per_entry(group: list[Planned]) -> list[Planned]:
    """One Planned per distinct entry (ranks with equal shards share one), in order."""
    first: dict[str, Planned] = {}
    for p in group:
        first.setdefault(p.entry.key, p)
    return list(first.values())


def target_users(group: list[Planned]) -> dict[str, list[int]]:
    """Target key → the ranks whose entry uses it, in order of first use."""
    users: dict[str, list[int]] = {}
    for p in group:
        for t in p.entry.targets():
            ranks = users.setdefault(t.key, [])
            if (p.rank or 0) not in ranks:
                ranks.append(p.rank or 0)
    return users


def _report(group: list[Planned], store: Store, world_size: int | None) -> PlanReport:
    """The plan of a planned group: its entries, and each unique target's state."""
    from cachebuild.tracing.targets import bucket_label

    entries: dict[str, EntryReport] = {}
    for p in group:
        report = entries.setdefault(p.entry.key, EntryReport(p.entry.key, p.why))
        if p.rank is not None:
            report.ranks.append(p.rank)
    users = target_users(group) if world_size is not None else {}
    targets: dict[str, TargetReport] = {}
    for p in per_entry(group):
        states = target_states(p, store)
        for t in p.entry.targets():
            found = targets.get(t.key)
            if found is None:
                targets[t.key] = TargetReport(t.key, bucket_label(t.bucket), [t.piece],
                                              states[t.key], users.get(t.key, []))
            elif t.piece not in found.pieces:
                found.pieces.append(t.piece)
    return PlanReport(list(entries.values()), list(targets.values()), world_size)


#: Where ``warm`` and ``plan`` look: a store, the options, a store directory, or None (the
#: environment's: ``CACHEBUILD_DIR``).
StoreArg: TypeAlias = "Store | StoreOptions | str | os.PathLike | None"


def _options_of(store: StoreArg) -> StoreOptions | None:
    """The options a ``store`` argument names, or None where it is an opened store."""
    from cachebuild.store import StoreOptions

    if store is None or isinstance(store, str | os.PathLike):
        return StoreOptions.from_env(cache_dir=store)
    return store if isinstance(store, StoreOptions) else None


def open_given(store: StoreArg) -> tuple[Store, bool]:
    """The store a ``store`` argument names, and whether it was opened here (and is to be
    closed here). Worker processes ask it how to open it (``Store.reopen_options``)."""
    from cachebuild.store import open_store

    options = _options_of(store)
    if options is not None:
        return open_store(options), True
    return store, False  # type: ignore[return-value]


def plan(model: ModelSource, *, store: StoreArg = None,
         device: str | None = None, world_size: int | None = None,
         say: Say | None = None) -> PlanReport:
    """Every target ``model`` needs and its state (``STATES``), without building or
    storing anything and without counting a use of the store.

    ``store``: a store, its options, or a store directory (default: the environment's,
    ``CACHEBUILD_DIR``). ``device``: move the model and its example inputs there first.
    ``world_size``: plan each rank of a tensor-parallel model. ``say``: told, in words,
    when the model is traced (its entry is not stored). Where ``store`` names a place
    that holds no store, it looks in an empty one, and makes none there.
    """
    from cachebuild.store import open_to_look

    scratch = None
    options = _options_of(store)
    if options is not None:
        opened, scratch = open_to_look(options)
        owned = True
    else:
        opened, owned = store, False  # type: ignore[assignment]
    try:
        group = list(plan_group(source_of(model), opened, device, world_size, say))
        return _report(group, opened, world_size)
    finally:
        if owned:
            opened.close()
        if scratch is not None:
            scratch.cleanup()


# -- building in worker processes ---------------------------------------------------------------

def _warning_classes() -> dict[str, type[Warning]]:
    from cachebuild.store import RemoteDownWarning, UnsignedRemoteWarning

    return {"RemoteDownWarning": RemoteDownWarning,
            "UnsignedRemoteWarning": UnsignedRemoteWarning}


Done = Callable[["BuildJob", bool, float, "str | None"], None]


def start_pool(workers: int, model_path: str, options: StoreOptions) -> BuildPool:
    """``workers`` build workers for a model file, started now (they import torch, Inductor
    and the file while the caller traces)."""
    from cachebuild.building.pool import BuildPool, WorkerSetup
    from cachebuild.trust.processes import withheld_path

    return BuildPool(workers, WorkerSetup(options, model_file=model_path,
                                          withheld=withheld_path()))


def build_jobs(jobs: list[BuildJob], workers: int | BuildPool, model_path: str,
               options: StoreOptions, on_done: Done,
               phases: dict[str, dict[str, Any]] | None = None,
               store: Store | None = None) -> None:
    """Build ``jobs`` in ``workers`` processes (or a pool started already), calling
    ``on_done(job, built, s, error)``, and filling ``phases`` with each build's. Where
    the workers could not import a module the model imports (from a folder of the
    caller's path they are not given: ``processes.withheld_path``) and ``store`` is given,
    those jobs are built in this process instead, which imported the model, with one
    warning that says why.

    ``options``: what each worker opens its store with. Remote-tier warnings raised in a
    worker are raised again here, so that a remote that goes down is reported once for the
    run, not once per worker. Jobs go out longest first (the piece with most nodes), so
    that the last one to finish is a short one.
    """
    from cachebuild.building.pool import NOT_SET_UP, BuildPool

    pool = workers if isinstance(workers, BuildPool) else start_pool(workers, model_path, options)
    not_set_up: list[tuple[BuildJob, str]] = []
    died: list[tuple[BuildJob, str]] = []
    again = False

    def done(job: BuildJob, result: Any) -> None:
        error = result.error or ""
        if store is not None and result.died and error.startswith(NOT_SET_UP) \
                and "No module named" in error:
            not_set_up.append((job, result.error))
            return
        if result.died and not again and not error.startswith(NOT_SET_UP):
            died.append((job, error))  # built once more below, in a new worker, alone
            return
        for name, message in result.warnings:
            warnings.warn(message, _warning_classes()[name], stacklevel=1)
        if phases is not None and result.phases:
            phases[job.target.key] = result.phases
        on_done(job, result.built, result.seconds, result.error)

    try:
        pool.run(sorted(jobs, key=lambda j: -len(j.nodes)), done)
    except KeyboardInterrupt:
        pool.close(now=True)  # the command ends: its builds with it
        raise
    finally:
        if pool is not workers:
            pool.close()
    if died:
        # Its worker ended while it held the job (killed for its memory, say): as a cold
        # start does, once more in a new worker, alone, where it has the machine to itself.
        from cachebuild.building.pool import job_label

        for job, error in died:
            log.warning("%s: %s; building it again in a new worker", job_label(job), error)
        again = True
        with start_pool(1, model_path, options) as fresh:
            fresh.run([job for job, _ in died], done)
    if not_set_up and store is not None:
        log.warning("cachebuild: %s; building %d target%s in this process instead",
                    not_set_up[0][1], len(not_set_up), "" if len(not_set_up) == 1 else "s")
        _build_here([job for job, _ in not_set_up], store, on_done, phases)


def _build_here(jobs: list[BuildJob], store: Store, on_done: Done,
                phases: dict[str, dict[str, Any]] | None = None) -> None:
    """Build ``jobs`` one after another in this process (no file for workers to import)."""
    from cachebuild.building.build import build_one
    from cachebuild.building.pool import job_label

    for job in jobs:
        progress.info("building %s", job_label(job))
        done = build_one(store, job)
        if phases is not None and done.phases:
            phases[job.target.key] = done.phases
        on_done(job, done.built, done.seconds, done.error)


def warm(model: ModelSource, *, store: StoreArg = None,
         jobs: int | None = None, device: str | None = None, world_size: int | None = None,
         dry_run: bool = False, say: Say | None = None,
         on_target: Callable[[TargetReport, int, int], None] | None = None,
         here: int = 0) -> WarmReport:
    """Build every target ``model`` needs that is not stored, and record its entry.

    ``model``: a MODEL.py path, a ``build`` function or a ``ModelSpec``. ``store`` as for
    ``plan``. ``jobs``: worker processes (default: ``CACHEBUILD_BUILD_JOBS`` where set,
    else as many as the CPUs this process may use and the memory available allow:
    ``pool.cold_start_jobs``). ``device``, ``world_size``: as for ``plan``. ``dry_run``:
    build and record nothing (the report's states are then ``plan``'s). ``say``: told, in
    words, when the model is traced; ``on_target(target, done, total)``: called as each
    target finishes. ``here``: up to this many missing targets of a model file build in
    this process, no worker started (a process that has set up Inductor already: a round
    of ``cachebuild warm --watch``); more build in workers.

    A model file's workers start as soon as the model is to be traced, so that their
    imports overlap the trace. Each built target's report holds its build's phases
    (``TargetReport.phases``), the report the model's own (``WarmReport.phases``: trace,
    split).

    Where the toolchain probe refuses the compiler the builds presumed
    (``probe.presumed``), it plans and builds again, with the probe's verdict.

    A target that fails is reported (state ``failed``, with its error) and the others
    still build; the entry is recorded all the same, and a server then builds what
    failed. Bad input (no such file, a ``build()`` that raises) is a UsageError; a work
    folder that is not a private directory of ours (or cannot be made) is an UnsafeStore
    (exit 2), before anything is traced.
    """
    try:
        return warm_once(model, store=store, jobs=jobs, device=device, world_size=world_size,
                         dry_run=dry_run, say=say, on_target=on_target, here=here)
    except ToolchainRefuted as e:
        progress.warning("%s; planning again", e)
        get_backend("inductor").forget_refuted(e.device)
        return warm_once(model, store=store, jobs=jobs, device=device, world_size=world_size,
                         dry_run=dry_run, say=say, on_target=on_target, here=here)


def warm_once(model: ModelSource, *, store: StoreArg = None,
              jobs: int | None = None, device: str | None = None,
              world_size: int | None = None, dry_run: bool = False, say: Say | None = None,
              on_target: Callable[[TargetReport, int, int], None] | None = None,
              here: int = 0) -> WarmReport:
    """``warm``, once."""
    from cachebuild.building.build import jobs_of, proven_by_build
    from cachebuild.building.entry import record_entry
    from cachebuild.building.pool import cold_start_jobs, expected_targets
    from cachebuild.counters import COUNTERS

    start = time.perf_counter()
    opened, owned = open_given(store)
    options = opened.reopen_options()
    pool: BuildPool | None = None
    before = dict(COUNTERS.seconds)
    try:
        if not dry_run:
            # A work folder that cannot be used fails every build: said once, before the
            # model is imported or traced.
            from cachebuild.store import prepare_work_dir

            prepare_work_dir(Path(opened.work_dir))
        source = source_of(model)

        def start_workers(targets: Callable[[], int]) -> None:
            nonlocal pool
            if pool is None and not dry_run and source.file is not None and options is not None:
                pool = start_pool(jobs or cold_start_jobs(targets()), str(source.file),
                                  options)

        def before_trace(config: CompileConfig, edited: Callable[[], bool]) -> None:
            if not dry_run and config.backend != "eager_fusion":
                # Every C++ build would fail on it: said before the trace, as a usage error.
                from cachebuild.backends.kernel_dir import check_cxx_work_dir

                check_cxx_work_dir(opened.work_dir)
            if not here:  # a guess: the trace says later
                start_workers(lambda: expected_targets(len(config.buckets()), edited=edited()))

        group = list(plan_group(source, opened, device, world_size, say, before_trace,
                                touch=not dry_run))
        report = _report(group, opened, world_size)
        if not dry_run:
            _use_stored(report.targets, opened)
        progress.info("planned %d target%s of %s", len(report.targets),
                      "" if len(report.targets) == 1 else "s", source.name)
        model_phases = {name: round(COUNTERS.seconds.get(name, 0.0) - before.get(name, 0.0), 3)
                        for name in ("trace", "split") if name in COUNTERS.seconds}
        if dry_run:
            return WarmReport(report.entries, report.targets, world_size,
                              seconds=time.perf_counter() - start, dry_run=True,
                              phases=model_phases)
        all_jobs: dict[str, BuildJob] = {}
        for p in group:
            for key, job in jobs_of(p.entry, p.spec.config).items():
                all_jobs.setdefault(key, job)
        by_key = {t.key: t for t in report.targets}
        missing = [job for key, job in all_jobs.items() if by_key[key].state != "stored"]
        for t in report.targets:
            t.state = "stored" if t.state == "stored" else "missing"
        done = [0]
        phases: dict[str, dict[str, Any]] = {}

        def finished(job: BuildJob, built: bool, seconds: float, error: str | None) -> None:
            target = by_key[job.target.key]
            if built and not error:
                proven_by_build(job, opened)
            target.state, target.seconds, target.error = ("failed" if error else
                                                          "built" if built else "stored",
                                                          seconds, error)
            built_how = phases.get(job.target.key, {})
            target.phases = dict(built_how.get("seconds", {}))
            target.reused = int(built_how.get("counts", {}).get("cxx_reused", 0))
            done[0] += 1
            if on_target is not None:
                on_target(target, done[0], len(missing))

        if missing:
            _check_keeps(opened, len(missing))
            if source.file is not None and options is not None and len(missing) > here:
                start_workers(lambda: len(missing))
                assert pool is not None
                if jobs is None:  # the guess at the trace may have been short
                    pool.grow(cold_start_jobs(len(missing)))
                progress.info("building %d target%s in worker processes", len(missing),
                              "" if len(missing) == 1 else "s")
                build_jobs(missing, pool, str(source.file), options, finished, phases,
                           store=opened)
            else:
                progress.info("building %d target%s in this process", len(missing),
                              "" if len(missing) == 1 else "s")
                _build_here(missing, opened, finished, phases)
        for p in group:  # what workers built with a presumed compiler is recorded next
            get_backend(p.spec.config.backend).confirm_toolchain(p.entry.device)
        for p in _new_entries(group):
            progress.info("recording the entry of %s", source.name)
            entry = next(e for e in report.entries if e.key == p.entry.key)
            entry.recorded = record_entry(p.entry, opened)
            entry.unrecordable = p.entry.unrecordable
        _lost_meanwhile(report.targets, opened)
        if pool is not None:  # the workers' ends are part of the time the command takes
            pool.close()
        return WarmReport(report.entries, report.targets, world_size,
                          seconds=time.perf_counter() - start, phases=model_phases)
    except KeyboardInterrupt:
        if pool is not None:
            pool.close(now=True)  # the command ends: its builds with it
        raise
    finally:
        if pool is not None:
            pool.close()
        if owned:
            opened.close()


def _check_keeps(store: Store, missing: int) -> None:
    """UsageError where what ``warm`` builds would not be kept: a read-only store whose
    overlay is this process's memory."""
    from cachebuild.store import OverlayStore

    if isinstance(store, OverlayStore) and store.overlay_dir is None:
        raise UsageError(
            f"cannot warm {missing} missing target{'' if missing == 1 else 's'}: the store at "
            f"{store.root} is read-only here, so they would be built into memory and gone at "
            "exit; warm a store you can write (--cache-dir, CACHEBUILD_DIR), or set "
            "CACHEBUILD_OVERLAY_DIR to a folder of yours to build into")


def _use_stored(targets: list[TargetReport], store: Store) -> None:
    """Read each target found stored, as a start would: it counts as used (``gc
    --older-than`` keeps what was warmed), and one that fails verification (quarantined
    by the read) is built again."""
    for t in targets:
        if t.state == "stored" and store.get(t.key) is None:
            t.state = "missing"


def _lost_meanwhile(targets: list[TargetReport], store: Store) -> None:
    """Say failed each target built or found that is not in ``store`` now the entries are
    recorded: a ``cachebuild gc`` between its build and its entry's record (nothing refers
    to a target until then) took it. Recorded, the entry protects what is built next.
    By record alone: the builds and the plan read every payload already."""
    for t in targets:
        if t.state in ("built", "stored") and store.get_record(t.key) is None:
            t.state, t.error = "failed", (
                "removed from the store before the entry that keeps it was recorded (a "
                "`cachebuild gc` meanwhile?): run `cachebuild warm` again to build it")


def _new_entries(group: list[Planned]) -> list[Planned]:
    """The planned entries that are new (traced here), each once."""
    out: dict[str, Planned] = {}
    for p in group:
        if p.found.entry is None:
            out.setdefault(p.entry.key, p)
    return list(out.values())
