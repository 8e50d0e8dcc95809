"""Store maintenance: garbage collection, verification and clean-up of leftovers.

Everything here works on a store's layout and index, live: other processes may read,
write and build while it runs. Removals go through the same striped entry lock as puts
and deletes, and a reader whose blob disappears simply misses. What it promises:

- ``collect`` never removes a pinned record or anything a pinned record's refs reach, and
  never leaves an entry whose targets are gone (an entry goes first, then the targets
  only it referred to); with ``dry_run`` it removes nothing and says what would go;
- ``verify`` reads every blob and reports each damaged one; with ``repair`` it
  quarantines them (through the store's own ``quarantine``) and drops their records;
- both remove only what is abandoned: temp files nobody holds, private directories of
  processes that are gone, blobs no record points to.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .files import move_to_quarantine, remove_abandoned_scratch, remove_any, remove_stored_files
from .index import Index
from .layout import Layout, check_key, checked_real_dir
from .locking import flocked, remove_if_abandoned, try_flock
from .record import GCReport, Record, VerifyReport, WorkUsage

#: ``(reason, inode)`` of the blob of a key checked against its index row: reason None if
#: it verifies (the store's ``check_blob_file``).
BlobCheck = Callable[[str, dict[str, Any]], tuple[str | None, int | None]]
#: Moves the damaged blob of a key (that inode) to quarantine and drops its record, for a
#: reason (the store's ``quarantine``).
Quarantine = Callable[[str, int | None, str], None]

#: Quarantined blobs are kept this long for inspection, then GC removes them.
QUARANTINE_KEEP_S = 7 * 86400
#: Build lock files of keys no longer stored are removed after this long unused.
LOCK_FILE_KEEP_S = 86400


def _is_key(name: str) -> bool:
    try:
        check_key(name)
    except ValueError:
        return False
    return True


def _object_files(layout: Layout) -> Iterable[os.DirEntry[str]]:
    try:
        shards = list(os.scandir(layout.objects))
    except FileNotFoundError:
        return
    for shard in shards:
        if not shard.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(FileNotFoundError):
            yield from os.scandir(shard.path)


def disk_usage(layout: Layout) -> dict[str, int]:
    """Bytes on disk per key: its blob plus any files materialized from it."""
    usage: dict[str, int] = {}
    for entry in _object_files(layout):
        key = entry.name.split(".", 1)[0]
        if not _is_key(key):
            continue
        with contextlib.suppress(FileNotFoundError):
            usage[key] = usage.get(key, 0) + entry.stat(follow_symlinks=False).st_size
    return usage


#: The file a build holds shared (flock) in the work folder while it runs: ``gc`` empties
#: the folder only when it can hold it alone.
WORK_LOCK = ".builds"
#: What builds make in the work folder beside the lock: Inductor's and Triton's caches,
#: the compilers' temp files and kept C++ objects. Nothing else there is ours to count or
#: remove (the operator may have pointed ``CACHEBUILD_WORK_DIR`` at a folder of theirs).
WORK_FOLDERS = ("inductor", "triton", "tmp", "cxx")
#: The file every one of those folders holds once a build made (or used) it: in a work
#: folder the operator named, a folder of that name without it (their ``tmp/``) is not
#: ours, and is neither counted nor removed.
WORK_MARK = ".cachebuild-work"


def mark_work_folder(folder: Path) -> None:
    """Mark ``folder`` (one of ``WORK_FOLDERS``, made by a build) as the builds'."""
    fd = os.open(folder / WORK_MARK, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    os.close(fd)


def made_by_builds(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a folder a build marked as its own (``WORK_MARK``)."""
    try:
        return stat.S_ISREG(os.lstat(os.path.join(path, WORK_MARK)).st_mode)
    except OSError:
        return False


def build_folders(folder: str | os.PathLike[str], named: bool = False) -> list[str]:
    """The folders of a work folder that builds write (``WORK_FOLDERS``); in a folder the
    operator ``named``, only those that carry the builds' mark (the operator's own folder
    of such a name is not ours to count or empty)."""
    tops = [os.path.join(folder, entry) for entry in WORK_FOLDERS]
    return [top for top in tops if not named or made_by_builds(top)]


def work_usage(folder: Path, named: bool = False) -> WorkUsage:
    """A folder's files (the build work folder): its bytes and file count (0 if it is
    missing). In a folder the operator ``named``, only the folders builds marked."""
    size = files = 0
    for top in build_folders(folder, named):
        for dirpath, _, names in os.walk(top):
            for name in names:
                if name == WORK_MARK and dirpath == top:
                    continue  # the mark, not a build's file
                with contextlib.suppress(OSError):
                    size += os.lstat(os.path.join(dirpath, name)).st_size
                    files += 1
    return WorkUsage(str(folder), size, files)


def clean_work(folder: Path, dry_run: bool, named: bool = False) -> tuple[int, bool]:
    """Empty the build work folder of what builds made there (``WORK_FOLDERS``; in a
    folder the operator ``named``, only those that carry the builds' mark) unless a build
    holds it: ``(bytes, emptied)`` (with ``dry_run``, what would go). UnsafeStore if
    the folder is not checked like the store (ours, private, under directories no one
    else could rename)."""
    if not folder.is_dir():
        return 0, True
    # Checked like the store before anything in it is counted or removed: a work folder
    # set to someone else's directory is refused (UnsafeStore), never emptied.
    folder = checked_real_dir(folder, "work folder")
    size = work_usage(folder, named).bytes
    if size == 0:
        return 0, True
    lock = folder / WORK_LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
                     | (0 if dry_run else os.O_CREAT), 0o600)
    except FileNotFoundError:
        return size, True  # a dry run, and no build ever held it
    except OSError:
        return 0, False
    try:
        if not try_flock(fd):
            return 0, False  # a build is running: its files stay
        if not dry_run:
            # what builds made, nothing else (not an operator's own tmp/ there)
            for top in build_folders(folder, named):
                if os.path.lexists(top):
                    remove_any(top)
        return size, True
    finally:
        os.close(fd)


def count_files(directory: Path) -> int:
    """How many entries ``directory`` holds (0 if it is missing)."""
    try:
        return sum(1 for _ in os.scandir(directory))
    except FileNotFoundError:
        return 0


def clean_leftovers(layout: Layout, index: Index, *, orphans: bool = True) -> tuple[int, int]:
    """Remove abandoned temp files and private directories of processes that are gone;
    with ``orphans``, move the blobs no record points to into quarantine/ (kept
    ``QUARANTINE_KEEP_S``), and remove the files materialized from them. Else those are
    only counted.

    A temp file is abandoned when no process holds its flock (its writer died); a blob
    without a record is what a writer killed between rename and index write leaves, or
    every blob of a store whose index was lost: so it is never deleted outright. Both are
    checked under the lock their writer would hold, so nothing in progress is touched.
    Returns ``(temp files removed, unrecorded blobs quarantined, or found)``.
    """
    tmp_removed = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(layout.tmp):
            if entry.name.endswith(".tmp") and remove_if_abandoned(Path(entry.path)):
                tmp_removed += 1
    tmp_removed += remove_abandoned_scratch(layout.scratch)
    if not orphans:
        return tmp_removed, count_unrecorded(layout, index)
    found = 0
    known = set(index.keys())
    for entry in list(_object_files(layout)):
        key = entry.name.split(".", 1)[0]
        if key in known or not _is_key(key):
            continue
        with flocked(layout.entry_lock(key)):
            if key in index:  # stored meanwhile
                continue
            if entry.name != key:  # made from a blob: made again from it if it comes back
                remove_any(entry.path)
            elif os.path.lexists(entry.path):
                move_to_quarantine(layout, Path(entry.path), "no record points to it",
                                   time.time())
                found += 1
    return tmp_removed, found


def count_unrecorded(layout: Layout, index: Index) -> int:
    """How many blobs no record of ``index`` points to (what ``clean_leftovers`` would
    quarantine), touching nothing."""
    known = set(index.keys())
    return sum(1 for entry in _object_files(layout)
               if entry.name not in known and _is_key(entry.name))


def _clean_old_files(layout: Layout, now: float) -> int:
    """Remove quarantined blobs past their keeping time; return how many."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(layout.quarantine):
            with contextlib.suppress(FileNotFoundError):
                if _quarantined_at(entry) < now - QUARANTINE_KEEP_S:
                    os.unlink(entry.path)
                    removed += 1
    return removed


def _quarantined_at(entry: os.DirEntry[str]) -> float:
    """When ``entry`` went into quarantine: its change time, which the move into
    quarantine/ sets (its modification time is the blob's own: a blob written ten days ago
    and quarantined now would go at once)."""
    return entry.stat(follow_symlinks=False).st_ctime


def _clean_lock_files(layout: Layout, index: Index, now: float) -> None:
    """Remove long-unused build lock files of keys that are no longer stored.

    Only files nobody holds are removed. A process that opened the file in the instant
    before removal could end up holding a lock on an unlinked file alongside a newcomer;
    the worst outcome is one duplicate build (puts are idempotent), and the age limit
    makes it rare.
    """
    with contextlib.suppress(FileNotFoundError):
        shards = [s for s in os.scandir(layout.locks) if len(s.name) == 2]
        for shard in shards:
            for entry in os.scandir(shard.path):
                key = entry.name.removesuffix(".lock")
                if not _is_key(key) or key in index:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if entry.stat().st_mtime > now - LOCK_FILE_KEEP_S:
                        continue
                    fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        if try_flock(fd):
                            os.unlink(entry.path)
                    finally:
                        os.close(fd)


def reachable(records: dict[str, Record], roots: Iterable[str]) -> set[str]:
    """Every key reachable from ``roots`` through refs (roots included)."""
    seen: set[str] = set()
    stack = [k for k in roots if k in records]
    while stack:
        key = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        stack.extend(r for r in records[key].refs if r in records and r not in seen)
    return seen


def eviction_heads(records: dict[str, Record], protected: set[str]) -> list[Record]:
    """The records GC may choose to evict, least recently used first: every record that
    refers to others (a model entry), and every record nothing refers to. A target some
    entry refers to is never chosen by itself; it goes with the last entry that refers to
    it (``unit_of``). Pinned records and what they reach (``protected``) are never chosen.
    """
    referred = referrers_of(records)
    # Least recently used first; ties broken by age, then key, so runs are repeatable.
    return sorted((r for k, r in records.items()
                   if k not in protected and (r.refs or k not in referred)),
                  key=lambda r: (r.last_used, r.created, r.key))


def referrers_of(records: dict[str, Record]) -> dict[str, set[str]]:
    """For each key of ``records``, the keys of the records that refer to it (a key
    referred to that is not stored, a target an imported entry names, is not one: GC
    would count it as removed)."""
    out: dict[str, set[str]] = {}
    for key, record in records.items():
        for ref in record.refs:
            if ref != key and ref in records:
                out.setdefault(ref, set()).add(key)
    return out


def unit_of(head: Record, referrers: dict[str, set[str]], protected: set[str],
            evicted: set[str]) -> list[str]:
    """What goes when ``head`` is evicted after ``evicted``: ``head`` first, then each
    record it refers to that no record left in the store still refers to."""
    unit = [head.key]
    gone = evicted | {head.key}
    for ref in head.refs:
        if ref in referrers and ref not in gone and ref not in protected \
                and referrers[ref] <= gone:
            unit.append(ref)
            gone.add(ref)
    return unit


def evict_unpinned(layout: Layout, index: Index, key: str) -> bool | None:
    """Delete ``key`` for GC unless it was pinned since GC planned: True if deleted, False
    if pinned, None if it was gone already (another process removed it meanwhile)."""
    with flocked(layout.entry_lock(key)):
        small = index.get_small(key)
        if small is not None and small["pinned"]:
            return False
        had_record = index.delete(key)
        had_blob = remove_stored_files(layout, key)
    return True if had_record or had_blob else None


def collect(layout: Layout, index: Index, work_dir: Path, *, max_size: int | None,
            older_than: float | None, dry_run: bool, now: float,
            work_named: bool = False) -> GCReport:
    """The work of ``LocalStore.gc`` (see there), with records aged at time ``now`` (the
    store's clock); the caller writes its pending usage first."""
    if max_size is not None and max_size < 0:
        raise ValueError("max_size must be >= 0")
    if older_than is not None and older_than < 0:
        raise ValueError("older_than must be >= 0")
    report = GCReport(dry_run=dry_run)
    if not dry_run:
        report.tmp_removed, report.orphans_removed = clean_leftovers(layout, index)
        # Files are aged by their modification times, which the kernel's clock sets.
        report.quarantine_removed = _clean_old_files(layout, time.time())
        _clean_lock_files(layout, index, time.time())
    else:  # what a run would quarantine
        report.orphans_removed = count_unrecorded(layout, index)
    report.work_bytes, emptied = clean_work(work_dir, dry_run, work_named)
    report.work_busy = not emptied
    records = {r.key: r for r in index.records(manifest=False)}
    usage = disk_usage(layout)
    protected = reachable(records, [k for k, r in records.items() if r.pinned])
    total = sum(usage.get(k, 0) for k in records)
    report.bytes_before, report.records_before = total, len(records)
    report.kept_pinned = len(protected)
    cutoff = now - older_than if older_than is not None else None
    remaining = total
    evicted: set[str] = set()
    referrers = referrers_of(records)
    for head in eviction_heads(records, protected):
        old = cutoff is not None and head.last_used < cutoff
        if not old and (max_size is None or remaining <= max_size):
            continue
        removed, vanished = [], []
        for key in unit_of(head, referrers, protected, evicted):
            # The entry first: no moment leaves a stored entry without its targets.
            done = True if dry_run else evict_unpinned(layout, index, key)
            if done is False:
                break  # pinned while we planned: it keeps the rest of its unit
            (removed if done else vanished).append(key)  # or removed by another process
        evicted.update(removed + vanished)
        report.units.append(removed)
        report.removed += removed
        freed = sum(usage.get(k, 0) for k in removed)
        report.freed_bytes += freed
        report.vanished += len(vanished)
        remaining -= freed + sum(usage.get(k, 0) for k in vanished)
    report.over_cap = max_size is not None and remaining > max_size
    report.bytes_after = remaining
    report.records_after = len(records) - len(report.removed) - report.vanished
    return report


def verify(layout: Layout, index: Index, check: BlobCheck, quarantine: Quarantine, *,
           repair: bool, progress: Callable[[int, int], None] | None) -> VerifyReport:
    """The work of ``LocalStore.verify`` (see there): ``check_all``, then the abandoned
    temp files of interrupted writes removed, and the blobs no record points to counted
    (with ``repair``, quarantined); the caller writes its pending usage first."""
    report = check_all(index, check, quarantine, repair=repair, progress=progress)
    report.tmp_removed, unrecorded = clean_leftovers(layout, index, orphans=repair)
    if repair:
        report.orphans_removed = unrecorded
    else:
        report.unrecorded = unrecorded
    return report


def check_all(index: Index, check: BlobCheck, quarantine: Quarantine, *,
              repair: bool, progress: Callable[[int, int], None] | None) -> VerifyReport:
    """``check`` every blob ``index`` records; with ``repair`` drop damaged index records
    and ``quarantine`` damaged blobs, else change nothing (a read-only store's verify)."""
    report = VerifyReport()
    keys = list(index.keys())
    for done, key in enumerate(keys, 1):
        small, damage = index.read_small(key)
        if damage is not None:
            report.checked += 1
            report.damaged.append((key, damage))
            if repair:
                index.delete(key)  # its blob, now unrecorded, goes as litter below
        if small is not None:  # else deleted since we listed it
            report.checked += 1
            reason, inode = check(key, small)
            if reason is None:
                report.ok += 1
                if small["unsigned_from"] is not None:
                    report.unsigned.append((key, small["unsigned_from"]))
                    if small.get("trusted") is None:
                        report.untrusted.append((key, small["unsigned_from"]))
            else:
                report.damaged.append((key, reason))
                if repair:
                    quarantine(key, inode, reason)
        if progress is not None:
            progress(done, len(keys))
    report.repaired = repair and bool(report.damaged)
    return report
