"""LocalStore: the content-addressed artifact store on local disk.

Guarantees, and how they are kept:

- **No torn or partial entry is ever returned.** A blob is written to ``tmp/``, fsync'd,
  renamed into ``objects/`` (atomic) and only then recorded in the index. Every read
  verifies the blob's header, length and checksum (and HMAC when signing); a blob that
  fails is quarantined, counted, and reported as a miss.
- **Readers never block on writers.** ``get`` takes no lock. A blob removed under a
  reader (GC, delete) is a miss; one already open stays readable until closed.
- **Puts are idempotent.** Keys name immutable content: putting an existing key returns
  the existing record. The rename and the index write happen under a short striped lock,
  so concurrent puts and deletes of a key never leave a record and a blob that disagree.
- **Only regular files are read.** A FIFO, a directory or a symlink where a blob or a
  materialized file should be is moved to quarantine and is a miss; nothing blocks on it
  or follows it out of the store.
- **A full disk can still be read and cleaned.** Each store this process writes keeps a
  small reserve file (``access.Writable``);
  when the disk is so full that the index cannot even be opened, the reserve is given
  up so that loads, ``gc`` and ``verify`` still work (it comes back after a ``gc``), and a
  file that must be materialized goes to memory instead.
- **Crashes leave only litter.** A writer killed at any point leaves at most a temp file
  (recognised as abandoned because nobody holds its flock) or a blob without a record;
  ``gc`` and ``verify`` remove both.

Hits and last-used times are buffered in memory (``usage.py``) and written to the index
at most about once a second (and on ``flush``/``close``/exit), so a hit costs one index
read and one file read. Files a loader needs by path and private directories are
``materialize.py``'s; GC and verification are ``maintenance.py``'s, on this store's
layout and index. Every time the store records comes from its ``clock`` (``clock.py``).
What differs where a store is only read is decided by the ``Access`` it is given
(``access.py``): every write asks it first, and so do opening the store, writing usage
and a damaged blob.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cachebuild import process_state
from cachebuild.errors import StoreError
from cachebuild.units import format_size

from . import maintenance
from .access import Access, ReadOnly, Writable
from .blob import (
    MAX_HEADER_SIZE,
    BlobHeader,
    CorruptBlob,
    StreamCheck,
    check_blob,
    encode_parts,
    parse_header,
    read_blob_fd,
)
from .files import (
    OddFile,
    is_regular,
    move_to_quarantine,
    open_regular,
    remove_stored_files,
    write_all,
)
from .index import INDEX_ERRORS, Index
from .interface import LocalTier, Progress
from .layout import Layout, check_key, check_suffix
from .locking import build_lock, flocked, open_temp
from .materialize import Materializer
from .options import StoreOptions
from .record import (
    BlobWrite,
    GCReport,
    KindTotals,
    Record,
    StoreStats,
    VerifyReport,
    check_origin,
    check_trust,
)
from .refs import has_refs, refs_of
from .timekeeping import SYSTEM_CLOCK, Clock
from .usage import Usage

log = logging.getLogger("cachebuild.store")


class UnknownKey(StoreError, KeyError):
    """The key is not in the store (bad input from a user's point of view: exit code 2)."""

    exit_code = 2

    def __init__(self, key: str) -> None:
        super().__init__(f"no record with key {key} in the store")
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0])


class BlobConflict(CorruptBlob):
    """An arriving blob for a key that already holds other bytes, refused (the stored blob
    is kept). Keys name immutable content, so one of the two is not what the key names;
    which one is not for an import to guess."""

    def __init__(self, key: str, stored: Record, incoming: str) -> None:
        #: The stored copy was built here (it came from no bundle or remote): the key has
        #: a copy this store stands by, and two builds of a target seldom match byte for
        #: byte. A copy that came from elsewhere, trusted or not, differing from another
        #: source's stays a conflict to say.
        self.stored_built_here = stored.unsigned_from is None and stored.trusted is None
        served = "not trusted" if stored.is_untrusted else "trusted or built here"
        super().__init__(f"differs from the blob already stored under this key (payload "
                         f"checksum {incoming}, stored {stored.checksum}, {served}); the "
                         "stored one is kept", key)


#: Bytes compared at a time when an arriving blob is checked against the stored one.
_COMPARE_CHUNK = 1 << 20


def _payload_of(fd: int) -> tuple[int, int]:
    """``(offset, length)`` of the payload of the blob open as ``fd`` (header checked)."""
    header = parse_header(os.pread(fd, MAX_HEADER_SIZE, 0))
    return header.header_size, header.length


