"""How a ``LocalStore`` may treat its files: the ``Access`` it is given when it opens,
``Writable`` (the default) or ``ReadOnly`` (``LocalStore(path, read_only=True)``). There
is one ``LocalStore``, with one copy of every read and write path; its access decides how
the layout and index are opened, whether a reserve is kept and usage written, where
private directories go, what a damaged blob does, and whether a write may start at all.

A store is only read where it is baked into an image layer, on a read-only mount, or
owned by root and served to another user. Reading is the same (every blob verified
against its index record, no symlink followed); nothing is written anywhere in the store:
its index is read through a read-only SQLite connection, hits and counters stay in this
process's memory, a file a loader needs by path is made in memory (a ``memfd``) unless a
verified one is stored already, private directories are made under ``/dev/shm``, and a
blob that fails verification is a miss that is logged once, not moved. Anything that
would write (a put, a pin, a lock for a build, ``gc``, ``verify --repair``) raises
``refusal``'s ReadOnlyStore before it touches anything; ``OverlayStore`` puts such
writes in a writable store of this user's instead.

What may be read is checked like a writable store, except that root may own it
(``layout.open_read_only``): the store, its format folder, index and objects folders
belong to us or root and no one else can write them, and no one but us or root can rename
a directory above it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Protocol

from cachebuild.errors import StoreError
from cachebuild.units import format_size

from . import maintenance
from .files import write_all
from .index import Index, IndexFull, ReadOnlyStore, free_bytes
from .interface import Progress
from .layout import Layout, open_read_only, prepare
from .locking import open_temp
from .maintenance import BlobCheck, Quarantine
from .record import VerifyReport
from .usage import Usage

log = logging.getLogger("cachebuild.store")

#: Bytes each writable store keeps in reserve, so that it can still be read and cleaned
#: when the disk is full (opening the index writes a little).
RESERVE_BYTES = 1 << 20
#: The reserve is made (again) only while at least this much space is free besides it.
RESERVE_MIN_FREE = 64 << 20


def refusal(root: Path, what: str) -> ReadOnlyStore:
    """The error for a write (``what``: "store KEY", "collect garbage") to the read-only
    store at ``root``, saying what to use instead."""
    return ReadOnlyStore(f"cannot {what}: the store at {root} is read-only here "
                         "(a read-only mount, or owned by another user); use a store "
                         "you can write (--cache-dir, CACHEBUILD_DIR)")


class Access(Protocol):
    """What differs between a store this process writes and one it only reads; made for
    one store, from its path (see the module doc)."""

    #: True: nothing in the store is written, moved or removed by this process.
    read_only: bool
    #: Private directories always go to memory (``/dev/shm``), not into the store.
    scratch_in_memory: bool
    #: Where the store's files are, checked as this access needs.
    layout: Layout

    def check_writable(self, what: str) -> None:
        """Return where the store may be written; otherwise raise ReadOnlyStore saying it
        could not ``what``. Every write calls it before it touches anything."""
        ...

    def open_index(self) -> Index:
        """The store's index, opened for this access."""
        ...

    def ensure_reserve(self) -> None:
        """Keep the store's reserve file where it has one (best effort)."""
        ...

    def flush(self, usage: Usage, index: Index) -> None:
        """Write ``usage``'s pending hits and counters to ``index``, or keep them in memory."""
        ...

    def damaged(self, key: str, reason: str, *, quiet: bool) -> bool:
        """Say (unless ``quiet``) that the blob of ``key`` failed verification; True where
        it is to be moved to quarantine, False where it stays and is only a miss."""
        ...

    def verify(self, index: Index, check: BlobCheck, quarantine: Quarantine, *,
               repair: bool, progress: Progress | None) -> VerifyReport:
        """Check every blob recorded in ``index`` with ``check`` (``LocalStore.verify``)."""
        ...


#: What a write refused on a full disk says.
_FULL = "the disk holding it is full; free some space on that disk and try again"


