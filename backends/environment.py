"""The environment folder: what holds for one machine, user and software stack, kept once
and shared by every store of that user.

The C++ toolchain probe's verdicts, Inductor's checks of the CPU's vector ISAs, its
precompiled headers (about 140 MB a compiler flag set), the C++ objects builds keep for
reuse and their records do not depend on the store: making them once per store would make
every new store (a typo in ``CACHEBUILD_DIR``, a CI job, a second store) pay them again.
So they live in one folder per environment, under the user's cache folder::

    $XDG_CACHE_HOME (default ~/.cache)/cachebuild/env/<fingerprint>/
      environment.json   what the fingerprint is made of (torch, Python, CPU, ...)
      aoti-<device>-*.json, vec_isa-*.json, headers/, cxx/ (kept objects), built/

``$CACHEBUILD_PROBE_DIR`` names the folder itself instead. The folder is checked like the
store (ours, private, no directory above it that another user could rename) by its users
(``probe.checked_dir``). A store never needs it to serve: a start that finds its targets
loads them without it, and a build into a read-only store's overlay makes it here, in the
user's folder, or (where that cannot be written) keeps the verdict in memory.

Every process that uses a folder holds its ``.in-use`` file shared (flock) while it does;
``remove`` and ``clean_objects`` take it alone, so ``cachebuild gc`` never removes a
folder, or objects, that a probe or a build is using. Listing and sizing import no torch
(``cachebuild stats``); only ``fingerprint`` does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The variable that names the environment folder itself (not a parent of it).
OVERRIDE = "CACHEBUILD_PROBE_DIR"
#: The file that says what the fingerprint is made of.
DESCRIPTION = "environment.json"
#: Held shared (flock) by every process using the folder, alone by ``remove`` and
#: ``clean_objects``.
IN_USE = ".in-use"
#: The C++ objects builds keep for reuse (``compilers``), and their records.
OBJECTS = ("cxx", "built/cxx")
#: ``cachebuild gc`` removes a kept object no build has made or reused for this long.
OBJECT_AGE = 7 * 24 * 3600.0


#: The length of an environment folder's name (a key of its factors).
FINGERPRINT_CHARS = 20


def root() -> Path:
    """The folder holding one environment folder per fingerprint (beside the default
    store's ``v1/``, never inside a store's)."""
    from cachebuild.store import cache_home

    return cache_home() / "cachebuild" / "env"


def factors() -> dict[str, Any]:
    """What makes an environment (imports torch): the environment factors of CPU targets
    (torch and its build, Python, the CPU's architecture and vector ISA; Triton where it
    can build for the CPU)."""
    from cachebuild.tracing.env import env_factors

    return env_factors("cpu")


def fingerprint() -> str:
    """The name of this environment's folder: a key of ``factors()`` (imports torch)."""
    from cachebuild.keys import make_key

    return make_key({"environment": factors()})[:FINGERPRINT_CHARS]


def overridden() -> Path | None:
    """The folder ``$CACHEBUILD_PROBE_DIR`` names, or None."""
    given = os.environ.get(OVERRIDE)
    return Path(given).expanduser().absolute() if given else None


def current() -> Path:
    """This environment's folder (not made, not checked): ``$CACHEBUILD_PROBE_DIR``, else
    ``root()/fingerprint()``."""
    return overridden() or root() / fingerprint()


