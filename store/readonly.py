"""What changes where a store is only read: baked into an image layer, on a read-only
mount, or owned by root and served to another user (``LocalStore(path, read_only=True)``).

Reading is the same (every blob verified against its index record, no symlink followed);
nothing is written anywhere in the store: its index is read through a read-only SQLite
connection, hits and counters stay in this process's memory, a file a loader needs by path
is made in memory (a ``memfd``) unless a verified one is stored already, private
directories are made under ``/dev/shm``, and a blob that fails verification is a miss that
is logged (``say_damaged``), not moved. Anything that would write (a put, a pin, a lock for
a build, ``gc``, ``verify --repair``) raises ``refusal``'s ReadOnlyStore before it touches
anything; ``OverlayStore`` puts such writes in a writable store of this user's instead.

What may be read is checked like a writable store, except that root may own it
(``layout.open_read_only``): the store, its format folder, index and objects folders
belong to us or root and no one else can write them, and no one but us or root can rename
a directory above it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .index import Index, ReadOnlyStore
from .interface import Progress
from .record import VerifyReport

log = logging.getLogger("cachebuild.store")


def refusal(root: Path, what: str) -> ReadOnlyStore:
    """The error for a write (``what``: "store KEY", "collect garbage") to the read-only
    store at ``root``, saying what to use instead."""
    return ReadOnlyStore(f"cannot {what}: the store at {root} is read-only here "
                         "(a read-only mount, or owned by another user); use a store "
                         "you can write (--cache-dir, CACHEBUILD_DIR)")


def say_damaged(said: set[str], root: Path, key: str, reason: str) -> None:
    """Log once per key (``said`` remembers) that a blob of the read-only store at ``root``
    failed verification: it cannot be moved, so it is a miss here."""
    if key not in said:
        said.add(key)
        log.warning("blob %s in the read-only store at %s failed verification (%s); "
                    "it is a miss here", key, root, reason)


def verify_reading(index: Index,
                   check: Callable[[str, dict[str, Any]], tuple[str | None, int | None]],
                   progress: Progress | None = None) -> VerifyReport:
    """Read and check every blob recorded in ``index`` with ``check`` (``LocalStore.
    check_blob_file``), changing nothing: no leftovers removed, nothing quarantined."""
    report = VerifyReport()
    records = list(index.records(manifest=False))
    for done, record in enumerate(records, 1):
        report.checked += 1
        reason, _ = check(record.key, index.get_small(record.key) or {})
        if reason is None:
            report.ok += 1
        else:
            report.damaged.append((record.key, reason))
        if progress is not None:
            progress(done, len(records))
    return report
