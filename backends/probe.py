"""Which C++ compiler builds AOTInductor libraries that load and run here?

AOTInductor builds a piece's wrapper (and, on CPU, its kernels) with the C++ compiler that
Inductor's ``cpp.cxx`` setting names, by default ``$CXX`` or else ``g++``. Some
environments' default compiler makes libraries that crash on load: a wrapper script that
brings its own C++ runtime, two runtimes disagreeing in one process. So the ``inductor``
backend asks once per environment. For each candidate compiler in turn (``$CXX``, the
``g++`` and ``c++`` found on ``PATH``, then ``/usr/bin/g++`` and ``/usr/bin/c++``; all at
once, in order of preference) a child process builds a two-op AOTI package with it, loads it through the runner artifacts load
with (``backends.aoti``), runs it and, on CUDA, captures and replays it in a CUDA graph.
The first that passes is the **toolchain**: Inductor builds use it through Inductor's own
setting (never by changing the process environment), and its identity enters every target
key, since it decides what a library contains. A crash of a child is a verdict on that
compiler, not a crash of ours. With no compiler that passes, ``auto`` builds ``standalone``
artifacts and ``aoti`` is refused with the reasons.

A compiler runs with this process's rights (often root), so no candidate is ever run,
not even for ``--version``, if another user could replace it (``executables.replaceable``:
the file, a symlink to it or a directory on the way not owned by root or us, or writable
by others); it is refused with why. With ``$CXX`` set, the compiler ``PATH`` finds is not
a candidate (``$CXX`` says which one to use; the system's ``/usr/bin`` ones remain).

Verdicts are cached as one JSON file per fingerprint (the environment's key factors plus
each candidate's path, size and modification time, so an upgraded compiler is probed
again) in the environment folder (``environment.py``: one per machine, user and software
stack, shared by every store; or ``$CACHEBUILD_PROBE_DIR``), which is checked like the
store (ours, private, and no directory above it that another user could rename). Where
that folder cannot be written (a read-only home), the verdict is kept in memory. A verdict
records its compiler's SHA-256, and before every use the compiler is checked again
(``unusable``: nobody else could replace it, and it still hashes the same); a verdict
that fails is probed again.

The probe is off the critical path: ``start`` runs it on a thread of its own (a compile
call and ``cachebuild warm`` start it before they trace), and ``verdict`` waits for that
run. Builds need not: ``presumed`` answers as soon as the first candidate in order whose
small library loaded is known (seconds), and builds in worker processes begin with it;
``confirm`` waits for the verdict before anything built with it is built in or loaded
into the calling process, and raises ToolchainRefuted where the verdict chose otherwise
(the caller plans again). Candidates run at once; the first in order of preference that passes wins as soon as
every one before it is refused, and the others are stopped. Each child first builds and
loads a small C++ library beside torch (a library that crashes as it loads, or at its
first use of the C++ runtime, is refused in a second or two; one that crashes only inside
AOTI's loader is refused at the package's load) before the package. Headers are
precompiled by the probe (into the environment folder, for the builds after it) only
where there is one candidate, which is then the one builds use; with several, which one
wins is not known until the packages load, so none precompiles any and the first build
makes those of the winner: the probe builds no more than a first build needs.

On a CPU a first cold start's builds prove the presumed compiler themselves: each build
loads its package in its worker, runs it and compares it with its piece before it is
stored (``Builder``), all that the probe's own package would show (``proven``). So a
child started by ``start`` stops after its small library and the ISA checks and builds
its package only if someone waits for the verdict before any build proved its compiler
(builds in the calling process, a start whose targets are all stored, another process
waiting for the verdict's lock), or if no proof came for ``PROOF_PATIENCE_S`` (a start
whose trace failed still reaches a verdict); on two cores its package would otherwise
take a CPU from the builds for tens of seconds. On a GPU the probe's package is also
captured in a CUDA graph, which a build does not do: it is always built.

Run ``python -m cachebuild.backends.probe DEVICE [COMPILER]`` to probe by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachebuild.backends.executables import content_hash, replaceable
from cachebuild.errors import CachebuildError, MachineShort, transient_advice

log = logging.getLogger("cachebuild.probe")
#: What a long wait is doing, as it starts (the command line shows it at once).
progress = logging.getLogger("cachebuild.progress")

#: One candidate's build and load may take this long (a cold CPU build of the tiny
#: package takes tens of seconds on two cores).
PROBE_TIMEOUT_S = 900.0
#: Compilers tried after ``$CXX`` and the ones ``PATH`` finds, in this order.
SYSTEM_COMPILERS = ("/usr/bin/g++", "/usr/bin/c++")
_VERDICTS: dict[str, Verdict] = {}
#: A child waiting for a build's proof (``_probe_all``) builds its own package after this
#: long without one: a process whose builds never come (its trace failed, it serves
#: eagerly) still reaches a verdict. (Another process waiting for the verdict asks for it
#: at once.)
PROOF_PATIENCE_S = 120.0
#: How a candidate passed without its child's package (``proven``).
PROVEN_BY_BUILD = "a build's package made with it loaded and ran in a worker"


@dataclass(frozen=True)
class Compiler:
    """A C++ compiler: the path Inductor is told to run, what ``--version`` says, and the
    SHA-256 of the file it runs when it was probed."""

    path: str
    version: str
    sha256: str = ""

    @classmethod
    def found(cls, path: str, version: str) -> Compiler:
        """The compiler at ``path`` as it is now (its content hashed)."""
        return cls(path, version, content_hash(path) or "")

    def factors(self) -> dict[str, str]:
        """What enters a target key: the real path and the version line."""
        return {"cxx": os.path.realpath(self.path), "cxx_version": self.version}


@dataclass
class Verdict:
    """The probe's answer for one device type in one environment.

    ``compiler`` is the first candidate whose AOTI libraries load and run (None if none
    does); ``refused`` holds every candidate tried before it, or all of them, with why.
    """

    device: str
    compiler: Compiler | None
    refused: list[tuple[str, str]] = field(default_factory=list)

    @property
    def aoti(self) -> bool:
        return self.compiler is not None

    def describe(self) -> str:
        """One line: what builds AOTI libraries here, and what was refused and why."""
        if self.compiler is not None:
            head = f"AOTInductor ({self.device}): {self.compiler.path} ({self.compiler.version})"
        else:
            head = f"AOTInductor ({self.device}): no compiler works; pieces build as standalone"
        if self.refused:
            head += "; refused " + "; ".join(f"{path}: {why}" for path, why in self.refused)
        return head

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Verdict:
        compiler = data.get("compiler")
        if compiler is not None and not (isinstance(compiler, dict) and all(
                isinstance(v, str) for v in compiler.values())):
            raise TypeError("a verdict's compiler must be an object of strings")
        return cls(device=str(data["device"]),
                   compiler=Compiler(**compiler) if compiler else None,
                   refused=[(str(p), str(w)) for p, w in data.get("refused", [])])


class UntrustedCompiler(CachebuildError):
    """A C++ compiler that another user could replace was about to run."""


def unusable(verdict: Verdict) -> str | None:
    """Why ``verdict``'s compiler may not be used now (None if it may, or if there is none):
    another user could replace it, or it is no longer the file that was probed."""
    compiler = verdict.compiler
    if compiler is None:
        return None
    why = replaceable(compiler.path)
    if why is not None:
        return f"{compiler.path} could be replaced by another user: {why}"
    if not compiler.sha256 or content_hash(compiler.path) != compiler.sha256:
        return f"{compiler.path} is not the file that was probed (its content changed)"
    return None


def trusted_compiler(path: str) -> str:
    """``path`` if no other user could replace it; UntrustedCompiler saying why otherwise.
    For a compiler named by anything but this process's own verdict (a target's manifest,
    an artifact's build info)."""
    why = replaceable(path)
    if why is not None:
        raise UntrustedCompiler(f"refusing to run the C++ compiler {path}: another user "
                                f"could replace it ({why})")
    return path


