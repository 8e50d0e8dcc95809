"""The Builder: the only way an artifact is produced or loaded.

``resolve(job)``: a target loaded earlier in this process is reused; a stored one is
loaded; a missing one is built under the key's lock (looking again once the lock is
held, since another process may have finished it), proven against its piece
(``verify.py``), stored, then loaded. A piece that fails to compile or to match its piece
raises BuildError naming the piece, bucket and key; nothing partial is stored, because the
store's put is atomic and happens only after a successful compile and check.

A piece that calls collectives is compiled, proven and checked on load against stand-in
process groups of its layout that communicate nothing (``distributed.local_groups``): the
rank that builds a target must not wait on the ranks waiting for it, and a build needs no
process group at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from cachebuild import keep, process_state
from cachebuild.backends import BuildRequest, get_backend
from cachebuild.backends.kernel_dir import build_work_dir
from cachebuild.backends.protocol import DeviceBound, LoadNeeds
from cachebuild.building.verify import check, check_artifact, verify_on_load, verify_sizes
from cachebuild.clock import BuildClock, measuring, summary
from cachebuild.config import CompileConfig
from cachebuild.counters import COUNTERS, timed
from cachebuild.errors import (
    BuildError,
    StoredArtifactError,
    StoreError,
    ToolchainRefuted,
    UsageError,
    one_line,
    transient,
    transient_advice,
)
from cachebuild.graph.facts import device_of, on_device
from cachebuild.keys import make_key
from cachebuild.tracing.distributed import local_groups
from cachebuild.tracing.targets import RANDOM, BuildJob, bucket_label, traced_settings
from cachebuild.trust.fxjson import data_to_module

if TYPE_CHECKING:
    from cachebuild.building.entry import Entry
    from cachebuild.building.pool import BuildPool, WorkerSetup
    from cachebuild.passes import PassManager
    from cachebuild.store.interface import Store

log = logging.getLogger("cachebuild.building.build")

#: Warnings a build prints that are about torch's internals, not the user's model: shown
#: with ``-v`` (logged at debug level), never printed into a progress bar.
_INTERNAL_CATEGORIES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


@contextmanager
def quiet_compiler_warnings() -> Iterator[None]:
    """Keep torch's internal warnings out of the terminal while a piece compiles.

    A build runs only torch code (the piece graph, the compiler), so a deprecation or
    future warning there is torch's business; it is logged at debug level. Other warnings
    are shown as usual.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if issubclass(w.category, _INTERNAL_CATEGORIES) or "/torch/" in w.filename:
            log.debug("compiler warning: %s: %s", w.category.__name__, w.message)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


