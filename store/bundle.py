"""Bundles: a store's entries in one file, to move a warmed cache into an image or onto
another machine.

A bundle is a tar archive (gzip-compressed when the file name ends in ``.gz``/``.tgz``)::

    cachebuild-bundle.json     {"format": "cachebuild-bundle", "version": 1, "entries": [...]}
    records/<key>.json         the entry's index record (kind, manifest, refs, pinned, ...;
                               refs are read again from the blob, a pin is kept only where
                               the importer trusts the bundle)
    objects/<key>              the entry's blob exactly as stored (header, payload, HMAC)
    ...                        (a record, then its blob, for every entry)

Blobs keep their own header and checksum (and signature), so an importer re-verifies
each one independently of the archive: nothing damaged is ever imported, and a damaged
entry does not stop the others.

A bundle is untrusted input, bounded in total as well as per member. Its members are
streamed, never read whole: a record member is refused past ``MAX_RECORD_BYTES``, records
waiting for their blobs may hold ``MAX_PENDING_RECORD_BYTES`` together, a bundle is read
up to ``MAX_MEMBERS`` members (the rest is refused unread), and a report keeps at most
``MAX_REPORTED`` refusals by name (and counts the rest). A blob is written to the store's
temp space as it is verified, refused as soon as it runs past the length its own header,
its record and its tar header declare. A record must be a well-formed record object. Into
a store with a signing key, unsigned blobs are refused unless the importer says otherwise
(``allow_unsigned``; ``cachebuild import --allow-unsigned``). Whatever a bundle's records
say, trust is the importer's: an unsigned blob is served only once its source is trusted
(``cachebuild import --trust``, ``cachebuild trust``), and its source is the bundle file
it was imported from (its name and a digest of its bytes), never a name its record gives.
A key the store already holds is compared with what the bundle brings: the same payload is
already present, other bytes are kept out where the store's copy was built here (two
builds of one target are seldom byte for byte alike), and refused otherwise,
unless they replace a copy that is not served by one that will be
(``LocalStore.write_blob_chunks``); ``--trust`` marks only records that
hold exactly the bytes this bundle brought. A key's blob appears once in a bundle; a
second copy is refused unread. Bundles are written 0600.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from cachebuild.errors import StoreError, UsageError, printable

from .blob import BlobHeader, CorruptBlob
from .interface import LocalTier
from .layout import check_key
from .maintenance import reachable
from .record import BadRecord, Record, loads_json

BUNDLE_FORMAT = "cachebuild-bundle"
BUNDLE_VERSION = 1
HEADER_NAME = "cachebuild-bundle.json"
_RECORD_RE = re.compile(r"records/([0-9a-f]{16,128})\.json")
_OBJECT_RE = re.compile(r"objects/([0-9a-f]{16,128})")
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)
#: A record or the bundle's header is never longer than this (manifests are kilobytes).
MAX_RECORD_BYTES = 4 * 1024 * 1024
#: Records read but not yet followed by their blobs hold at most this much together
#: (an export writes each blob right after its record).
MAX_PENDING_RECORD_BYTES = 32 * 1024 * 1024
#: A bundle is read up to this many members (a record and a blob per entry).
MAX_MEMBERS = 1 << 16
#: A report names at most this many refused members; it counts the others.
MAX_REPORTED = 1000
_CHUNK = 1 << 20

Progress = Callable[[int, int], None]


#: How a report names what could not be read past a damaged member of a bundle.
REST = "(rest of bundle)"


@dataclass
class ExportReport:
    """Entries written to a bundle, their payload bytes, and entries left out with why."""

    exported: list[str] = field(default_factory=list)
    bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ImportReport:
    """Entries imported (written by this import), entries already present (the store held
    exactly the bytes the bundle brought), and entries refused with the reason (the first
    ``MAX_REPORTED`` by name, the others counted in ``more_refused``). A key is imported
    or present at most once, so neither list is longer than the bundle's entries."""

    imported: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    #: Keys the store holds other bytes for, its copy built here: kept, as two builds of
    #: one target are seldom byte for byte alike.
    kept: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    more_refused: int = 0
    #: Why the import stopped before the bundle's end (the store could not take a blob:
    #: a full disk, say); what came before it is imported.
    stopped: str | None = None

    def refuse(self, name: str, why: str) -> None:
        """Count ``name`` as refused, with ``why`` (the unread rest of the bundle is
        always listed: it is said apart from the records)."""
        if len(self.refused) < MAX_REPORTED or name == REST:
            self.refused.append((name, why))
        else:
            self.more_refused += 1

    @property
    def refused_count(self) -> int:
        """How many records were refused (not the unread rest of a damaged bundle)."""
        return len(self.refused) + self.more_refused - self.rest_refused

    @property
    def rest_refused(self) -> bool:
        """Whether the rest of the bundle could not be read (damaged, truncated, too long)."""
        return any(name == REST for name, _ in self.refused)

    @property
    def ok(self) -> bool:
        return not self.refused and not self.more_refused and self.stopped is None


