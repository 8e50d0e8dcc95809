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
Records are signed and checked by ``signing.py``, refs read by ``refs.py``; ``push`` and
``pull`` (``transfer.py``) move whole sets of keys between the tiers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachebuild.errors import StoreError, UsageError

from .blob import CorruptBlob, StreamCheck, check_blob, encode_blob
from .interface import LocalTier, Progress, Store
from .options import StoreOptions
from .record import MAX_ORIGIN, GCReport, Record, StoreStats, TierStats, VerifyReport
from .refs import refs_of
from .signing import incoming, outgoing

if TYPE_CHECKING:
    # Imported when a remote is opened: `import redis` costs a process that has no
    # remote about 0.15 s of start-up.
    from .remote import RedisRemote

log = logging.getLogger(__name__)


class UnsignedRemoteWarning(UserWarning):
    """A remote tier is used without a signing key (explicitly allowed)."""


@dataclass
class TierCounters:
    """Lookups of this process, by where they were answered."""

    l1_hits: int = 0
    l2_hits: int = 0
    l2_bytes: int = 0  # of the payloads those copied in
    misses: int = 0
    remote_rejected: int = 0


#: What ``TieredStore.fetch`` says of a key: copied from L2 (or, for a look, verified
#: there), not in L2 (or L2 unreachable), or in L2 but failing verification.
FetchOutcome = str  # "pulled" | "missing" | "rejected"