def describe(folder: Path) -> None:
    """Write ``environment.json`` into ``folder`` (made and checked) unless it is there:
    what ``cachebuild stats`` and ``gc --environments`` say a folder is."""
    path = folder / DESCRIPTION
    if path.exists():
        return
    tmp = path.with_name(f".{DESCRIPTION}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"factors": factors(), "created": time.time()}))
    os.replace(tmp, path)


@contextlib.contextmanager
def in_use(folder: Path) -> Iterator[None]:
    """Hold ``folder`` shared while the block runs (``remove`` waits for no one: it skips a
    folder that is held)."""
    fd = os.open(folder / IN_USE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(fd)  # when it was last used, for `stats`
        yield
    finally:
        os.close(fd)


@dataclass
class Folder:
    """One environment folder as ``cachebuild stats`` and ``gc`` see it."""

    path: str
    bytes: int  # as `du -sb` counts them: every file and directory, links once
    files: int
    description: dict[str, Any] | None  # ``environment.json``, if readable
    last_used: float | None  # when a process last held it

    def summary(self) -> str:
        """``torch 2.13.0+cpu, Python 3.11, x86_64 AVX2`` (or what is known of it)."""
        f = (self.description or {}).get("factors")
        if not isinstance(f, dict):
            return "no description"
        parts = [f"torch {f.get('torch')}", f"Python {f.get('python')}",
                 " ".join(str(f[k]) for k in ("machine", "cpu_isa") if f.get(k)),
                 f"Triton {f['triton']}" if f.get("triton") else ""]
        return ", ".join(p for p in parts if p.strip())


def is_environment_folder(folder: Folder) -> bool:
    """Whether ``folder`` is one this tool made: it describes itself, or is named as
    ``fingerprint()`` names folders (one made before its description was written)."""
    name = os.path.basename(folder.path)
    return folder.description is not None or (
        len(name) == FINGERPRINT_CHARS and all(c in "0123456789abcdef" for c in name))


def tree_bytes(path: Path) -> tuple[int, int]:
    """``(bytes, files)`` under ``path`` as ``du -sb`` counts bytes: the apparent size of
    every entry (directories included, ``path`` itself too), each inode once, symlinks not
    followed; (0, 0) if it is missing."""
    seen: set[tuple[int, int]] = set()
    size = files = 0
    try:
        st = os.lstat(path)
    except OSError:
        return 0, 0
    seen.add((st.st_dev, st.st_ino))
    size += st.st_size
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                size += st.st_size
                if name in filenames:
                    files += 1
    return size, files


def _folder(path: Path) -> Folder:
    size, files = tree_bytes(path)
    try:
        description = json.loads((path / DESCRIPTION).read_text())
    except (OSError, ValueError):
        description = None
    try:
        last_used: float | None = os.stat(path / IN_USE).st_mtime
    except OSError:
        last_used = None
    return Folder(str(path), size, files, description if isinstance(description, dict)
                  else None, last_used)


def paths() -> list[Path]:
    """Every environment folder of this user: the one ``$CACHEBUILD_PROBE_DIR`` names, and
    each under ``root()``, each once; folders that do not exist are left out. Imports no
    torch, reads no folder's contents."""
    found: list[Path] = []
    given = overridden()
    if given is not None and given.is_dir():
        found.append(given)
    with contextlib.suppress(OSError):
        found += sorted(p for p in root().iterdir() if p.is_dir() and not p.is_symlink())
    seen: set[str] = set()
    out = []
    for path in found:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            out.append(path)
    return out


def listed() -> list[Folder]:
    """``paths()``, each with its size and description."""
    return [_folder(path) for path in paths()]


@contextlib.contextmanager
def _alone(path: Path) -> Iterator[Path | None]:
    """Hold the environment folder ``path`` alone while the block runs: yields its real
    path, or None where a process holds it. UnsafeStore if it is not a folder of ours that
    only we can write, under directories no one else could rename: someone else's folder
    is never emptied. OSError where its lock file cannot be opened (a read-only folder)."""
    from cachebuild.store import checked_real_dir, try_flock

    real = checked_real_dir(path, "environment folder")
    fd = os.open(real / IN_USE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        yield real if try_flock(fd) else None
    finally:
        os.close(fd)


def remove(path: Path, dry_run: bool) -> tuple[int, bool]:
    """Remove the environment folder ``path`` unless a process holds it: ``(bytes,
    removed)`` (with ``dry_run``, what would go)."""
    import shutil

    with _alone(path) as real:
        if real is None:
            return 0, False
        size, _ = tree_bytes(real)
        if not dry_run:
            # Renamed first, so no process finds a half-removed folder under its name.
            gone = real.with_name(f".removing-{real.name}-{os.getpid()}")
            os.rename(real, gone)
            shutil.rmtree(gone, ignore_errors=True)
            if gone.exists():  # what could not be removed is not counted as removed
                size -= tree_bytes(gone)[0]
        return size, True


def clean_objects(path: Path, dry_run: bool, older_than: float = OBJECT_AGE,
                  now: float | None = None) -> tuple[int, bool]:
    """Remove the C++ objects kept in the environment folder ``path`` that no build has
    made or reused for ``older_than`` seconds, and their records, unless a process holds
    the folder: ``(bytes, removed)`` (with ``dry_run``, what would go)."""
    if not (path / OBJECTS[0]).is_dir():
        return 0, True
    from cachebuild.store import WORK_MARK

    cutoff = (time.time() if now is None else now) - older_than
    with _alone(path) as real:
        if real is None:
            return 0, False
        kept, records = (real / part for part in OBJECTS)
        size = 0
        for entry in os.scandir(kept):
            if entry.name == WORK_MARK:
                continue  # the folder's mark, not an object
            with contextlib.suppress(OSError):  # counted once it is gone, not before
                st = entry.stat(follow_symlinks=False)
                if st.st_mtime >= cutoff:
                    continue
                if not dry_run:
                    os.unlink(entry.path)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(records / entry.name)
                size += st.st_size
        return size, True


@dataclass
class DiskPart:
    """One folder the store's user pays for: what it is, where, its bytes, what it holds."""

    what: str
    path: str
    bytes: int
    about: str = ""


@dataclass
class DiskPaid:
    """What the store's user pays for on disk, part by part, and in all."""

    parts: list[DiskPart] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        return {"parts": [asdict(p) for p in self.parts], "total": self.total}


def disk_paid(store_root: Path, folders: list[Folder], work_path: str | None) -> DiskPaid:
    """What the store's user pays for on disk, as ``du -sb`` counts it, part by part: the
    store's folder (``<dir>/v1``), a work folder outside it (``work_path``), and each
    environment folder (toolchain verdicts, ISA checks, precompiled headers; shared by
    every store of this user)."""
    paid = DiskPaid([DiskPart("store on disk", str(store_root), tree_bytes(store_root)[0],
                              "records, blobs, index, work files")])
    if work_path is not None and not Path(work_path).is_relative_to(store_root):
        # Only what builds marked as theirs: the operator's folder may hold their files.
        from cachebuild.store import build_folders

        ours = build_folders(work_path, named=True)
        paid.parts.append(DiskPart("work folder", work_path,
                                   sum(tree_bytes(Path(p))[0] for p in ours), "builds' files"))
    for folder in folders:
        paid.parts.append(DiskPart("environment", folder.path, folder.bytes,
                                   f"{folder.summary()}; toolchain verdicts, ISA checks, "
                                   "precompiled headers, kept C++ objects, shared by your "
                                   "stores"))
    return paid
