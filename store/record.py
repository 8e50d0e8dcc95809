"""The index record kept for every stored blob, and the reports of store maintenance."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Record:
    """What the index knows about one stored artifact.

    ``size`` is the payload length in bytes and ``checksum`` its xxh3 hex digest (both
    also in the blob header); ``created`` and ``last_used`` are Unix times; ``hits``
    counts verified reads; ``manifest`` is the dict of factors the key was made from;
    ``refs`` are keys this entry needs (a model entry lists its targets), which GC keeps
    alive while this entry is pinned.
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

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        data = asdict(self)
        data["refs"] = list(self.refs)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        """The record ``to_json`` produced (unknown fields are ignored)."""
        return cls(key=data["key"], kind=data["kind"], size=int(data["size"]),
                   checksum=data["checksum"], created=float(data["created"]),
                   last_used=float(data["last_used"]), hits=int(data.get("hits", 0)),
                   pinned=bool(data.get("pinned", False)), manifest=data.get("manifest"),
                   refs=tuple(data.get("refs", ())))


@dataclass
class GCReport:
    """What a GC run removed (or, with ``dry_run``, would remove) and what it kept.

    ``bytes_before``/``bytes_after`` are the on-disk bytes of stored entries (blobs and
    files materialized from them); ``kept_pinned`` counts the entries GC may not remove
    (pinned, or reachable from a pinned entry through refs); ``over_cap`` is True when
    those alone exceed ``max_size``.
    """

    dry_run: bool
    removed: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    entries_before: int = 0
    entries_after: int = 0
    kept_pinned: int = 0
    over_cap: bool = False
    tmp_removed: int = 0
    orphans_removed: int = 0
    quarantine_removed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VerifyReport:
    """The result of checking every blob.

    ``damaged`` lists ``(key, reason)`` for blobs that failed verification or are
    missing; ``repaired`` says whether they were quarantined and their records dropped.
    """

    checked: int = 0
    ok: int = 0
    damaged: list[tuple[str, str]] = field(default_factory=list)
    repaired: bool = False
    tmp_removed: int = 0
    orphans_removed: int = 0

    @property
    def clean(self) -> bool:
        """True if no damage was found."""
        return not self.damaged

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["damaged"] = [{"key": k, "reason": r} for k, r in self.damaged]
        data["clean"] = self.clean
        return data