def candidate_compilers() -> list[str]:
    """The compilers to try, best first, each once (by the file it resolves to): ``$CXX``
    if set, else the ``g++`` and ``c++`` on ``PATH``; then the system's. Some may be
    ones another user could replace: ``trusted_candidates`` sorts them out."""
    names: list[str | None] = []
    if os.environ.get("CXX"):
        names.append(shutil.which(os.environ["CXX"]))
    else:
        names += [shutil.which("g++"), shutil.which("c++")]
    names += [p for p in SYSTEM_COMPILERS if os.access(p, os.X_OK)]
    out: list[str] = []
    seen: set[str] = set()
    for name in names:
        if name and os.path.realpath(name) not in seen:
            seen.add(os.path.realpath(name))
            out.append(name)
    return out


def trusted_candidates() -> tuple[list[str], list[tuple[str, str]]]:
    """The candidates that may be run, and the others with why they may not."""
    trusted, refused = [], []
    for path in candidate_compilers():
        why = replaceable(path)
        if why is None:
            trusted.append(path)
        else:
            refused.append((path, f"not run: another user could replace it ({why})"))
    return trusted, refused


def compiler_version(path: str) -> str | None:
    """The first line ``path --version`` prints, or None if it does not run."""
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def _fingerprint(device: str, candidates: list[str]) -> str:
    from cachebuild.keys import make_key
    from cachebuild.tracing.env import env_factors

    files = []
    for path in candidates:
        try:
            st = os.stat(path)
            files.append([path, st.st_size, st.st_mtime_ns])
        except OSError:
            files.append([path, None, None])
    return make_key({"probe": "aoti-toolchain", "env": env_factors(device), "compilers": files})


