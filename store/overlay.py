"""A read-only store with a writable overlay: what a server uses when the configured store
is baked into its image or mounted read-only.

Reads look in the overlay first (what this user built since: a newer entry there shadows
a stale one below) and then in the read-only store; a warm start that finds everything
below never makes the overlay, so it writes nothing and says nothing. The first write (a
build after a miss) makes the overlay and says so on one line: in ``overlay_dir``
(``CACHEBUILD_OVERLAY_DIR``), a store of this user's that later starts read too, or else
in a private folder in memory (``/dev/shm``) that is gone at exit.

Counters of the read-only store (hits, warm starts, loads) stay in this process's memory.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import access
from .interface import Progress, Store
from .local import LocalStore
from .options import StoreOptions
from .record import GCReport, OverlaySummary, Record, StoreStats, VerifyReport

log = logging.getLogger("cachebuild.store")


class OverlayStore(Store):
    """``base`` (read-only) below an overlay made on first write (see the module doc)."""

    def __init__(self, base: LocalStore, overlay_dir: Path | None = None,
                 work_dir: Path | None = None, opened_with: StoreOptions | None = None) -> None:
        """``work_dir``: where builds' compilers write (default: the overlay's ``work/``).
        ``opened_with``: the options ``open_store`` opened it with."""
        self.base = base
        self._opened_with = opened_with
        self._work_dir = work_dir
        self.root = base.root
        self.overlay_dir = Path(overlay_dir).expanduser() if overlay_dir else None
        self._overlay: LocalStore | None = None
        self._memory: str | None = None

    def reopen_options(self) -> StoreOptions | None:
        # An overlay in memory is this process's alone.
        return self._opened_with if self.overlay_dir is not None else None

    # -- the overlay ------------------------------------------------------------------

    @property
    def overlay(self) -> LocalStore | None:
        """The overlay if it exists (an ``overlay_dir`` from an earlier process counts),
        without making it."""
        if self._overlay is None and self.overlay_dir is not None and \
                (self.overlay_dir / "v1").is_dir():
            self._overlay = self._open(self.overlay_dir)
        return self._overlay

    def writable(self) -> LocalStore:
        """The overlay, made now if it is not there yet (and said so, once)."""
        if self.overlay is not None:
            return self._overlay  # type: ignore[return-value]
        if self.overlay_dir is not None:
            where = f"{self.overlay_dir} (CACHEBUILD_OVERLAY_DIR)"
            self._overlay = self._open(self.overlay_dir)
        else:
            parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._memory = tempfile.mkdtemp(prefix=f"cachebuild-overlay-{os.getpid()}-",
                                            dir=parent)
            atexit.register(_remove_if_ours, self._memory, os.getpid())
            where = ("memory, gone when this process exits (set CACHEBUILD_OVERLAY_DIR to a "
                     "folder of yours to keep it)")
            self._overlay = self._open(Path(self._memory) / "store")
        if self.base.disk_full:
            log.warning("cachebuild: the disk holding the store at %s is full, so what this "
                        "process builds goes to %s", self.base.path, where)
        else:
            log.warning("cachebuild: the store at %s is read-only here, so what this process "
                        "builds goes to %s", self.base.path, where)
        return self._overlay

    def _open(self, path: Path) -> LocalStore:
        return LocalStore(path, signing_key=self.base.signing_key,
                          require_signature=self.base.require_signature,
                          lock_timeout=self.base.lock_timeout, work_dir=self._work_dir,
                          clock=self.base.clock, what="overlay folder")

    def _layers(self) -> list[LocalStore]:
        overlay = self.overlay
        return [overlay, self.base] if overlay is not None else [self.base]

    def _holder(self, key: str) -> LocalStore | None:
        """The layer whose record of ``key`` a read uses: the overlay's, else the base's."""
        for layer in self._layers():
            if layer.get_record(key) is not None:
                return layer
        return None

    # -- the Store protocol -------------------------------------------------------------

    read_only = False  # writes go to the overlay
    #: A store of this machine only.
    remote = None

    @property
    def local(self) -> LocalStore:
        """The read-only store (what ``export`` reads, and ``import`` refuses to write)."""
        return self.base

    @property
    def work_dir(self) -> Path:
        """Where builds' compilers write: a build makes the overlay anyway."""
        return self.writable().work_dir

    @property
    def work_dir_named(self) -> bool:
        return self.writable().work_dir_named

    @property
    def work_records(self) -> Path:
        """The overlay's: builds write there."""
        return self.writable().work_records

    @property
    def signing_key(self) -> bytes | None:
        return self.base.signing_key

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        return self.base.scratch_dir(in_memory=True)

    def contains(self, key: str) -> bool:
        return any(layer.contains(key) for layer in self._layers())

    __contains__ = contains

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        for layer in self._layers():
            data = layer.get(key, touch=touch)
            if data is not None:
                return data
        return None

    def get_record(self, key: str) -> Record | None:
        holder = self._holder(key)
        return holder.get_record(key) if holder is not None else None

    def materialize(self, key: str, suffix: str) -> Path | None:
        for layer in self._layers():
            path = layer.materialize(key, suffix)
            if path is not None:
                return path
        return None

    def put(self, key: str, data: bytes | bytearray | memoryview, *, kind: str,
            manifest: dict[str, Any] | None = None, refs: Sequence[str] = ()) -> Record:
        return self.writable().put(key, data, kind=kind, manifest=manifest, refs=refs)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from the overlay (the read-only store keeps its copy, which a
        newer one put in the overlay shadows)."""
        overlay = self.overlay
        return overlay.delete(key) if overlay is not None else False

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        with self.writable().lock(key, timeout):
            yield

    def records(self, *, kind: str | None = None, manifests: bool = True,
                shared: bool = False) -> Iterator[Record]:
        seen: set[str] = set()
        for layer in self._layers():
            for record in layer.records(kind=kind, manifests=manifests):
                if record.key not in seen:
                    seen.add(record.key)
                    yield record

    def count(self, counter: str, amount: int = 1) -> None:
        self.base.count(counter, amount)  # in memory

    def pin(self, key: str) -> None:
        self._overlay_holding(key, "pin").pin(key)

    def unpin(self, key: str) -> None:
        self._overlay_holding(key, "unpin").unpin(key)

    def _overlay_holding(self, key: str, what: str) -> LocalStore:
        overlay = self.overlay
        if overlay is None or overlay.get_record(key) is None:
            raise access.refusal(self.root, f"{what} {key}")
        return overlay

    def gc(self, max_size: int | None = None, older_than: float | None = None,
           dry_run: bool = False) -> GCReport:
        """Collect the overlay (the read-only store is left as it is)."""
        overlay = self.overlay
        if overlay is None:
            raise access.refusal(self.root, "collect garbage (and there is no overlay)")
        return overlay.gc(max_size=max_size, older_than=older_than, dry_run=dry_run)

    def verify(self, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Check both layers. ``repair`` is refused (ReadOnlyStore): the read-only store's
        damage cannot be repaired here, and the overlay's is a miss that builds again."""
        if repair:
            raise access.refusal(self.root, "repair damage")
        report = self.base.verify(repair=False, progress=progress)
        overlay = self.overlay
        if overlay is not None:
            more = overlay.verify(repair=False, progress=progress)
            report.checked += more.checked
            report.ok += more.ok
            report.damaged += more.damaged
            report.tmp_removed = more.tmp_removed
            report.unrecorded = more.unrecorded
        return report

    def stats(self) -> StoreStats:
        out = self.base.stats()
        overlay = self.overlay
        if overlay is not None:
            # its records only: its full stats would walk its blobs and work folder too
            out.overlay = OverlaySummary(str(overlay.root),
                                         sum(1 for _ in overlay.records(manifests=False)))
        elif self.overlay_dir is not None:
            out.overlay = OverlaySummary(str(self.overlay_dir))
        return out

    def flush(self) -> None:
        if self._overlay is not None:
            self._overlay.flush()

    def close(self) -> None:
        if self._overlay is not None:
            self._overlay.close()
        self.base.close()

    def __enter__(self) -> OverlayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OverlayStore({self.base!r}, overlay_dir={self.overlay_dir!r})"


def _remove_if_ours(folder: str, pid: int) -> None:
    """At exit: remove an overlay in memory, in the process that made it only (a child
    forked from it ends before it, and the folder is still its parent's)."""
    if os.getpid() == pid:
        shutil.rmtree(folder, ignore_errors=True)
