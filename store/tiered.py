"""Two tiers behind the local store's API: L1 on local disk, L2 in a shared Redis.

Lookup goes L1 → L2 → miss. A blob read from L2 is verified (framing, checksum and, when
a signing key is configured, its HMAC) before anything uses it, then copied into L1 so the
next lookup is local. A put writes L1 first, then L2. Everything the remote does wrong
(down, slow, half evicted, tampered) turns into a miss here, never an exception.

Signing: artifacts contain code that runs on load, so with a remote configured a signing
key is required; running without one takes an explicit ``allow_unsigned=True`` and warns.
With a key, a remote blob that is unsigned or signed with another key is never loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachebuild.errors import StoreError, UsageError
from cachebuild.store.base import Progress, Store
from cachebuild.store.blob import CorruptBlob, decode_blob, encode_blob
from cachebuild.store.local import LocalStore
from cachebuild.store.record import GCReport, Record, VerifyReport

if TYPE_CHECKING:
    # Imported when a remote is opened: `import redis` costs a process that has no
    # remote about 0.15 s of start-up.
    from cachebuild.store.remote import RedisRemote

log = logging.getLogger(__name__)

# Index fields that describe the artifact and travel with it; last_used, hits and pinned
# describe one machine's use of it and stay local.
_SHARED_FIELDS = ("key", "kind", "size", "checksum", "created", "manifest", "refs")


class UnsignedRemoteWarning(UserWarning):
    """A remote tier is used without a signing key (explicitly allowed)."""


@dataclass
class TierCounters:
    """Lookups of this process, by where they were answered."""

    l1_hits: int = 0
    l2_hits: int = 0
    misses: int = 0
    remote_rejected: int = 0


@dataclass
class TransferCounts:
    """What a ``push`` or ``pull`` did, key by key."""

    transferred: int = 0  # copied to the other tier by this call
    present: int = 0  # already in the destination tier
    missing: int = 0  # not in the source tier (or incomplete there)
    rejected: int = 0  # pull only: failed verification, not loaded
    failed: int = 0  # remote down, refused, or another writer was uploading it
    bytes: int = 0  # payload bytes transferred

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def shared_record(record: Record) -> dict[str, Any]:
    """The part of a local index record that is stored beside the blob in Redis."""
    full = record.to_json()
    return {name: full[name] for name in _SHARED_FIELDS if name in full}


class TieredStore(Store):
    """L1 ``LocalStore`` plus an optional L2 ``RedisRemote``, used wherever a store is.

    Reads fall through to L2, writes and deletes go to both; pins, GC, verify and records
    are the local store's (GC only ever prunes L1), and ``records(shared=True)`` adds the
    records only L2 holds.
    """

    def __init__(
        self,
        local: LocalStore,
        remote: RedisRemote | None,
        *,
        signing_key: bytes | None = None,
        allow_unsigned: bool = False,
        lock_ttl: float = 60.0,
    ) -> None:
        self.local = local
        self.remote = remote
        if signing_key is None:
            signing_key = getattr(local, "signing_key", None)
        self.signing_key: bytes | None = signing_key
        self.lock_ttl = lock_ttl
        self.counters = TierCounters()
        self._count_lock = threading.Lock()
        if remote is not None and signing_key is None:
            if not allow_unsigned:
                raise UsageError(
                    f"remote {remote.display_url} needs a signing key (CACHEBUILD_SIGNING_KEY): "
                    "artifacts contain code that runs on load; pass --allow-unsigned to use "
                    "it without one"
                )
            warnings.warn(
                f"using remote {remote.display_url} without a signing key: anyone who can "
                "write to it can run code in every process that loads from it",
                UnsignedRemoteWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return f"TieredStore({self.local!r}, {self.remote!r})"

    @property
    def root(self) -> Path:  # type: ignore[override]
        return self.local.root

    @property
    def probe_dir(self) -> Path:
        return self.local.probe_dir

    def _count(self, field: str) -> None:
        with self._count_lock:
            setattr(self.counters, field, getattr(self.counters, field) + 1)

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The verified payload for ``key`` from L1, else from L2 (copied into L1), else None."""
        data = self.local.get(key)
        if data is not None:
            self._count("l1_hits")
            return data
        payload, _ = self._fetch(key)
        self._count("l2_hits" if payload is not None else "misses")
        return payload

    def _fetch(self, key: str) -> tuple[bytes | None, str]:
        """Pull ``key`` from L2 into L1: (payload, "pulled" | "missing" | "rejected")."""
        if self.remote is None:
            return None, "missing"
        fetched = self.remote.get(key)
        if fetched is None:
            return None, "missing"
        record, framed = fetched
        try:
            kind, payload = decode_blob(
                framed,
                expected_key=key,
                signing_key=self.signing_key,
                require_signature=self.signing_key is not None,
            )
            if record.get("kind") not in (None, kind):
                raise CorruptBlob(f"record says kind {record.get('kind')!r}, blob says {kind!r}")
        except CorruptBlob as exc:
            self._count("remote_rejected")
            log.warning("rejected remote blob %s from %s: %s", key, self.remote.display_url, exc)
            return None, "rejected"
        manifest = record.get("manifest")
        refs = tuple(record.get("refs") or ())
        try:
            if self._same_key_as_local:
                # Keep the verified blob byte for byte (L1 re-checks it with the same key).
                self.local.write_blob(key, framed, manifest=manifest, refs=refs)
            else:
                self.local.put(key, payload, kind=kind, manifest=manifest, refs=refs)
        except StoreError as exc:
            # The payload is verified and usable; only the local copy failed (disk full).
            log.warning("could not copy remote blob %s into the local store: %s", key, exc)
        return payload, "pulled"

    def contains(self, key: str) -> bool:
        """True if ``key`` is in L1, or has a complete record in L2."""
        if self.local.contains(key):
            return True
        return self.remote is not None and self.remote.contains(key)

    def get_record(self, key: str) -> Record | None:
        """L1's index record for ``key``, else the one stored with its L2 blob, else None."""
        record = self.local.get_record(key)
        if record is not None or self.remote is None:
            return record
        shared = self.remote.get_record(key)
        if shared is None:
            return None
        return _record_from_shared(key, shared)

    def records(self, *, kind: str | None = None, manifests: bool = True,
                shared: bool = False) -> Iterator[Record]:
        """L1's records; with ``shared``, also every record only L2 holds."""
        local = set()
        for record in self.local.records(kind=kind, manifests=manifests):
            local.add(record.key)
            yield record
        if not shared or self.remote is None:
            return
        for raw in self.remote.records():
            key = raw.get("key")
            if isinstance(key, str) and key not in local:
                record = _record_from_shared(key, raw)
                if kind is None or record.kind == kind:
                    yield record

    def materialize(self, key: str, suffix: str) -> Path | None:
        """A verified file holding ``key``'s payload, pulling it from L2 first if needed."""
        if not self.local.contains(key) and self.get(key) is None:
            return None
        return self.local.materialize(key, suffix)

    # -- writes -----------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: bytes,
        *,
        kind: str,
        manifest: dict | None = None,
        refs: Iterable[str] = (),
    ) -> Record:
        """Store ``data`` in L1, then in L2 when the remote is writable; L1's record."""
        record = self.local.put(key, data, kind=kind, manifest=manifest, refs=refs)
        self._push_one(key, data, record)
        return record

    def _push_one(self, key: str, payload: bytes, record: Record) -> bool:
        if self.remote is None or not self.remote.writable:
            return False
        framed = encode_blob(key, record.kind, payload, self.signing_key)
        return self.remote.put(key, shared_record(record), framed)

    def _push_stored(self, key: str) -> str:
        """Upload L1's ``key`` to L2: "pushed", "present", "missing" or "failed"."""
        remote = self.remote
        assert remote is not None
        if remote.contains(key):
            return "present"
        record = self.local.get_record(key)
        if record is None:
            return "missing"
        if self._same_key_as_local:
            framed = self.local.read_blob(key)  # verified; already signed with our key
        else:
            payload = self.local.get(key)
            framed = (
                None
                if payload is None
                else encode_blob(key, record.kind, payload, self.signing_key)
            )
        if framed is None:
            return "missing"
        if remote.put(key, shared_record(record), framed):
            return "pushed"
        return "present" if remote.contains(key) else "failed"

    @property
    def _same_key_as_local(self) -> bool:
        return getattr(self.local, "signing_key", None) == self.signing_key

    # -- locks --------------------------------------------------------------------------

    @contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Single-flight for ``key`` on this machine (file lock) and across machines (Redis).

        The local lock is taken first so a machine sends one waiter to Redis, not one per
        process. ``timeout`` bounds the wait for both together (default: the local store's
        lock timeout; negative waits forever); LockTimeout if exceeded.
        Without a writable remote this is just the local lock.
        """
        start = time.monotonic()
        with self.local.lock(key, timeout=timeout):
            if self.remote is None:
                yield
                return
            limit = timeout if timeout is not None else getattr(self.local, "lock_timeout", 600.0)
            # A negative timeout means wait forever, as for the local lock.
            remaining = None if limit < 0 else max(0.0, limit - (time.monotonic() - start))
            with self.remote.lock(key, ttl=self.lock_ttl, timeout=remaining):
                yield

    # -- deletes and local-only operations ------------------------------------------------

    def delete(self, key: str) -> bool:
        """Delete ``key`` from L1 and, when writable, from L2; True if L1 had it.

        Deleting is how a stale entry is replaced (delete, then put), so the shared copy
        goes too; otherwise the next put would leave the stale one in L2. A read-only
        remote is left alone. (GC only ever prunes L1.)
        """
        removed = self.local.delete(key)
        if self.remote is not None:
            self.remote.delete(key)
        return removed

    def close(self) -> None:
        """Close L1 (writing its pending usage statistics) and drop L2's connections."""
        self.local.close()
        if self.remote is not None:
            self.remote.close()

    def pin(self, key: str) -> None:
        self.local.pin(key)

    def unpin(self, key: str) -> None:
        self.local.unpin(key)

    def gc(self, max_size: int | None = None, older_than: float | None = None,
           dry_run: bool = False) -> GCReport:
        """GC of L1 (see ``LocalStore.gc``); the shared tier is left to its own eviction."""
        return self.local.gc(max_size=max_size, older_than=older_than, dry_run=dry_run)

    def verify(self, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Verify L1 (see ``LocalStore.verify``)."""
        return self.local.verify(repair=repair, progress=progress)

    def stats(self) -> dict[str, Any]:
        """L1's stats plus a ``tiers`` section: this process's hits by tier and the remote's
        health now (a remote that is down warns once)."""
        if self.remote is not None:
            self.remote.ping()
        out = dict(self.local.stats())
        with self._count_lock:
            tiers: dict[str, Any] = dataclasses.asdict(self.counters)
        remote = self.remote
        tiers["remote_errors"] = remote.errors if remote is not None else 0
        tiers["remote_incomplete"] = remote.incomplete if remote is not None else 0
        tiers["remote"] = remote.display_url if remote is not None else None
        tiers["remote_mode"] = remote.mode if remote is not None else "off"
        tiers["remote_available"] = remote.available if remote is not None else False
        tiers["signed"] = self.signing_key is not None
        out["tiers"] = tiers
        return out


def _record_from_shared(key: str, shared: dict[str, Any]) -> Record:
    """A ``Record`` for an L2 entry: never used or pinned on this machine."""
    created = float(shared.get("created") or 0.0)
    return Record(
        key=key,
        kind=str(shared.get("kind", "")),
        size=int(shared.get("size") or 0),
        checksum=str(shared.get("checksum", "")),
        created=created,
        last_used=created,
        hits=0,
        pinned=False,
        manifest=shared.get("manifest"),
        refs=tuple(shared.get("refs") or ()),
    )


def _entry_keys(entries: Iterable[Any]) -> list[str]:
    return [e if isinstance(e, str) else e.key for e in entries]


def push(tiered: TieredStore, keys: Iterable[str] | None = None) -> TransferCounts:
    """Copy ``keys`` (default: every L1 entry) from L1 to L2; what happened, counted.

    Raises UsageError without a remote or with a read-only one. A remote that goes down
    part-way makes the remaining keys count as ``failed``; nothing raises.
    """
    remote = tiered.remote
    if remote is None:
        raise UsageError("push needs a remote (--remote or CACHEBUILD_REMOTE)")
    if remote.mode != "rw":
        raise UsageError(f"remote {remote.display_url} is read-only; push needs mode rw")
    counts = TransferCounts()
    wanted = _entry_keys(tiered.local.records(manifests=False)) if keys is None else list(keys)
    for key in wanted:
        outcome = tiered._push_stored(key)
        if outcome == "pushed":
            counts.transferred += 1
            record = tiered.local.get_record(key)
            counts.bytes += record.size if record is not None else 0
        elif outcome == "present":
            counts.present += 1
        elif outcome == "missing":
            counts.missing += 1
        else:
            counts.failed += 1
    return counts


def pull(
    tiered: TieredStore, keys: Iterable[str] | None = None, *, workers: int = 4
) -> TransferCounts:
    """Copy ``keys`` (default: every L2 entry) from L2 into L1, verifying each one.

    A key already in L1 is not fetched. A blob that fails verification is counted as
    ``rejected`` and never written to L1. ``workers`` threads fetch, verify and write in
    parallel (socket reads, hashing and file writes all release the GIL). Raises
    UsageError without a remote.
    """
    remote = tiered.remote
    if remote is None:
        raise UsageError("pull needs a remote (--remote or CACHEBUILD_REMOTE)")
    counts = TransferCounts()
    wanted = list(remote.keys()) if keys is None else list(keys)

    def one(key: str) -> tuple[str, int]:
        if tiered.local.contains(key):
            return "present", 0
        if not remote.available:
            return "failed", 0
        payload, outcome = tiered._fetch(key)
        if payload is not None:
            return "transferred", len(payload)
        if outcome == "rejected":
            return "rejected", 0
        return ("missing" if remote.available else "failed"), 0

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for outcome, size in pool.map(one, wanted):
            setattr(counts, outcome, getattr(counts, outcome) + 1)
            counts.bytes += size
    return counts
