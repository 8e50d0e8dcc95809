"""The store index: a diskcache database of records, manifests and counters.

Values are stored as JSON text, never pickles, so reading the index cannot run code: the
database's rows are read through a ``Disk`` that refuses pickled keys and values, and every
row is checked field by field before use. A row that is not well formed (damaged by a
crash, a full disk or a hand edit) reads as absent, so its key is a miss and is rebuilt;
``verify`` names it and ``verify --repair`` drops it. Layout of the database's keys:

- ``<key>``: the record without its manifest (small, read on every ``get``);
- ``m:<key>``: the manifest, only when there is one (may be large; read on demand);
- ``c:<name>``: store-wide counters (hits, misses, quarantined, puts).

Every read-modify-write runs in a diskcache transaction, so concurrent processes never
lose each other's updates.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import diskcache

from cachebuild.errors import StoreError

from .layout import check_private_file
from .record import BadRecord, Record, check_fields, check_trust, loads_json

log = logging.getLogger("cachebuild.store")

_MANIFEST = "m:"
_COUNTER = "c:"
#: Counters the index keeps: lookups (hits, misses), blobs stored and quarantined, and what
#: processes did with the store (``LocalStore.count``): targets built and loaded, and the
#: milliseconds those took, traces, warm starts, blobs a remote tier gave (``l2_hits``) and
#: the remote copies refused as they failed verification.
COUNTERS = ("hits", "misses", "quarantined", "puts", "builds", "build_ms", "loads", "load_ms",
            "traces", "warm_starts", "l2_hits", "remote_rejected")

#: Errors the database raises when the disk is full, read-only or locked for too long.
INDEX_ERRORS = (sqlite3.Error, diskcache.Timeout, OSError)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class _Refused:
    """What a pickled key or value reads as: never unpickled, never a str."""


REFUSED = _Refused()


class _PlainDisk(diskcache.Disk):
    """diskcache's serializer, minus unpickling: the index holds only text and integers,
    so a pickled row can only be damage (or planted), and reading it must not run code."""

    def get(self, key: Any, raw: bool) -> Any:
        return super().get(key, raw) if raw else REFUSED

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == diskcache.core.MODE_PICKLE:
            return REFUSED
        return super().fetch(mode, filename, value, read)


def parse_row(key: str, raw: Any) -> dict[str, Any]:
    """The record row stored under ``key`` (everything but its manifest), checked; raises
    BadRecord saying what is wrong with it."""
    if not isinstance(raw, str | bytes):
        raise BadRecord("index row is not JSON text")
    try:
        small = loads_json(raw)
    except (ValueError, RecursionError) as e:
        raise BadRecord(f"index row is not valid JSON ({e})") from None
    if not isinstance(small, dict):
        raise BadRecord("index row is not a JSON object")
    has_manifest = small.get("has_manifest", False)
    if not isinstance(has_manifest, bool):
        raise BadRecord("index row field 'has_manifest' must be true or false")
    fields = check_fields({k: v for k, v in small.items() if k != "manifest"}, key=key)
    # Trust is kept in this index only (check_fields, for records from elsewhere, never
    # reads it).
    fields["trusted"] = check_trust(small.get("trusted"))
    del fields["manifest"]
    fields["refs"] = list(fields["refs"])
    fields["has_manifest"] = has_manifest
    return fields


class IndexFull(StoreError):
    """The store index could not be opened to write because its disk is full."""


class ReadOnlyStore(StoreError):
    """A write to a store this process may only read (exit code 2: the store given)."""

    exit_code = 2


class _ReadOnlyCache:
    """The reads ``Index`` makes of a diskcache database, through a read-only SQLite
    connection that writes nothing (no settings, no journal, no statistics): for a store
    in an image layer, on a read-only mount, or owned by root and served to another user.

    Rows and value files are decoded by the same ``Disk`` as for writing (no pickles)."""

    def __init__(self, directory: Path, why: str = "") -> None:
        db = directory / diskcache.core.DBNAME
        if not db.is_file():
            raise StoreError(f"no store index in {directory}")
        self._directory = directory
        self._why = why or "it is read-only here"
        self._disk = _PlainDisk(str(directory))
        path = quote(str(db))
        try:  # a database another process may change (root's shared store)
            self._con = sqlite3.connect(f"file:{path}?mode=ro", uri=True,
                                        check_same_thread=False)
            self._con.execute("SELECT 1 FROM Cache LIMIT 1").fetchall()
        except sqlite3.Error:
            # A WAL database without its shared-memory file, which a reader cannot make on
            # a read-only file system: read it as it stands (an image layer changes never).
            self._con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True,
                                        check_same_thread=False)
        # A database file with no table yet: a store whose first write never happened (its
        # disk was full as the index was made): it holds no records.
        self._empty = not self._con.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'Cache'").fetchall()
        self._lock = threading.Lock()

    def get(self, key: str, default: Any = None) -> Any:
        if self._empty:
            return default
        db_key, raw = self._disk.put(key)
        with self._lock:
            rows = self._con.execute("SELECT mode, filename, value FROM Cache WHERE key = ? "
                                     "AND raw = ?", (db_key, raw)).fetchall()
        if not rows:
            return default
        mode, filename, value = rows[0]
        try:
            return self._disk.fetch(mode, filename, value, False)
        except OSError:
            return default

    def iterkeys(self) -> Iterator[Any]:
        if self._empty:
            return
        with self._lock:
            rows = self._con.execute("SELECT key, raw FROM Cache ORDER BY key, raw").fetchall()
        for key, raw in rows:
            yield self._disk.get(key, raw)

    def close(self) -> None:
        self._con.close()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ReadOnlyStore(f"cannot write the store index in {self._directory}: {self._why}")

    transact = set = delete = incr = _refuse


#: Free bytes under which a store index that cannot be opened is said to be on a full disk
#: (SQLite's "disk I/O error" says nothing of it).
FULL_BELOW = 1 << 20


def free_bytes(directory: Path) -> int | None:
    """Bytes free to us on the file system holding ``directory`` (None if unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _create_private(db: Path) -> None:
    """Create the index's database file, empty (an empty file is an empty SQLite
    database), readable and writable by us alone, where there is none: SQLite makes its
    journal files with the database's mode, and a mode from the umask could let others
    write what the store serves (``check_private_file`` then refuses it)."""
    try:
        os.close(os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                         | os.O_NOFOLLOW, 0o600))
    except (FileExistsError, FileNotFoundError):  # there, or no folder yet: diskcache
        pass  # makes the folder, and the file with it


