"""Shared records: what of a local record travels to the shared tier, signed, and how a
record read from there is checked before anything uses it.

A blob carries its own signature (``blob.py``); the record stored beside it in Redis
(kind, size, checksum, creation time, manifest, ``unsigned_from``) is signed here with the
same fleet key, over its canonical JSON. What this module promises:

- ``outgoing`` never shares refs (they decide what GC keeps, so a reader takes them from
  the verified payload, ``refs.refs_of``) nor this machine's use of an artifact (hits,
  last use, pins);
- ``incoming`` returns a record only if every field is well formed, with no refs, hits
  or pins, and says whether it is authentic: signed with ``signing_key`` (anything is,
  when there is no key);
- a signature verifies only for the same key and the same fields; a record that is not
  canonical JSON never verifies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from typing import Any

from cachebuild.keys import canonical_json

from .record import BadRecord, Record

log = logging.getLogger(__name__)

# Index fields that describe the artifact and travel with it; last_used, hits and pinned
# describe one machine's use of it and stay local (and refs are never trusted from L2).
SHARED_FIELDS = ("key", "kind", "size", "checksum", "created", "manifest", "refs",
                 "unsigned_from")
_RECORD_DOMAIN = b"cachebuild-record-v1\0"
SIGNATURE = "sig"


def shared_record(record: Record) -> dict[str, Any]:
    """The part of a local index record that is stored beside the blob in Redis."""
    full = record.to_json()
    return {name: full[name] for name in SHARED_FIELDS if name in full}


def sign_record(signing_key: bytes, shared: dict[str, Any]) -> str:
    """The HMAC-SHA256 (hex) of a shared record, over its canonical JSON."""
    body = {k: v for k, v in shared.items() if k != SIGNATURE}
    return hmac.new(signing_key, _RECORD_DOMAIN + canonical_json(body).encode(),
                    hashlib.sha256).hexdigest()


def record_signed_by(signing_key: bytes, shared: dict[str, Any]) -> bool:
    """True if ``shared`` carries a valid signature made with ``signing_key``."""
    sig = shared.get(SIGNATURE)
    if not isinstance(sig, str) or not sig.isascii():  # compare_digest takes ASCII text only
        return False
    try:
        expected = sign_record(signing_key, shared)
    except (TypeError, ValueError, RecursionError):  # not canonical JSON: not ours
        return False
    return hmac.compare_digest(expected, sig)


def outgoing(record: Record, signing_key: bytes | None) -> dict[str, Any]:
    """The shared record of ``record``, without refs, signed with ``signing_key`` if any."""
    shared = shared_record(record)
    shared["refs"] = []  # never read back from L2 (see refs.refs_of)
    if signing_key is not None:
        shared[SIGNATURE] = sign_record(signing_key, shared)
    return shared


def incoming(key: str, raw: Any, signing_key: bytes | None) -> tuple[Record | None, bool]:
    """A shared record of ``key`` checked field by field (None if it is not well formed),
    and whether it is authentic: signed with ``signing_key``, or anything without a key."""
    if not isinstance(raw, dict):
        return None, False
    try:
        record = Record.from_json({k: v for k, v in raw.items() if k != SIGNATURE}, key=key)
    except BadRecord as e:
        log.info("remote record of %s is not well formed: %s", key, e)
        return None, False
    record = dataclasses.replace(record, hits=0, pinned=False, refs=())
    if signing_key is None:
        return record, True
    return record, record_signed_by(signing_key, raw)