class Writable:
    """The store is this process's to write: made if missing, with a reserve for a full
    disk, usage written to its index, damaged blobs quarantined."""

    def __init__(self, path: Path, what: str = "store directory") -> None:
        self.layout = prepare(path, what)
        #: This process gave up the reserve to open the index: the disk is full, and the
        #: space freed is left to what frees more (``gc``), not spent on usage counters.
        self.disk_full = False
        #: True once the disk was too full to open the index to write (``_read_only_now``).
        self.read_only = False
        self.scratch_in_memory = False
        self._said: set[str] = set()

    def check_writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"cannot {what} in the store at {self.layout.root}: {_FULL}")

    def open_index(self) -> Index:
        """The index; on a disk too full to open it, the reserve is given up first, and
        with none left (or still too full) the store is only read (``_read_only_now``)."""
        try:
            return Index(self.layout.index)
        except IndexFull:
            if not self.layout.reserve.exists():
                return self._read_only_now()
            # Opening the index writes a little. On a full disk give up the reserve so
            # that the store can still be read and cleaned, which is how space comes back.
            os.unlink(self.layout.reserve)
            self.disk_full = True
            log.warning("cachebuild: the disk holding the store at %s is full: released the store's "
                        "%s reserve so that it can still be read; free space, e.g. with "
                        "`cachebuild gc --max-size SIZE`", self.layout.root,
                        format_size(RESERVE_BYTES))
        try:
            return Index(self.layout.index)
        except IndexFull:
            return self._read_only_now()

    def _read_only_now(self) -> Index:
        """On a disk too full to open the index to write, with no reserve to give up: the
        store is only read from here on, as ``ReadOnly`` reads one (a start loads what is
        stored, damage is a miss and stays where it is, nothing is recorded), and every
        write is refused saying the disk is full."""
        self.disk_full = self.read_only = self.scratch_in_memory = True
        log.warning("cachebuild: the disk holding the store at %s is full: the store is only read by "
                    "this process (nothing it builds or uses is recorded); free space on "
                    "that disk", self.layout.root)
        return Index(self.layout.index, read_only=True, why=_FULL)

    def ensure_reserve(self) -> None:
        """Make the reserve file if it is missing and space is plentiful."""
        path = self.layout.reserve
        if self.read_only or os.path.lexists(path):
            return
        free = free_bytes(self.layout.root)
        if free is None or free < RESERVE_MIN_FREE + RESERVE_BYTES:
            return
        try:
            fd, tmp_path = open_temp(self.layout.tmp, "reserve")
        except OSError:
            return  # a read-only file system, or full after all
        try:
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            except OSError:  # a file system without fallocate: write the bytes
                write_all(fd, (bytes(RESERVE_BYTES),))
            os.fsync(fd)
            os.replace(tmp_path, path)
            self.disk_full = False
        except OSError:
            pass
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)

    def flush(self, usage: Usage, index: Index) -> None:
        if not self.disk_full:  # else kept in memory, as a read-only store's
            usage.flush(index)

    def damaged(self, key: str, reason: str, *, quiet: bool) -> bool:
        if self.read_only:  # nothing moves on a full disk: a miss, said once
            if not quiet and key not in self._said:
                self._said.add(key)
                log.warning("cachebuild: blob %s failed verification (%s); not used (the disk is full: "
                            "it stays where it is)", key, reason)
            return False
        if not quiet:
            log.warning("cachebuild: blob %s failed verification (%s); quarantined, it will be rebuilt",
                        key, reason)
        return True

    def verify(self, index: Index, check: BlobCheck, quarantine: Quarantine, *,
               repair: bool, progress: Progress | None) -> VerifyReport:
        """``maintenance.verify``: leftovers removed, and with ``repair`` damaged blobs
        quarantined."""
        return maintenance.verify(self.layout, index, check, quarantine,
                                  repair=repair, progress=progress)


class ReadOnly:
    """The store is only read here (see the module doc): every write refused, nothing in
    the store changed, a damaged blob said once per key."""

    read_only = True
    scratch_in_memory = True

    def __init__(self, path: Path) -> None:
        self.layout = open_read_only(path)
        self._said: set[str] = set()  # the damaged blobs said already

    def check_writable(self, what: str) -> None:
        raise refusal(self.layout.root, what)

    def open_index(self) -> Index:
        return Index(self.layout.index, read_only=True)

    def ensure_reserve(self) -> None:
        pass  # nothing is written, so nothing needs room to be written

    def flush(self, usage: Usage, index: Index) -> None:
        pass  # usage stays in this process's memory

    def damaged(self, key: str, reason: str, *, quiet: bool) -> bool:
        if not quiet and key not in self._said:
            self._said.add(key)
            log.warning("cachebuild: blob %s in the read-only store at %s failed verification (%s); "
                        "it is a miss here", key, self.layout.root, reason)
        return False

    def verify(self, index: Index, check: BlobCheck, quarantine: Quarantine, *,
               repair: bool, progress: Progress | None) -> VerifyReport:
        """Every blob read and checked, nothing changed: no leftovers removed, nothing
        quarantined; ``repair`` is refused."""
        if repair:
            self.check_writable("repair")
        return maintenance.check_all(index, check, quarantine, repair=False, progress=progress)
