"""Targets built in the background: in worker processes, then loaded on a thread.

A cold start that serves meanwhile (``serving.interim``) hands its missing targets to a
``BackgroundBuild``: workers build them (never the calling process, whose calls, random
streams and environment a build must not touch), a thread loads them once all are stored
and records the entry, and the first caller to ``claim`` them gets them, once.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from cachebuild import process_state
from cachebuild.building.build import Builder, BuildJob, jobs_of, run_in_workers
from cachebuild.building.entry import Entry, record_entry
from cachebuild.building.pool import WorkerSetup, background_jobs, job_label, setup_for
from cachebuild.errors import BuildError, UsageError

log = logging.getLogger("cachebuild")

#: What ``CACHEBUILD_WHILE_BUILDING`` may say (``CompileConfig.while_building="auto"``).
WHILE_BUILDING_SETTINGS = ("wait", "standalone", "eager_fusion")


def while_building_setting() -> str | None:
    """What ``while_building="auto"`` serves with by the operator's word
    (``CACHEBUILD_WHILE_BUILDING``), or None where unset; UsageError for another value."""
    value = os.environ.get("CACHEBUILD_WHILE_BUILDING", "").strip()
    if not value:
        return None
    if value not in WHILE_BUILDING_SETTINGS:
        raise UsageError(f"CACHEBUILD_WHILE_BUILDING={value!r}: choose one of "
                         f"{', '.join(WHILE_BUILDING_SETTINGS)} (unset: standalone pieces "
                         "on a CPU, wait elsewhere)")
    return value


class BackgroundBuild:
    """The missing targets of an entry, building in worker processes in the background,
    then loaded there too (``done`` is set once they are, or once a build failed:
    ``error`` says why, and the caller keeps what it has).
    With ``record``, the entry is recorded on that thread once they are all stored and
    loaded (not for an entry that is stored already). The targets go to the first caller
    that ``claim``s them (the serving thread's next call), once."""

    @classmethod
    def start(cls, entry: Entry, builder: Builder, jobs: list[BuildJob], *,
              record: bool) -> BackgroundBuild | None:
        """Start building ``jobs`` (``builder.missing(entry)``) in the background, or None
        where no worker could build them as this process would (``pool.setup_for``).
        Workers as for a cold start, one CPU left to this process unless the environment
        says how many: it goes on working meanwhile."""
        setup = setup_for(jobs, builder.store, builder.passes)
        if setup is None:
            return None
        return cls(entry, builder, jobs, background_jobs(len(jobs)), setup, record=record)

    def __init__(self, entry: Entry, builder: Builder, jobs: list[BuildJob], workers: int,
                 setup: WorkerSetup, *, record: bool) -> None:
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
        self._thread = threading.Thread(target=self._run, name="cachebuild-background-build",
                                        daemon=True)
        self._thread.start()
        process_state.current().building.add(self)
        # Registered after the toolchain probe's own exit handler, so run before it.
        atexit.register(self.finish_at_exit)

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

    def finish_at_exit(self) -> None:
        """A process that ends while its targets build waits for them, saying so, so that
        its next start finds them stored (and the entry recorded); Ctrl-C leaves them,
        to be built again by the next start."""
        if self.done.is_set():
            return
        log.warning("cachebuild: waiting for the %d targets building in the background, "
                    "so that the next start finds them stored (Ctrl-C leaves them)",
                    len(self._jobs))
        try:
            self.done.wait()
        except KeyboardInterrupt:
            log.warning("cachebuild: left the targets building in the background; the "
                        "next start builds what is missing")

    def _run(self) -> None:
        start = time.perf_counter()

        def built(job: BuildJob, result: Any) -> None:
            log.info("cachebuild: built %s in %.1f s in the background", job_label(job),
                     result.seconds)

        try:
            failed = run_in_workers(self._jobs, self.builder, self._setup, self._workers,
                                    built)
            if failed:
                raise BuildError("; ".join(why for _, why in failed))
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
        except Exception as e:  # the caller keeps what it has
            self.error = f"{type(e).__name__}: {e}"
            log.warning("cachebuild: the targets building in the background failed, so the "
                        "model keeps serving with its interim targets: %s", self.error)
        finally:
            self.done.set()
