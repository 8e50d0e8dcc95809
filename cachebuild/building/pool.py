"""Targets built in worker processes: ``BuildPool``, and how many workers fit here.

A worker is ``cachebuild.worker`` in an isolated interpreter (``processes.python_command``:
nothing imported from the working directory, only the caller's path entries that no other
user could change), started at once (so that its imports of torch and Inductor overlap
whatever the caller does meanwhile, a trace say: a pool may be started before the caller
knows what it will build, and told how later, ``begin``); it
imports what the jobs need to resolve their ops (a model file, or the modules that
registered them), opens the caller's store by its options and builds one job at a time
through ``build.build_one`` (under the key's lock: a worker never builds what another
process is building). A worker that never got a job is stopped at once when the pool
closes. Jobs and results travel pickled over the worker's stdin and a pipe of its own, so
what the model file prints never mixes with them, and the caller's ``__main__`` is never
run again in a worker (``multiprocessing``'s spawn would run a server script's top level
once per worker).

Every worker builds into the same store, and so into the same work folder: one Inductor
cache, one Triton cache, one set of precompiled headers and one cache of C++ objects
(``backends/compilers.py``) for all of them. A worker that dies (killed, out of memory)
fails the job it held, naming how it ended, and the next job starts a new worker. Each
worker's Inductor compiles with its share of the CPUs (``compile_threads``), not with a
pool of its own as large as the machine.

``jobs_here(n)``: how many workers ``n`` targets get by default: no more than the CPUs
this process may use, nor than the memory available holds at ``CACHEBUILD_BUILD_MEMORY``
(default 1.5 GiB) per build: a worker of the example model peaks at 0.5 GiB and its C++
compiler at another 0.5 GiB (measured on CPU, torch 2.13). Before a trace says how many
targets there are, ``expected_targets`` guesses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from cachebuild.errors import UsageError

if TYPE_CHECKING:
    from cachebuild.passes import PassManager
    from cachebuild.store import StoreOptions
    from cachebuild.store.interface import Store
    from cachebuild.tracing.targets import BuildJob

#: What a long wait is doing, as each build starts (the command line shows it at once).
progress = logging.getLogger("cachebuild.progress")
log = logging.getLogger("cachebuild.building.build")


def job_label(job: BuildJob) -> str:
    """``piece 3 range 1-64``: a build job in words."""
    from cachebuild.tracing.targets import bucket_label

    return f"piece {job.target.piece} {bucket_label(job.target.bucket)}"

#: Seconds a thread waiting for builds waits at a time: a Ctrl-C that the OS hands to
#: another thread of the process is raised in the waiting one only when its wait returns.
WAIT_SLICE_S = 0.5

#: Memory one build takes at its peak, by default (see the module doc).
BUILD_MEMORY = int(1.5 * 2**30)


# -- how many ------------------------------------------------------------------------------

def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def compile_threads(workers: int) -> dict[str, str]:
    """What sizes the compile pool of each of ``workers`` build workers: its share of the
    CPUs. Inductor's default is a pool of one process per CPU in every process that
    compiles, each importing torch as it starts: N workers would start N times the CPUs,
    and their builds would wait on those imports. Nothing where the operator set
    ``TORCHINDUCTOR_COMPILE_THREADS``."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        check_compile_threads()
        return {}
    return {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, usable_cpus() // max(1, workers)))}


def check_compile_threads() -> None:
    """UsageError unless ``TORCHINDUCTOR_COMPILE_THREADS``, where set, is what Inductor
    takes (a whole number of at least 1): it reads it only as a build starts, and fails
    there with a traceback."""
    value = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    digits = (value or "").strip()
    if value is not None and not (digits.isascii() and digits.isdigit() and int(digits) >= 1):
        raise UsageError(f"TORCHINDUCTOR_COMPILE_THREADS={value!r}: give a whole number of "
                         "compile processes per build, at least 1, or unset it")


def available_memory() -> int | None:
    """Bytes of memory available to new work (Linux's MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def build_memory() -> int:
    """Bytes one build is expected to need (``CACHEBUILD_BUILD_MEMORY``: ``2G``, ``800M``)."""
    value = os.environ.get("CACHEBUILD_BUILD_MEMORY", "").strip()
    if not value:
        return BUILD_MEMORY
    from cachebuild.units import parse_size

    try:
        size = parse_size(value)
    except ValueError as e:
        raise UsageError(f"CACHEBUILD_BUILD_MEMORY={value!r}: {e}") from None
    if size <= 0:
        raise UsageError(f"CACHEBUILD_BUILD_MEMORY={value!r}: give a size above 0, e.g. 2G")
    return size


def jobs_here(targets: int) -> int:
    """Worker processes for ``targets`` builds by default: at most one per usable CPU and
    per ``build_memory()`` of available memory, at least one."""
    jobs = min(usable_cpus(), max(targets, 1))
    memory = available_memory()
    if memory is not None:
        jobs = min(jobs, max(1, memory // build_memory()))
    return max(1, jobs)


def expected_targets(buckets: int, *, edited: bool = False) -> int:
    """How many targets a start prepares workers for before its trace says: a decoder's
    pieces come in three kinds (the first, the repeated middle, the last), each built per
    bucket. After an edit of a model warmed before (``edited``, ``nearest.edited_since``)
    some are likely stored, and workers importing on every CPU would slow the trace that
    finds which: no more than the CPUs beside the trace's (one, on two). A pool started
    on this guess grows if the plan asks for more."""
    full = 3 * max(1, buckets)
    return min(full, max(1, usable_cpus() - 1)) if edited else full


def builds_here() -> bool:
    """Whether the operator asked for builds in the calling process
    (``CACHEBUILD_BUILD_JOBS=1``). Otherwise a cold start builds in worker processes
    wherever they can build as it would, one target too: the serving process then
    neither imports Inductor nor points the compilers' folders at a store for a build."""
    value = os.environ.get("CACHEBUILD_BUILD_JOBS", "").strip()
    return value.isdigit() and int(value) == 1


def cold_start_jobs(targets: int) -> int:
    """Workers a cold start builds ``targets`` missing targets in: ``CACHEBUILD_BUILD_JOBS``
    if set (1: in the calling process, ``builds_here``), else ``jobs_here``."""
    value = os.environ.get("CACHEBUILD_BUILD_JOBS", "").strip()
    if not value:
        return jobs_here(targets)
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"CACHEBUILD_BUILD_JOBS={value!r}: give a whole number of worker "
                         "processes, 1 or more (1: a server builds in its own process, `warm` "
                         "in one worker)")
    return min(int(value), max(targets, 1))


