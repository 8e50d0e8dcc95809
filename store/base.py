"""The ``Store`` protocol: what every store offers, whatever its tiers.

``LocalStore`` (one machine's disk) and ``TieredStore`` (that, plus a shared Redis) both
implement it, and everything above the store layer (the builder, the runtime, the CLI)
uses only this. Keys are 32 hex characters naming immutable content; what is stored
under one is a payload of some ``kind`` with its ``Record`` (size, checksum, times, pins,
the manifest of factors, refs to other keys).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from cachebuild.store.record import GCReport, Record, VerifyReport

#: Progress callback: (done, total).
Progress = Callable[[int, int], None]


class Store(Protocol):
    """A locked, content-addressed store of verified artifacts."""

    #: Where the store's files are (the local tier's ``<dir>/v1``), for messages.
    root: Path

    @property
    def probe_dir(self) -> Path:
        """A private folder where backends keep per-environment probe verdicts."""
        ...

    @property
    def work_dir(self) -> Path:
        """Where compilers write while a target builds (``kernel_dir.build_work_dir``):
        the store's ``work/`` folder or the operator's; ``stats`` counts it, ``gc``
        empties it when no build runs."""
        ...

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        """A directory only this process uses (0700, made by us and checked like the
        store, removed at exit), for files a loader must hand to another library by path.
        ``in_memory``: backed by memory, for when the store's disk is full."""
        ...

    def contains(self, key: str) -> bool:
        """True if ``key`` is stored (in any tier) and its bytes verify: a target counts
        as present only once it could be loaded."""
        ...

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The verified payload of ``key``, or None (a miss: absent, or failed checks).
        ``touch=False`` reads without counting a use (hits, last used)."""
        ...

    def get_record(self, key: str) -> Record | None:
        """The record of ``key`` without reading its payload, or None."""
        ...

    def put(self, key: str, data: bytes | bytearray | memoryview, *, kind: str,
            manifest: dict[str, Any] | None = None, refs: Sequence[str] = ()) -> Record:
        """Store ``data`` under ``key`` (a no-op if it is stored already); its record."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        ...

    def lock(self, key: str, timeout: float | None = None) -> AbstractContextManager[None]:
        """The build lock of ``key``, for single-flight builds across processes."""
        ...

    def materialize(self, key: str, suffix: str) -> Path | None:
        """A verified file holding ``key``'s payload (e.g. a package to load), or None."""
        ...

    def records(self, *, kind: str | None = None, manifests: bool = True,
                shared: bool = False) -> Iterator[Record]:
        """Every local record (of one ``kind``); with ``shared``, also those only a
        shared tier holds."""
        ...

    def count(self, counter: str, amount: int = 1) -> None:
        """Add to an activity counter the store keeps (builds, loads, their milliseconds,
        traces, warm starts): what ``cachebuild stats`` reports across processes."""
        ...

    def pin(self, key: str) -> None:
        """Keep ``key`` (and what its refs reach) from GC."""
        ...

    def unpin(self, key: str) -> None:
        ...

    def gc(self, max_size: int | None = None, older_than: float | None = None,
           dry_run: bool = False) -> GCReport:
        ...

    def verify(self, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        ...

    def stats(self) -> dict[str, Any]:
        ...

    def close(self) -> None:
        """Write pending statistics and release connections."""
        ...
