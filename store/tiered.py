"""Two tiers behind the local store's API: L1 on local disk, L2 in a shared Redis.

Lookup goes L1 → L2 → miss. A blob read from L2 is verified (framing, checksum and, when
a signing key is configured, its HMAC) before anything uses it, then copied into L1 so the
next lookup is local. A put writes L1 first, then L2. Everything the remote does wrong
(down, slow, half evicted, tampered) turns into a miss here, never an exception.

Trust: anyone who can write to Redis can write anything there, so nothing from it is used
before it is checked.

- **Blobs** carry an HMAC with the fleet's signing key. A remote blob that is unsigned,
  signed with another key, or changed in any byte is never loaded: it is a miss, and the
  target is built locally. ``contains`` and ``get_record`` answer for a remote key only
  once its blob has been fetched and verified (and copied into L1), so a target counts as
  present only when it can be loaded.
- **Records** (kind, size, checksum, creation time, manifest) are signed with the same
  key (``sign_record``) and checked field by field. A record whose signature does not
  verify is never shown (``records(shared=True)``, which ``explain`` reads) and its
  manifest is never copied into L1; its kind, size and checksum must agree with the
  verified blob's header, or the blob is rejected.
- **Refs** decide what GC keeps, so they are never taken from Redis: an entry pulled
  into L1 gets the target keys its own verified payload lists.

Signing: artifacts contain code that runs on load, so with a remote configured a signing
key is required; running without one takes an explicit ``allow_unsigned=True`` and warns.
``push`` signs what it uploads: a blob that L1 holds unsigned (built before the key was
configured) is signed with the fleet key on the way, and counted as such.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachebuild.errors import StoreError, UsageError
from cachebuild.keys import canonical_json, guard_seal_key
from cachebuild.store.base import Progress, Store
from cachebuild.store.blob import (
    CorruptBlob,
    StreamCheck,
    check_blob,
    encode_blob,
    parse_header,
)
from cachebuild.store.layout import InvalidKey, check_key
from cachebuild.store.local import LocalStore
from cachebuild.store.record import MAX_ORIGIN, BadRecord, GCReport, Record, VerifyReport

if TYPE_CHECKING:
    # Imported when a remote is opened: `import redis` costs a process that has no
    # remote about 0.15 s of start-up.
    from cachebuild.store.remote import RedisRemote

log = logging.getLogger(__name__)

# Index fields that describe the artifact and travel with it; last_used, hits and pinned
# describe one machine's use of it and stay local (and refs are never trusted from L2).
_SHARED_FIELDS = ("key", "kind", "size", "checksum", "created", "manifest", "refs",
                  "unsigned_from")
_RECORD_DOMAIN = b"cachebuild-record-v1\0"
_SIGNATURE = "sig"


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
    signed: int = 0  # push only: held unsigned in L1, signed with the fleet key to upload
    unvouched: int = 0  # push only: entered L1 unsigned from elsewhere, not named: not pushed
    unvouched_keys: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def shared_record(record: Record) -> dict[str, Any]:
    """The part of a local index record that is stored beside the blob in Redis."""
    full = record.to_json()
    return {name: full[name] for name in _SHARED_FIELDS if name in full}


def sign_record(signing_key: bytes, shared: dict[str, Any]) -> str:
    """The HMAC-SHA256 (hex) of a shared record, over its canonical JSON."""
    body = {k: v for k, v in shared.items() if k != _SIGNATURE}
    return hmac.new(signing_key, _RECORD_DOMAIN + canonical_json(body).encode(),
                    hashlib.sha256).hexdigest()


def record_signed_by(signing_key: bytes, shared: dict[str, Any]) -> bool:
    """True if ``shared`` carries a valid signature made with ``signing_key``."""
    sig = shared.get(_SIGNATURE)
    if not isinstance(sig, str):
        return False
    try:
        expected = sign_record(signing_key, shared)
    except (TypeError, ValueError, RecursionError):  # not canonical JSON: not ours
        return False
    return hmac.compare_digest(expected, sig)


def entry_refs(kind: str, payload: bytes) -> tuple[str, ...]:
    """The keys a verified payload refers to: for a model entry, the target keys its
    pieces list and the seal of its guards; nothing for any other kind. Refs come only
    from here, never from a shared record, because they decide what GC keeps."""
    if kind != "entry":
        return ()
    try:
        doc = json.loads(payload)
        keys = [t["key"] for p in doc.get("pieces", []) for t in p.get("targets", [])]
        if "key" in doc and "guards" in doc:  # an entry that has a seal
            try:
                keys.append(guard_seal_key(doc["key"], doc["guards"]))
            except (ValueError, TypeError, RecursionError):
                pass  # guards no key can be made of: the entry is a miss anyway
        return tuple(dict.fromkeys(check_key(k) for k in keys))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        log.warning("entry payload lists no readable targets; keeping it without refs")
        return ()


class TieredStore(Store):
    """L1 ``LocalStore`` plus an optional L2 ``RedisRemote``, used wherever a store is.

    Reads fall through to L2, writes and deletes go to both; pins, GC, verify and records
    are the local store's (GC only ever prunes L1), and ``records(shared=True)`` adds the
    records only L2 holds (those whose signature verifies).
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
        # Keys whose remote copy failed verification in this process: remote copies are
        # immutable, so asking again would only fetch and reject the same bytes.
        self._rejected: set[str] = set()
        # Records of verified remote blobs that L1 could not keep (a full disk).
        self._unstored: dict[str, Record] = {}
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

    @property
    def work_dir(self) -> Path:
        return self.local.work_dir

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        return self.local.scratch_dir(in_memory=in_memory)

    def _count(self, field: str) -> None:
        with self._count_lock:
            setattr(self.counters, field, getattr(self.counters, field) + 1)

    # -- what comes from L2 -------------------------------------------------------------

    def _shared(self, key: str, raw: Any) -> tuple[Record | None, bool]:
        """A shared record checked field by field (None if it is not well formed), and
        whether it is authentic: signed with our key, or anything when running unsigned."""
        if not isinstance(raw, dict):
            return None, False
        try:
            record = Record.from_json({k: v for k, v in raw.items() if k != _SIGNATURE},
                                      key=key)
        except BadRecord as e:
            log.info("remote record of %s is not well formed: %s", key, e)
            return None, False
        record = dataclasses.replace(record, hits=0, pinned=False, refs=())
        if self.signing_key is None:
            return record, True
        return record, record_signed_by(self.signing_key, raw)

    def _outgoing(self, record: Record) -> dict[str, Any]:
        shared = shared_record(record)
        shared["refs"] = []  # never read back from L2 (see entry_refs)
        if self.signing_key is not None:
            shared[_SIGNATURE] = sign_record(self.signing_key, shared)
        return shared

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The verified payload for ``key`` from L1, else from L2 (copied into L1), else None
        (``touch=False``: a look, not a use, as ``LocalStore.get``)."""
        data = self.local.get(key, touch=touch)
        if data is not None:
            if touch:
                self._count("l1_hits")
            return data
        payload, _ = self._fetch(key, keep=touch)
        if payload is None and touch:
            self._count("misses")
        return payload

    def _fetch(self, key: str, *, keep: bool = True) -> tuple[bytes | None, str]:
        """Pull ``key`` from L2 into L1: (payload, "pulled" | "missing" | "rejected").
        ``keep=False``: verify and return it, writing and counting nothing (a look)."""
        if self.remote is None:
            return None, "missing"
        if key in self._rejected:
            return None, "rejected"
        try:
            fetched = self.remote.get(key, self._early_check(key))
            if fetched is None:
                return None, "missing"
            raw_record, framed = fetched
            header = check_blob(framed, expected_key=key, signing_key=self.signing_key,
                                require_signature=self.signing_key is not None)
            record, authentic = self._shared(key, raw_record)
            if record is not None and (record.kind, record.size, record.checksum) != (
                    header.kind, header.length, header.checksum):
                raise CorruptBlob("its record disagrees with the blob's header", key)
        except CorruptBlob as exc:
            self._count("remote_rejected")
            self._rejected.add(key)
            log.warning("rejected remote blob %s from %s: %s", key, self.remote.display_url,
                        exc.reason)
            return None, "rejected"
        start = header.header_size
        payload = bytes(memoryview(framed)[start:start + header.length])
        if not keep:
            return payload, "pulled"
        manifest = record.manifest if record is not None and authentic else None
        refs = entry_refs(header.kind, payload)
        origin = self._origin(record if authentic else None)
        try:
            if self._same_key_as_local:
                # Keep the verified blob byte for byte (L1 re-checks it with the same key).
                self.local.write_blob(key, framed, manifest=manifest, refs=refs,
                                      unsigned_from=origin)
            else:
                self.local.put(key, payload, kind=header.kind, manifest=manifest, refs=refs,
                               unsigned_from=origin)
        except StoreError as exc:
            # The payload is verified and usable; only the local copy failed (disk full).
            log.warning("could not copy remote blob %s into the local store: %s", key, exc)
            self._unstored[key] = Record(key=key, kind=header.kind, size=header.length,
                                         checksum=header.checksum, created=time.time(),
                                         last_used=time.time(), manifest=manifest, refs=refs,
                                         unsigned_from=origin)
        self._count("l2_hits")
        return payload, "pulled"

    def _early_check(self, key: str) -> Callable[[memoryview, int], None]:
        """A check of each chunk as it arrives (``RedisRemote.get``): the header, in the
        first, must be for ``key``, declare the length the record does and, with a signing
        key, be signed; otherwise the rest is never downloaded (CorruptBlob)."""
        checker = StreamCheck(expected_key=key, signing_key=self.signing_key,
                              require_signature=self.signing_key is not None)
        checked = False

        def check(chunk: memoryview, length: int) -> None:
            nonlocal checked
            checker.feed(chunk)
            header = checker.header
            if header is None or checked:
                return
            checked = True
            if header.total_size != length:
                raise CorruptBlob(f"its header declares {header.total_size} bytes, its "
                                  f"record {length}", key)
            if self.signing_key is not None and not header.signed:
                raise CorruptBlob("unsigned, and this store has a signing key", key)

        return check

    def _origin(self, record: Record | None) -> str | None:
        """``unsigned_from`` for a blob fetched from L2: the remote itself when nothing was
        verified with a key; else whatever the authentic record says (an artifact that
        entered some store unsigned and was pushed by name stays marked)."""
        assert self.remote is not None
        if self.signing_key is None:
            return f"remote {self.remote.display_url} (no signing key)"[:MAX_ORIGIN]
        return record.unsigned_from if record is not None else None

    def contains(self, key: str) -> bool:
        """True if ``key`` verifies in L1, or in L2 (fetched, verified, copied into L1)."""
        if self.local.contains(key):
            return True
        payload, _ = self._fetch(key)
        return payload is not None

    def get_record(self, key: str) -> Record | None:
        """L1's index record for ``key``; for a key only L2 holds, the record L1 has once
        the remote blob is fetched and verified (None if it fails)."""
        record = self.local.get_record(key)
        if record is not None or self.remote is None:
            return record
        if self._fetch(key)[0] is None:
            return None
        return self.local.get_record(key) or self._unstored.get(key)

    def records(self, *, kind: str | None = None, manifests: bool = True,
                shared: bool = False) -> Iterator[Record]:
        """L1's records; with ``shared``, also every record only L2 holds, if it is well
        formed and authentic (signed with our key)."""
        local = set()
        for record in self.local.records(kind=kind, manifests=manifests):
            local.add(record.key)
            yield record
        if not shared or self.remote is None:
            return
        for key, raw in self.remote.records():
            if key in local:
                continue
            record, authentic = self._shared(key, raw)
            if record is None or not authentic:
                continue
            if kind is None or record.kind == kind:
                yield record if manifests else dataclasses.replace(record, manifest=None)

    def materialize(self, key: str, suffix: str) -> Path | None:
        """A verified file holding ``key``'s payload, pulling it from L2 first if needed."""
        path = self.local.materialize(key, suffix)
        if path is None and self._fetch(key)[0] is not None:
            path = self.local.materialize(key, suffix)
        return path

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
        self._rejected.discard(key)
        self._push_one(key, data, record)
        return record

    def _push_one(self, key: str, payload: bytes, record: Record) -> bool:
        if self.remote is None or not self.remote.writable:
            return False
        framed = encode_blob(key, record.kind, payload, self.signing_key)
        return self.remote.put(key, self._outgoing(record), framed)

    def _push_stored(self, key: str, vouched: bool = False) -> str:
        """Upload L1's ``key`` to L2: "pushed", "signed" (pushed, after signing a blob L1
        holds unsigned), "present", "missing", "unvouched" (it entered L1 unsigned from
        elsewhere and ``vouched`` is False) or "failed"."""
        remote = self.remote
        assert remote is not None
        if remote.contains(key):
            return "present"
        record = self.local.get_record(key)
        if record is None:
            return "missing"
        if record.unsigned_from is not None and not vouched:
            return "unvouched"
        framed = self.local.read_blob(key)  # verified with L1's settings
        if framed is None:
            return "missing"
        header = parse_header(framed)
        signed_now = False
        if self.signing_key is not None and not (header.signed and self._same_key_as_local):
            # What lands in L2 must verify there: sign it with the fleet key (a blob built
            # before the key was configured is held unsigned in L1).
            payload = memoryview(framed)[header.header_size:header.header_size + header.length]
            framed = encode_blob(key, record.kind, payload, self.signing_key)
            signed_now = True
        if remote.put(key, self._outgoing(record), framed):
            return "signed" if signed_now else "pushed"
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
            with self.remote.lock(key, ttl=self.lock_ttl, timeout=remaining,
                                  signing_key=self.signing_key):
                yield

    # -- deletes and local-only operations ------------------------------------------------

    def delete(self, key: str) -> bool:
        """Delete ``key`` from L1 and, when writable, from L2; True if L1 had it.

        Deleting is how a stale entry is replaced (delete, then put), so the shared copy
        goes too; otherwise the next put would leave the stale one in L2. A read-only
        remote is left alone. (GC only ever prunes L1.)
        """
        removed = self.local.delete(key)
        self._rejected.discard(key)
        self._unstored.pop(key, None)
        if self.remote is not None:
            self.remote.delete(key)
        return removed

    def close(self) -> None:
        """Close L1 (writing its pending usage statistics) and drop L2's connections."""
        self.local.close()
        if self.remote is not None:
            self.remote.close()

    def count(self, counter: str, amount: int = 1) -> None:
        self.local.count(counter, amount)

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


