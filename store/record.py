"""The index record kept for every stored blob, and the reports of store maintenance."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from cachebuild.errors import StoreError


@dataclass(frozen=True)
class Record:
    """What the index knows about one stored artifact.

    ``size`` is the payload length in bytes and ``checksum`` its xxh3 hex digest (both
    also in the blob header); ``created`` and ``last_used`` are Unix times; ``hits``
    counts verified reads; ``manifest`` is the dict of factors the key was made from;
    ``refs`` are keys this entry needs (a model entry lists its targets), which GC keeps
    alive while this entry is pinned. ``unsigned_from`` is set when the artifact entered
    this store without a signature verified with the fleet key (pulled from a remote used
    without a key, imported unsigned): where it came from. It is never cleared, travels
    with the record (bundles, signed shared records), and ``push`` will not sign such an
    artifact unless it is named (``--vouch``). ``trusted`` says who trusted the source of
    such an artifact, and how (``cachebuild trust SOURCE``, ``import --trust``, a remote
    used with ``--allow-unsigned``, the fleet key's signature): without it a store does
    not serve the artifact (``is_untrusted``). It is this store's decision: kept in its
    own index only, never read from a bundle or a shared record.
    """

    key: str
    kind: str
    size: int
    checksum: str
    created: float
    last_used: float
    hits: int = 0
    pinned: bool = False
    manifest: dict[str, Any] | None = None
    refs: tuple[str, ...] = ()
    unsigned_from: str | None = None
    trusted: str | None = None

    @property
    def is_untrusted(self) -> bool:
        """True if the artifact entered unsigned and no one trusted where it came from."""
        return self.unsigned_from is not None and self.trusted is None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        data = asdict(self)
        data["refs"] = list(self.refs)
        return data

    @classmethod
    def from_json(cls, data: Any, *, key: str | None = None) -> Record:
        """The record ``to_json`` produced, checked field by field (unknown fields are
        ignored). ``key``: the key the record must be for.

        For records from anywhere else than this machine's own index (a bundle, a shared
        tier): raises BadRecord, naming the first field that is missing or of the wrong
        type, and never returns a record a reader could trip over.
        """
        if not isinstance(data, dict):
            raise BadRecord(f"a record must be a JSON object, not {type(data).__name__}")
        rec_key = data.get("key", key)
        if key is not None and rec_key != key:
            raise BadRecord(f"record is for key {_show(rec_key)}, not {key}")
        fields = check_fields(data, key=rec_key)
        return cls(key=rec_key, **fields)


@dataclass(frozen=True)
class BlobWrite:
    """What writing an arriving blob did (``LocalTier.write_blob_chunks``): ``record`` is
    the key's record now; ``written`` is False when exactly these bytes were already
    stored under the key, and nothing was written."""

    record: Record
    written: bool


#: What a kind may look like: a short name (``entry``, ``aoti-cuda``, ``fx-graph``).
KIND_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
_CHECKSUM_RE = re.compile(r"[0-9a-f]{16}|[0-9a-f]{32}")
_KEY_RE = re.compile(r"[0-9a-f]{16,128}")
#: No stored artifact is larger than this (256 TiB): a size past it is not a size.
MAX_SIZE = 1 << 48
#: A record lists at most this many refs (a model entry lists its targets).
MAX_REFS = 1 << 16
#: ``unsigned_from`` names a place in at most this many characters.
MAX_ORIGIN = 300
#: A manifest nests objects and lists at most this deep (this store's own: about 10).
MAX_MANIFEST_DEPTH = 64


class BadRecord(StoreError):
    """A record (index row, bundle member, shared-tier record) that is not well formed."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_json(text: str | bytes | bytearray) -> Any:
    """JSON text as Python values, refusing ``NaN`` and ``Infinity`` (which Python's
    ``json`` reads but nothing can store again) and nesting too deep to read back:
    ValueError, as for any bad JSON."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def _nesting(value: Any) -> int:
    """How deep ``value`` nests dicts and lists (without recursing: it may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else \
            item if isinstance(item, list | tuple) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_MANIFEST_DEPTH:
            stack.extend((c, depth + 1) for c in children)
    return deepest


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _int(data: dict[str, Any], name: str, default: Any = None) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE:
        raise BadRecord(f"record field {name!r} must be a whole number from 0 to 2**48, "
                        f"not {_show(value)}")
    return value


def _time(data: dict[str, Any], name: str, default: Any = None) -> float:
    value = data.get(name, default)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value < 0):
        raise BadRecord(f"record field {name!r} must be a time (seconds), not {_show(value)}")
    return float(value)


