"""A store this process may only read: baked into an image layer, on a read-only mount, or
owned by root and served to another user.

``ReadOnlyLocalStore`` reads exactly as ``LocalStore`` does (every blob verified against
its index record, no symlink followed) and writes nothing anywhere in it: its index is
read through a read-only SQLite connection, hits and counters stay in this process's
memory, a file a loader needs by path is made in memory (a ``memfd``) unless a verified
one is stored already, a private directory is made under ``/dev/shm``, and a blob that
fails verification is a miss that is logged, not moved. Anything that would write (a
put, a pin, a lock for a build, ``gc``) raises ``ReadOnlyStore``; ``OverlayStore`` puts
such writes in a writable store of this user's instead.

What may be read is checked like a writable store, except that root may own it: the
store, its format folder, index and objects folders belong to us or root and no one else
can write them, and no one but us or root can rename a directory above it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .blob import BlobHeader, CorruptBlob, read_blob_fd
from .files import OddFile, open_regular
from .index import Index, ReadOnlyStore
from .interface import Progress
from .layout import Layout, check_key, check_suffix, open_read_only
from .local import LocalStore
from .record import GCReport, Record, StoreStats, VerifyReport

log = logging.getLogger("cachebuild.store")


class ReadOnlyLocalStore(LocalStore):
    """A ``LocalStore`` that reads only (see the module doc)."""

    read_only = True

    def _open_layout(self, path: Path) -> Layout:
        return open_read_only(path)

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._finalizer.detach()  # usage stays in memory: nothing is flushed at exit

    def reopen_options(self) -> None:
        return None  # another process could not write what it builds here

    def _open_index(self) -> Index:
        return Index(self._layout.index, read_only=True)

    def ensure_reserve(self) -> None:
        pass  # nothing is written, so no reserve is needed

    def _refuse(self, what: str) -> ReadOnlyStore:
        return ReadOnlyStore(f"cannot {what}: the store at {self.root} is read-only here "
                             "(a read-only mount, or owned by another user); use a store "
                             "you can write (--cache-dir, CACHEBUILD_DIR)")

    # -- what stays in memory -----------------------------------------------------------

    def flush(self) -> None:
        """Hits, last-used times and counters stay in this process's memory."""

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        return super().scratch_dir(in_memory=True)

    def quarantine(self, key: str, inode: int | None, reason: str, quiet: bool = False) -> None:
        """A damaged blob here cannot be moved: it is a miss, said once per key."""
        if not quiet and key not in self._said_damaged:
            self._said_damaged.add(key)
            log.warning("blob %s in the read-only store at %s failed verification (%s); "
                        "it is a miss here", key, self.root, reason)

    @property
    def _said_damaged(self) -> set[str]:
        found = self.__dict__.get("_damaged")
        if found is None:
            found = self.__dict__["_damaged"] = set()
        return found

    def materialize(self, key: str, suffix: str) -> Path | None:
        """The stored file of ``key`` if one was materialized when the store was written
        and it verifies; else the verified payload in a memory file (nothing is written
        to disk). None on a miss."""
        check_key(key)
        check_suffix(suffix)
        small = self._index.get_small(key)
        if small is None:
            self._usage.note(None, "misses")
            return None
        path = self._files.stored(key, suffix, small)
        if path is not None:
            self._usage.note(key, "hits")
            return path
        payload = self.get(key)
        if payload is None:
            return None
        return self._files.in_memory(key, suffix, payload)

    # -- what would write ---------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview, *, kind: str,
            manifest: dict[str, Any] | None = None, refs: Sequence[str] = (),
            unsigned_from: str | None = None, trusted: str | None = None) -> Record:
        raise self._refuse(f"store {key}")

    def write_blob(self, key: str, blob: bytes | bytearray | memoryview, *,
                   manifest: dict[str, Any] | None = None, refs: Sequence[str] = (),
                   pinned: bool = False, unsigned_from: str | None = None,
                   trusted: str | None = None) -> Record:
        raise self._refuse(f"store {key}")

    def write_blob_chunks(self, key: str, chunks: Iterable[bytes | bytearray | memoryview], *,
                          manifest: dict[str, Any] | None = None, refs: Sequence[str] = (),
                          pinned: bool = False,
                          accept: Callable[[BlobHeader], None] | None = None,
                          unsigned_from: Callable[[BlobHeader], str | None] | str | None = None,
                          trusted: Callable[[BlobHeader], str | None] | str | None = None,
                          ) -> Record:
        raise self._refuse(f"store {key}")

    def delete(self, key: str) -> bool:
        raise self._refuse(f"delete {key}")

    def pin(self, key: str) -> None:
        raise self._refuse(f"pin {key}")

    def trust(self, source: str, how: str, keys: Iterable[str] | None = None) -> list[str]:
        raise self._refuse(f"trust {source}")

    def unpin(self, key: str) -> None:
        raise self._refuse(f"unpin {key}")

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        raise self._refuse(f"lock {key} for a build")
        yield  # pragma: no cover

    def gc(self, max_size: int | None = None, older_than: float | None = None,
           dry_run: bool = False) -> GCReport:
        raise self._refuse("collect garbage")

    def verify(self, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Read and check every blob, changing nothing (``repair`` is refused)."""
        if repair:
            raise self._refuse("repair")
        report = VerifyReport()
        records = list(self._index.records(manifest=False))
        for done, record in enumerate(records, 1):
            report.checked += 1
            reason, _ = self.check_blob_file(record.key, self._index.get_small(record.key)
                                             or {})
            if reason is None:
                report.ok += 1
            else:
                report.damaged.append((record.key, reason))
            if progress is not None:
                progress(done, len(records))
        return report

    def check_blob_file(self, key: str, small: dict[str, Any]) -> tuple[str | None, int | None]:
        if not small:
            return "index record is damaged", None
        try:
            fd = open_regular(self._layout.blob_str(key))
        except OddFile as e:
            return f"{e.what} where the blob should be", e.inode
        if fd is None:
            return "blob file is missing", None
        try:
            header, _ = read_blob_fd(fd, expected_key=key, signing_key=self._signing_key,
                                     require_signature=self.require_signature)
        except CorruptBlob as e:
            return e.reason, None
        finally:
            os.close(fd)
        if header.checksum != small["checksum"]:
            return "checksum differs from the index record", None
        return None, None

    def stats(self) -> StoreStats:
        out = super().stats()
        out.read_only = True
        return out

    def __repr__(self) -> str:
        return f"ReadOnlyLocalStore({str(self.path)!r})"

