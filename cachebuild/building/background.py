"""Targets built in the background: in worker processes, then loaded on a thread.

A cold start that serves meanwhile (``serving.interim``) hands its missing targets to a
``BackgroundBuild``: workers build them (never the calling process, whose calls, random
streams and environment a build must not touch), a thread loads them once all are stored
and records the entry, and each caller that ``claim``s them (a compiled model) gets them
once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any

from cachebuild import process_state
from cachebuild.building.build import Builder, BuildJob, jobs_of, run_in_workers
from cachebuild.building.entry import Entry, record_entry
from cachebuild.building.pool import WAIT_SLICE_S, WorkerSetup, job_label
from cachebuild.errors import BuildError, UsageError
from cachebuild.store.interface import Store

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


def running_builds(store: Store, key: str | None = None) -> list[BackgroundBuild]:
    """The builds of this process running in the background into ``store`` (one that
    reopens the same way), of the entry ``key`` if given."""
    options = store.reopen_options()
    return [b for b in list(process_state.current().building)
            if b.running and b.error is None and b.store_options == options
            and (key is None or b.entry.key == key)]


def _leave(builds: list[BackgroundBuild]) -> None:
    for b in builds:
        b.left = True
    log.warning("cachebuild: left the targets building in the background; the next start "
                "builds what is missing")


def _exiting() -> bool:
    """Whether the interpreter is ending (its main thread done: exit handlers run)."""
    return not threading.main_thread().is_alive()


def finish_at_exit() -> None:
    """A process that ends while its targets build waits for them (and for every other
    build of the process, in one wait that says what it waits for), so that its next
    start finds them stored and the entries recorded. Ctrl-C, or an exit that a
    Ctrl-C caused, leaves them: the next start builds what is missing."""
    pending = [b for b in list(process_state.current().building)
               if not b.left and b.running]
    if not pending:
        return
    if isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        _leave(pending)
        return
    count = sum(len(b._jobs) for b in pending)
    log.warning("cachebuild: waiting for the %d target%s building in the background, so "
                "that the next start finds them stored (Ctrl-C leaves them)", count,
                "" if count == 1 else "s")
    began = time.monotonic()
    try:
        for b in pending:
            while not b.done.wait(15):
                log.warning("cachebuild: still building in the background (%.0f s)",
                            time.monotonic() - began)
    except KeyboardInterrupt:
        _leave(pending)


def _forked() -> None:
    """In a child forked while builds ran in the background (a pre-fork server): the
    threads that built them are not in the child; its parent builds and stores them. The
    child follows each through the store (``BackgroundBuild._follow``): it serves what it
    has meanwhile, takes the targets once the parent has stored them all, as the parent
    does, and never waits for them at its exit (nor records the entry: the parent does)."""
    for b in list(process_state.current().building):
        if not b.done.is_set():
            # New locks: one held by a thread of the parent at the fork stays held here.
            b._lock, b.done = threading.Lock(), threading.Event()
            b.left = True
            b._follower = None
            b._following = True
        if b._busy_fd is not None:  # the builder's lock is its own: this copy would hold it
            with contextlib.suppress(OSError):
                os.close(b._busy_fd)
            b._busy_fd = None


def _busy_file() -> tuple[str | None, int | None]:
    """A new file of this user's, locked (``flock``) by this process: held while it builds.
    ``(None, None)`` where none can be made (a child then follows until the targets come)."""
    import fcntl
    import tempfile

    try:
        fd, path = tempfile.mkstemp(prefix="cachebuild-building-")
    except OSError:
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None, None
    return path, fd


def _held(path: str | None) -> bool:
    """Whether the process that made ``path`` (``_busy_file``) still holds it: builds."""
    import fcntl

    if path is None:
        return True  # nothing says otherwise
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False  # let go: done, or failed
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or cannot say
        return True
    finally:
        os.close(fd)
    return False  # ended without letting go (killed)


#: How many times targets removed from the store before they were loaded are built again.
BUILD_ROUNDS = 3

#: How often a forked child looks in the store for its parent's targets, at first and at
#: most (it looks less often the longer they take).
FOLLOW_POLL_S = (0.5, 10.0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class BackgroundBuild:
    """The missing targets of an entry, building in worker processes in the background,
    then loaded there too (``done`` is set once they are, or once a build failed:
    ``error`` says why, and the caller keeps what it has).
    With ``record``, the entry is recorded on that thread once they are all stored and
    loaded (not for an entry that is stored already). Each caller that ``claim``s them
    (a compiled model's next call) gets them once; builds of this process for a store
    are found by ``running_builds`` (a start of the same entry joins one, a lookup counts
    its entry as stored)."""

    def __init__(self, entry: Entry, builder: Builder, jobs: list[BuildJob], workers: int,
                 setup: WorkerSetup, *, record: bool) -> None:
        """Start building ``jobs`` (``builder.missing(entry)``) in the background, in
        ``workers`` workers (``pool.background_jobs``) set up with ``setup``
        (``pool.setup_for``, which the caller asked first: None there means no worker can
        build them as this process would)."""
        self.entry = entry
        self.builder = builder
        #: how the store reopens (``Store.reopen_options``): which store this builds into
        self.store_options = builder.store.reopen_options()
        self.done = threading.Event()
        self.error: str | None = None
        self.seconds = 0.0
        #: set where the process, ending, was told not to wait for it (Ctrl-C)
        self.left = False
        self._claimants: set[int] = set()  # ids of the owners that took the targets
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._jobs, self._workers, self._setup = jobs, workers, setup
        self._record = record
        #: A file the building process holds locked while it builds (``_busy``): a child
        #: forked meanwhile follows the build through the store (``_forked``) until it
        #: is stored, or the lock is let go without it (the build failed, the builder
        #: died, a gc removed a target since).
        self._busy, self._busy_fd = _busy_file()
        self._following = False
        self._follower: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run, name="cachebuild-background-build",
                                        daemon=True)
        self._thread.start()
        process_state.current().building.add(self)
        # Registered after the toolchain probe's own exit handler, so run before it; the
        # function, not this build: a finished build is not kept alive until the exit.
        atexit.register(finish_at_exit)

    @property
    def running(self) -> bool:
        """True while the targets build (or load), before they are ready or failed."""
        self._follow_in_child()
        return not self.done.is_set()

    @property
    def claimed(self) -> bool:
        """True once some caller took the targets (``claim``)."""
        return bool(self._claimants)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the targets are built and loaded, or failed; True if that is over."""
        self._follow_in_child()
        if timeout is not None:
            return self.done.wait(timeout)
        while not self.done.wait(WAIT_SLICE_S):  # in slices: see ``WAIT_SLICE_S``
            pass
        return True

    def claim(self, owner: object) -> dict[str, Any] | None:
        """The loaded targets, to ``owner`` the first time it asks after they are ready
        (None after that, and while they build or after they failed)."""
        if self.running or self.error is not None:
            return None
        with self._lock:
            if id(owner) in self._claimants:
                return None
            self._claimants.add(id(owner))
            return self._loaded

    def take(self) -> dict[str, Any]:
        """The targets, once built, for a start that has nothing else to serve with (its
        interim targets failed) and serves them at once: raises BuildError if they
        failed too."""
        self.wait()
        if self.error is not None:
            raise BuildError(self.error)
        return self._loaded

    def _run(self) -> None:
        start = time.perf_counter()

        def built(job: BuildJob, result: Any) -> None:
            # Said at exit too, where the process waits for it (``finish_at_exit``).
            log.log(logging.WARNING if _exiting() else logging.INFO,
                    "cachebuild: built %s in %.1f s in the background", job_label(job),
                    result.seconds)

        try:
            jobs, loaded = self._jobs, {}
            for _ in range(BUILD_ROUNDS):
                failed = run_in_workers(jobs, self.builder, self._setup, self._workers, built)
                if failed:
                    raise BuildError("; ".join(why for _, why in failed))
                # A target removed from the store meanwhile (a `cachebuild gc`) is built
                # again, as a start that waits for its builds does.
                jobs = self._load_into(loaded)
                if not jobs:
                    break
            else:
                raise BuildError(f"built, then removed from the store before they were "
                                 f"loaded, {BUILD_ROUNDS} times (a `cachebuild gc` meanwhile?): "
                                 f"{', '.join(j.target.key for j in jobs)}")
            self._loaded = loaded
            self.seconds = time.perf_counter() - start
            if self._record:
                record_entry(self.entry, self.builder.store)
        except Exception as e:  # the caller keeps what it has
            self._failed(e, "cachebuild: the targets building in the background failed: %s; "
                            "a model served by interim targets keeps them, one without any "
                            "raises this at its call")
        finally:
            self.done.set()
            self._let_go()

    def _failed(self, error: Exception, said: str) -> None:
        """Keep why the targets cannot be had (``error``), and log ``said`` with it."""
        self.error = (str(error) if isinstance(error, BuildError)
                      else f"{type(error).__name__}: {error}")
        log.warning(said, self.error)

    def _let_go(self) -> None:
        """End the lock that says this process builds (``_busy``)."""
        if self._busy is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._busy)
        if self._busy_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._busy_fd)
        self._busy_fd = None

    def _load_into(self, loaded: dict[str, Any]) -> list[BuildJob]:
        """Load every target of the entry not in ``loaded`` yet from the store into it;
        the jobs of those the store no longer holds."""
        gone = []
        for key, job in jobs_of(self.entry, self.builder.config).items():
            if key not in loaded:
                fn = self.builder.load(key, job)
                if fn is None:
                    gone.append(job)
                else:
                    loaded[key] = fn
        return gone

    def _load_all(self) -> dict[str, Any]:
        """Every target of the entry, loaded from the store (where all are now)."""
        loaded: dict[str, Any] = {}
        gone = self._load_into(loaded)
        if gone:
            raise BuildError(f"target {gone[0].target.key} was stored, then removed from the "
                             "store before it was loaded (a `cachebuild gc` meanwhile?)")
        return loaded

    def _follow_in_child(self) -> None:
        """In a forked child (``_forked``): start following the parent's build, once."""
        if not self._following or self._follower is not None:
            return
        with self._lock:
            if self._follower is None:
                self._follower = threading.Thread(target=self._follow, daemon=True,
                                                  name="cachebuild-follow-build")
                self._follower.start()

    def _follow(self) -> None:
        """Wait until the parent has stored every target, then load them; an error once
        the parent stopped building without storing them all (``_held``)."""
        start = time.perf_counter()
        poll = FOLLOW_POLL_S[0]
        try:
            missing = list(jobs_of(self.entry, self.builder.config))
            while True:
                # The index alone (a record is there): loading checks the bytes.
                missing = [k for k in missing if self.builder.store.get_record(k) is None]
                if not missing:
                    break
                if not _held(self._busy) and any(
                        self.builder.store.get_record(k) is None for k in missing):
                    raise BuildError("the process this one was forked from stopped building "
                                     "them before they were all stored (its build failed, it "
                                     "ended, or a gc removed one since): the next start builds "
                                     "what is missing")
                time.sleep(poll)
                poll = min(FOLLOW_POLL_S[1], poll * 1.5)
            self._loaded = self._load_all()
            self.seconds = time.perf_counter() - start
        except Exception as e:  # the child keeps what it has
            self._failed(e, "cachebuild: the targets this process's parent built in the "
                            "background cannot be taken here: %s; it keeps serving with "
                            "what it has")
        finally:
            self.done.set()
