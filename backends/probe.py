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

Verdicts are cached as one JSON file per environment fingerprint (the environment's key
factors plus each candidate's path, size and modification time, so an upgraded compiler is
probed again) in the store's ``probe/`` folder, or in ``$CACHEBUILD_PROBE_DIR``, which is
checked like the store (ours, private, and no directory above it that another user could
rename). A verdict records its compiler's SHA-256, and before every use the compiler is
checked again (``unusable``: nobody else could replace it, and it still hashes the same);
a verdict that fails is probed again.

Run ``python -m cachebuild.backends.probe DEVICE [COMPILER]`` to probe by hand.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachebuild.backends.executables import content_hash, replaceable
from cachebuild.errors import CachebuildError

log = logging.getLogger("cachebuild.probe")

#: One candidate's build and load may take this long (a cold CPU build of the tiny
#: package takes tens of seconds on two cores).
PROBE_TIMEOUT_S = 900.0
#: Compilers tried after ``$CXX`` and the ones ``PATH`` finds, in this order.
SYSTEM_COMPILERS = ("/usr/bin/g++", "/usr/bin/c++")
_VERDICTS: dict[str, Verdict] = {}


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
    from cachebuild.env import env_factors
    from cachebuild.keys import make_key

    files = []
    for path in candidates:
        try:
            st = os.stat(path)
            files.append([path, st.st_size, st.st_mtime_ns])
        except OSError:
            files.append([path, None, None])
    return make_key({"probe": "aoti-toolchain", "env": env_factors(device), "compilers": files})


def probe_dir(default: Path | None = None) -> Path:
    """Where verdicts are kept: ``$CACHEBUILD_PROBE_DIR``, else ``default`` (the store's
    ``probe/`` folder), else the default store's. Not checked here: see ``checked_dir``."""
    if os.environ.get("CACHEBUILD_PROBE_DIR"):
        return Path(os.environ["CACHEBUILD_PROBE_DIR"])
    if default is not None:
        return default
    from cachebuild.store.layout import FORMAT_DIR
    from cachebuild.store.options import StoreOptions

    return Path(StoreOptions.from_env().cache_dir).expanduser() / FORMAT_DIR / "probe"


def checked_dir(folder: Path | None = None) -> Path:
    """``probe_dir(folder)``, made if missing and checked like the store (UnsafeStore,
    exit 2, if another user owns it, could write it, or could rename it or a directory
    above it); its real path."""
    from cachebuild.store.layout import check_parents, check_private_dir, make_private_dir

    path = probe_dir(folder).expanduser().absolute()
    make_private_dir(path)
    real = Path(os.path.realpath(path))
    check_private_dir(real)
    check_parents(real)
    return real


def verdict(device: str, folder: Path | None = None) -> Verdict:
    """The toolchain verdict for ``device`` ("cpu", "cuda:0", ...), probing if needed.

    Probing runs each trusted candidate in a child process, once per environment; later
    calls (in any process sharing ``folder``) read the cached verdict. Every call checks
    the verdict's compiler again (``unusable``) and probes again if it fails.
    """
    from filelock import FileLock

    from cachebuild.errors import StoreError
    from cachebuild.store.layout import check_readable_dir, writable_here

    kind = device.split(":")[0]
    candidates, untrusted = trusted_candidates()
    fingerprint = _fingerprint(device, candidate_compilers())
    found = _VERDICTS.get(fingerprint)
    if found is not None and unusable(found) is None:
        return found
    given = probe_dir(folder).expanduser().absolute()
    if given.exists() and not writable_here(given):
        # A read-only store's folder (an image's): its verdict is used where it has one,
        # the folder is safe to read and the compiler checks out; else this process probes
        # and keeps the verdict in memory.
        try:
            check_readable_dir(given)
            found = _read(given / f"aoti-{kind}-{fingerprint}.json")
        except StoreError:
            found = None
        if found is None or unusable(found) is not None:
            found = _probe_all(device, candidates, untrusted)
        _VERDICTS[fingerprint] = found
        return found
    folder = checked_dir(folder)
    verdict_file = folder / f"aoti-{kind}-{fingerprint}.json"
    with FileLock(str(verdict_file) + ".lock"):
        found = _read(verdict_file)
        why = unusable(found) if found is not None else None
        if why is not None:
            log.warning("probing the C++ toolchain again: %s", why)
        if found is None or why is not None:
            found = _probe_all(device, candidates, untrusted, folder)
            tmp = verdict_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(found.to_json()))
            os.replace(tmp, verdict_file)
            log.info("%s", found.describe())
    _VERDICTS[fingerprint] = found
    return found


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
    from cachebuild.store.layout import check_parents, check_private_dir

    path = probe_dir(folder).expanduser().absolute()
    if not path.exists():
        return []
    real = Path(os.path.realpath(path))
    check_private_dir(real)
    check_parents(real)
    out = []
    for path in sorted(real.glob("aoti-*.json")):
        found = _read(path)
        if found is not None:
            out.append(found)
    return out


