"""Moving keys between a tiered store's tiers: ``push`` (L1 → L2) and ``pull`` (L2 → L1).

What they promise:

- **Nothing unverified lands anywhere.** ``pull`` writes a blob to L1 only after it
  verified (framing, checksum, and the fleet's signature when there is a key), through
  the tiered store's ``fetch``; a key L1 holds is not fetched. ``push`` uploads a blob L1
  read and verified with its own settings, signed with the fleet key: one L1 holds
  unsigned because it was built here before the key was set is signed on the way.
- **"Already there" means usable there.** A copy the remote holds counts as present only
  when it verifies as a reader with this store's settings would verify it; one that does
  not (damaged, or signed with another key) is counted ``rejected`` and left alone, unless
  ``replace`` asks for it to be deleted and uploaded again (a wrong local key would
  otherwise replace a fleet's good copies with copies nobody else can read).
- **Nobody's word is signed unasked.** What entered L1 unsigned from elsewhere
  (``Record.unsigned_from``) is not pushed unless it is vouched for by name.
- **A remote in trouble is counted, not raised.** A remote that goes down part-way makes
  the remaining keys count as ``failed``. Only bad usage raises (``UsageError``): no
  remote, or ``push`` to a read-only one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cachebuild.errors import UsageError

from .blob import encode_blob, parse_header
from .interface import Store
from .layout import InvalidKey, check_key
from .signing import outgoing
from .tiered import TieredStore

log = logging.getLogger(__name__)


@dataclass
class TransferCounts:
    """What a ``push`` or ``pull`` did, key by key."""

    transferred: int = 0  # copied to the other tier by this call
    present: int = 0  # already in the destination tier
    missing: int = 0  # not in the source tier (or incomplete there)
    rejected: int = 0  # failed verification: pull: not loaded; push: the remote's copy
    replaced: int = 0  # push only: the remote's copy failed verification, uploaded again
    failed: int = 0  # remote down, refused, or another writer was uploading it
    bytes: int = 0  # payload bytes transferred
    signed: int = 0  # push only: held unsigned in L1, signed with the fleet key to upload
    unvouched: int = 0  # push only: entered L1 unsigned from elsewhere, not named: not pushed
    unvouched_keys: list[str] = dataclasses.field(default_factory=list)
    rejected_keys: list[str] = dataclasses.field(default_factory=list)  # push only
    missing_keys: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tiers(store: Store, what: str) -> TieredStore:
    """``store`` as a tiered store with a remote; UsageError if it has none."""
    if not isinstance(store, TieredStore) or store.remote is None:
        raise UsageError(f"{what} needs a remote (--remote or CACHEBUILD_REMOTE)")
    return store


def upload(tiered: TieredStore, key: str, vouched: bool = False,
           replace: bool = False) -> str:
    """Upload L1's ``key`` to L2: "pushed", "signed" (pushed, after signing a blob L1
    holds unsigned), "present" (L2's copy verifies), "rejected" (L2's copy does not, and
    ``replace`` is False), "replaced" (it did not and was uploaded again), "missing",
    "unvouched" (it entered L1 unsigned from elsewhere and ``vouched`` is False) or
    "failed"."""
    remote = tiered.remote
    assert remote is not None
    replacing = False
    if remote.contains(key):
        outcome = tiered.check_remote_copy(key)
        if outcome == "pulled":
            return "present"
        if outcome == "rejected":
            if not replace:
                return "rejected"
            replacing = True
        # "missing": the copy was incomplete (its record is dropped): upload it again.
    record = tiered.local.get_record(key)
    if record is None:
        return "missing"
    if record.unsigned_from is not None and not vouched:
        return "unvouched"
    framed = tiered.local.read_blob(key)  # verified with L1's settings
    if framed is None:
        return "missing"
    header = parse_header(framed)
    signed_now = False
    if tiered.signing_key is not None and not (header.signed and tiered.same_key_as_local):
        # What lands in L2 must verify there: sign it with the fleet key (a blob built
        # before the key was configured is held unsigned in L1).
        payload = memoryview(framed)[header.header_size:header.header_size + header.length]
        framed = encode_blob(key, record.kind, payload, tiered.signing_key)
        signed_now = True
    if replacing and not remote.delete(key):
        return "failed"
    if remote.put(key, outgoing(record, tiered.signing_key), framed):
        return "replaced" if replacing else "signed" if signed_now else "pushed"
    if not remote.contains(key):
        return "failed"
    # A put leaves what is there: another writer's copy, or one no reader can read (a
    # value of another Redis type under the record's name), which is not "present".
    if tiered.check_remote_copy(key) == "pulled":
        return "present"
    if not replace or replacing:
        return "rejected"
    if remote.delete(key) and remote.put(key, outgoing(record, tiered.signing_key), framed):
        return "replaced"
    return "failed"


def push(store: Store, keys: Iterable[str] | None = None,
         vouch: Iterable[str] = (), *, replace: bool = False) -> TransferCounts:
    """Copy ``keys`` (default: every L1 entry) and ``vouch`` from L1 to L2; what happened,
    counted (see the module doc). ``vouch``: keys that entered L1 unsigned, to sign and
    push all the same. ``replace``: delete the remote copies that fail verification and
    upload them again. Raises UsageError without a remote or with a read-only one."""
    tiered = _tiers(store, "push")
    remote = tiered.remote
    assert remote is not None
    if remote.mode != "rw":
        raise UsageError(f"remote {remote.display_url} is read-only; push needs mode rw")
    counts = TransferCounts()
    vouched = set(vouch)
    if keys is None:
        wanted = [r.key for r in tiered.local.records(manifests=False)]
    else:
        wanted = list(keys)
    for key in dict.fromkeys([*wanted, *vouched]):
        outcome = upload(tiered, key, vouched=key in vouched, replace=replace)
        if outcome == "unvouched":
            counts.unvouched += 1
            counts.unvouched_keys.append(key)
        elif outcome in ("pushed", "signed", "replaced"):
            counts.transferred += 1
            counts.signed += outcome == "signed"
            counts.replaced += outcome == "replaced"
            record = tiered.local.get_record(key)
            counts.bytes += record.size if record is not None else 0
        elif outcome == "present":
            counts.present += 1
        elif outcome == "missing":
            counts.missing += 1
            counts.missing_keys.append(key)
        elif outcome == "rejected":
            counts.rejected += 1
            counts.rejected_keys.append(key)
        else:
            counts.failed += 1
    return counts


def pull(store: Store, keys: Iterable[str] | None = None, *,
         workers: int = 4) -> TransferCounts:
    """Copy ``keys`` (default: every L2 entry) from L2 into L1, verifying each one.

    A key already in L1 is not fetched. A blob that fails verification, or a name that is
    not a store key, is counted as ``rejected`` and never written to L1. ``workers``
    threads fetch, verify and write in parallel (socket reads, hashing and file writes all
    release the GIL). Raises UsageError without a remote.
    """
    tiered = _tiers(store, "pull")
    remote = tiered.remote
    assert remote is not None
    counts = TransferCounts()
    wanted = list(remote.keys()) if keys is None else list(keys)

    def one(key: str) -> tuple[str, int]:
        try:
            check_key(key)
        except InvalidKey:
            log.warning("cachebuild: not pulling %r: not a store key", str(key)[:100])
            return "rejected", 0
        if tiered.local.contains(key):
            return "present", 0
        if not remote.available:
            return "failed", 0
        payload, outcome = tiered.fetch(key)
        if payload is not None:
            return "transferred", len(payload)
        if outcome == "rejected":
            return "rejected", 0
        return ("missing" if remote.available else "failed"), 0

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for key, (outcome, size) in zip(wanted, pool.map(one, wanted), strict=True):
            setattr(counts, outcome, getattr(counts, outcome) + 1)
            counts.bytes += size
            if outcome == "missing":
                counts.missing_keys.append(key)
    return counts