def probe_dir(default: Path | None = None) -> Path:
    """Where verdicts are kept: ``$CACHEBUILD_PROBE_DIR``, else ``default``, else this
    environment's folder under the user's cache folder (``environment.current``). Not
    checked here: see ``checked_dir``."""
    from cachebuild.backends import environment

    if environment.overridden() is not None:
        return environment.overridden()  # type: ignore[return-value]
    if default is not None:
        return default
    return environment.current()


def checked_dir(folder: Path | None = None) -> Path:
    """``probe_dir(folder)``, made if missing and checked like the store (UnsafeStore,
    exit 2, if another user owns it, could write it, or could rename it or a directory
    above it), with its ``environment.json``; its real path."""
    from cachebuild.backends.environment import describe, root
    from cachebuild.store import checked_real_dir, make_private_dir

    path = probe_dir(folder).expanduser().absolute()
    if path.parent == root():
        # The folder of every environment folder: private too, so that no one else sees
        # which environments this user has.
        make_private_dir(path.parent, "folder of environment folders")
    real = checked_real_dir(path, "environment folder", make=True)
    describe(real)
    return real


def usable_dir(folder: Path | None = None) -> Path | None:
    """``checked_dir(folder)`` where it can be used to write; None where the default
    environment folder cannot be made or written here (a read-only home: builds then keep
    what it would hold in their work folder, and verdicts in memory), said once. A folder
    named by ``$CACHEBUILD_PROBE_DIR`` or ``folder`` that fails its checks is the
    operator's error (UnsafeStore, exit 2)."""
    from cachebuild.backends import environment
    from cachebuild.errors import StoreError
    from cachebuild.store import say_once

    try:
        real = checked_dir(folder)
    except (StoreError, OSError) as e:
        if folder is not None or environment.overridden() is not None:
            raise
        say_once(f"the environment folder cannot be used here ({e}); the C++ toolchain "
                 "verdict is kept in memory, for this process only, and builds keep headers "
                 "in their work folder; to keep them for every build, name a folder you can "
                 "write in CACHEBUILD_PROBE_DIR")
        return None
    if not os.access(real, os.W_OK):
        return None
    return real


# -- the probe, off the critical path ---------------------------------------------------

_inflight_lock = threading.Lock()


@dataclass
class _Inflight:
    """A probe ``start`` runs: ``done`` when its verdict is known; ``guess`` as soon as
    it can be presumed (``presumed``). While it runs it is told the compilers whose
    packages builds proved (``proven``) and whether anyone waits for its verdict
    (``wanted``): a CPU candidate's child builds its own package only then."""

    done: Future[None] = field(default_factory=Future)
    guess: Future[Verdict] = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    proven: set[str] = field(default_factory=set)
    wanted: bool = False

    def presume(self, found: Verdict) -> None:
        if not self.guess.done():
            self.guess.set_result(found)

    def news(self) -> tuple[set[str], bool]:
        """The compilers proven so far (real paths), and whether the verdict is wanted:
        read together, so that a proof given before a wait is never missed."""
        with self.lock:
            return set(self.proven), self.wanted


_inflight: dict[str, _Inflight] = {}
#: By device type: what this process's builds presumed while the probe ran
#: (``presumed``), until ``confirm`` holds it against the verdict.
_PRESUMED: dict[str, Verdict] = {}


def _inflight_key(device: str, folder: Path | None) -> str:
    return f"{device.split(':')[0]}|{folder or ''}"


def start(device: str, folder: Path | None = None) -> None:
    """Find the verdict for ``device`` on a thread of its own, now, so that whoever needs
    it later (``verdict``) waits the least: a compile call and ``warm`` call this before
    they trace. Does nothing where it is known or already being found."""
    key = _inflight_key(device, folder)
    with _inflight_lock:
        if key in _inflight:
            return
        running = _inflight[key] = _Inflight()

    def run() -> None:
        error: BaseException | None = None
        try:
            running.presume(_verdict(device, folder, running))
        except BaseException as e:  # noqa: BLE001  # the waiter finds it again, and says it
            error = e
            if not running.guess.done():
                running.guess.set_exception(e)
        with _inflight_lock:  # gone before ``done``: a waiter then reads the verdict
            _inflight.pop(key, None)
        if error is None:
            running.done.set_result(None)
        else:
            running.done.set_exception(error)

    threading.Thread(target=run, name="cachebuild-probe", daemon=True).start()


