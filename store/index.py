"""The store index: a diskcache database of records, manifests and counters.

Values are stored as JSON text, never pickles, so reading the index cannot run code.
Layout of the database's keys:

- ``<key>``: the record without its manifest (small, read on every ``get``);
- ``m:<key>``: the manifest, only when there is one (may be large; read on demand);
- ``c:<name>``: store-wide counters (hits, misses, quarantined, puts).

Every read-modify-write runs in a diskcache transaction, so concurrent processes never
lose each other's updates.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import diskcache

from cachebuild.errors import StoreError

from .record import Record

_MANIFEST = "m:"
_COUNTER = "c:"
COUNTERS = ("hits", "misses", "quarantined", "puts")

#: Errors the database raises when the disk is full, read-only or locked for too long.
INDEX_ERRORS = (sqlite3.Error, diskcache.Timeout, OSError)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Index:
    """Records keyed by store key, in a diskcache database at ``directory``."""

    def __init__(self, directory: Path) -> None:
        try:
            # No eviction and no culling: the store decides what goes (GC), not the cache.
            self._db = diskcache.Cache(str(directory), timeout=60, eviction_policy="none",
                                       size_limit=2**62, cull_limit=0, statistics=0,
                                       tag_index=0)
        except INDEX_ERRORS as e:
            raise StoreError(f"cannot open the store index in {directory}: {e}") from None

    def close(self) -> None:
        self._db.close()

    def transact(self) -> AbstractContextManager[Any]:
        """A write transaction: other writers wait until it ends."""
        return self._db.transact()

    # -- records ------------------------------------------------------------------------

    def get_small(self, key: str) -> dict[str, Any] | None:
        """The record of ``key`` without its manifest, as a dict; None if absent."""
        raw = self._db.get(key)
        return None if raw is None else json.loads(raw)

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
            man = None if raw is None else json.loads(raw)
        return Record(key=key, kind=small["kind"], size=small["size"],
                      checksum=small["checksum"], created=small["created"],
                      last_used=small["last_used"], hits=small["hits"],
                      pinned=small["pinned"], manifest=man, refs=tuple(small["refs"]))

    def put(self, record: Record) -> None:
        """Write ``record`` (and its manifest); call inside ``transact()``."""
        small = {"kind": record.kind, "size": record.size, "checksum": record.checksum,
                 "created": record.created, "last_used": record.last_used,
                 "hits": record.hits, "pinned": record.pinned, "refs": list(record.refs),
                 "has_manifest": record.manifest is not None}
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
        return key in self._db

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
        self._db.incr(_COUNTER + name, amount, default=0)

    def counters(self) -> dict[str, int]:
        return {name: int(self._db.get(_COUNTER + name, 0)) for name in COUNTERS}