def background_jobs(targets: int) -> int:
    """Workers a build in the background (the process serves meanwhile) uses for
    ``targets`` targets: ``CACHEBUILD_BUILD_JOBS`` if set, else a cold start's count with
    one CPU left to the serving process."""
    workers = cold_start_jobs(targets)
    if not os.environ.get("CACHEBUILD_BUILD_JOBS", "").strip():
        workers = max(1, min(workers, usable_cpus() - 1))
    return workers


# -- which modules a worker imports -------------------------------------------------------

def op_modules(jobs: Iterable[BuildJob]) -> list[str] | None:
    """The modules a worker must import so that every op the jobs' pieces call is
    registered, or None where some op's module cannot be imported by name (defined in
    ``__main__``, a notebook, ``exec``) or only from a folder a worker does not import
    from (``processes.import_path``): such jobs build in the calling process."""
    from cachebuild.graph.facts import KEYED_NAMESPACES

    modules: list[str] = []
    for job in jobs:
        for node in job.nodes:
            target = node.get("target")
            if not isinstance(target, str) or not target.startswith("op:"):
                continue
            qualname = target[3:].split(".")[0]
            if qualname.split("::")[0] in KEYED_NAMESPACES:
                continue
            module = _module_of_op(qualname)
            if module is None:
                return None
            if module not in modules:
                modules.append(module)
    return modules


def _module_of_op(qualname: str) -> str | None:
    """The importable module that registered operator ``qualname`` (``ns::name``)."""
    from torch._library import custom_ops, simple_registry

    opdef = custom_ops.OPDEFS.get(qualname)
    if opdef is not None:
        name = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
        return name if _importable(name) else None
    entry = simple_registry.singleton.find(qualname)
    kernel = getattr(getattr(entry, "fake_impl", None), "kernel", None)
    source = str(getattr(kernel, "source", "") or "")
    path = source.rsplit(":", 1)[0]
    if not path:
        return None
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == path and _importable(name):
            return name
    return None


def _importable(name: str | None) -> bool:
    """True if a worker imports module ``name`` by its name from where this process did
    (``processes.reachable``: not from a folder another user could change)."""
    from cachebuild.trust.processes import reachable

    if not name or name in ("__main__", "__mp_main__") or name.startswith("<"):
        return False
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and spec is not None and spec.name == name and reachable(module)


def store_options(store: Store) -> StoreOptions | None:
    """The options workers open ``store`` with (``Store.reopen_options``), or None where
    its targets build in the calling process: a store no other process can open, or one
    with a remote tier (its transfers, locks and counters are this process's)."""
    if store.remote is not None:
        return None
    return store.reopen_options()