def verdict(device: str, folder: Path | None = None) -> Verdict:
    """The toolchain verdict for ``device`` ("cpu", "cuda:0", ...), probing if needed.

    Probing runs the trusted candidates in child processes, once per environment; later
    calls (in any process sharing the environment folder) read the cached verdict. Every
    call checks the verdict's compiler again (``unusable``) and probes again if it fails.
    Where ``start`` is finding it already, waits for that (said on the
    ``cachebuild.progress`` log within half a second, unless it is decided by then).
    """
    with _inflight_lock:
        running = _inflight.get(_inflight_key(device, folder))
    if running is not None and threading.current_thread().name != "cachebuild-probe":
        if not running.done.done():
            with running.lock:
                running.wanted = True
            # A build's proof given just before is taken within a turn of the probe's loop:
            # no line for that.
            with contextlib.suppress(BaseException):
                running.done.result(timeout=0.5)
        if not running.done.done():
            progress.info("waiting for the C++ toolchain probe (once per machine and "
                          "environment)")
        with contextlib.suppress(BaseException):
            running.done.result()  # an error is found again, and raised, below
    return _verdict(device, folder)


def presumed(device: str, folder: Path | None = None) -> Verdict:
    """The verdict for ``device`` where it is known; while ``start``'s probe is still
    finding it, what it presumes as soon as it can: the first candidate in order of
    preference whose small C++ library loaded beside torch (every one before it refused).
    Builds in worker processes may begin with it; nothing built with it may be built in
    or loaded into this process before ``confirm`` (its packages may still crash)."""
    with _inflight_lock:
        running = _inflight.get(_inflight_key(device, folder))
    if running is None or threading.current_thread().name == "cachebuild-probe":
        return verdict(device, folder)
    if not running.guess.done():
        progress.info("waiting for the C++ toolchain check (once per machine and "
                      "environment)")
    try:
        found = running.guess.result()
    except BaseException:  # noqa: BLE001  # found again, and raised, by the verdict
        return verdict(device, folder)
    # Recorded even where the verdict came meanwhile: ``confirm`` then compares at once.
    _PRESUMED.setdefault(device.split(":")[0], found)
    return found


def confirm(device: str, folder: Path | None = None) -> None:
    """Return once what this process presumed for ``device`` (``presumed``) is the
    verdict, waiting for the probe where it still runs; ToolchainRefuted where the verdict
    chose otherwise, to every caller until ``forget_refuted``. At once where nothing was
    presumed (a verdict known before, or a worker process, which presumes nothing)."""
    from cachebuild.errors import ToolchainRefuted

    kind = device.split(":")[0]
    guess = _PRESUMED.get(kind)
    if guess is None:
        return
    found = verdict(device, folder)
    if _chosen(found) == _chosen(guess):
        _PRESUMED.pop(kind, None)
        return
    # Kept: every later caller (another model's start, another thread) is refused too,
    # until it plans again with the verdict (``forget_refuted``).
    raise ToolchainRefuted(
            f"builds began with {guess.compiler.path if guess.compiler else 'no compiler'}, "
            f"and the toolchain probe then chose otherwise: {found.describe()}", device)


def forget_refuted(device: str) -> None:
    """Before planning again after ToolchainRefuted: what was presumed for ``device``'s
    type is forgotten, the verdict being known now (``presumed`` returns it)."""
    _PRESUMED.pop(device.split(":")[0], None)


def proven(device: str, compiler: str) -> None:
    """A worker process built an AOTInductor package for ``device`` with ``compiler``,
    loaded it beside torch and ran it against its piece (a build's proof): on a CPU, all
    that the probe's own package would show, so the probe running for that device takes
    it as the compiler's pass and builds no package of its own. On a GPU the probe also
    captures its package in a CUDA graph, which a build does not: nothing is taken."""
    kind = device.split(":")[0]
    if kind != "cpu":
        return
    with _inflight_lock:
        running = [r for key, r in _inflight.items() if key.split("|")[0] == kind]
    for each in running:
        with each.lock:
            each.proven.add(os.path.realpath(compiler))


def _chosen(found: Verdict) -> dict[str, str] | None:
    return found.compiler.factors() if found.compiler is not None else None