def _busy(error: BaseException) -> bool:
    """Whether opening the index failed because another process holds it (SQLite's lock
    outlasted the wait), not because it is damaged."""
    return isinstance(error, diskcache.Timeout) or (
        isinstance(error, sqlite3.OperationalError) and "locked" in str(error))


class Index:
    """Records keyed by store key, in a diskcache database at ``directory`` (opened to
    read only, writing nothing, with ``read_only``)."""

    _TIMEOUT = 60  # seconds a write waits for another process's transaction

    def __init__(self, directory: Path, *, read_only: bool = False, why: str = "") -> None:
        """``why``: what a refused write says where ``read_only`` (else that the index is
        read-only here)."""
        self.read_only = read_only
        for suffix in ("", "-wal", "-shm"):  # what SQLite reads the records from
            check_private_file(directory / (diskcache.core.DBNAME + suffix), "store index file")
        if read_only:
            try:
                self._db: Any = _ReadOnlyCache(directory, why)
            except INDEX_ERRORS as e:
                raise StoreError(f"cannot read the store index in {directory}: {e}") from None
            self._warned: set[str] = set()
            return
        try:
            _create_private(directory / diskcache.core.DBNAME)
            # No eviction and no culling: the store decides what goes (GC), not the cache.
            self._db = diskcache.Cache(str(directory), timeout=self._TIMEOUT, disk=_PlainDisk,
                                       eviction_policy="none", size_limit=2**62, cull_limit=0,
                                       statistics=0, tag_index=0)
        except INDEX_ERRORS as e:
            free = free_bytes(directory)
            if free is not None and free < FULL_BELOW:
                raise IndexFull(
                    f"cannot open the store index in {directory}: {e}; the disk holding it "
                    f"is full ({free} bytes free): free some space and try again (nothing "
                    "stored is lost)") from None
            if _busy(e):
                raise StoreError(
                    f"the store index in {directory} is busy: another process has held it "
                    f"for {self._TIMEOUT} s ({e}); try again once it is done (a `cachebuild "
                    "gc`, an import or a build writing to it; nothing stored is lost)"
                    ) from None
            if "readonly database" in str(e) or not os.access(directory, os.W_OK):
                raise StoreError(
                    f"cannot write the store index in {directory} ({e}): this user may not "
                    "write that folder or its files; give them back to the store's owner "
                    "(chown, chmod u+w), or serve the store read-only (nothing stored is "
                    "lost)") from None
            raise StoreError(
                f"cannot open the store index in {directory}: {e}; if it is damaged, move "
                "that folder aside (the store then starts with no records, and `cachebuild "
                "gc` moves the blobs no record points to into quarantine/) or restore it "
                "from a backup") from None
        self._warned: set[str] = set()

    def close(self) -> None:
        self._db.close()

    def transact(self) -> AbstractContextManager[Any]:
        """A write transaction: other writers wait until it ends."""
        return self._db.transact()

    # -- records ------------------------------------------------------------------------

    def get_small(self, key: str) -> dict[str, Any] | None:
        """The record of ``key`` without its manifest, as a dict; None if absent or not
        well formed (logged once per key and process)."""
        small, reason = self.read_small(key)
        if reason is not None and key not in self._warned:
            self._warned.add(key)
            log.warning("cachebuild: index record of %s is damaged (%s); treating it as a miss "
                        "(cachebuild verify --repair drops it)", key, reason)
        return small

    def read_small(self, key: str) -> tuple[dict[str, Any] | None, str | None]:
        """``(row, None)``, ``(None, None)`` if absent, or ``(None, why)`` if damaged."""
        raw = self._db.get(key)
        if raw is None:
            return None, None
        try:
            return parse_row(key, raw), None
        except BadRecord as e:
            return None, str(e)

    def get(self, key: str, *, manifest: bool = True) -> Record | None:
        """The full record of ``key`` (manifest included unless ``manifest=False``)."""
        small = self.get_small(key)
        if small is None:
            return None
        return self._record(key, small, manifest)

    def _record(self, key: str, small: dict[str, Any], manifest: bool) -> Record:
        man = None
        if manifest and small.get("has_manifest"):
            raw = self._db.get(_MANIFEST + key)
            try:
                man = loads_json(raw) if isinstance(raw, str | bytes) else None
            except (ValueError, RecursionError):
                man = None
            if not isinstance(man, dict):
                man = None  # a damaged manifest only costs explanations, never a load
        return Record(key=key, kind=small["kind"], size=small["size"],
                      checksum=small["checksum"], created=small["created"],
                      last_used=small["last_used"], hits=small["hits"],
                      pinned=small["pinned"], manifest=man, refs=tuple(small["refs"]),
                      unsigned_from=small["unsigned_from"], trusted=small["trusted"])

    def put(self, record: Record) -> None:
        """Write ``record`` (and its manifest); call inside ``transact()``."""
        small = {"kind": record.kind, "size": record.size, "checksum": record.checksum,
                 "created": record.created, "last_used": record.last_used,
                 "hits": record.hits, "pinned": record.pinned, "refs": list(record.refs),
                 "has_manifest": record.manifest is not None}
        if record.unsigned_from is not None:
            small["unsigned_from"] = record.unsigned_from
        if record.trusted is not None:
            small["trusted"] = record.trusted
        if record.manifest is not None:
            self._db.set(_MANIFEST + record.key, _dumps(record.manifest))
        else:
            self._db.delete(_MANIFEST + record.key)
        self._db.set(record.key, _dumps(small))

    def set_small(self, key: str, small: dict[str, Any]) -> None:
        """Overwrite the manifest-less part of a record; call inside ``transact()``."""
        self._db.set(key, _dumps(small))

    def delete(self, key: str) -> bool:
        """Drop the record of ``key``; True if there was one."""
        with self._db.transact():
            self._db.delete(_MANIFEST + key)
            return bool(self._db.delete(key))

    def __contains__(self, key: str) -> bool:
        """True if ``key`` has a well-formed record."""
        return self.get_small(key) is not None

    def keys(self) -> Iterator[str]:
        """Every stored key (records only, not manifests or counters)."""
        for k in self._db.iterkeys():
            if isinstance(k, str) and ":" not in k:
                yield k

    def records(self, *, manifest: bool = True) -> Iterator[Record]:
        """Every record; entries deleted while iterating are skipped."""
        for key in list(self.keys()):
            small = self.get_small(key)
            if small is not None:
                yield self._record(key, small, manifest)

    # -- counters -----------------------------------------------------------------------

    def incr(self, name: str, amount: int) -> None:
        try:
            self._db.incr(_COUNTER + name, amount, default=0)
        except TypeError:  # a damaged counter starts again
            self._db.set(_COUNTER + name, amount)

    def counters(self) -> dict[str, int]:
        out = {}
        for name in COUNTERS:
            value = self._db.get(_COUNTER + name, 0)
            out[name] = value if isinstance(value, int) and not isinstance(value, bool) else 0
        return out