def _select(store: LocalTier, keys: Iterable[str] | None, kinds: Iterable[str] | None,
            with_refs: bool) -> list[Record]:
    records = {r.key: r for r in store.records()}
    if keys is None:
        chosen = list(records)
    else:
        wanted = [check_key(k) for k in keys]
        missing = [k for k in wanted if k not in records]
        if missing:
            raise UsageError(f"not in the store: {', '.join(missing)}")
        chosen = sorted(reachable(records, wanted)) if with_refs else wanted
    kind_set = set(kinds) if kinds else None
    if kind_set is not None and "entry" in kind_set:
        kind_set.add("guards")  # an entry's seal (``entry.guard_seal_key``) is part of it
    return [records[k] for k in chosen if kind_set is None or records[k].kind in kind_set]


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    info.mtime = int(mtime)
    tar.addfile(info, io.BytesIO(data))


def export_bundle(store: LocalTier, path: str | os.PathLike[str], *,
                  keys: Iterable[str] | None = None, kinds: Iterable[str] | None = None,
                  with_refs: bool = True, progress: Progress | None = None) -> ExportReport:
    """Write the selected entries of ``store`` to a bundle at ``path``.

    Selects every entry, or ``keys`` (plus everything their refs reach, unless
    ``with_refs`` is False), optionally only of ``kinds``. Each blob is verified as it is
    read; one that fails is left out and listed in ``skipped``. The bundle is written to
    a temporary name and renamed, so a failed export leaves no partial file.
    """
    target = Path(path)
    selected = _select(store, keys, kinds, with_refs)
    report = ExportReport()
    mode = "w:gz" if target.suffix in (".gz", ".tgz") else "w"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    now = time.time()
    try:
        # 0600 from the start: a bundle holds code that runs when it is loaded.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode=mode) as tar:
            header = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "created": now,
                      "entries": [r.key for r in selected]}
            _add(tar, HEADER_NAME, json.dumps(header).encode(), now)
            for done, record in enumerate(selected, 1):
                blob = store.read_blob(record.key)
                if blob is None:
                    report.skipped.append((record.key, "missing or damaged in the store"))
                else:
                    _add(tar, f"records/{record.key}.json",
                         json.dumps(record.to_json()).encode(), record.created)
                    _add(tar, f"objects/{record.key}", blob, record.created)
                    report.exported.append(record.key)
                    report.bytes += record.size
                if progress is not None:
                    progress(done, len(selected))
            tar.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, target)
    except OSError as e:
        raise StoreError(f"cannot write bundle {target}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return report


def _read_header(tar: tarfile.TarFile, path: Path) -> tuple[tarfile.TarInfo, dict[str, Any]]:
    not_bundle = f"{path} is not a cachebuild bundle"
    try:
        first = tar.next()
        if first is None or first.name != HEADER_NAME or not first.isfile():
            raise UsageError(f"{not_bundle} (no {HEADER_NAME} at its start)")
        if first.size > MAX_RECORD_BYTES:
            raise UsageError(f"{not_bundle} ({HEADER_NAME} is {first.size} bytes)")
        f = tar.extractfile(first)
        assert f is not None
        header = loads_json(f.read(MAX_RECORD_BYTES + 1))
    except _ARCHIVE_ERRORS + (ValueError, RecursionError) as e:
        raise UsageError(f"{not_bundle}: {e}") from None
    if not isinstance(header, dict) or header.get("format") != BUNDLE_FORMAT \
            or not isinstance(header.get("entries"), list):
        raise UsageError(f"{not_bundle} (bad {HEADER_NAME})")
    if header.get("version") != BUNDLE_VERSION:
        raise UsageError(f"{path}: unsupported bundle version {header.get('version')!r}")
    return first, header


def check_bundle(path: str | os.PathLike[str]) -> None:
    """Raise UsageError unless ``path`` starts as a bundle of this version does (its
    header), reading no more than that: an import refuses a file that is no bundle
    before it opens, or makes, the store it would import into."""
    src = Path(path)
    with _open_bundle(src) as f:
        try:
            with tarfile.open(fileobj=f, mode="r|*") as tar:
                _read_header(tar, Path(printable(src)))
        except _ARCHIVE_ERRORS as e:
            raise UsageError(f"{printable(src)} is not a cachebuild bundle (not a tar archive): "
                             f"{e}") from None


def _open_bundle(src: Path) -> BinaryIO:
    """The bundle file at ``src``, open to read; UsageError, saying why, where it cannot be."""
    try:
        return open(src, "rb")  # noqa: SIM115  # the caller closes it
    except FileNotFoundError:
        raise UsageError(f"no such bundle: {printable(src)}") from None
    except IsADirectoryError:
        raise UsageError(f"{printable(src)} is a folder, not a bundle: give a file "
                         "`cachebuild export` wrote") from None
    except OSError as e:
        raise UsageError(f"cannot read the bundle {printable(src)}: {e.strerror or e}") from None


def _read_record(tar: tarfile.TarFile, member: tarfile.TarInfo, key: str) -> Record | str:
    """The record in ``member``, checked; or why it cannot be used."""
    if not member.isfile():
        return "index record is not a regular file"
    if member.size > MAX_RECORD_BYTES:
        return f"index record is {member.size} bytes, more than a record can be"
    f = tar.extractfile(member)
    assert f is not None
    try:
        return Record.from_json(loads_json(f.read(MAX_RECORD_BYTES + 1)), key=key)
    except (ValueError, RecursionError) as e:
        return f"index record is not JSON: {e}"
    except BadRecord as e:
        return f"bad index record: {e}"


def _pieces(f: Any, size: int) -> Iterable[bytes]:
    """The member's bytes in pieces, never more than its tar header declares."""
    left = size
    while left > 0:
        piece = f.read(min(_CHUNK, left))
        if not piece:
            raise CorruptBlob(f"truncated in the bundle: {size - left} of {size} bytes")
        left -= len(piece)
        yield piece


def _import_entry(store: LocalTier, key: str, record: Record, f: Any, size: int,
                  report: ImportReport, allow_unsigned: bool, source: str,
                  trusted: str | None, brought: dict[str, str]) -> None:
    """Verify and store the blob of ``key`` streamed from ``f`` against the bundle's
    ``record``, and put the key in ``report``: imported (written), existing (the store held
    the same payload) or refused (damaged, not what its record says, or other bytes than
    the store holds and may keep). ``brought``: the payload checksum of every key this
    bundle's bytes are now stored for, for ``--trust`` to mark those and no others."""
    def accept(header: BlobHeader) -> None:
        if (header.kind, header.length, header.checksum) != (
                record.kind, record.size, record.checksum):
            raise CorruptBlob("blob does not match its index record", key)
        if size != header.total_size:
            raise CorruptBlob(f"bundle member is {size} bytes, its header says "
                              f"{header.total_size}", key)
        if store.signing_key is not None and not header.signed and not allow_unsigned:
            raise CorruptBlob("unsigned, and this store has a signing key: import with "
                              "--allow-unsigned if you trust the bundle", key)

    def origin(header: BlobHeader) -> str | None:
        # A blob our key did not verify came from this bundle file, whatever its record
        # claims: trust goes by source, and a name written inside a bundle would let it
        # borrow the trust of the bundle it names. A blob our key verified is trusted by
        # that signature, not by a name, so it keeps the provenance its record gives.
        if store.signing_key is not None and header.signed:
            return record.unsigned_from
        return source

    def trust_of(header: BlobHeader) -> str | None:
        # The importer's word (--trust), or the fleet key's signature on this very blob.
        if trusted is not None:
            return trusted
        return "signed with the fleet key" if store.signing_key is not None and header.signed \
            else None

    try:
        # Read and verified even when the key is stored: what the bundle brings is
        # compared with what is there, never assumed to be the same.
        # Its refs come from its verified payload; its pin only where the importer (or
        # the store's key) vouches for it: a bundle's records decide nothing GC keeps.
        done = store.write_blob_chunks(
            key, _pieces(f, size), manifest=record.manifest,
            pinned=lambda header: record.pinned and trust_of(header) is not None,
            accept=accept, unsigned_from=origin, trusted=trust_of)
    except CorruptBlob as e:
        if getattr(e, "stored_built_here", False):  # a ``BlobConflict`` with our own build
            report.kept.append(key)
        else:
            report.refuse(key, e.reason)
        return
    brought[key] = done.record.checksum
    (report.imported if done.written else report.existing).append(key)


def import_bundle(store: LocalTier, path: str | os.PathLike[str], *,
                  progress: Progress | None = None, allow_unsigned: bool = False,
                  trust: bool = False) -> ImportReport:
    """Import every entry of the bundle at ``path`` into ``store``, re-verifying each blob.

    An entry is refused (and listed with the reason) if its blob fails verification with
    this store's signing settings, disagrees with its record, lacks its record or blob,
    or, into a store with a signing key, is unsigned (unless ``allow_unsigned`` or
    ``trust``); the rest are imported. What comes in unsigned is marked with the bundle
    as its source (``Record.unsigned_from``) and is not served until that source is
    trusted: ``trust`` trusts it at once (``Record.trusted`` names this import), else
    ``LocalStore.trust`` does later; a store's own key's signature on a blob trusts it.
    The source is this bundle file (``bundle NAME (DIGEST)``: its name and a digest of
    its bytes, so two bundles of one name are two sources), never what its records say.
    Members are streamed (see the module doc), so a bundle that inflates to more than
    memory holds costs no more memory than a small one. A truncated bundle imports what
    came before the damage; a store that cannot take a blob (a full disk) stops the
    import there (``ImportReport.stopped`` says why), what came before it imported. A
    key already stored is compared with what the bundle brings:
    the same payload is counted as present; other bytes are refused (the stored copy
    stays) unless the stored copy is not served and the bundle's will be (``trust``, the
    store's key), which then replace it. ``trust`` marks only records holding the bytes
    this bundle brought. A key's blob is read once; a second copy is refused. Raises
    UsageError if ``path`` is not a bundle at all.
    """
    src = Path(path)
    bundle_file = _open_bundle(src)  # closed with the tar below
    source = bundle_source(src, bundle_file)
    try:
        tar = tarfile.open(fileobj=bundle_file, mode="r|*")
    except _ARCHIVE_ERRORS as e:
        bundle_file.close()
        raise UsageError(f"{src} is not a cachebuild bundle: {e}") from None
    report = ImportReport()
    how = f"cachebuild import --trust ({source})" if trust else None
    with bundle_file, tar:
        first, header = _read_header(tar, src)
        expected = header["entries"]
        records: dict[str, tuple[Record | str, int]] = {}
        pending = 0  # bytes of the record members in ``records``
        seen: set[str] = set()
        brought: dict[str, str] = {}  # key -> payload checksum of what this bundle stored
        current: str | None = None  # the blob being read, named if the archive breaks
        members = 0
        try:
            for member in tar:  # (iteration starts again with the header member)
                tar.members = []  # streamed: what was read is not kept
                name = member.name
                if member is first:
                    continue
                members += 1
                if members > MAX_MEMBERS:
                    report.refuse(REST, f"more than {MAX_MEMBERS} members: "
                                                      "the rest was not read")
                    break
                if m := _RECORD_RE.fullmatch(name):
                    key = m.group(1)
                    old = records.pop(key, None)
                    pending -= old[1] if old is not None else 0
                    size = max(member.size, 0)
                    if pending + size > MAX_PENDING_RECORD_BYTES:
                        report.refuse(key, "index records without their blobs would take "
                                           f"more than {MAX_PENDING_RECORD_BYTES >> 20} MiB")
                        continue
                    records[key] = (_read_record(tar, member, key), size)
                    pending += size
                elif m := _OBJECT_RE.fullmatch(name):
                    key = current = m.group(1)
                    if key in seen:
                        # An export writes each blob once: a second copy is not read, so a
                        # key is never counted twice nor stored from two different copies.
                        pending -= records.pop(key, (None, 0))[1]
                        report.refuse(key, "blob appears more than once in the bundle; "
                                           "only the first copy was read")
                        current = None
                        continue
                    seen.add(key)
                    f = tar.extractfile(member) if member.isfile() else None
                    record, size = records.pop(key, (None, 0))
                    pending -= size
                    if f is None:
                        report.refuse(key, "blob is not a regular file")
                    elif record is None:
                        report.refuse(key, "blob without an index record before it")
                    elif isinstance(record, str):
                        report.refuse(key, record)
                    else:
                        try:
                            _import_entry(store, key, record, f, member.size, report,
                                          allow_unsigned or trust, source, how, brought)
                        except StoreError as e:  # the store, not the bundle: stop here
                            if isinstance(e, CorruptBlob):
                                raise
                            report.stopped = str(e)
                            break
                    current = None
                    if progress is not None:
                        progress(len(seen), max(len(expected), len(seen)))
                else:
                    report.refuse(_printable(name), "unexpected member in bundle")
        except (*_ARCHIVE_ERRORS, CorruptBlob) as e:
            report.refuse(current or REST, f"bundle is damaged or truncated: {e}")
        if report.stopped is None:  # else the rest was not read: nothing is missing
            for key in records:
                seen.add(key)
                report.refuse(key, "index record without a blob")
            for key in expected[:MAX_MEMBERS]:
                if isinstance(key, str) and key not in seen:
                    report.refuse(_printable(key), "listed in the bundle but missing from it")
    _drop_stranded(store, report, seen | {k for k in expected if isinstance(k, str)})
    if how is not None:
        # What an earlier import brought in without --trust and this bundle brought again
        # byte for byte: trusted now. By content, not by source name: a record stored
        # from other bytes stays untrusted whatever bundle it says it came from.
        store.trust_blobs(how, {k: brought[k] for k in report.existing})
    return report


def _drop_stranded(store: LocalTier, report: ImportReport, offered: set[str]) -> None:
    """Take back what this import wrote for a record that refers to a record the bundle
    held (``offered``) but the store does not: an entry whose target was refused, damaged
    or truncated away. Kept, it would send a start, ``verify`` and ``export`` to a target
    that is not there. A ref the bundle never held (an export of entries alone, their
    targets served by a remote tier) is not this import's to judge. Repeated, as a record
    taken back may strand another; what the store held before the import is never
    touched."""
    while True:
        stranded = []
        for key in report.imported:
            record = store.get_record(key)
            missing = [r for r in (record.refs if record else ())
                       if r in offered and store.get_record(r) is None]
            if missing:
                stranded.append((key, missing))
        if not stranded:
            return
        for key, missing in stranded:
            store.delete(key)
            report.imported.remove(key)
            offered.add(key)
            report.refuse(key, f"refers to {len(missing)} record{'s' if len(missing) > 1 else ''}"
                               f" the bundle held but that was not stored ({missing[0][:12]}...): "
                               "not kept")


def bundle_source(path: str | os.PathLike[str], f: Any = None) -> str:
    """The source what comes unsigned from the bundle at ``path`` is marked with:
    ``bundle NAME (DIGEST)``, its file name and a digest of its bytes, so that two bundles
    of one name are two sources and trusting one never trusts the other. ``f``: the
    bundle already open, read whole and rewound (the bytes then imported are those).
    SHA-256, 16 hex digits shown: another bundle with the same name and digest as one the
    operator trusts cannot be made (a fast hash's 48 bits could be matched)."""
    h = hashlib.sha256()
    with contextlib.nullcontext(f) if f is not None else open(path, "rb") as bundle:
        while piece := bundle.read(_CHUNK):
            h.update(piece)
        bundle.seek(0)
    return f"bundle {_printable(Path(path).name)[:200]} ({h.hexdigest()[:16]})"


def _printable(name: str) -> str:
    """A member name as it may be printed: no control characters, bounded length."""
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in name[:200])
    return text + ("…" if len(name) > 200 else "")