def check_kind(kind: Any) -> str:
    """``kind`` if it looks like an artifact kind, else BadRecord."""
    if not isinstance(kind, str) or not KIND_RE.fullmatch(kind):
        raise BadRecord(f"record field 'kind' must be a short name such as 'entry', "
                        f"not {_show(kind)}")
    return kind


def check_fields(data: dict[str, Any], *, key: Any = None,
                 defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every ``Record`` field but ``key`` from ``data``, type-checked (BadRecord if not).

    ``defaults`` fill fields ``data`` lacks (a shared record has no ``hits``).
    """
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise BadRecord(f"record key {_show(key)} is not a store key")
    data = {**(defaults or {}), **data}
    checksum = data.get("checksum")
    if not isinstance(checksum, str) or not _CHECKSUM_RE.fullmatch(checksum):
        raise BadRecord(f"record field 'checksum' must be 16 or 32 hex digits, "
                        f"not {_show(checksum)}")
    pinned = data.get("pinned", False)
    if not isinstance(pinned, bool):
        raise BadRecord(f"record field 'pinned' must be true or false, not {_show(pinned)}")
    manifest = data.get("manifest")
    if manifest is not None and not isinstance(manifest, dict):
        raise BadRecord(f"record field 'manifest' must be an object, not {_show(manifest)}")
    if manifest is not None and _nesting(manifest) > MAX_MANIFEST_DEPTH:
        raise BadRecord(f"record field 'manifest' nests more than {MAX_MANIFEST_DEPTH} deep")
    refs = data.get("refs", [])
    if not isinstance(refs, list | tuple) or len(refs) > MAX_REFS or not all(
            isinstance(r, str) and _KEY_RE.fullmatch(r) for r in refs):
        raise BadRecord(f"record field 'refs' must be a list of store keys, not {_show(refs)}")
    created = _time(data, "created")
    return {"kind": check_kind(data.get("kind")), "size": _int(data, "size"),
            "checksum": checksum, "created": created,
            "last_used": _time(data, "last_used", created), "hits": _int(data, "hits", 0),
            "pinned": pinned, "manifest": manifest, "refs": tuple(refs),
            "unsigned_from": check_origin(data.get("unsigned_from"))}


def check_origin(origin: Any) -> str | None:
    """``origin`` if it can be a record's ``unsigned_from`` (None, or a short line of
    printable text), else BadRecord."""
    if origin is None:
        return None
    if not isinstance(origin, str) or not origin or len(origin) > MAX_ORIGIN \
            or not origin.isprintable():
        raise BadRecord(f"record field 'unsigned_from' must be a short line of text, "
                        f"not {_show(origin)}")
    return origin


def check_trust(trusted: Any) -> str | None:
    """``trusted`` if it can be a record's ``trusted`` (None, or a short line of printable
    text), else BadRecord."""
    if trusted is None:
        return None
    if not isinstance(trusted, str) or not trusted or len(trusted) > MAX_ORIGIN * 2 \
            or not trusted.isprintable():
        raise BadRecord(f"record field 'trusted' must be a short line of text, "
                        f"not {_show(trusted)}")
    return trusted


@dataclass
class GCReport:
    """What a GC run removed (or, with ``dry_run``, would remove) and what it kept.

    ``bytes_before``/``bytes_after`` are the on-disk bytes of stored records (blobs and
    files materialized from them); ``kept_pinned`` counts the records GC may not remove
    (pinned, or reachable from a pinned record through refs); ``over_cap`` is True when
    those alone exceed ``max_size``. ``units`` groups ``removed`` as it was evicted: a
    model entry first, then the targets no remaining entry refers to; a loose record alone.
    """

    dry_run: bool
    removed: list[str] = field(default_factory=list)
    units: list[list[str]] = field(default_factory=list)
    freed_bytes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    records_before: int = 0
    records_after: int = 0
    kept_pinned: int = 0
    over_cap: bool = False
    tmp_removed: int = 0
    orphans_removed: int = 0  # blobs no record points to, quarantined (or that would be)
    quarantine_removed: int = 0
    work_bytes: int = 0  # compilers' working files of builds removed (or that would be)
    work_busy: bool = False  # a build was running, so they were left
    vanished: int = 0  # records of its units another process removed while it ran

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VerifyReport:
    """The result of checking every blob.

    ``damaged`` lists ``(key, reason)`` for blobs that failed verification or are
    missing; ``repaired`` says whether they were quarantined and their records dropped.
    ``unsigned`` lists ``(key, where from)`` for records that entered the store without a
    verified signature (``Record.unsigned_from``): not damage, but not vouched for;
    ``untrusted`` those of them whose source no one trusted (``Record.is_untrusted``),
    which a store does not serve.
    """

    checked: int = 0
    ok: int = 0
    damaged: list[tuple[str, str]] = field(default_factory=list)
    unsigned: list[tuple[str, str]] = field(default_factory=list)
    untrusted: list[tuple[str, str]] = field(default_factory=list)
    repaired: bool = False
    tmp_removed: int = 0
    #: Blobs no record points to: quarantined (``repair``), or only found.
    orphans_removed: int = 0
    unrecorded: int = 0

    @property
    def clean(self) -> bool:
        """True if no damage was found."""
        return not self.damaged

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["damaged"] = [{"key": k, "reason": r} for k, r in self.damaged]
        data["unsigned"] = [{"key": k, "from": w} for k, w in self.unsigned]
        data["untrusted"] = [{"key": k, "from": w} for k, w in self.untrusted]
        data["clean"] = self.clean
        return data


@dataclass
class KindTotals:
    """Records of one kind and their payload bytes."""

    records: int = 0
    bytes: int = 0


@dataclass
class WorkUsage:
    """The build work folder: what compilers wrote there during builds (``gc`` empties it)."""

    path: str
    bytes: int = 0
    files: int = 0


@dataclass
class OverlaySummary:
    """Where this user's builds go beside a read-only store, and how many records it has."""

    path: str
    records: int = 0


