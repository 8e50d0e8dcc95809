"""Serving while the targets build (``CompileConfig.while_building``).

A cold start whose entry has targets missing builds, first, the same pieces for a backend
that builds in seconds (``interim_entry``: every target's manifest with that backend's
factors instead, so the targets are content-addressed like any other and shared with any
later start that asks for them) and serves with those at once. The missing targets build
meanwhile in worker processes (``workers.BuildPool``): never in the serving process,
whose calls, random streams and environment a build must not touch. When every one of
them is stored, ``Swap`` loads them (on its thread) and records the entry; the next call
of the model, on the serving thread, makes a runtime over them and runs on it: a call
runs on one runtime from its start to its end, so no call mixes the two kinds of targets.
The old runtime's graphs (captured for its artifacts) go with it, its background capture
stopped; the new runtime captures its own as the policy says (``eager``: in that call,
before it runs).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cachebuild import process_state
from cachebuild.building.build import Builder, BuildJob, jobs_of, resolve_all
from cachebuild.building.entry import Entry, record_entry
from cachebuild.building.planner import target_factors
from cachebuild.config import CompileConfig
from cachebuild.counters import COUNTERS
from cachebuild.errors import BuildError, ToolchainRefuted, one_line
from cachebuild.keys import make_key
from cachebuild.passes import PassManager
from cachebuild.tracing.targets import bucket_label

if TYPE_CHECKING:
    import torch

log = logging.getLogger("cachebuild")


def interim_config(config: CompileConfig) -> CompileConfig | None:
    """The config of the targets a cold start serves with while ``config``'s build, or
    None where there are none to serve with (``wait``, or the same backend anyway)."""
    choice = config.while_building
    if choice == "wait" or config.backend == "eager_fusion":  # nothing builds faster
        return None
    if choice == "eager_fusion":
        return replace(config, backend="eager_fusion", while_building="wait")
    if config.backend == "inductor" and config.flavour == "standalone":
        return None
    return replace(config, backend="inductor", flavour="standalone", while_building="wait")


def interim_entry(entry: Entry, config: CompileConfig, passes: PassManager) -> Entry:
    """``entry`` with every target keyed for ``config``'s backend instead (an entry that is
    used, never recorded: it shares the recorded one's key)."""
    from cachebuild.backends import get_backend

    factors = target_factors(get_backend(config.backend), config, passes, entry.device)
    keys: dict[str, str] = {}
    manifests: dict[str, dict[str, Any]] = {}
    for key, manifest in entry.manifests.items():
        new = {**manifest, "backend": factors["backend"], "passes": factors["passes"]}
        keys[key] = make_key(new)
        manifests[keys[key]] = new
    pieces = [replace(p, targets=[replace(t, key=keys[t.key]) for t in p.targets])
              for p in entry.pieces]
    return replace(entry, pieces=pieces, manifests=manifests)


def serve_while_building(model: torch.nn.Module, config: CompileConfig, builder: Builder,
                         entry: Entry, why: str, warm: bool, swap: Swap | None
                         ) -> tuple[Entry, dict[str, Any], Swap] | None:
    """With ``while_building`` and targets missing: start building them in worker
    processes (unless ``swap`` already builds them), build (or load) the interim targets
    here, and return the entry to serve with, its targets and the swap; the first call
    after the missing targets are stored and loaded takes over (``take_over``). None where
    there is nothing to do, or no worker could build the missing targets as this process
    would (then the caller builds them here)."""
    from cachebuild.building.pool import cold_start_jobs, setup_for, usable_cpus

    interim = interim_config(config)
    if interim is None:  # the default ("wait"): no store lookups on any start
        return None
    jobs = builder.missing(entry)
    if not jobs:
        return None
    if swap is None or not swap.pending or swap.entry.key != entry.key:
        setup = setup_for(jobs, builder.store, builder.passes)
        if setup is None:
            log.warning("cachebuild: %s builds its targets before serving "
                        "(while_building=%r): worker processes could not build them as "
                        "this process would (ops or passes of its own, or a store they "
                        "cannot open)", type(model).__name__, config.while_building)
            return None
        # Started first, so the workers' start overlaps the interim builds here, and
        # one CPU left to this process unless the environment says how many.
        workers = cold_start_jobs(len(jobs))
        if not os.environ.get("CACHEBUILD_BUILD_JOBS", "").strip():
            workers = max(1, min(workers, usable_cpus() - 1))
        # Its targets all stored, the entry is recorded there: a later start is warm.
        swap = Swap(entry, builder, jobs, workers, setup, record=why != "fresh")
    served = interim_entry(entry, interim, builder.passes)
    interim_builder = Builder(builder.store, interim, builder.passes, builder.device)
    try:
        loaded = resolve_all(served, interim_builder, warm=warm, workers=False)
    except ToolchainRefuted:
        raise  # the start plans again
    except Exception as e:  # nothing to serve with meanwhile: wait for the real ones
        log.warning("cachebuild: %s has no %s targets to serve with while it builds "
                    "(%s); waiting for its own", type(model).__name__,
                    config.while_building, one_line(e, typed=True))
        return entry, swap.take(), swap
    log.warning("cachebuild: %s serves with %s targets while its %d missing targets "
                "build in the background", type(model).__name__,
                config.while_building, len(jobs))
    return served, loaded, swap


