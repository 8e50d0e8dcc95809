"""What a stored payload refers to, read by the layer that owns the payload's format.

GC keeps what a pinned record's refs reach, so refs must come from a payload that was
verified, never from a record someone else wrote (a shared tier's, a bundle's). The store
does not read any payload's format itself: the owner of a kind registers a reader for it,
at run time (``register_refs``) or, so that a process that never imported the owner still
reads it, in the ``cachebuild.refs`` entry-point group (name: the kind; value: the reader,
``cachebuild.building.entry:payload_refs`` for model entries). What ``refs_of`` promises:

- store keys only, each once, in the order the reader gave them;
- nothing for a kind without a reader, and nothing (one log line) for a payload its
  reader cannot read: a payload is never refused for its refs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

from .layout import check_key

log = logging.getLogger("cachebuild.store")

#: A reader: a verified payload → the keys it needs beside it (ValueError, TypeError,
#: KeyError or AttributeError if it cannot read it).
RefsReader = Callable[[bytes], Iterable[str]]

_REGISTRY: dict[str, RefsReader] = {}
_DECLARED: dict[str, RefsReader | None] = {}


def register_refs(kind: str, reader: RefsReader) -> None:
    """Read the refs of payloads of ``kind`` with ``reader`` in this process."""
    _REGISTRY[kind] = reader


def _reader(kind: str) -> RefsReader | None:
    found = _REGISTRY.get(kind)
    if found is not None:
        return found
    if kind not in _DECLARED:
        points = [ep for ep in entry_points(group="cachebuild.refs") if ep.name == kind]
        _DECLARED[kind] = points[0].load() if points else None
    return _DECLARED[kind]


#: A payload longer than this is not read for refs where it arrives from someone else
#: (``has_refs``): an entry is kilobytes to a few megabytes.
MAX_REFS_PAYLOAD = 64 << 20


def has_refs(kind: str, length: int) -> bool:
    """Whether a payload of ``kind`` and ``length`` bytes is read for its refs: a reader is
    registered for the kind, and the payload is no longer than ``MAX_REFS_PAYLOAD`` (a
    longer one lists none, one log line)."""
    if _reader(kind) is None:
        return False
    if length > MAX_REFS_PAYLOAD:
        log.warning("cachebuild: a %s of %d bytes arrived: longer than any this store makes, it is kept "
                    "without refs", kind, length)
        return False
    return True


def refs_of(kind: str, payload: bytes) -> tuple[str, ...]:
    """The keys a verified payload of ``kind`` refers to (see the module doc)."""
    reader = _reader(kind)
    if reader is None:
        return ()
    try:
        return tuple(dict.fromkeys(check_key(k) for k in reader(payload)))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        log.warning("cachebuild: a stored %s lists no readable refs; keeping it without refs", kind)
        return ()