class TieredStore(Store):
    """L1 ``LocalStore`` plus an optional L2 ``RedisRemote``, used wherever a store is.

    Reads fall through to L2, writes and deletes go to both; pins, GC, verify and records
    are the local store's (GC only ever prunes L1), and ``records(shared=True)`` adds the
    records only L2 holds (those whose signature verifies).
    """

    def __init__(
        self,
        local: LocalTier,
        remote: RedisRemote | None,
        *,
        signing_key: bytes | None = None,
        allow_unsigned: bool = False,
        lock_ttl: float = 60.0,
        opened_with: StoreOptions | None = None,
    ) -> None:
        """``opened_with``: the options ``open_store`` opened it with."""
        self._local = local
        self._opened_with = opened_with
        self._remote = remote
        if signing_key is None:
            signing_key = local.signing_key
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
                    "artifacts contain code that runs on load; to use it without one, pass "
                    "--allow-unsigned (the command line) or set CACHEBUILD_ALLOW_UNSIGNED=1 "
                    "(a server)"
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
    def local(self) -> LocalTier:
        """L1."""
        return self._local

    @property
    def remote(self) -> RedisRemote | None:
        """L2, or None."""
        return self._remote

    @property
    def root(self) -> Path:  # type: ignore[override]
        return self.local.root

    @property
    def work_dir(self) -> Path:
        return self.local.work_dir

    @property
    def work_dir_named(self) -> bool:
        return self.local.work_dir_named

    @property
    def work_records(self) -> Path:
        return self.local.work_records

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        return self.local.scratch_dir(in_memory=in_memory)

    def _count(self, field: str, amount: int = 1) -> None:
        with self._count_lock:
            setattr(self.counters, field, getattr(self.counters, field) + amount)

    def _keep_count(self, counter: str) -> None:
        """Count in the local store too, for ``cachebuild stats`` (a read-only one keeps
        no counters)."""
        with contextlib.suppress(StoreError):
            self.local.count(counter)

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The verified payload for ``key`` from L1, else from L2 (copied into L1), else None
        (``touch=False``: a look, not a use, as ``LocalStore.get``)."""
        data = self.local.get(key, touch=touch)
        if data is not None:
            if touch:
                self._count("l1_hits")
            return data
        payload, _ = self.fetch(key, keep=touch)
        if payload is None and touch:
            self._count("misses")
        return payload

    def fetch(self, key: str, *, keep: bool = True) -> tuple[bytes | None, FetchOutcome]:
        """Pull ``key`` from L2 into L1, verified: (payload, "pulled" | "missing" |
        "rejected"). ``keep=False``: verify and return it, writing and counting nothing
        (a look). A copy L1 cannot keep (a full disk) is still returned, and its record
        answered by ``get_record`` for the life of this store."""
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
            record, authentic = incoming(key, raw_record, self.signing_key)
            if record is not None and (record.kind, record.size, record.checksum) != (
                    header.kind, header.length, header.checksum):
                raise CorruptBlob("its record disagrees with the blob's header", key)
        except CorruptBlob as exc:
            self._count("remote_rejected")
            self._keep_count("remote_rejected")
            self._rejected.add(key)
            log.warning("cachebuild: rejected remote blob %s from %s: %s", key, self.remote.display_url,
                        exc.reason)
            return None, "rejected"
        start = header.header_size
        payload = bytes(memoryview(framed)[start:start + header.length])
        if not keep:
            return payload, "pulled"
        manifest = record.manifest if record is not None and authentic else None
        refs = refs_of(header.kind, payload)
        origin = self._origin(record if authentic else None)
        trusted = self._trusted(origin)
        try:
            if self.same_key_as_local:
                # Keep the verified blob byte for byte (L1 re-checks it with the same key).
                self.local.write_blob(key, framed, manifest=manifest, refs=refs,
                                      unsigned_from=origin, trusted=trusted)
            else:
                self.local.put(key, payload, kind=header.kind, manifest=manifest, refs=refs,
                               unsigned_from=origin, trusted=trusted)
        except StoreError as exc:
            # The payload is verified and usable; only the local copy failed (disk full).
            log.warning("cachebuild: could not copy remote blob %s into the local store: %s", key, exc)
            now = self.local.clock.time()
            self._unstored[key] = Record(key=key, kind=header.kind, size=header.length,
                                         checksum=header.checksum, created=now,
                                         last_used=now, manifest=manifest, refs=refs,
                                         unsigned_from=origin, trusted=trusted)
        self._count("l2_hits")
        self._count("l2_bytes", len(payload))
        self._keep_count("l2_hits")
        return payload, "pulled"

    def check_remote_copy(self, key: str) -> FetchOutcome:
        """Whether L2's copy of ``key`` verifies as a reader of this store would verify it
        ("pulled"), fails ("rejected") or is absent or incomplete ("missing"); nothing is
        written to L1, and the answer is not remembered (the copy may be replaced next)."""
        self._rejected.discard(key)
        outcome = self.fetch(key, keep=False)[1]
        self._rejected.discard(key)
        return outcome

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

    def _trusted(self, origin: str | None) -> str | None:
        """``Record.trusted`` for a blob fetched from L2 from ``origin``: without a key,
        the option that named this remote as a source of unsigned blobs
        (``allow_unsigned``, without which no keyless remote is used); with one, the fleet
        key's signature, verified on this very blob (someone vouched for it by name)."""
        if origin is None:  # signed with the fleet key: came from the fleet, not built here
            return "signed with the fleet key"
        assert self.remote is not None
        if self.signing_key is None:
            return f"--allow-unsigned with remote {self.remote.display_url}"[:MAX_ORIGIN]
        return "signed with the fleet key"

    def contains(self, key: str) -> bool:
        """True if ``key`` verifies in L1, or in L2 (fetched, verified, copied into L1)."""
        if self.local.contains(key):
            return True
        payload, _ = self.fetch(key)
        return payload is not None

    def get_record(self, key: str) -> Record | None:
        """L1's index record for ``key``; for a key only L2 holds, the record L1 has once
        the remote blob is fetched and verified (None if it fails)."""
        record = self.local.get_record(key)
        if record is not None or self.remote is None:
            return record
        if self.fetch(key)[0] is None:
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
            record, authentic = incoming(key, raw, self.signing_key)
            if record is None or not authentic:
                continue
            if kind is None or record.kind == kind:
                yield record if manifests else dataclasses.replace(record, manifest=None)

    def materialize(self, key: str, suffix: str) -> Path | None:
        """A verified file holding ``key``'s payload, pulling it from L2 first if needed
        (counted as ``get`` counts: a load is a lookup)."""
        path = self.local.materialize(key, suffix)
        if path is not None:
            self._count("l1_hits")
        elif self.fetch(key)[0] is not None:
            path = self.local.materialize(key, suffix)
        else:
            self._count("misses")
        return path

    # -- writes -----------------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview, *, kind: str,
            manifest: dict[str, Any] | None = None, refs: Sequence[str] = ()) -> Record:
        """Store ``data`` in L1, then in L2 when the remote is writable; L1's record."""
        record = self.local.put(key, data, kind=kind, manifest=manifest, refs=refs)
        self._rejected.discard(key)
        self._push_one(key, data, record)
        return record

    def _push_one(self, key: str, payload: bytes | bytearray | memoryview,
                  record: Record) -> bool:
        if self.remote is None or not self.remote.writable:
            return False
        framed = encode_blob(key, record.kind, payload, self.signing_key)
        return self.remote.put(key, outgoing(record, self.signing_key), framed)

    @property
    def same_key_as_local(self) -> bool:
        """True if L1 signs and checks with the fleet key (so its blobs go to L2 as they
        are, and L2's come to L1 byte for byte)."""
        return self.local.signing_key == self.signing_key

    # -- locks --------------------------------------------------------------------------

    @contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Single-flight for ``key`` on this machine (file lock) and across machines (Redis).

        The local lock is taken first so a machine sends one waiter to Redis, not one per
        process. ``timeout`` bounds the wait for both together (default: the local store's
        lock timeout; negative waits forever); LockTimeout if exceeded.
        Without a writable remote this is just the local lock.
        """
        start = self.local.clock.monotonic()
        with self.local.lock(key, timeout=timeout):
            if self.remote is None:
                yield
                return
            limit = timeout if timeout is not None else self.local.lock_timeout
            # A negative timeout means wait forever, as for the local lock.
            remaining = None if limit < 0 else max(0.0, limit - (self.local.clock.monotonic() - start))
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

    def reopen_options(self) -> StoreOptions | None:
        # A remote this process found down is left out: each worker would wait out its
        # timeout again.
        if self._opened_with is not None and self.remote is not None \
                and not self.remote.available:
            return self._opened_with.with_remote_off()
        return self._opened_with

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

    def stats(self) -> StoreStats:
        """L1's stats plus ``tiers``: this process's hits by tier and the remote's health
        now (a remote that is down warns once)."""
        if self.remote is not None:
            self.remote.ping()
        out = self.local.stats()
        with self._count_lock:
            tiers = TierStats(**dataclasses.asdict(self.counters))
        tiers.signed = self.signing_key is not None
        remote = self.remote
        if remote is not None:
            tiers.remote_errors, tiers.remote_incomplete = remote.errors, remote.incomplete
            tiers.remote, tiers.remote_mode = remote.display_url, remote.mode
            tiers.remote_available = remote.available
        out.tiers = tiers
        return out