def _verdict(device: str, folder: Path | None, running: _Inflight | None = None) -> Verdict:
    from cachebuild.backends.environment import in_use
    from cachebuild.errors import StoreError
    from cachebuild.store import check_readable_dir, writable_here

    kind = device.split(":")[0]
    candidates, untrusted = trusted_candidates()
    fingerprint = _fingerprint(device, candidate_compilers())
    found = _VERDICTS.get(fingerprint)
    if found is not None and unusable(found) is None:
        return found
    given = probe_dir(folder).expanduser().absolute()
    if given.exists() and not writable_here(given):
        # A folder this process may only read (an image's): its verdict is used where it
        # has one, the folder is safe to read and the compiler checks out; else this
        # process probes and keeps the verdict in memory.
        try:
            check_readable_dir(given)
            found = _read(given / f"aoti-{kind}-{fingerprint}.json")
        except StoreError:
            found = None
        if found is None or unusable(found) is not None:
            found = _probe_all(device, candidates, untrusted, running=running)
        _VERDICTS[fingerprint] = found
        return found
    real = usable_dir(folder)
    if real is None:
        found = _probe_all(device, candidates, untrusted, running=running)
        _VERDICTS[fingerprint] = found
        return found
    verdict_file = real / f"aoti-{kind}-{fingerprint}.json"
    # Made by a process that waits for the lock: the one holding it, probing, is asked to
    # decide now (its child builds its package instead of waiting for a build's proof).
    asked = verdict_file.with_suffix(".wanted")
    with in_use(real), _verdict_lock(verdict_file, asked):
        found = _read(verdict_file)
        why = unusable(found) if found is not None else None
        if why is not None:
            log.warning("probing the C++ toolchain again: %s", why)
        if found is None or why is not None:
            found = _probe_all(device, candidates, untrusted, real, running, asked)
            tmp = verdict_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(found.to_json()))
            os.replace(tmp, verdict_file)
            asked.unlink(missing_ok=True)
            log.info("%s", found.describe())
    _VERDICTS[fingerprint] = found
    return found