def setup_for(jobs: list[BuildJob], store: Store, passes: PassManager | None
              ) -> WorkerSetup | None:
    """How workers can build ``jobs`` exactly as this process would, or None where they
    cannot: a store they cannot open, passes other than the config's own (custom ones
    live in this process), a backend not built in, or ops registered by code they cannot
    import."""
    from cachebuild.passes import PassManager

    options = store_options(store)
    if options is None or not jobs:
        return None
    for job in jobs:
        if job.config.backend not in ("inductor", "eager_fusion"):
            return None
        if passes is not None and passes.factors() != PassManager.from_config(
                job.config.passes).factors():
            return None
    modules = op_modules(jobs)
    if modules is None:
        return None
    from cachebuild.trust.processes import import_path, withheld_path

    return WorkerSetup(options, modules=modules, sys_path=import_path(),
                       withheld=withheld_path())


# -- the pool --------------------------------------------------------------------------------

@dataclass
class WorkerSetup:
    """What each worker does before its first job: import ``model_file`` (a MODEL.py, by
    path, as the command line does) and ``modules`` (by name), with ``sys_path`` first on
    its path (only entries ``processes.import_path`` passes), then open the store
    ``options`` name. ``withheld``: why each folder of the caller's path left out of
    ``sys_path`` is (said where a worker cannot import a module)."""

    options: StoreOptions
    model_file: str | None = None
    modules: list[str] = field(default_factory=list)
    sys_path: list[str] = field(default_factory=list)
    withheld: list[str] = field(default_factory=list)


#: How a worker that could not set up (import the model, open the store) begins the
#: error of each job it is given.
NOT_SET_UP = "the build worker could not set up: "


@dataclass
class Result:
    """One job's outcome: built (True) or found stored (False), its seconds, its error,
    the warnings a worker hands on (class name, message), and the build's phases.
    ``died``: no worker gave a verdict on it (the worker ended while it held the job, or
    none could start): its error is the process's, not the piece's."""

    key: str
    built: bool
    seconds: float
    error: str | None = None
    warnings: list[tuple[str, str]] = field(default_factory=list)
    phases: dict[str, Any] = field(default_factory=dict)
    died: bool = False


#: Every worker this process started, for ``_forked``.
_STARTED: weakref.WeakSet[_Worker] = weakref.WeakSet()