def _probe_all(device: str, candidates: list[str],
               untrusted: list[tuple[str, str]] | None = None,
               records: Path | None = None) -> Verdict:
    """Probe every candidate at once (each in its own child); the first in order that
    passes wins, and the ones before it (and ``untrusted``, never run) are refused with
    why. Each child records in ``records`` (the probe folder) the CPU's vector ISAs its
    build checked (``compilers.watch``) and the headers it precompiled, so builds with
    that compiler make neither again."""
    from concurrent.futures import ThreadPoolExecutor

    kind = device.split(":")[0]
    versions = {path: compiler_version(path) for path in candidates}
    runnable = [p for p in candidates if versions[p] is not None]
    with ThreadPoolExecutor(max_workers=max(1, len(runnable))) as pool:
        results = dict(zip(runnable, pool.map(lambda p: _probe_one(device, p, records), runnable),
                           strict=True))
    refused: list[tuple[str, str]] = list(untrusted or [])
    for path in candidates:
        if versions[path] is None:
            refused.append((path, "does not run (`--version` failed)"))
            continue
        ok, why = results[path]
        if ok:
            return Verdict(kind, Compiler.found(path, versions[path] or ""), refused)
        refused.append((path, why))
        log.warning("AOTInductor probe: %s refused for %s: %s", path, kind, why)
    return Verdict(kind, None, refused)


def _probe_one(device: str, compiler: str, records: Path | None = None) -> tuple[bool, str]:
    """Build, load and run the tiny package with ``compiler`` in a child process, whose
    compilers write (caches, temp files) into a folder removed after, and which records its
    ISA checks and precompiled headers in ``records``."""
    import tempfile

    from cachebuild.processes import child_env, python_command

    with tempfile.TemporaryDirectory(prefix="cachebuild-probe-") as work:
        # Isolated, in its own folder: it imports nothing from the caller's working
        # directory, nor do the Python processes Inductor starts in it (``processes``).
        env = child_env({"TMPDIR": work, "TORCHINDUCTOR_CACHE_DIR": work,
                         "TRITON_CACHE_DIR": work})
        try:
            # Builds run the compiler by its real path (``Compiler.factors``): so does the
            # probe, so that what it records (ISA checks, precompiled headers, keyed by
            # the command line) is what they look for.
            command = python_command("cachebuild.backends.probe", device,
                                     os.path.realpath(compiler), str(records or ""))
            proc = subprocess.run(command, capture_output=True, text=True, cwd=work,
                                  timeout=PROBE_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {PROBE_TIMEOUT_S:.0f} s"
    if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
        return True, "ok"
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        stage = "on load" if "built" in proc.stdout else "while building"
        return False, f"crashed {stage} ({name})"
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return False, f"exit {proc.returncode}: {tail[:200]}"


def _probe(device: str, compiler: str | None, records: str = "") -> None:
    """The child: build the tiny package with ``compiler`` (recording the ISA checks the
    build makes, and keeping the headers it precompiles, in ``records``, if named: what
    every later build with that compiler takes), load it, run it, check it."""
    import tempfile

    import torch
    import torch._inductor.codecache  # noqa: F401  # before its header folder is set

    from cachebuild import compat
    from cachebuild.backends import aoti
    from cachebuild.backends.compilers import watch

    if records:
        compat.point_header_dir(os.path.join(records, "headers"))

    class Tiny(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.relu(x @ w) + 1,)

    x = torch.randn(8, 16, device=device)
    w = torch.randn(16, 16, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        ep = torch.export.export(Tiny(), (x, w), strict=False)
        with watch(Path(tmp), Path(records) if records else None):
            package = aoti.build_package(ep, os.path.join(tmp, "probe.pt2"), {}, compiler)
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


if __name__ == "__main__":
    _probe(sys.argv[1] if len(sys.argv) > 1 else "cpu", sys.argv[2] if len(sys.argv) > 2 else None,
           sys.argv[3] if len(sys.argv) > 3 else "")