@dataclass
class TierStats:
    """A tiered store's lookups in this process, by where they were answered, and its
    remote's health now."""

    l1_hits: int = 0
    l2_hits: int = 0
    l2_bytes: int = 0  # of the blobs those copied in
    misses: int = 0
    remote_rejected: int = 0
    remote_errors: int = 0
    remote_incomplete: int = 0
    remote: str | None = None  # its address, credentials left out
    remote_mode: str = "off"
    remote_available: bool = False
    signed: bool = False


@dataclass
class StoreStats:
    """What a store holds and what processes did with it (``Store.stats()``).

    ``bytes`` is the records' payload, ``disk_bytes`` what their blobs take on disk;
    ``hit_rate`` is None before any lookup; the counters (hits, misses, puts, quarantined,
    builds and their seconds, loads and theirs, traces, warm starts, blobs copied in from a
    remote tier and remote copies refused) count since the store was made. ``read_only``,
    ``overlay`` and ``tiers`` (this process's lookups by tier) are set by the stores that
    have them.
    """

    path: str
    records: int = 0
    bytes: int = 0
    disk_bytes: int = 0
    pinned: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float | None = None
    quarantined: int = 0
    puts: int = 0
    builds: int = 0
    build_seconds: float = 0.0
    loads: int = 0
    load_seconds: float = 0.0
    traces: int = 0
    warm_starts: int = 0
    l2_hits: int = 0
    remote_rejected: int = 0
    by_kind: dict[str, KindTotals] = field(default_factory=dict)
    tmp_files: int = 0
    quarantine_files: int = 0
    work: WorkUsage | None = None
    read_only: bool = False
    overlay: OverlaySummary | None = None
    tiers: TierStats | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