@contextlib.contextmanager
def _verdict_lock(verdict_file: Path, asked: Path) -> Iterator[None]:
    """Hold the lock of ``verdict_file``; where another process holds it (probing), say
    so in ``asked`` before waiting for it."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(verdict_file) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        with contextlib.suppress(OSError):
            asked.touch()
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _read(path: Path) -> Verdict | None:
    try:
        return Verdict.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # damaged: probe again
        log.warning("ignoring unreadable probe verdict %s (%s)", path, e)
        return None


def cached_verdicts(folder: Path | None = None) -> list[Verdict]:
    """Every verdict cached in ``folder`` (for ``cachebuild stats``); reads files only,
    from a folder checked like the store (UnsafeStore if it is not safe)."""
    from cachebuild.store import checked_real_dir

    path = folder if folder is not None else probe_dir()
    path = path.expanduser().absolute()
    if not path.exists():
        return []
    real = checked_real_dir(path, "environment folder")
    out = []
    for path in sorted(real.glob("aoti-*.json")):
        found = _read(path)
        if found is not None:
            out.append(found)
    return out


@dataclass
class Toolchains:
    """What the environment folders say of this machine's toolchains (``cachebuild stats``):
    every verdict they hold, and why a folder's were not read, if one's were not."""

    verdicts: list[Verdict]
    problem: str | None = None

    def to_json(self) -> list[dict[str, Any]]:
        return [v.to_json() | {"summary": v.describe(), "unusable": unusable(v)}
                for v in self.verdicts]


def listed_toolchains(folders: list[Path]) -> Toolchains:
    """The verdicts cached in each of ``folders``; a folder not safe to read is skipped
    and named in ``problem`` (builds do not use its verdicts either)."""
    from cachebuild.store import UnsafeStore

    found = Toolchains([])
    for folder in folders:
        try:
            found.verdicts += cached_verdicts(folder)
        except UnsafeStore as e:
            found.problem = str(e)
    return found


#: The children running now, stopped if this process exits first (a model that failed to
#: trace ends the process while its probe still runs).
_children: set[subprocess.Popen[bytes]] = set()


def _kill(child: subprocess.Popen[bytes]) -> None:
    """End ``child`` and the compilers it started (its own process group)."""
    with contextlib.suppress(OSError):
        os.killpg(child.pid, signal.SIGKILL)


#: Set as this process ends: a child killed then says nothing of its compiler, and the
#: probe it belonged to keeps no verdict (``_probe_all``).
_ENDING = threading.Event()


def _forked() -> None:
    """In a child forked while a probe ran: its thread and its children are the parent's.
    The child neither waits for that thread (a verdict is then read from the verdict
    file, whose lock the parent's probe holds until it is written) nor, ending, stops the
    parent's children (their deaths would read as crashes of their compilers)."""
    global _inflight_lock
    _inflight_lock = threading.Lock()
    _inflight.clear()
    _children.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


@atexit.register
def _stop_children() -> None:
    _ENDING.set()
    for child in list(_children):
        _kill(child)


def _probe_all(device: str, candidates: list[str],
               untrusted: list[tuple[str, str]] | None = None,
               records: Path | None = None, running: _Inflight | None = None,
               asked: Path | None = None) -> Verdict:
    """Probe every candidate at once (each in its own child); the first in order that
    passes wins as soon as every one before it is refused, and the children still
    running are stopped. Those before it (and ``untrusted``, never run) are refused with
    why. Each child records in ``records`` (the environment folder) the CPU's vector ISAs
    its build checked (``compilers.watch``); a lone candidate's child also keeps the
    headers it precompiled there, so builds with that compiler make neither again.
    ``running`` (the probe ``start`` runs) is told, once, the first candidate in order
    whose small library loaded (``presumed``), as soon as that is known.

    On a CPU, with ``running``, a child stops after its small library and the ISA checks
    and waits: a build that proves a package made with its compiler (``proven``) is its
    pass, and it builds its own package (precompiling no headers) once someone waits for
    the verdict (in this process, or in another one, which then makes the file
    ``asked``), or on its own after ``PROOF_PATIENCE_S``. A first cold start's builds,
    which prove their packages anyway, then share the CPUs with no package built only to
    be thrown away. No child's wait counts against its time."""
    import tempfile

    kind = device.split(":")[0]
    progress.warning("probing the C++ compilers for AOTInductor: once per machine and "
                     "environment (a minute or two), kept in %s",
                     records if records is not None else "memory")
    versions = {path: compiler_version(path) for path in candidates}
    runnable = [p for p in candidates if versions[p] is not None]
    refused: list[tuple[str, str]] = list(untrusted or [])
    results: dict[str, tuple[bool, str]] = {}
    started = time.monotonic()
    wait = running is not None and kind == "cpu"
    # Until when each child may run; None while it waits, its checks done, to be told to
    # build its package (``told``).
    deadline: dict[str, float | None] = {p: started + PROBE_TIMEOUT_S for p in runnable}
    told: set[str] = set()
    presume = running.presume if running is not None else None
    with tempfile.TemporaryDirectory(prefix="cachebuild-probe-") as work:
        children = {path: _start_one(device, path, Path(work) / str(i), records,
                                     headers=len(runnable) == 1, wait=wait)
                    for i, path in enumerate(runnable)}
        try:
            while True:
                proofs, wanted = running.news() if running is not None else (set(), False)
                wanted = wanted or (asked is not None and asked.exists())
                for path, (proc, out, err) in list(children.items()):
                    if path in results:
                        continue
                    if os.path.realpath(path) in proofs:
                        results[path] = (True, PROVEN_BY_BUILD)
                    elif proc.poll() is not None:
                        results[path] = _outcome(proc, out, err)
                        _children.discard(proc)
                        log.info("AOTInductor probe: %s %s after %.1f s", path,
                                 "passed" if results[path][0] else
                                 f"refused ({results[path][1]})", time.monotonic() - started)
                    elif wait and path not in told:
                        said = out.read_text(errors="replace").split()
                        if "checked" in said:
                            if wanted and "package" not in said:
                                _ask_for_package(proc)
                            if wanted or "package" in said:  # its package's time begins
                                told.add(path)
                                deadline[path] = time.monotonic() + PROBE_TIMEOUT_S
                            else:
                                deadline[path] = None
                if presume is not None:
                    guess = _presumption(candidates, versions, results, children)
                    if guess is not None:
                        presume(_verdict_of(kind, guess, versions, refused, results))
                        presume = None
                decided = _decided(candidates, versions, results)
                if decided is not None:
                    break
                now = time.monotonic()
                for path, until in deadline.items():
                    if path not in results and until is not None and now > until:
                        results[path] = (False, f"timed out after {PROBE_TIMEOUT_S:.0f} s")
                time.sleep(0.1)
        finally:
            for proc, _, _ in children.values():
                if proc.poll() is None:
                    _kill(proc)
                proc.wait()
                if proc.stdin is not None:  # the pipe a waiting child was told through
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
                _children.discard(proc)
    if _ENDING.is_set():  # what a child killed at the exit said is not a verdict
        raise CachebuildError("the process ended before the C++ toolchain probe did")
    for path in candidates:
        if versions[path] is None:
            refused.append((path, "does not run (`--version` failed)"))
            continue
        ok, why = results[path]
        if why.startswith(SHORT):  # undecided, and before any that passed: nothing decided
            reason = why.removeprefix(SHORT)
            raise MachineShort(f"the C++ toolchain probe could not decide on {path} ({reason}):"
                               f" {transient_advice(reason)}; nothing was decided about the "
                               "compilers", reason)
        if ok:
            log.warning("the C++ compiler for AOTInductor on %s is %s (%s): chosen by the "
                        "probe in %.0f s%s, kept for every build in this environment", kind,
                        path, versions[path], time.monotonic() - started,
                        f" ({why})" if why != "ok" else "")
            return Verdict(kind, Compiler.found(path, versions[path] or ""), refused)
        refused.append((path, why))
        log.warning("AOTInductor probe: %s refused for %s: %s", path, kind, why)
    return Verdict(kind, None, refused)


def _presumption(candidates: list[str], versions: dict[str, str | None],
                 results: dict[str, tuple[bool, str]],
                 children: dict[str, tuple[subprocess.Popen[bytes], Path, Path]]) -> str | None:
    """The candidate to presume (``""``: none passes), or None while that waits on a
    child: the first in order that passed, or whose small library loaded (its child said
    ``library``), every one before it refused."""
    for path in candidates:
        if versions[path] is None:
            continue
        if path in results:
            if results[path][0]:
                return path
            continue
        out = children[path][1]
        if "library" in out.read_text(errors="replace").split():
            return path
        return None
    return ""


def _ask_for_package(proc: subprocess.Popen[bytes]) -> None:
    """Tell a child waiting after its checks to build, load and run its package."""
    with contextlib.suppress(OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.write(b"package\n")
        proc.stdin.flush()


def _verdict_of(kind: str, path: str, versions: dict[str, str | None],
                refused: list[tuple[str, str]],
                results: dict[str, tuple[bool, str]]) -> Verdict:
    """The verdict choosing ``path`` (``""``: none), those refused so far named."""
    so_far = [*refused, *((p, why) for p, (ok, why) in results.items() if not ok)]
    if not path:
        return Verdict(kind, None, so_far)
    return Verdict(kind, Compiler.found(path, versions[path] or ""), so_far)


def _decided(candidates: list[str], versions: dict[str, str | None],
             results: dict[str, tuple[bool, str]]) -> bool | None:
    """True once the first candidate in order that passes is known (every one before it
    refused), or every candidate is refused; None while that waits on a child."""
    for path in candidates:
        if versions[path] is None:
            continue
        if path not in results:
            return None
        if results[path][0]:
            return True
    return True


def _start_one(device: str, compiler: str, work: Path, records: Path | None,
               headers: bool, wait: bool = False) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start the child that builds, loads and runs the tiny package with ``compiler``, in
    ``work`` (its compilers' caches and temp files, removed after), recording its ISA
    checks (and, with ``headers``, keeping its precompiled headers) in ``records``. With
    ``wait``, it says ``checked`` after its small library and the ISA checks and builds
    the package (without headers) once told ``package`` on its standard input, or on its
    own after ``PROOF_PATIENCE_S``; it says ``package`` as it begins."""
    from cachebuild.trust.processes import child_env, python_command

    work.mkdir(mode=0o700)
    # Isolated, in its own folder: it imports nothing from the caller's working directory,
    # nor do the Python processes Inductor starts in it (``processes``).
    # One compile thread: the package has two kernels, and a pool of one process per CPU
    # (Inductor's default), each importing torch, would take CPUs the first builds need.
    env = child_env({"TMPDIR": str(work), "TORCHINDUCTOR_CACHE_DIR": str(work),
                     "TRITON_CACHE_DIR": str(work), "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    # Builds run the compiler by its real path (``Compiler.factors``): so does the probe,
    # so that what it records (ISA checks, precompiled headers, keyed by the command line)
    # is what they look for.
    command = python_command("cachebuild.backends.probe", device, os.path.realpath(compiler),
                             str(records or ""), "headers" if headers and not wait else "",
                             str(PROOF_PATIENCE_S) if wait else "")
    out, err = work / "stdout", work / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        # A session of its own: stopping it stops the compilers it started too.
        proc = subprocess.Popen(command, stdin=subprocess.PIPE if wait else subprocess.DEVNULL,
                                stdout=o, stderr=e, cwd=work, env=env, start_new_session=True)
    _children.add(proc)
    return proc, out, err


def _outcome(proc: subprocess.Popen[bytes], out: Path, err: Path) -> tuple[bool, str]:
    """A finished child's verdict on its compiler: ``(passed, why)``."""
    stdout = out.read_text(errors="replace")
    if proc.returncode == 0 and stdout.strip().endswith("ok"):
        return True, "ok"
    if proc.returncode == SHORT_EXIT and "short " in stdout:
        return False, SHORT + stdout.split("short ", 1)[1].strip()
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        if "library" not in stdout:
            return False, f"crashed on load ({name}) of a small C++ library built with it"
        stage = "on load" if "built" in stdout else "while building"
        return False, f"crashed {stage} ({name})"
    tail = (err.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
    return False, f"exit {proc.returncode}: {tail[:200]}"


#: A library with a C++ runtime of its own crashes as it loads beside torch's, or at its
#: first use of the runtime (``std::regex`` in AOTI's loader): checked in a second or two,
#: before any package is built.
_RUNTIME_CHECK = """
#include <regex>
#include <string>
extern "C" int cachebuild_probe(const char* text) {
    return std::regex_match(std::string(text), std::regex("[a-z]+[0-9]*")) ? 1 : 0;
}
"""


def _runtime_check(compiler: str, folder: str) -> None:
    """Build a small C++ library with ``compiler``, load it into this process (which has
    torch loaded) and use its C++ runtime; a crash here is the child's exit."""
    import ctypes

    source = os.path.join(folder, "check.cpp")
    library = os.path.join(folder, "libcheck.so")
    with open(source, "w") as f:
        f.write(_RUNTIME_CHECK)
    subprocess.run([compiler, "-shared", "-fPIC", "-O0", "-o", library, source], check=True,
                   capture_output=True, timeout=PROBE_TIMEOUT_S)
    lib = ctypes.CDLL(library)
    if lib.cachebuild_probe(b"abc123") != 1:
        raise SystemExit("the small C++ library built with it gives wrong answers")
    print("library", flush=True)


def _probe(device: str, compiler: str | None, records: str = "", headers: str = "",
           wait: str = "") -> None:
    """The child: build a small C++ library with ``compiler`` and use it beside torch,
    check the CPU's vector ISAs with it (recorded in ``records``, if named), then build
    the tiny package (keeping the headers it precompiles in ``records`` with ``headers``:
    what every later build with that compiler takes; else building none), load it, run
    it, check it. With ``wait`` (seconds), between the two it says ``checked`` and waits:
    it builds the package once its standard input says ``package``, or after ``wait``
    seconds without a word (it ends if its input is closed), saying ``package`` as it
    begins."""
    import tempfile

    import torch
    import torch._inductor.codecache  # noqa: F401  # before its header folder is set

    from cachebuild import compat
    from cachebuild.backends import aoti
    from cachebuild.backends.compilers import watch

    options: dict[str, Any] = {}
    if records and headers:
        compat.point_header_dir(os.path.join(records, "headers"))
    else:  # headers for a compiler that may not be chosen would be built for nothing
        options["cpp_cache_precompile_headers"] = False

    class Tiny(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.relu(x @ w) + 1,)

    x = torch.randn(8, 16, device=device)
    w = torch.randn(16, 16, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        if compiler:
            _runtime_check(compiler, tmp)
            # Inductor's checks of the CPU's vector ISAs with this compiler, first: the
            # builds that begin meanwhile with it (``presumed``) wait for their record.
            from torch._inductor import cpu_vec_isa

            with watch(Path(tmp), Path(records) if records else None), \
                    aoti.compiling_with(compiler):
                cpu_vec_isa.valid_vec_isa_list()
        if wait:
            print("checked", flush=True)
            import select

            told, _, _ = select.select([sys.stdin], [], [], float(wait))
            if told and sys.stdin.readline().strip() != "package":
                return
            print("package", flush=True)
        ep = torch.export.export(Tiny(), (x, w), strict=False)
        with watch(Path(tmp), Path(records) if records else None):
            package = aoti.build_package(ep, os.path.join(tmp, "probe.pt2"), options, compiler)
        print("built", flush=True)
        run = aoti.load_package(package, device)
        (out,) = run(x, w)
        torch.testing.assert_close(out, torch.relu(x @ w) + 1)
        if device.startswith("cuda"):  # the runner must also be capturable
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run(x, w)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                (captured,) = run(x, w)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(captured, torch.relu(x @ w) + 1)
    print("ok")


#: How ``_outcome`` says a child failed for the machine's sake (``SHORT_EXIT``).
SHORT = "short of the machine: "

#: The exit status of a probe child that failed for the machine's sake (a full disk, a
#: file size limit, no memory: ``errors.transient``), not its compiler's (EX_TEMPFAIL).
SHORT_EXIT = 75


if __name__ == "__main__":
    _args = sys.argv[1:] + ["", "", "", "", ""]
    try:
        _probe(_args[0] or "cpu", _args[1] or None, _args[2], _args[3], _args[4])
    except Exception as _e:
        from cachebuild.errors import transient

        _why = transient(_e)
        # A compiler killed by a signal, or one that hangs, is refused as ever: it may be
        # broken. A full disk, a file size limit, no memory is nothing of the compiler's.
        if _why is None or _why in ("the compiler was killed", "a compiler timed out"):
            raise
        print(f"short {_why}", flush=True)
        sys.exit(SHORT_EXIT)
