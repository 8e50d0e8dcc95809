"""The store's interfaces, from the smallest to the fullest.

- ``ArtifactSource``: what a backend reads when it loads an artifact (``get``,
  ``contains``, ``materialize``, ``scratch_dir``). Every store is one, and so is the
  scratch store that holds a freshly built artifact while it is proven.
- ``Store``: what the builder, the runtime, the planner and the commands use, whatever the
  tiers: reads, writes, build locks, records, pins, maintenance. ``LocalStore``,
  a read-only ``LocalStore``, ``OverlayStore`` and ``TieredStore`` declare it.
- ``LocalTier``: one machine's store as tiering, bundles and transfers use it: framed
  blobs in and out, verified with its own signing settings, and those settings.
  ``Store.local`` is a store's local tier (itself, for a local store).
- ``RemoteTier``: what is said of a shared tier (``Store.remote``, None without one).

Keys are 32 hex characters naming immutable content; what is stored under one is a
payload of some ``kind`` with its ``Record`` (size, checksum, times, pins, the manifest of
factors, refs to other keys).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from cachebuild.store.blob import BlobHeader
from cachebuild.store.options import StoreOptions
from cachebuild.store.record import BlobWrite, GCReport, Record, StoreStats, VerifyReport
from cachebuild.store.timekeeping import Clock

#: Progress callback: (done, total).
Progress = Callable[[int, int], None]


class ArtifactSource(Protocol):
    """Where a backend loads an artifact from: verified bytes, or a verified file."""

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The verified payload of ``key``, or None (a miss: absent, or failed checks).
        ``touch=False`` reads without counting a use (hits, last used)."""
        ...

    def contains(self, key: str) -> bool:
        """True if ``key`` is stored (in any tier) and its bytes verify: a target counts
        as present only once it could be loaded."""
        ...

    def materialize(self, key: str, suffix: str) -> Path | None:
        """A verified file holding ``key``'s payload (e.g. a package to load), or None."""
        ...

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        """A directory only this process uses (0700, made by us and checked like the
        store, removed at exit), for files a loader must hand to another library by path.
        ``in_memory``: backed by memory, for when the store's disk is full."""
        ...


class RemoteTier(Protocol):
    """A shared tier, as the commands speak of it."""

    #: Its URL without a password, for messages.
    display_url: str
    #: ``rw`` or ``ro`` (this process writes nothing to it).
    mode: str

    @property
    def available(self) -> bool:
        """False once it stopped answering (the store then carries on without it)."""
        ...


class Store(ArtifactSource, Protocol):
    """A locked, content-addressed store of verified artifacts."""

    #: Where the store's files are (the local tier's ``<dir>/v1``), for messages.
    root: Path

    @property
    def local(self) -> LocalTier:
        """The local tier: this store itself, L1 of a tiered store, or the read-only store
        under an overlay (what bundles are exported from)."""
        ...

    @property
    def remote(self) -> RemoteTier | None:
        """The shared tier, or None (a store of this machine only)."""
        ...

    @property
    def work_dir(self) -> Path:
        """Where compilers write while a target builds (``kernel_dir.build_work_dir``):
        the store's ``work/`` folder or the operator's; ``stats`` counts it, ``gc``
        empties it when no build runs."""
        ...

    @property
    def work_dir_named(self) -> bool:
        """True where the operator named the work folder (``CACHEBUILD_WORK_DIR``): it may
        hold their own files, so builds and ``gc`` touch only what builds marked there."""
        ...

    @property
    def work_records(self) -> Path:
        """A private folder of the store's own (never inside ``work_dir``) where builds
        record what they leave in the work folder, so that what a later build reuses
        from there is checked against a record a planted file cannot bring along (where
        the environment folder is not ours to write: it keeps them otherwise)."""
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
        """Let GC remove ``key`` again."""
        ...

    def gc(self, max_size: int | None = None, older_than: float | None = None,
           dry_run: bool = False) -> GCReport:
        """Evict least recently used records (see ``LocalStore.gc``)."""
        ...

    def verify(self, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Check every local blob (see ``LocalStore.verify``)."""
        ...

    def stats(self) -> StoreStats:
        """Counts, sizes and counters (see ``LocalStore.stats``), per tier."""
        ...

    def reopen_options(self) -> StoreOptions | None:
        """The options that open this same store in another process (a build worker), so
        that what that process writes is read here; None where there are none (a store
        only this process's memory holds, or one it may only read)."""
        ...

    def close(self) -> None:
        """Write pending statistics and release connections."""
        ...


class LocalTier(Store, Protocol):
    """One machine's store, as tiering, bundles and transfers use it (see the module doc).
    A framed blob is a blob exactly as stored: header, payload and signature."""

    #: Checked with (and, written, signed with) this key; None: unsigned.
    signing_key: bytes | None
    #: Refuses blobs that are not signed with ``signing_key``.
    require_signature: bool
    #: The default wait of ``lock``, in seconds.
    lock_timeout: float
    #: True: every write raises (``LocalStore(path, read_only=True)``).
    read_only: bool
    #: Where every time it records comes from.
    clock: Clock

    def put(self, key: str, data: bytes | bytearray | memoryview, *, kind: str,
            manifest: dict[str, Any] | None = None, refs: Sequence[str] = (),
            unsigned_from: str | None = None, trusted: str | None = None) -> Record:
        """``Store.put``; ``unsigned_from``: the data came from there without a verified
        signature (``Record.unsigned_from``); ``trusted``: who trusted that source
        (``Record.trusted``)."""
        ...

    def read_blob(self, key: str) -> bytes | None:
        """The framed blob of ``key``, verified; None on a miss. Not a use."""
        ...

    def write_blob(self, key: str, blob: bytes | bytearray | memoryview, *,
                   manifest: dict[str, Any] | None = None, refs: Sequence[str] = (),
                   pinned: bool = False, unsigned_from: str | None = None,
                   trusted: str | None = None) -> Record:
        """Store a framed blob byte for byte, after verifying it (CorruptBlob if it
        fails); a no-op returning the record if ``key`` is stored."""
        ...

    def write_blob_chunks(self, key: str, chunks: Iterable[bytes | bytearray | memoryview], *,
                          manifest: dict[str, Any] | None = None,
                          pinned: Callable[[BlobHeader], bool] | bool = False,
                          accept: Callable[[BlobHeader], None] | None = None,
                          unsigned_from: Callable[[BlobHeader], str | None] | str | None = None,
                          trusted: Callable[[BlobHeader], str | None] | str | None = None,
                          ) -> BlobWrite:
        """``write_blob`` for a blob that arrives in pieces (from someone else: a bundle),
        verified as it is written and compared with what the key holds: the same payload
        is not written again, other bytes replace only a stored blob that is not served by
        one that would be, else CorruptBlob (``BlobConflict``) and the stored one stays.
        Its refs are read from its verified payload (``refs.refs_of``), never given."""
        ...

    def trust(self, source: str, how: str, keys: Iterable[str] | None = None) -> list[str]:
        """Mark what came unsigned from ``source`` as trusted by ``how``; the keys marked."""
        ...

    def trust_blobs(self, how: str, checksums: Mapping[str, str]) -> list[str]:
        """Mark the records of these keys trusted by ``how`` where they hold the payload of
        the checksum given, whatever source they name; the keys marked."""
        ...

    def flush(self) -> None:
        """Write this process's pending usage statistics."""
        ...