class Swap:
    """The missing targets of an entry, building in worker processes in the background,
    then loaded there too (``done`` is set once they are, or once a build failed:
    ``error`` says why, and the model keeps serving with what it has).
    With ``record``, the entry is recorded on that thread once they are all stored and
    loaded (not for an entry that is stored already). The swap itself is the serving
    thread's: the next call ``claim``s the targets and runs on a runtime over them from
    its start to its end."""

    def __init__(self, entry: Entry, builder: Builder, jobs: list[BuildJob], workers: int,
                 setup: Any, *, record: bool) -> None:
        self.entry = entry
        self.builder = builder
        self.done = threading.Event()
        self.error: str | None = None
        self.seconds = 0.0
        #: set once a call (or ``take``) took the targets: nothing is pending any more
        self.claimed = False
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._jobs, self._workers, self._setup = jobs, workers, setup
        self._record = record
        self._thread = threading.Thread(target=self._run, name="cachebuild-swap", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        """True while the targets build, or are built and no call took them yet."""
        return not self.claimed and self.error is None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the targets are built and loaded, or failed; True if that is over."""
        return self.done.wait(timeout)

    def claim(self) -> dict[str, Any] | None:
        """The loaded targets, to the first caller after they are ready (None to any
        other, and while they build or after they failed)."""
        if not self.done.is_set() or self.error is not None:
            return None
        with self._lock:
            if self.claimed:
                return None
            self.claimed = True
            return self._loaded

    def take(self) -> dict[str, Any]:
        """The targets, once built, for a caller that has nothing else to serve with
        (its interim targets failed): raises BuildError if they failed too."""
        self.done.wait()
        if self.error is not None:
            raise BuildError(self.error)
        with self._lock:
            self.claimed = True
            return self._loaded

    def _run(self) -> None:
        from cachebuild.building.pool import BuildPool

        start = time.perf_counter()
        failed: list[str] = []

        def finished(job: BuildJob, result: Any) -> None:
            where = f"piece {job.target.piece} {bucket_label(job.target.bucket)}"
            if result.error:
                failed.append(f"{where}: {result.error}")
                return
            log.info("cachebuild: built %s in %.1f s in the background", where,
                     result.seconds)
            if result.built:
                COUNTERS.built += 1
                COUNTERS.misses += 1
                COUNTERS.add_time("build", result.seconds)
                # proven by the worker before it stored it
                process_state.current().verified.add(job.target.key)
            if result.phases:
                self.builder.worker_phases[job.target.key] = result.phases

        try:
            with BuildPool(self._workers, self._setup) as pool:
                pool.run(sorted(self._jobs, key=lambda j: -len(j.nodes)), finished)
            if failed:
                raise BuildError("; ".join(failed))
            loaded = {}
            for key, job in jobs_of(self.entry, self.builder.config).items():
                fn = self.builder.load(key, job)
                if fn is None:
                    raise BuildError(f"target {key} was built but cannot be loaded back")
                loaded[key] = fn
            self.seconds = time.perf_counter() - start
            self._loaded = loaded
            if self._record:
                record_entry(self.entry, self.builder.store)
        except Exception as e:  # the model keeps serving with the targets it has
            self.error = f"{type(e).__name__}: {e}"
            log.warning("cachebuild: the targets building in the background failed, so the "
                        "model keeps serving with its interim targets: %s", self.error)
        finally:
            self.done.set()
