"""The build work folder as the store keeps it: checked like the store, and what builds
reuse from it checked against records the store keeps elsewhere.

Compilers write into the work folder while a target builds (Inductor's and Triton's
caches, C++ objects, temp files), and later builds reuse what they find there: a C++
object is linked into a new target, a cached kernel is loaded. Whatever is reused must be
what one of our builds made, or a target (then signed, with a key) would carry someone
else's code. So:

- ``open_work_dir`` checks the folder like the store (``layout.prepare_work_dir``: ours,
  private, no directory above it another user could rename) and the store's record that
  it made this very folder (``claims/``, by real path, device and inode). A folder the
  store has no record of (made before these records, or by someone else, or put in the
  place of ours) is emptied before any build uses it, and then recorded; one that holds
  anything but what builds make there (``WORK_FOLDERS``) is refused instead, as it is
  somebody's folder named by mistake.
- ``ObjectRecords`` keeps the SHA-256 of each C++ object a build keeps (in the environment
  folder's ``cxx/``, or the work folder's where that folder is not ours); an object is
  reused only if it still hashes to its record, and the bytes that were hashed are the
  bytes used.

The records never live in the work folder, so a file planted there cannot bring its own
record: they are kept with the environment (the environment folder's ``built/``, checked like
the store and shared by this user's stores, as a work folder may be), or in the store's
own ``built/`` (``Store.work_records``) where that folder is not ours to write.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from cachebuild import process_state

from .files import open_regular, remove_any, write_whole
from .layout import UnsafeStore, make_private_dir, prepare_work_dir
from .locking import flocked, flocked_shared
from .maintenance import WORK_FOLDERS, WORK_LOCK, made_by_builds

#: In a folder of object records: held while an object and its record are written or read.
OBJECTS_LOCK = ".lock"

log = logging.getLogger("cachebuild.building.build")


def say_once(message: str) -> None:
    """Log ``message`` as a warning, once per process (``ProcessState.said``)."""
    if process_state.current().first_saying(message):
        log.warning("cachebuild: %s", message)


def _claim_file(records: Path, real: Path) -> Path:
    name = hashlib.sha256(str(real).encode()).hexdigest()[:32]
    return records / "claims" / f"{name}.json"


def _identity(real: Path) -> dict[str, object]:
    st = os.lstat(real)
    return {"path": str(real), "dev": st.st_dev, "ino": st.st_ino}


def _claimed(claim: Path, identity: dict[str, object]) -> bool:
    data = _read_regular(claim)
    try:
        return data is not None and json.loads(data) == identity
    except ValueError:
        return False


def open_work_dir(path: Path, records: Path, named: bool = False) -> Path:
    """The work folder at ``path``, checked (``layout.prepare_work_dir``: UnsafeStore, exit
    2, if it is not a private directory of ours under safe directories) and known to the
    store: a folder ``records`` has no claim on is emptied first (when no build holds it)
    and claimed. One that the operator ``named`` (``CACHEBUILD_WORK_DIR``) is emptied only
    of what builds marked as theirs (``maintenance.WORK_MARK``): anything else there, a
    ``tmp/`` of theirs too, makes it refused. Returns its real path."""
    real = prepare_work_dir(path)
    make_private_dir(records)
    make_private_dir(records / "claims")
    identity = _identity(real)
    claim = _claim_file(records, real)
    if _claimed(claim, identity):
        return real
    lock = os.open(real / WORK_LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                   0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # no build may be reading it while it is emptied
        if not _claimed(claim, identity):
            found = [e.name for e in os.scandir(real) if e.name != WORK_LOCK]
            foreign = sorted(name for name in found if name not in WORK_FOLDERS or (
                named and not made_by_builds(real / name)))
            if foreign:
                # Not emptied: a folder of the operator's, named by mistake, would be lost.
                raise UnsafeStore(
                    f"the work folder {real} holds what no build put there "
                    f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}), and "
                    "builds empty a work folder the store has no record of: give a new or "
                    "empty folder (CACHEBUILD_WORK_DIR), or unset it")
            if found:
                say_once(f"emptied the work folder {real}: the store has no record of making "
                         "it, so nothing found there is reused")
            for name in found:
                remove_any(real / name)
            try:
                write_whole(claim, json.dumps(identity).encode())
            except OSError as e:
                # A full (or quota-bound) disk under the records: the build goes on in the
                # folder just emptied; with no claim, the next build empties it again.
                say_once(f"cannot record the work folder {real} in {records} "
                         f"({e.strerror or e}): builds go on, reusing nothing found there "
                         "next time; free some room there")
    finally:
        os.close(lock)
    return real


class ObjectRecords:
    """The SHA-256 of each object a build kept (``backends.compilers``), by its key,
    in ``folder`` (a private folder of the store's or the environment's).

    Two builds may keep the same object at once, with bytes that differ (a compiler
    writes the object's own path into it): an object and its record are written together
    under the folder's lock, and read together under it, so no build sees one build's
    object with another's record."""

    def __init__(self, folder: Path) -> None:
        make_private_dir(folder)
        self.folder = folder

    def _path(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad object name {name!r}")
        return self.folder / name

    def keep(self, name: str, kept: Path, data: bytes) -> None:
        """Keep ``data`` at ``kept`` as the object ``name``, with its record (each file
        written whole, or not at all)."""
        with flocked(self.folder / OBJECTS_LOCK):
            write_whole(kept, data)
            write_whole(self._path(name), hashlib.sha256(data).hexdigest().encode())

    def verified(self, name: str, kept: Path) -> bytes | None:
        """The bytes of ``kept`` if they hash to the record of ``name``; None if there is no
        such file, or no record (``say_once`` says so when a file is there but does not
        match its record)."""
        try:
            with flocked_shared(self.folder / OBJECTS_LOCK):
                data, recorded = self._read(name, kept)
        except OSError:
            # The lock cannot be had (a read-only folder): read without it. A record and
            # an object of two builds read together then differ, and it compiles again.
            data, recorded = self._read(name, kept)
        if data is None:
            return None
        if recorded is None:
            return None  # a build stopped between the two writes: nothing to say
        if recorded.decode(errors="replace").strip() == hashlib.sha256(data).hexdigest():
            return data
        say_once(f"a kept C++ object ({kept.parent}) does not match its record "
                 f"({self.folder}): compiling it again (and any other such object)")
        return None

    def _read(self, name: str, kept: Path) -> tuple[bytes | None, bytes | None]:
        """The object's bytes and its record's (None: missing)."""
        data = _read_regular(kept)
        return data, (_read_regular(self._path(name)) if data is not None else None)


def _read_regular(path: Path) -> bytes | None:
    """The bytes of the regular file at ``path``; None if it is missing or something else
    (a symlink is not followed, a FIFO not waited on)."""
    try:
        fd = open_regular(path)
    except Exception:
        return None
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError:
            return None