class Builder:
    """Resolves targets against one store with one config's backend and passes."""

    def __init__(self, store: Store, config: CompileConfig, passes: PassManager | None = None,
                 device: str = "cpu") -> None:
        """``passes``: a ``PassManager`` to use instead of the one ``config.passes`` makes
        (custom passes); its factors enter every target key all the same. ``device``: where
        loaded targets run (the live model's device)."""
        self.store = store
        self.config = config
        self.device = device
        self.backend = get_backend(config.backend)
        self._passes = passes
        #: Where each target this builder built went, by key: seconds per phase
        #: (``clock.PHASES``) and counts (``cxx_reused``).
        self.phases: dict[str, dict[str, Any]] = {}
        #: The same, of targets worker processes built for this builder.
        self.worker_phases: dict[str, dict[str, Any]] = {}

    @property
    def passes(self) -> PassManager:
        if self._passes is None:
            from cachebuild.passes import PassManager

            self._passes = PassManager.from_config(self.config.passes)
        return self._passes

    def load(self, key: str, job: BuildJob | None = None) -> Any | None:
        """The loaded target ``key`` if the store has it (None on a miss).

        An artifact that cannot run on this builder's GPU index (``DeviceBound``) is
        replaced by its copy for this index, loaded or built (``job`` needed; without
        it, None: ``resolve`` comes back with the job).
        """
        loaded = process_state.current().loaded
        if (key, self.device) in loaded and self.store.contains(key):
            # Loaded earlier in this process (from this store or another one): the same
            # key is the same artifact. A store that lacks it is a miss, so it is built
            # into this store too.
            COUNTERS.hits += 1
            return loaded[key, self.device]
        record = self.store.get_record(key)
        if record is None:
            return None
        # Perhaps built (here or by a worker) with a compiler the probe only presumed:
        # nothing of it is loaded into this process before the verdict confirms it. On a
        # CPU but what a worker built for this process, then loaded beside torch and ran
        # there (its proof): all the verdict would show of this very library.
        if not (self.device.split(":")[0] == "cpu" and key in process_state.current().verified):
            self.backend.confirm_toolchain(self.device)
        start = time.perf_counter()
        try:
            fn = self.backend.load(record.kind, key, self.store, self.device)
        except DeviceBound as bound:
            return self._device_copy(job, bound) if job is not None else None
        except Exception as e:
            if isinstance(e, StoreError) or transient(e):
                raise
            why = str(e) or type(e).__name__
            raise StoredArtifactError(why if key in why else
                                      f"stored artifact {key} was not loaded: {why}") from e
        if fn is None:  # vanished or failed verification (quarantined): a miss
            return None
        COUNTERS.hits += 1
        seconds = time.perf_counter() - start
        COUNTERS.loaded += 1
        COUNTERS.add_time("load", seconds)
        self.store.count("loads")
        self.store.count("load_ms", round(seconds * 1000))
        loaded[key, self.device] = fn
        return fn

    def _device_copy(self, job: BuildJob, bound: DeviceBound) -> Any | None:
        """The copy of ``job``'s target for this builder's GPU, loaded, or built and stored
        under its own key (``device_copy``): one build per GPU index, shared by every
        later process on that index."""
        copy = device_copy(job, self.device)
        log.info("target %s was built for %s, whose index its code names; using its copy "
                 "for %s (%s)", job.target.key[:12], bound.built_for, self.device,
                 copy.target.key[:12])
        fn = self.load(copy.target.key)
        if fn is None:
            self.build(copy)
            fn = self.load(copy.target.key)
        if fn is not None:
            COUNTERS.device_copies += 1
            process_state.current().loaded[job.target.key, self.device] = fn
        return fn

    def built_by_worker(self, job: BuildJob, result: Any) -> None:
        """Count what a worker did for ``job`` (``pool.Result``, no error) as this process
        counts its own builds; what it built was proven there before it was stored."""
        if result.built:
            COUNTERS.built += 1
            COUNTERS.misses += 1
            COUNTERS.add_time("build", result.seconds)
            process_state.current().verified.add(job.target.key)
            proven_by_build(job, self.store)
        if result.phases:
            self.worker_phases[job.target.key] = result.phases

    def here(self, job: BuildJob) -> BuildJob:
        """``job`` with its tensors on this builder's GPU where only the index differs (an
        entry traced by another rank): each rank builds and proves on its own GPU."""
        want = torch.device(self.device)
        if want.index is None:
            return job
        metas = [replace(m, device=str(want))
                 if m.kind == "tensor" and m.device_type == want.type else m
                 for m in job.input_metas]
        return job if metas == job.input_metas else replace(job, input_metas=metas)

    def missing(self, entry: Entry) -> list[BuildJob]:
        """The jobs of ``entry``'s unique targets that are not stored, as this builder
        would build them (``here``)."""
        return [self.here(job) for key, job in jobs_of(entry, self.config).items()
                if not self.store.contains(key)]

    def build(self, job: BuildJob) -> bool:
        """Make sure ``job``'s target is stored; True if this call compiled it. A target
        planned for another backend or flavour than this builder's is never built here
        (BuildError): it would be stored under a key that names what it is not."""
        job = self.here(job)
        key = job.target.key
        if self.store.contains(key):
            return False
        planned = {k: v for k, v in job.target.manifest["backend"].items() if k != "toolchain"}
        if planned != self.backend.factors(self.config):
            raise BuildError(f"target {key} was planned for {planned.get('name')} "
                             f"({planned.get('flavour', 'its own settings')}), not for this "
                             f"build's {self.config.backend} ({self.config.flavour})")
        COUNTERS.misses += 1
        # Compiled and proven here: not with a compiler the probe has only presumed (and
        # not waiting for its verdict while holding the key's lock).
        self.backend.confirm_toolchain(device_of(job.input_metas))
        with self.store.lock(key):
            if self.store.contains(key):
                return False
            start = time.perf_counter()
            where = f"piece {job.target.piece} ({bucket_label(job.target.bucket)}, key {key})"
            layout = job.target.manifest.get("distributed")
            toolchain = job.target.manifest["backend"].get("toolchain", {})
            gpu = on_device(device_of(job.input_metas))
            clock = BuildClock()
            try:
                with measuring(clock), clock.phase("lowering"), quiet_compiler_warnings(), \
                        local_groups(layout), gpu, keep.rng(), self._compilers(toolchain), \
                        traced_settings(job.target.manifest):
                    artifact = self.backend.compile(BuildRequest(
                        # Compilers trace the graph and check what it calls by name:
                        # the original arithmetic, not its bounded stand-ins.
                        gm=data_to_module(job.nodes, bounded=False),
                        input_metas=list(job.input_metas),
                        bucket=job.target.bucket,
                        config=self.config,
                        key=key,
                        passes=self.passes,
                        toolchain=toolchain,
                    ))
            except Exception as e:
                COUNTERS.failed += 1
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                said = compiler_said(e)
                if said:
                    first += f": the compiler said: {said}"
                machine = transient(e)
                hint = f" ({machine}: {transient_advice(machine)})" if machine else ""
                raise BuildError(f"{where} failed to compile: {type(e).__name__}: {first}{hint}") from e
            seconds = time.perf_counter() - start
            with measuring(clock), clock.phase("proof"), timed("verify"), local_groups(layout), \
                    on_device(device_of(job.input_metas)), keep.rng(), \
                    self._compilers(toolchain), traced_settings(job.target.manifest):
                self._prove(job, artifact, where)
            with measuring(clock), clock.phase("store"):
                self.store.put(key, artifact.payload, kind=artifact.kind,
                               manifest=job.target.manifest)
            if artifact.fallback:
                COUNTERS.fallbacks += 1
                log.warning("piece %d (%s) built as %s: %s", job.target.piece,
                            bucket_label(job.target.bucket), artifact.kind, artifact.fallback)
            COUNTERS.built += 1
            COUNTERS.add_time("build", seconds)
            self.store.count("builds")
            self.store.count("build_ms", round(seconds * 1000))
            self.phases[key] = {"seconds": clock.report(), "counts": dict(clock.counts)}
            reused = clock.counts.get("cxx_reused", 0)
            log.info("built piece %d %s as %s in %.1f s (%s, %d bytes): %s%s", job.target.piece,
                     bucket_label(job.target.bucket), artifact.kind, seconds, key[:12],
                     len(artifact.payload), summary(clock.seconds),
                     f"; {reused} C++ objects reused" if reused else "")
            return True

    def _compilers(self, toolchain: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        """Where a build's compilers write while it runs: the store's work folder
        (``build_work_dir``), for a backend that generates code. For one that only
        rewrites graphs nothing is pointed anywhere: the process environment stays as it
        is, but for what importing torch's compilers writes there (a pass may import
        them), taken back (``keep.environment``)."""
        if not self.backend.generates_code:
            return keep.environment()
        return build_work_dir(self.store, cxx=bool(toolchain))

    def _prove(self, job: BuildJob, artifact: Any, where: str) -> None:
        """Raise BuildError unless the artifact matches its piece run eagerly."""
        metas = list(job.input_metas)
        try:
            sizes = check_artifact(self.backend, artifact, job.target.key, job.nodes, metas,
                                   job.target.bucket)
        except Exception as e:
            COUNTERS.failed += 1
            if "failed to map segment" in str(e) and _noexec(self.store.work_dir):
                raise BuildError(
                    f"{where} was built, but its compiled library cannot be loaded from the "
                    f"build work folder {self.store.work_dir} ({one_line(e)}): is that folder "
                    "on a file system mounted noexec? Set CACHEBUILD_WORK_DIR to a folder "
                    "where libraries may run; not stored") from e
            sizes = verify_sizes(job.target.bucket)
            drawn = job.target.manifest.get(RANDOM)
            hint = (f"; the piece draws random numbers ({', '.join(drawn)}), which this "
                    "build does not draw as eager does: dropout in train mode? serve the "
                    "model in eval()" if drawn else "")
            raise BuildError(
                f"{where} does not match its piece run eagerly at sizes "
                f"{', '.join(map(str, sizes))}: {type(e).__name__}: {e}; not stored{hint}"
            ) from e
        process_state.current().verified.add(job.target.key)
        log.debug("proved %s at sizes %s", where, sizes)

    def check_loaded(self, job: BuildJob, fn: Any) -> None:
        """The same proof for a target loaded from the store, once per process
        (``CACHEBUILD_VERIFY=load``). Runs the piece eagerly: no Dynamo, no Inductor."""
        job = self.here(job)
        key = job.target.key
        if key in process_state.current().verified:
            return
        metas = list(job.input_metas)
        with timed("verify"):
            try:
                with local_groups(job.target.manifest.get("distributed")), \
                        on_device(device_of(metas)), \
                        traced_settings(job.target.manifest):
                    check(fn, job.nodes, metas, job.target.bucket)
            except Exception as e:
                raise BuildError(
                    f"piece {job.target.piece} ({bucket_label(job.target.bucket)}, key {key}) "
                    f"loaded from the store does not match its piece run eagerly: "
                    f"{type(e).__name__}: {e}; remove it with `cachebuild gc` or rebuild") from e
        process_state.current().verified.add(key)

    def resolve(self, job: BuildJob) -> Any:
        """The callable for ``job``'s target: loaded, or built then loaded."""
        for _ in range(3):
            fn = self.load(job.target.key, job)
            if fn is not None:
                return fn
            self.build(job)
        raise BuildError(f"target {job.target.key} was built but cannot be loaded back")


def compiler_said(error: BaseException) -> str | None:
    """The first line of a failed C++ compile's output that reports an error (else its
    first line), where ``error`` is, or wraps, such a failure (Inductor's
    ``CppCompileError``: an ``output`` beside its ``cmd``); else None. The error's own
    first line only says "C++ compile error"."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        output = getattr(e, "output", None)
        if isinstance(output, str) and hasattr(e, "cmd"):
            lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
            return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else None)
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return None


def device_copy(job: BuildJob, device: str) -> BuildJob:
    """The job building ``job``'s target for GPU ``device`` (``cuda:1``), for artifacts
    whose code names the GPU they were built on: its own key (derived from the target's
    and the device: the only keys with a device index) and manifest."""
    target = job.target
    manifest = {**target.manifest, "device_copy": {"of": target.key, "device": device}}
    copy = replace(target, key=make_key(manifest), manifest=manifest)
    metas = [replace(m, device=device) if m.kind == "tensor" else m for m in job.input_metas]
    return replace(job, target=copy, input_metas=metas)


@dataclass
class BuildOutcome:
    """How one target's build went: ``built`` (False: already stored), the ``error`` in
    words if it failed, its ``seconds`` and its ``phases`` (``Builder.phases``; empty
    when nothing was compiled)."""

    built: bool
    error: str | None
    seconds: float
    phases: dict[str, Any] = field(default_factory=dict)


def build_one(store: Store, job: BuildJob) -> BuildOutcome:
    """Build ``job``'s target into ``store`` with a builder of its own. A failure is
    reported, never raised (but ToolchainRefuted: every target is planned again): the
    caller builds the other targets on."""
    start = time.perf_counter()
    builder = Builder(store, job.config)
    try:
        built, error = builder.build(job), None
    except ToolchainRefuted:
        raise
    except Exception as e:
        built, error = False, str(e)
    return BuildOutcome(built, error, time.perf_counter() - start,
                        builder.phases.get(job.target.key, {}))


# -- every target of an entry ------------------------------------------------------------

#: At most this many artifacts load at once (loading is mostly I/O and dlopen); the
#: environment's ``CACHEBUILD_LOAD_THREADS`` overrides it (1: load in the calling thread,
#: which is also what a profiler of the warm start needs to see).
LOAD_THREADS = 8


def load_threads() -> int:
    value = os.environ.get("CACHEBUILD_LOAD_THREADS", "")
    if not value:
        return LOAD_THREADS
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"CACHEBUILD_LOAD_THREADS={value!r}: give a whole number of threads, 1 or more")
    return int(value)


def proven_by_build(job: BuildJob, store: Store) -> None:
    """A build (a worker's, most often) made ``job``'s target and proved it before storing
    it: tell its backend, for what that shows of the toolchain it was built with
    (``Backend.toolchain_proven``: a probe still running may take it as its answer)."""
    factors = job.target.manifest["backend"]
    try:
        record = store.get_record(job.target.key)
        if record is not None and "name" in factors:
            get_backend(factors["name"]).toolchain_proven(
                device_of(job.input_metas), factors.get("toolchain", {}), record.kind)
    except Exception as e:  # news for a probe, never the build's failure
        log.debug("no toolchain news from %s: %s", job.target.key, e)


def load_needs(keys: list[str], builder: Builder) -> LoadNeeds:
    """What loading the ones of these targets that ``builder``'s store holds takes (its
    backend says, per artifact kind)."""
    for key in keys:
        record = builder.store.get_record(key)
        if record is not None and builder.backend.load_needs(record.kind).inductor:
            return LoadNeeds(inductor=True)
    return LoadNeeds()


def _build_in_workers(jobs: list[BuildJob], builder: Builder,
                      done: Callable[[str, float], None], pool: BuildPool | None = None) -> None:
    """Build ``jobs`` in worker processes (``cold_start_jobs`` of them) where that can be
    done exactly as here (``workers.setup_for``) and the operator did not ask for builds
    here (``builds_here``); else leave them to the caller, which builds them one after
    another. ``pool``: workers started already (``early_pool``; the caller closes it).

    A job a worker failed is never built here: a build that crashed or exhausted its
    worker would take the calling process (a server) down with it (``run_in_workers``);
    a job that failed raises BuildError with the worker's words (where the toolchain the
    job was planned with is refuted meanwhile, ToolchainRefuted, so that the start plans
    again)."""
    from cachebuild.building.pool import builds_here, cold_start_jobs, job_label, setup_for

    if builds_here():
        return
    workers = cold_start_jobs(len(jobs))
    jobs = [builder.here(job) for job in jobs]
    setup = setup_for(jobs, builder.store, builder.passes)
    if setup is None:
        log.info("building %d targets in this process: worker processes could not build "
                 "them as it would (ops or passes of its own, or a store they cannot open)",
                 len(jobs))
        return
    log.info("building %d targets in %d worker processes", len(jobs), workers)
    failed = run_in_workers(jobs, builder, setup, workers,
                            lambda job, result: done(job_label(job), result.seconds), pool)
    if failed:
        for job, _ in failed:  # a worker's build with a compiler refuted since
            builder.backend.confirm_toolchain(device_of(job.input_metas))
        raise BuildError("; ".join(why for _, why in failed))


def run_in_workers(jobs: list[BuildJob], builder: Builder, setup: WorkerSetup, workers: int,
                   built: Callable[[BuildJob, Any], None], pool: BuildPool | None = None
                   ) -> list[tuple[BuildJob, str]]:
    """Build ``jobs`` in ``workers`` worker processes set up with ``setup`` (``pool``:
    started already, told ``setup`` now; the caller closes it). ``built(job, result)``
    is called for each job built (or found stored) once ``builder`` counted it
    (``Builder.built_by_worker``). A job whose worker ended while it held it (killed for
    its memory, say) is built once more in a new worker, alone, where every failure was
    such an end. Returns each job that failed, with why in the worker's words (naming
    its piece)."""
    from cachebuild.building.pool import BuildPool, job_label

    failed: list[tuple[BuildJob, Any]] = []

    def finished(job: BuildJob, result: Any) -> None:
        if result.error:
            failed.append((job, result))
            return
        builder.built_by_worker(job, result)
        built(job, result)

    ordered = sorted(jobs, key=lambda j: -len(j.nodes))
    if pool is not None:
        pool.begin(setup)
        pool.grow(workers)
        pool.run(ordered, finished)
    else:
        with BuildPool(workers, setup) as started:
            started.run(ordered, finished)
    if failed and all(result.died for _, result in failed):
        again = [job for job, _ in failed]
        for job, result in failed:
            log.warning("%s: %s; building it again in a new worker", job_label(job),
                        result.error)
        failed.clear()
        with BuildPool(1, setup) as fresh:
            fresh.run(again, finished)
    return [(job, result.error if result.error.startswith(f"piece {job.target.piece} ")
             and not result.died else f"{job_label(job)}: {result.error}")
            for job, result in failed]


def early_pool(store: Store, config: CompileConfig,
               edited: Callable[[], bool] = lambda: False) -> BuildPool | None:
    """Build workers for a cold start, started before its trace so that their imports
    overlap it (``expected_targets`` of them, fewer after an edit: ``edited()``, asked
    only here; told what to build after the plan), or None where its builds would not go
    to workers: ``CACHEBUILD_BUILD_JOBS=1``, a backend not built in, a store workers
    cannot open."""
    from cachebuild.building.pool import (
        BuildPool,
        builds_here,
        cold_start_jobs,
        expected_targets,
        store_options,
    )

    if config.backend not in ("inductor", "eager_fusion") or store_options(store) is None \
            or builds_here():
        return None
    return BuildPool(cold_start_jobs(expected_targets(len(config.buckets()),
                                                      edited=edited())))


def jobs_of(entry: Entry, config: CompileConfig) -> dict[str, BuildJob]:
    """One BuildJob per unique target key of an entry."""
    jobs: dict[str, BuildJob] = {}
    for target in entry.targets():
        if target.key not in jobs:
            piece = entry.pieces[target.piece]
            jobs[target.key] = BuildJob(target, piece.nodes, piece.input_metas, config)
    return jobs


def resolve_all(entry: Entry, builder: Builder, *, warm: bool = False,
                on_missing: Callable[[int, int], None] | None = None,
                workers: bool = True, pool: BuildPool | None = None) -> dict[str, Any]:
    """Every unique target of ``entry``, loaded or built.

    ``warm``: ``entry`` was found stored (a warm start, counted as such); if loading its
    targets initialises Inductor (their backend says so: ``standalone`` artifacts), its
    import is started at once (``preload``) and they load on up to ``load_threads()``
    threads. AOTI packages load in milliseconds, on the calling thread.
    ``on_missing(missing, total)`` is called before any build; the builds then show
    progress (``notice.build_progress``). Missing targets build in worker processes where
    they can (``_build_in_workers``); ``workers``: False builds every missing target in
    this process, one after another (targets that build in seconds, while workers build
    others); ``pool``: workers started already for them (``early_pool``).
    """
    from cachebuild.building.notice import build_progress

    jobs = jobs_of(entry, builder.config)
    parallel = warm and load_needs(list(jobs), builder).inductor
    if parallel:
        preload()
    if warm:
        COUNTERS.entries_loaded += 1
        builder.store.count("warm_starts")
        COUNTERS.planned += len(entry.targets())
        COUNTERS.unique += len(jobs)
        log.info("warm start from entry %s", entry.key[:12])
    threads = min(load_threads(), len(jobs)) if parallel else 1
    if threads <= 1:
        loaded = {key: builder.load(key) for key in jobs}
    else:
        with ThreadPoolExecutor(max_workers=threads) as loader:
            loaded = dict(zip(jobs, loader.map(builder.load, jobs), strict=True))
    missing = [key for key, fn in loaded.items() if fn is None]
    if missing and on_missing is not None:
        on_missing(len(missing), len(jobs))
    with build_progress(len(missing)) as done:
        if workers and missing:
            _build_in_workers([jobs[key] for key in missing], builder, done, pool)
        for key in missing:
            start = time.perf_counter()
            loaded[key] = builder.resolve(jobs[key])  # built by a worker: a load
            target = jobs[key].target
            if target.key in builder.phases:  # built here after all
                done(f"piece {target.piece} {bucket_label(target.bucket)}",
                     time.perf_counter() - start)
    if verify_on_load():
        for key, fn in loaded.items():
            if key not in missing:
                builder.check_loaded(jobs[key], fn)
    return loaded


_PRELOAD: threading.Thread | None = None


def preload() -> threading.Thread:
    """Start initialising Inductor's runtime in the background (idempotent).

    Loading ``standalone`` artifacts needs Inductor, whose import takes seconds; a server
    calls this first thing so that the import overlaps building its model and loading
    weights. Loading ``aoti`` artifacts needs none of it. Only the import happens
    here: also loading an artifact in the background, to pay Inductor's first-load set-up
    early, made the warm start slower on an H200 (it contended with the foreground loads).
    """
    global _PRELOAD
    if _PRELOAD is None:
        _PRELOAD = threading.Thread(target=_preload, name="cachebuild-preload", daemon=True)
        _PRELOAD.start()
    return _PRELOAD


def _preload() -> None:
    with timed("preload"):
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401  # the first load imports it otherwise
        from torch._inductor import CompiledArtifact  # noqa: F401


def _noexec(folder: os.PathLike[str] | str) -> bool:
    """Whether ``folder`` is on a file system mounted noexec (no library there loads)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_NOEXEC)
    except OSError:
        return False