def _entry_keys(entries: Iterable[Any]) -> list[str]:
    return [e if isinstance(e, str) else e.key for e in entries]


def push(tiered: TieredStore, keys: Iterable[str] | None = None,
         vouch: Iterable[str] = ()) -> TransferCounts:
    """Copy ``keys`` (default: every L1 entry) and ``vouch`` from L1 to L2; what happened,
    counted.

    With a signing key every uploaded blob is signed with it: one that L1 holds unsigned
    because it was built here before the key was set is signed on the way (counted in
    ``signed`` as well as ``transferred``). One that entered L1 unsigned from elsewhere
    (``Record.unsigned_from``) is not pushed, and counted in ``unvouched``, unless it is
    one of ``vouch``: signing it would vouch for what nobody verified. Raises UsageError
    without a remote or with a read-only one. A remote that goes down part-way makes the
    remaining keys count as ``failed``; nothing raises.
    """
    remote = tiered.remote
    if remote is None:
        raise UsageError("push needs a remote (--remote or CACHEBUILD_REMOTE)")
    if remote.mode != "rw":
        raise UsageError(f"remote {remote.display_url} is read-only; push needs mode rw")
    counts = TransferCounts()
    vouched = set(vouch)
    wanted = _entry_keys(tiered.local.records(manifests=False)) if keys is None else list(keys)
    wanted = list(dict.fromkeys([*wanted, *vouched]))
    for key in wanted:
        outcome = tiered._push_stored(key, vouched=key in vouched)
        if outcome == "unvouched":
            counts.unvouched += 1
            counts.unvouched_keys.append(key)
        elif outcome in ("pushed", "signed"):
            counts.transferred += 1
            counts.signed += outcome == "signed"
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

    A key already in L1 is not fetched. A blob that fails verification, or a name that is
    not a store key, is counted as ``rejected`` and never written to L1. ``workers``
    threads fetch, verify and write in parallel (socket reads, hashing and file writes all
    release the GIL). Raises UsageError without a remote.
    """
    remote = tiered.remote
    if remote is None:
        raise UsageError("pull needs a remote (--remote or CACHEBUILD_REMOTE)")
    counts = TransferCounts()
    wanted = list(remote.keys()) if keys is None else list(keys)

    def one(key: str) -> tuple[str, int]:
        try:
            check_key(key)
        except InvalidKey:
            log.warning("not pulling %r: not a store key", str(key)[:100])
            return "rejected", 0
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