def _forked() -> None:
    """In a forked child: let go of the pipes to the parent's workers (a worker ends when
    its job pipe closes, and the child's copy kept it open: the parent waited 30 s for
    each). The fds stay open, on /dev/null, so the copies' file objects close cleanly."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for worker in list(_STARTED):
            for f in (worker.jobs, worker.results):
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(devnull, f.fileno())
    finally:
        os.close(devnull)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class _Worker:
    """One worker process; told what to set up now (``setup``) or later (``begin``)."""

    def __init__(self, setup: WorkerSetup | None, env: dict[str, str] | None = None) -> None:
        self.used = False
        self.told = False
        from cachebuild.trust.processes import child_env, python_command

        read, write = os.pipe()
        try:
            # Isolated: it imports cachebuild, torch and the model's modules from where
            # this process does, never from the working directory (``processes``).
            # In the caller's process group: a signal sent to the group (a hang-up, a
            # Ctrl-C, a supervisor's stop) reaches it too (it ignores Ctrl-C: the caller
            # decides, ``kill``).
            self.proc = subprocess.Popen(
                python_command("cachebuild.worker", str(write), flags=("-u",)),
                stdin=subprocess.PIPE, pass_fds=(write,), env=child_env(env), close_fds=True)
        finally:
            os.close(write)
        self.results: BinaryIO = os.fdopen(read, "rb")
        assert self.proc.stdin is not None
        self.jobs: BinaryIO = self.proc.stdin
        _STARTED.add(self)
        if setup is not None:
            self.begin(setup)

    def begin(self, setup: WorkerSetup) -> None:
        self.told = True
        with contextlib.suppress(OSError):  # died meanwhile: ``run`` starts another
            send(self.jobs, setup)

    def run(self, job: BuildJob) -> Result:
        self.used = True
        try:
            send(self.jobs, job)
            result = receive(self.results)
        except (OSError, EOFError, pickle.UnpicklingError, struct.error):
            result = None
        if not isinstance(result, Result):
            code = self.proc.wait()
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            return Result(job.target.key, False, 0.0, f"the build worker {how} while building it",
                          died=True)
        return result

    def close(self) -> None:
        self.stop()
        self.wait()

    def stop(self) -> None:
        """Tell the worker to end after the job it holds (``wait`` waits for it)."""
        with contextlib.suppress(OSError):
            self.jobs.close()
        if not self.used and self.proc.poll() is None:
            self.proc.terminate()  # still importing, say: it holds nothing to finish

    def kill(self) -> None:
        """End the worker now: its job is lost (the store holds only what was whole),
        nothing else. The compilers it started end with their compile, or, at a terminal,
        with the Ctrl-C that reached them too."""
        with contextlib.suppress(OSError):
            self.jobs.close()
        for end in (self.proc.terminate, self.proc.kill):
            with contextlib.suppress(ProcessLookupError):
                end()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
                break

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        except BaseException:  # Ctrl-C again while it finishes its job: now, then
            self.kill()
            raise
        finally:
            self.proc.wait()
            self.results.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class BuildPool:
    """``workers`` build worker processes, started now; ``run`` hands them jobs. Without
    ``setup``, they import what every build needs and wait for ``begin(setup)``."""

    def __init__(self, workers: int, setup: WorkerSetup | None = None) -> None:
        self.setup = setup
        self._env = compile_threads(workers)  # the next workers' (``grow`` sets it again)
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []  # every worker started, for ``close``
        self._closing = threading.Event()  # no job starts once it is set
        try:
            self.grow(max(1, workers))
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self._idle)

    def begin(self, setup: WorkerSetup) -> None:
        """Tell the workers started without a setup what to set up."""
        self.setup = setup
        for worker in self._idle:
            if not worker.told:
                worker.begin(setup)

    def grow(self, workers: int) -> None:
        """Start workers until there are ``workers``, the new ones with their share of the
        CPUs among that many."""
        if workers > len(self._idle):
            self._env = compile_threads(workers)
        while len(self._idle) < workers:
            self._idle.append(self._start())

    def _start(self) -> _Worker:
        worker = _Worker(self.setup, self._env)
        self._all.append(worker)
        return worker

    def run(self, jobs: list[BuildJob], on_done: Callable[[BuildJob, Result], None]) -> None:
        """Build ``jobs``, each in the first free worker, calling ``on_done(job, result)``
        on this thread as each finishes; returns when all are done."""
        if self.setup is None:
            raise RuntimeError("BuildPool.run before begin(setup)")
        pending = list(jobs)
        lock = threading.Lock()
        finished: list[tuple[BuildJob, Result]] = []
        ready = threading.Condition(lock)

        def serve(worker: _Worker) -> None:
            while True:
                with lock:
                    if self._closing.is_set():
                        return
                    if not pending:
                        self._idle.append(worker)
                        ready.notify_all()
                        return
                    job = pending.pop(0)
                progress.info("building %s", job_label(job))
                try:
                    if not worker.alive:  # died after its last job: a new one takes this
                        worker.close()
                        with lock:
                            if self._closing.is_set():
                                return
                            worker = self._start()
                    result = worker.run(job)
                except Exception as e:  # a worker that cannot start: the job fails, said why
                    result = Result(job.target.key, False, 0.0,
                                    f"no build worker could run it: {type(e).__name__}: {e}",
                                    died=True)
                with lock:
                    finished.append((job, result))
                    ready.notify_all()

        workers, self._idle = self._idle, []
        threads = [threading.Thread(target=serve, args=(w,), daemon=True,
                                    name="cachebuild-build-worker") for w in workers]
        for t in threads:
            t.start()
        done = 0
        try:
            while done < len(jobs):
                with lock:
                    while not finished:
                        ready.wait(WAIT_SLICE_S)
                    batch, finished[:] = list(finished), []
                for job, result in batch:
                    done += 1
                    on_done(job, result)
        except BaseException:  # Ctrl-C, say: no job starts after it
            with lock:
                self._closing.set()
                pending.clear()
            raise
        for t in threads:
            t.join()

    def close(self, *, now: bool = False) -> None:
        """End the workers, also any a ``run`` that was interrupted still holds: each
        after the job it holds, or with ``now`` (an interrupted command) at once
        (``_Worker.kill``)."""
        self._closing.set()
        workers, self._all, self._idle = self._all, [], []
        if now:
            for worker in workers:
                worker.kill()
        for worker in workers:  # all told first: they end side by side, not one by one
            worker.stop()
        for worker in workers:
            worker.wait()

    def __enter__(self) -> BuildPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(now=kind is not None and issubclass(kind, KeyboardInterrupt))


# -- framing -----------------------------------------------------------------------------------

def send(stream: BinaryIO, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("!Q", len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("!Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)