def _same_payload(path_a: str | Path, path_b: str | Path) -> bool:
    """True if the blob files at ``path_a`` and ``path_b`` hold the same payload byte for
    byte (their headers and signatures may differ). Checksums are not enough to call two
    blobs the same: xxh3 is not made to resist someone who crafts a collision."""
    fd_a = os.open(path_a, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd_b = os.open(path_b, os.O_RDONLY | os.O_CLOEXEC)
        try:
            (at_a, length), (at_b, length_b) = _payload_of(fd_a), _payload_of(fd_b)
            if length != length_b:
                return False
            done = 0
            while done < length:
                n = min(_COMPARE_CHUNK, length - done)
                piece = os.pread(fd_a, n, at_a + done)
                if len(piece) != n or piece != os.pread(fd_b, n, at_b + done):
                    return False
                done += n
            return True
        finally:
            os.close(fd_b)
    finally:
        os.close(fd_a)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _trust_of(origin: str | None, trusted: str | None) -> str | None:
    """``Record.trusted`` for an artifact from ``origin``, or that arrived signed with the
    fleet key (``trusted`` says so); None for one built here, which nothing vouches for
    but this store."""
    return check_trust(trusted) if origin is not None or trusted is not None else None


def untrusted_refusal(origin: str) -> str:
    """The line that says an artifact from ``origin`` is not served, and what to do."""
    return (f"not loading what came unsigned from {origin}: no one trusted that source "
            f"(built here instead where needed); if you trust it, run "
            f"`cachebuild trust '{origin}'` (or import the bundle with --trust), or sign "
            f"with the fleet key (CACHEBUILD_SIGNING_KEY)")


def _servable(small: dict[str, Any], quiet: bool = False) -> bool:
    """False, after saying so once per source (unless ``quiet``: a look before a build,
    which a worker process makes too), for a record whose artifact entered unsigned from
    a source no one trusted: nothing from outside runs unvetted."""
    origin = small.get("unsigned_from")
    if origin is None or small.get("trusted") is not None:
        return True
    if quiet:
        return False
    # Once per process, not per store object: a process may open one store more than
    # once, and the user needs the line once.
    if process_state.current().first_saying(untrusted_refusal(origin)):
        log.warning("cachebuild: %s", untrusted_refusal(origin))
    return False


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    while len(data) < size:  # only for reads over 2 GiB
        chunk = os.pread(fd, size - len(data), len(data))
        if not chunk:
            break
        data += chunk
    return data


class LocalStore(LocalTier):
    """A locked, content-addressed artifact store under ``path/v1`` (see the module doc).

    ``path`` is created 0700 and refused (StoreError) if another user owns it or
    group/others can write it, or if anyone but us and root could rename it or a
    directory above it (``store.options`` decides the path from the environment).
    With ``signing_key`` every blob written is signed (HMAC-SHA256) and signed blobs are
    checked on read; ``require_signature`` also rejects unsigned ones. ``lock_timeout``
    is the default wait of ``lock`` in seconds. ``work_dir``: where compilers write while
    a target builds (default ``v1/work``; ``stats`` counts it, ``gc`` empties it).
    ``clock``: where every time the store records comes from (``clock.SYSTEM_CLOCK``).
    ``read_only``: this process only reads the store (an image layer, a read-only mount,
    root's store served to another user): the store is given ``access.ReadOnly``
    instead of ``access.Writable`` as its access, and every write raises ReadOnlyStore
    before it touches anything. ``what`` names the folder in messages (``"overlay
    folder"``: one that ``CACHEBUILD_OVERLAY_DIR`` set).
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 signing_key: bytes | None = None, require_signature: bool = False,
                 lock_timeout: float = 600.0,
                 work_dir: str | os.PathLike[str] | None = None,
                 clock: Clock = SYSTEM_CLOCK, read_only: bool = False,
                 what: str = "store directory") -> None:
        if require_signature and not signing_key:
            raise StoreError("require_signature needs a signing key "
                             "(set CACHEBUILD_SIGNING_KEY)")
        if signing_key is not None and not isinstance(signing_key, bytes | bytearray):
            raise TypeError("signing_key must be bytes")
        self.path = Path(path).expanduser()
        self.clock = clock
        self._access: Access = ReadOnly(self.path) if read_only else Writable(self.path, what)
        self._layout = self._access.layout
        self.root: Path = self._layout.root
        self._work_dir = Path(work_dir) if work_dir else self._layout.work
        self._index = self._access.open_index()
        self.ensure_reserve()
        self._signing_key = bytes(signing_key) if signing_key else None
        self.require_signature = require_signature
        self.lock_timeout = lock_timeout
        self._usage = Usage(clock)
        self._held = threading.local()  # build locks this thread holds, for nesting
        self._files = Materializer(self._layout, clock, read_only=self._access.read_only)
        weakref.finalize(self, self._access.flush, self._usage, self._index)

    @property
    def read_only(self) -> bool:
        """True: this process only reads the store (see the class doc)."""
        return self._access.read_only

    @property
    def disk_full(self) -> bool:
        """True where the disk holding the store was found full as it was opened."""
        return bool(getattr(self._access, "disk_full", False))

    def check_writable(self, what: str) -> None:
        """ReadOnlyStore (exit 2), saying what to use instead, where ``what`` (``"import
        a bundle"``) would write to a store this process may only read."""
        self._access.check_writable(what)

    #: A store of this machine only.
    remote = None

    @property
    def local(self) -> LocalStore:
        """This store: it is its own local tier."""
        return self

    def reopen_options(self) -> StoreOptions | None:
        if self.read_only:
            return None  # another process could not write what it builds here
        return StoreOptions(cache_dir=self.path, signing_key=self._signing_key,
                            require_signature=self.require_signature, work_dir=self._work_dir)

    # -- a full disk --------------------------------------------------------------------

    def ensure_reserve(self) -> None:
        """Make the reserve file if it is missing and space is plentiful (best effort; a
        store only read keeps none)."""
        self._access.ensure_reserve()

    # -- private directories ------------------------------------------------------------

    def scratch_dir(self, *, in_memory: bool = False) -> Path:
        """A directory only this process uses, for files a loader must hand to another
        library by path (Inductor's kernels): made 0700 by us, checked like the store,
        removed at exit (or by ``gc`` once its process is gone). ``in_memory``: under
        ``/dev/shm`` instead of the store (for a full disk; always where it is read-only)."""
        return self._files.scratch_dir(in_memory=in_memory or self._access.scratch_in_memory)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.path)!r}{', read_only=True' if self.read_only else ''})"

    def __enter__(self) -> LocalStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Write pending usage statistics and close the index."""
        self.flush()
        self._index.close()
        self._files.close()

    def flush(self) -> None:
        """Write this process's pending hits and last-used times to the index (where it
        is read-only they stay in memory)."""
        self._access.flush(self._usage, self._index)

    @property
    def layout(self) -> Layout:
        """Where the store's files are."""
        return self._layout

    @property
    def index(self) -> Index:
        """The index of records (for maintenance and tests that age a record)."""
        return self._index

    @property
    def work_dir(self) -> Path:
        """Where compilers write while a target builds (see ``Store.work_dir``)."""
        return self._work_dir

    @property
    def work_dir_named(self) -> bool:
        """See ``Store.work_dir_named``."""
        return self._work_dir != self._layout.work

    @property
    def work_records(self) -> Path:
        """See ``Store.work_records`` (the store's ``built/``, made on use)."""
        return self._layout.built

    @property
    def signing_key(self) -> bytes | None:
        return self._signing_key

    # -- writing ------------------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview, *, kind: str,
            manifest: dict[str, Any] | None = None, refs: Sequence[str] = (),
            unsigned_from: str | None = None, trusted: str | None = None) -> Record:
        """Store ``data`` under ``key`` and return its record.

        Keys name immutable content, so putting a key that is already stored is a no-op
        that returns the existing record. When this returns, the blob is durable (fsync)
        and visible to every process. Raises StoreError with the cause when the disk is
        full or read-only; the store is left as it was. ``unsigned_from``: the data came
        from there without a verified signature (``Record.unsigned_from``); ``trusted``:
        who trusted that source (``Record.trusted``). An artifact built here
        (``unsigned_from`` None) replaces a stored one that is not trusted.
        """
        self._access.check_writable(f"store {key}")
        check_key(key)
        refs = tuple(check_key(r) for r in refs)
        if isinstance(data, memoryview):
            data = data.cast("B")
        existing = self._existing(key, replacing_untrusted=unsigned_from is None)
        if existing is not None:
            return existing
        header, trailer, checksum = encode_parts(key, kind, data, self._signing_key)
        now = self.clock.time()
        record = Record(key=key, kind=kind, size=len(data),
                        checksum=checksum, created=now, last_used=now, manifest=manifest,
                        refs=refs, unsigned_from=check_origin(unsigned_from),
                        trusted=_trust_of(unsigned_from, trusted))
        return self._install(record, (header, data, trailer))

    def write_blob(self, key: str, blob: bytes | bytearray | memoryview, *,
                   manifest: dict[str, Any] | None = None, refs: Sequence[str] = (),
                   pinned: bool = False, unsigned_from: str | None = None,
                   trusted: str | None = None) -> Record:
        """Store a complete framed blob (as ``read_blob`` returns) under ``key``.

        The blob is verified first with this store's signing settings (CorruptBlob if it
        fails) and stored byte for byte, so a signature made elsewhere is kept. Like
        ``put``, a key already stored is a no-op returning the existing record.
        """
        self._access.check_writable(f"store {key}")
        check_key(key)
        refs = tuple(check_key(r) for r in refs)
        header = check_blob(blob, expected_key=key, signing_key=self._signing_key,
                            require_signature=self.require_signature)
        existing = self._existing(key, replacing_untrusted=unsigned_from is None)
        if existing is not None:
            return existing
        now = self.clock.time()
        record = Record(key=key, kind=header.kind, size=header.length,
                        checksum=header.checksum, created=now, last_used=now,
                        pinned=pinned, manifest=manifest, refs=refs,
                        unsigned_from=check_origin(unsigned_from),
                        trusted=_trust_of(unsigned_from, trusted))
        return self._install(record, (blob,))

    def _existing(self, key: str, *, replacing_untrusted: bool = False) -> Record | None:
        """The stored record of ``key`` that a write leaves in place; None if the write
        goes ahead (nothing stored, or ``replacing_untrusted`` and what is stored is not
        trusted: a build of our own takes its place)."""
        record = self._index.get(key)
        if record is not None and is_regular(self._layout.blob(key)):
            if replacing_untrusted and record.is_untrusted:
                return None
            return record
        return None

    @contextlib.contextmanager
    def _temp_blob(self, record: Record) -> Iterator[tuple[int, Path]]:
        """An open temp file for ``record``'s blob (fd, path), closed and removed after
        (unless ``_commit`` renamed it into place); an OSError on the way becomes the
        store's write error for ``record``."""
        try:
            fd, tmp_path = open_temp(self._layout.tmp, record.key)
        except OSError as e:
            raise self._write_error(e, record) from None
        try:
            yield fd, tmp_path
        except OSError as e:
            raise self._write_error(e, record) from None
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)  # gone already when it was renamed into place

    def _install(self, record: Record, parts: Sequence[bytes | bytearray | memoryview]) -> Record:
        with self._temp_blob(record) as (fd, tmp_path):
            write_all(fd, parts)
            return self._commit(record, fd, tmp_path)[0]

    def write_blob_chunks(self, key: str, chunks: Iterable[bytes | bytearray | memoryview], *,
                          manifest: dict[str, Any] | None = None,
                          pinned: Callable[[BlobHeader], bool] | bool = False,
                          accept: Callable[[BlobHeader], None] | None = None,
                          unsigned_from: Callable[[BlobHeader], str | None] | str | None = None,
                          trusted: Callable[[BlobHeader], str | None] | str | None = None,
                          ) -> BlobWrite:
        """``write_blob`` for a blob that arrives in pieces, never held whole in memory.

        Each piece is verified as it is written to a temp file (StreamCheck): a blob that
        runs past the length its header declares is refused before more is read.
        ``accept(header)`` runs as soon as the header is known and may raise to refuse
        the blob. CorruptBlob if a check fails; nothing is stored then.
        ``unsigned_from`` (``Record.unsigned_from``) may be a function of the verified
        header (whether the blob was signed decides it), and so may ``trusted``
        (``Record.trusted``) and ``pinned``. The blob comes from someone else: its refs,
        which GC keeps for a pinned record, are read from its verified payload
        (``refs_of``), never taken from a record that came with it.

        The blob is read and verified whether or not the key is stored, and then compared
        with what is (``_arrival_replaces``): the same payload is not written again
        (``BlobWrite.written`` False); other bytes replace the stored blob only where it
        is not served (``Record.is_untrusted``) and the arriving one would be, else
        BlobConflict, and the stored blob and record stay as they were.
        """
        self._access.check_writable(f"store {key}")
        check_key(key)
        checker = StreamCheck(expected_key=key, signing_key=self._signing_key,
                              require_signature=self.require_signature)
        placeholder = Record(key=key, kind="blob", size=0, checksum="", created=0.0,
                             last_used=0.0)
        with self._temp_blob(placeholder) as (fd, tmp_path):
            accepted = accept is None
            for piece in chunks:
                checker.feed(piece)
                if not accepted and checker.header is not None:
                    accept(checker.header)  # type: ignore[misc]
                    accepted = True
                write_all(fd, (piece,))
            header = checker.finish()
            if not accepted:
                accept(header)  # type: ignore[misc]
            now = self.clock.time()
            origin = unsigned_from(header) if callable(unsigned_from) else unsigned_from
            refs = (refs_of(header.kind, _payload_at(tmp_path, header))
                    if has_refs(header.kind, header.length) else ())
            record = Record(key=key, kind=header.kind, size=header.length,
                            checksum=header.checksum, created=now, last_used=now,
                            pinned=pinned(header) if callable(pinned) else pinned,
                            manifest=manifest, refs=refs,
                            unsigned_from=check_origin(origin),
                            trusted=_trust_of(
                                origin, trusted(header) if callable(trusted) else trusted))
            stored, written = self._commit(record, fd, tmp_path, functools.partial(
                self._arrival_replaces, record, tmp_path))
            return BlobWrite(stored, written)

    def _arrival_replaces(self, record: Record, tmp_path: Path, current: Record) -> bool:
        """Whether the verified blob at ``tmp_path``, arriving as ``record``, takes the place
        of the stored ``current`` (called under the key's entry lock, with a regular file
        where the blob is). False for the same payload (nothing to write); True where the
        stored blob no longer verifies (moved to quarantine first: the arrival repairs
        it), or where what is stored is not served and the arrival would be (the build
        of our own, the importer's --trust or the fleet key outranks an unvetted copy).
        Otherwise BlobConflict: other bytes never silently take a key's place, and the
        stored ones are never lost to an import."""
        blob_path = self._layout.blob(record.key)
        damage, _ = self.check_blob_file(record.key, current.to_json())
        if damage is not None:
            move_to_quarantine(self._layout, blob_path, damage, self.clock.time())
            self._index.incr("quarantined", 1)
            return True
        if (current.kind, current.size, current.checksum) == (
                record.kind, record.size, record.checksum) \
                and _same_payload(blob_path, tmp_path):
            return False
        if current.is_untrusted and not record.is_untrusted:
            return True
        raise BlobConflict(record.key, current, record.checksum)

    def _commit(self, record: Record, fd: int, tmp_path: Path,
                replaces: Callable[[Record], bool] | None = None) -> tuple[Record, bool]:
        """Make the written temp file ``tmp_path`` (open as ``fd``) the blob of ``record``
        and record it, unless the key is stored and ``replaces(current)`` (asked under the
        key's entry lock; default: a build of our own replaces what is not trusted) says
        it stays. ``(the key's record, whether it was written)``. OSError on failure, or
        whatever ``replaces`` raises; the store is then as it was."""
        key = record.key
        blob_path = self._layout.blob(key)
        os.fsync(fd)
        with flocked(self._layout.entry_lock(key)):
            current = self._index.get(key)
            if current is not None and is_regular(blob_path):
                goes_ahead = replaces(current) if replaces is not None \
                    else current.is_untrusted and record.unsigned_from is None
                if not goes_ahead:
                    return current, False  # stored already (by another process, perhaps)
            blob_path.parent.mkdir(mode=0o700, exist_ok=True)
            if os.path.lexists(blob_path) and not is_regular(blob_path):
                move_to_quarantine(self._layout, blob_path, "not-a-regular-file", self.clock.time())
            os.replace(tmp_path, blob_path)
            try:
                _fsync_dir(blob_path.parent)
                if current is not None:  # the record outlived its blob: keep its history
                    record = replace(record, created=current.created, hits=current.hits,
                                     pinned=current.pinned or record.pinned)
                try:
                    with self._index.transact():
                        self._index.put(record)
                        self._index.incr("puts", 1)
                except INDEX_ERRORS as e:
                    raise self._index_write_error(e, record) from None
            except BaseException:
                # No record may point at nothing, and no blob may outlive a failed put.
                with contextlib.suppress(OSError):
                    os.unlink(blob_path)
                raise
        return record, True

    def _write_error(self, e: OSError, record: Record) -> StoreError:
        # An arriving blob's kind and size are known only once it is read (its record then
        # is ``write_blob_chunks``'s placeholder, with no checksum yet).
        what = (f"{record.key} ({record.kind}, {format_size(record.size)})" if record.checksum
                else f"the arriving blob {record.key}")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreError(f"no space left on the device to store {what} in {self.root}: "
                              "free disk space or shrink the store "
                              "(cachebuild gc --max-size SIZE); nothing was stored")
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return StoreError(f"cannot write {what} to the store at {self.root}: "
                              f"{e.strerror.lower() if e.strerror else e}; use a writable "
                              "store directory (--cache-dir); nothing was stored")
        return StoreError(f"could not store {what} in {self.root}: {e.strerror or e}")

    def _index_write_error(self, e: Exception, record: Record) -> StoreError:
        text = str(e)
        if "full" in text:
            return self._write_error(OSError(errno.ENOSPC, "disk full"), record)
        if "readonly" in text or "read-only" in text:
            return self._write_error(OSError(errno.EROFS, "read-only index"), record)
        return StoreError(f"could not record {record.key} in the store index: {text}; "
                          "nothing was stored")

    def delete(self, key: str) -> bool:
        """Remove ``key``'s record, blob and materialized files; True if anything was there."""
        self._access.check_writable(f"delete {key}")
        check_key(key)
        with flocked(self._layout.entry_lock(key)):
            had_record = self._index.delete(key)
            had_blob = remove_stored_files(self._layout, key)
        return had_record or had_blob

    # -- reading ------------------------------------------------------------------------

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The verified payload stored under ``key``, or None on a miss.

        A blob that fails verification is quarantined, counted, and reported as a miss,
        so the caller rebuilds it; a blob removed while reading is a miss as well, and so
        is an artifact that entered unsigned from a source no one trusted
        (``Record.is_untrusted``: one warning line per source says what to do). With
        ``touch=False`` it is a look, not a use (``plan``, ``explain``): hits, misses and
        the last-used time GC goes by stay as they were.
        """
        check_key(key)
        small = self._index.get_small(key)
        payload = None if small is None or not _servable(small) else self._read_payload(key, small)
        if not touch:
            return payload
        if payload is None:
            due = self._usage.note(None, "misses")
        else:
            due = self._usage.note(key, "hits")
        if due:
            self.flush()
        return payload

    def _open_blob(self, key: str) -> int | None:
        """An fd on the blob of ``key``; None if it is missing, or if something other than
        a regular file is there (moved to quarantine, the record dropped: a miss)."""
        try:
            return open_regular(self._layout.blob_str(key))
        except OddFile as e:
            self.quarantine(key, e.inode, f"{e.what} where the blob should be")
            return None

    def _read_payload(self, key: str, small: dict[str, Any]) -> bytes | None:
        def read(fd: int) -> tuple[BlobHeader, bytes]:
            return read_blob_fd(fd, expected_key=key, signing_key=self._signing_key,
                                require_signature=self.require_signature)

        return self._read_verified(key, small, read)

    def _read_verified(self, key: str, small: dict[str, Any],
                       read: Callable[[int], tuple[BlobHeader, bytes]]) -> bytes | None:
        """``read(fd)``'s bytes for the blob of ``key``, checked against its index record.

        None if the blob is gone; a blob that fails verification is quarantined, and None.
        """
        fd = self._open_blob(key)
        if fd is None:
            return None
        try:
            try:
                header, data = read(fd)
                if header.checksum != small["checksum"] and not self._record_matches(key, header):
                    raise CorruptBlob("checksum differs from the index record", key)
                if header.kind != small["kind"] and not self._record_matches(key, header):
                    raise CorruptBlob(f"kind {header.kind!r} differs from the index record "
                                      f"({small['kind']!r})", key)
            except CorruptBlob as e:
                self.quarantine(key, os.fstat(fd).st_ino, e.reason)
                return None
        finally:
            os.close(fd)
        return data

    def _record_matches(self, key: str, header: BlobHeader) -> bool:
        # The record may have been replaced (delete + put) between our index read and our
        # file open; only a record that still disagrees with the blob means damage.
        fresh = self._index.get_small(key)
        return fresh is None or (fresh["checksum"], fresh["kind"]) == (header.checksum,
                                                                        header.kind)

    def read_blob(self, key: str) -> bytes | None:
        """The complete framed blob of ``key`` (header + payload + signature), verified.

        For shipping a blob elsewhere (a remote tier, a bundle) where the receiver
        re-verifies it with ``decode_blob``/``write_blob``. None on a miss; a blob that
        fails verification is quarantined and is a miss. Does not count as a hit.
        """
        check_key(key)
        small = self._index.get_small(key)
        if small is None:
            return None

        def read(fd: int) -> tuple[BlobHeader, bytes]:
            data = _read_all(fd)
            return check_blob(data, expected_key=key, signing_key=self._signing_key,
                              require_signature=self.require_signature), data

        return self._read_verified(key, small, read)

    def get_record(self, key: str) -> Record | None:
        """The index record of ``key`` (no blob is read), including this process's
        not yet flushed hits; None if absent."""
        check_key(key)
        record = self._index.get(key)
        if record is None:
            return None
        pending = self._usage.pending(key)
        if pending is not None:
            record = replace(record, last_used=max(record.last_used, pending[0]),
                             hits=record.hits + pending[1])
        return record

    def contains(self, key: str) -> bool:
        """True if ``key`` is stored, may be served (see ``get``) and its blob verifies now
        (read and checked like a ``get``; a blob that fails is quarantined, and then this
        is False)."""
        check_key(key)
        small = self._index.get_small(key)
        return (small is not None and _servable(small, quiet=True)
                and self._read_payload(key, small) is not None)

    __contains__ = contains

    def count(self, counter: str, amount: int = 1) -> None:
        """Add to one of the store's activity counters (``index.COUNTERS``: builds, loads,
        their milliseconds, traces, warm starts), written with the usage statistics."""
        if self._usage.add(counter, amount):
            self.flush()

    def records(self, *, kind: str | None = None, manifests: bool = True,
                shared: bool = False) -> Iterator[Record]:
        """Every record (optionally of one ``kind``; ``manifests=False`` skips loading
        them). There is no shared tier here, so ``shared`` changes nothing."""
        self.flush()
        for record in self._index.records(manifest=manifests):
            if kind is None or record.kind == kind:
                yield record

    def materialize(self, key: str, suffix: str) -> Path | None:
        """A plain file holding ``key``'s verified payload, e.g. a ``.so`` to dlopen.

        Created once beside the blob (``objects/ab/<key><suffix>``, mode 0500) and reused
        by later calls and processes after checking its size and checksum against the
        record; a file that fails the check is replaced, and anything but a regular file
        there is moved to quarantine first. On a full disk the file is made in memory
        (a ``/proc/self/fd`` path that lives as long as the store). None on a miss.
        """
        check_key(key)
        check_suffix(suffix)
        small = self._index.get_small(key)
        if small is None or not _servable(small):
            self._usage.note(None, "misses")
            return None
        path = self._files.stored(key, suffix, small)
        if path is not None:
            if self._usage.note(key, "hits"):
                self.flush()
            return path
        payload = self.get(key)
        if payload is None:
            return None
        return self._files.write(key, suffix, payload, self._index)

    # -- trust --------------------------------------------------------------------------

    def trust(self, source: str, how: str, keys: Iterable[str] | None = None) -> list[str]:
        """Trust ``source``: every record whose artifact came unsigned from it
        (``Record.unsigned_from == source``) and is not trusted yet keeps ``how`` (who
        trusted it, and by what) as its ``trusted``, and is served from then on. Returns
        the keys marked; the mark is never cleared and never travels (a bundle or a
        remote does not carry it). ``keys``: only those (else every record)."""
        self._access.check_writable(f"trust {source}")
        how = check_trust(how) or ""
        marked = []
        with self._index.transact():
            for key in list(self._index.keys() if keys is None else keys):
                small = self._index.get_small(key)
                if small is not None and small.get("unsigned_from") == source \
                        and small.get("trusted") is None:
                    small["trusted"] = how
                    self._index.set_small(key, small)
                    marked.append(key)
        return marked

    def trust_blobs(self, how: str, checksums: Mapping[str, str]) -> list[str]:
        """Trust the stored records of the keys in ``checksums`` whose payload checksum is
        the one given for the key (the bytes whoever trusts, ``how``, vouched for: what a
        bundle imported with --trust brought), whatever source they name: a record not
        trusted yet keeps ``how`` as its ``trusted``. A record that holds other bytes is
        left as it is. Returns the keys marked (see ``trust``)."""
        self._access.check_writable("trust what was brought")
        how = check_trust(how) or ""
        marked = []
        # One transaction: the checksum compared is the one of the record marked.
        with self._index.transact():
            for key, checksum in checksums.items():
                small = self._index.get_small(check_key(key))
                if small is not None and small.get("unsigned_from") is not None \
                        and small.get("trusted") is None and small.get("checksum") == checksum:
                    small["trusted"] = how
                    self._index.set_small(key, small)
                    marked.append(key)
        return marked

    # -- pins ---------------------------------------------------------------------------

    def pin(self, key: str) -> None:
        """Keep ``key`` (and everything its refs reach) from GC. UnknownKey if absent."""
        self._set_pinned(key, True)

    def unpin(self, key: str) -> None:
        """Let GC remove ``key`` again. UnknownKey if absent."""
        self._set_pinned(key, False)

    def _set_pinned(self, key: str, value: bool) -> None:
        self._access.check_writable(f"{'pin' if value else 'unpin'} {key}")
        check_key(key)
        with self._index.transact():
            small = self._index.get_small(key)
            if small is None:
                raise UnknownKey(key)
            small["pinned"] = value
            self._index.set_small(key, small)

    # -- locks --------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """The build lock of ``key``: one holder at a time across processes and threads.

        Use it for single-flight builds: take the lock, look again (another process may
        have just stored the key), build and put only on a miss. Waits at most
        ``timeout`` seconds (default: the store's ``lock_timeout``; negative waits
        forever) and then raises LockTimeout naming the key and the lock file. A thread
        that already holds the lock may take it again (nested use does not deadlock).
        """
        self._access.check_writable(f"lock {key} for a build")
        check_key(key)
        held: dict[str, int] = self._held.__dict__.setdefault("keys", {})
        if held.get(key):
            held[key] += 1
            try:
                yield
            finally:
                held[key] -= 1
            return
        wait = self.lock_timeout if timeout is None else timeout
        with build_lock(self._layout.build_lock(key), key, wait):
            held[key] = 1
            try:
                yield
            finally:
                del held[key]

    # -- maintenance --------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Counts and sizes of what is stored, and the activity counters (``StoreStats``)."""
        self.flush()
        stats = StoreStats(path=str(self.root))
        for record in self._index.records(manifest=False):
            stats.records += 1
            stats.bytes += record.size
            stats.pinned += record.pinned
            kind = stats.by_kind.setdefault(record.kind, KindTotals())
            kind.records += 1
            kind.bytes += record.size
        stats.by_kind = dict(sorted(stats.by_kind.items()))
        counters = self._index.counters()
        lookups = counters["hits"] + counters["misses"]
        stats.disk_bytes = sum(maintenance.disk_usage(self._layout).values())
        stats.hits, stats.misses = counters["hits"], counters["misses"]
        stats.hit_rate = counters["hits"] / lookups if lookups else None
        stats.quarantined, stats.puts = counters["quarantined"], counters["puts"]
        stats.builds, stats.build_seconds = counters["builds"], counters["build_ms"] / 1000
        stats.loads, stats.load_seconds = counters["loads"], counters["load_ms"] / 1000
        stats.traces, stats.warm_starts = counters["traces"], counters["warm_starts"]
        stats.l2_hits, stats.remote_rejected = counters["l2_hits"], counters["remote_rejected"]
        stats.tmp_files = maintenance.count_files(self._layout.tmp)
        stats.work = maintenance.work_usage(self.work_dir, self.work_dir_named)
        stats.quarantine_files = maintenance.count_files(self._layout.quarantine)
        stats.read_only = self.read_only
        return stats

    def gc(self, max_size: int | None = None, older_than: float | None = None,
           dry_run: bool = False) -> GCReport:
        """Evict least-recently-used records until the store is at most ``max_size``
        bytes on disk, and every record unused for ``older_than`` seconds.

        Pinned records and everything reachable from them through refs survive. Also
        removes leftovers of interrupted writes. With ``dry_run`` nothing is removed and
        the report says what would be.
        """
        self._access.check_writable("collect garbage")
        self.flush()
        report = maintenance.collect(self._layout, self._index, self.work_dir,
                                     max_size=max_size, older_than=older_than,
                                     dry_run=dry_run, now=self.clock.time(),
                                     work_named=self.work_dir_named)
        if not dry_run:
            self.ensure_reserve()  # given up on a full disk: back once there is room
        return report

    def verify(self, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Read and check every blob; report the damaged ones (and missing blobs).

        With ``repair`` damaged blobs are quarantined and their records dropped, so the
        next lookup misses and rebuilds, and so are the blobs no record points to (else
        only counted: ``VerifyReport.unrecorded``). Always removes the abandoned temp files
        of interrupted writes.
        """
        self.flush()
        return self._access.verify(self._index, self.check_blob_file,
                                   functools.partial(self.quarantine, quiet=True),
                                   repair=repair, progress=progress)

    # -- checking blobs, and quarantine ---------------------------------------------------

    def check_blob_file(self, key: str, small: dict[str, Any]) -> tuple[str | None, int | None]:
        """``(reason, inode)``: reason None if the blob of ``key`` verifies against ``small``."""
        try:
            fd = open_regular(self._layout.blob_str(key))
        except OddFile as e:
            return f"{e.what} where the blob should be", e.inode
        if fd is None:
            return "blob file is missing", None
        try:
            ino = os.fstat(fd).st_ino
            try:
                header, _ = read_blob_fd(fd, expected_key=key, signing_key=self._signing_key,
                                         require_signature=self.require_signature)
            except CorruptBlob as e:
                return e.reason, ino
            if header.checksum != small["checksum"] and not self._record_matches(key, header):
                return "checksum differs from the index record", ino
            if header.kind != small["kind"]:
                return f"kind {header.kind!r} differs from the index record", ino
        finally:
            os.close(fd)
        return None, ino

    def quarantine(self, key: str, inode: int | None, reason: str, quiet: bool = False) -> None:
        """Move the damaged blob of ``key`` to quarantine/ and drop its record.

        Only the blob that was found damaged (same inode) is moved, so a good blob that
        replaced it meanwhile is left alone. Failures (read-only disk) only warn: the
        caller treats the entry as a miss either way. ``quiet``: the caller reports it
        (``verify --repair`` lists what it quarantined), so no log line says it twice.
        Where the store is read-only nothing moves: the blob is a miss, said once.
        """
        if not self._access.damaged(key, reason, quiet=quiet):
            return
        blob_path = self._layout.blob(key)
        try:
            with flocked(self._layout.entry_lock(key)):
                if inode is None:  # nothing to move: the blob is missing
                    self._index.delete(key)
                    return
                try:
                    current = os.lstat(blob_path).st_ino
                except FileNotFoundError:
                    current = None
                if current != inode:
                    return
                # Record first, then file: a crash in between leaves an unrecorded blob
                # (litter that gc/verify remove), never a record pointing at nothing.
                with self._index.transact():
                    self._index.delete(key)
                    self._index.incr("quarantined", 1)
                move_to_quarantine(self._layout, blob_path, reason, self.clock.time())
                remove_stored_files(self._layout, key)
        except (OSError, *INDEX_ERRORS) as e:
            log.warning("cachebuild: could not quarantine blob %s: %s", key, e)


def _payload_at(path: Path, header: BlobHeader) -> bytes:
    """The payload of the blob file at ``path`` that ``header`` (verified) describes."""
    with open(path, "rb") as f:
        f.seek(header.header_size)
        return f.read(header.length)
