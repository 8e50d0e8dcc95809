"""LocalStore in one process: API, integrity, GC, permissions, full and read-only disks."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from trust import share_with_a_group

from cachebuild.keys import make_key
from cachebuild.store import (
    CorruptBlob,
    InvalidKey,
    KindTotals,
    LocalStore,
    LockTimeout,
    Record,
    StoreError,
    UnknownKey,
    encode_blob,
    others_can_write,
)


def key(i: int | str) -> str:
    return make_key({"test": i})


def blob_path(store: LocalStore, k: str):
    return store.root / "objects" / k[:2] / k


# -- basic API ------------------------------------------------------------------------


def test_layout_and_permissions(open_local, store_dir):
    store = open_local(store_dir)
    assert store.root == store_dir / "v1"
    for name in ("index", "objects", "locks", "quarantine", "tmp"):
        assert (store.root / name).is_dir()
    for path in (store_dir, store.root, store.root / "objects"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_default_path_from_env(tmp_path, monkeypatch):
    from cachebuild.store import StoreOptions, open_store

    monkeypatch.setenv("CACHEBUILD_DIR", str(tmp_path / "from-env"))
    assert open_store().root == tmp_path / "from-env" / "v1"
    monkeypatch.delenv("CACHEBUILD_DIR")
    assert StoreOptions.from_env().cache_dir == Path("~/.cache/cachebuild").expanduser()


def test_put_get_record(store, clock):
    k, ref = key(1), key(2)
    record = store.put(k, b"payload", kind="target", manifest={"graph": [1, 2]}, refs=[ref])
    assert isinstance(record, Record)
    assert (record.key, record.kind, record.size, record.pinned, record.refs) == (
        k, "target", 7, False, (ref,))
    assert record.manifest == {"graph": [1, 2]}
    assert record.created == record.last_used == clock.time()  # the store's clock
    clock.advance(5)
    assert store.get(k) == b"payload"
    assert store.contains(k) and k in store
    got = store.get_record(k)
    assert got.hits == 1 and got.last_used == record.last_used + 5
    assert got.manifest == {"graph": [1, 2]}
    assert store.get(key(3)) is None and not store.contains(key(3))
    assert store.get_record(key(3)) is None


def test_put_is_immutable(open_local, store_dir):
    store = open_local(store_dir)
    first = store.put(key(1), b"first", kind="target")
    again = store.put(key(1), b"something else", kind="other")
    assert again.checksum == first.checksum and again.kind == "target"
    assert store.get(key(1)) == b"first"


def test_put_accepts_memoryview_and_bytearray(open_local, store_dir):
    store = open_local(store_dir)
    store.put(key(1), memoryview(b"abcdef")[1:4], kind="k")
    store.put(key(2), bytearray(b"xyz"), kind="k")
    assert store.get(key(1)) == b"bcd" and store.get(key(2)) == b"xyz"


def test_bad_keys_are_refused(open_local, store_dir):
    store = open_local(store_dir)
    for bad in ("../../etc/passwd", "ABCDEF0123456789ABCDEF0123456789", "abc", ""):
        with pytest.raises(InvalidKey):
            store.put(bad, b"x", kind="k")
        with pytest.raises(InvalidKey):
            store.get(bad)
    with pytest.raises(InvalidKey):
        store.put(key(1), b"x", kind="k", refs=["not a key"])


def test_delete(open_local, store_dir):
    store = open_local(store_dir)
    store.put(key(1), b"x", kind="k")
    store.materialize(key(1), ".so")
    assert store.delete(key(1)) is True
    assert store.get(key(1)) is None and not store.contains(key(1))
    assert list((store.root / "objects" / key(1)[:2]).iterdir()) == []
    assert store.delete(key(1)) is False


def test_pin_unpin(open_local, store_dir):
    store = open_local(store_dir)
    store.put(key(1), b"x", kind="k")
    store.pin(key(1))
    assert store.get_record(key(1)).pinned
    store.unpin(key(1))
    assert not store.get_record(key(1)).pinned
    with pytest.raises(UnknownKey, match=f"no record with key {key(9)}") as info:
        store.pin(key(9))
    assert isinstance(info.value, KeyError) and isinstance(info.value, StoreError)
    with pytest.raises(UnknownKey):
        store.unpin(key(9))


def test_entries_and_stats(open_local, store_dir):
    store = open_local(store_dir)
    store.put(key(1), b"a" * 100, kind="target", manifest={"m": 1})
    store.put(key(2), b"b" * 50, kind="entry", refs=[key(1)])
    store.pin(key(2))
    store.get(key(1))
    store.get(key(1))
    store.get(key(3))
    assert {r.key for r in store.records()} == {key(1), key(2)}
    assert [r.key for r in store.records(kind="entry")] == [key(2)]
    assert next(store.records(kind="target")).manifest == {"m": 1}
    stats = store.stats()
    assert stats.records == 2 and stats.bytes == 150 and stats.pinned == 1
    assert stats.hits == 2 and stats.misses == 1 and stats.hit_rate == pytest.approx(2 / 3)
    assert stats.by_kind == {"entry": KindTotals(records=1, bytes=50),
                             "target": KindTotals(records=1, bytes=100)}
    assert stats.disk_bytes > 150 and stats.puts == 2 and stats.quarantined == 0


def test_usage_is_shared_with_other_store_objects(open_local, store_dir):
    a = open_local(store_dir)
    a.put(key(1), b"x", kind="k")
    for _ in range(3):
        a.get(key(1))
    a.close()
    assert open_local(store_dir).get_record(key(1)).hits == 3


def test_materialize(open_local, store_dir):
    store = open_local(store_dir)
    payload = os.urandom(3 << 20)
    store.put(key(1), payload, kind="aoti")
    path = store.materialize(key(1), ".so")
    assert path == blob_path(store, key(1)).with_name(key(1) + ".so")
    assert path.read_bytes() == payload
    assert stat.S_IMODE(path.stat().st_mode) == 0o500
    inode = path.stat().st_ino
    # reused by a later store object (another process would do the same)
    assert open_local(store_dir).materialize(key(1), ".so").stat().st_ino == inode
    # a damaged file is replaced, never returned
    os.chmod(path, 0o700)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\0\0\0\0")
    again = store.materialize(key(1), ".so")
    assert again.read_bytes() == payload and again.stat().st_ino != inode
    assert store.materialize(key(2), ".so") is None
    with pytest.raises(ValueError):
        store.materialize(key(1), "/../x")


def test_read_and_write_blob(open_local, store_dir, tmp_path):
    src = open_local(store_dir, signing_key=b"k")
    src.put(key(1), b"payload", kind="target", manifest={"a": 1})
    framed = src.read_blob(key(1))
    dst = open_local(tmp_path / "other", signing_key=b"k", require_signature=True)
    record = dst.write_blob(key(1), framed, manifest={"a": 1}, refs=[key(2)])
    assert (record.kind, record.size, record.refs) == ("target", 7, (key(2),))
    assert dst.get(key(1)) == b"payload"
    assert dst.read_blob(key(1)) == framed  # stored byte for byte
    with pytest.raises(CorruptBlob):
        dst.write_blob(key(3), framed)  # blob of another key
    with pytest.raises(CorruptBlob, match="unsigned"):
        dst.write_blob(key(4), encode_blob(key(4), "k", b"x"))
    assert src.read_blob(key(9)) is None


# -- integrity ------------------------------------------------------------------------


def _flip_byte(path, offset=-5):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path, keep=-100):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _damaged_store(store: LocalStore) -> tuple[LocalStore, str, str, str]:
    good, flipped, truncated = key("good"), key("flipped"), key("truncated")
    for k in (good, flipped, truncated):
        store.put(k, os.urandom(300_000), kind="target")
    _flip_byte(blob_path(store, flipped))
    _truncate(blob_path(store, truncated))
    return store, good, flipped, truncated


def test_get_detects_and_quarantines_damage(store):
    store, good, flipped, truncated = _damaged_store(store)
    assert store.get(good) is not None
    assert store.get(flipped) is None
    assert store.get(truncated) is None
    # gone from the index and moved to quarantine; never returned again
    assert store.get_record(flipped) is None and store.get_record(truncated) is None
    assert store.get(flipped) is None
    names = sorted(p.name for p in (store.root / "quarantine").iterdir())
    assert len(names) == 2
    assert any(n.startswith(flipped) and "checksum" in n for n in names)
    assert any(n.startswith(truncated) and "truncated" in n for n in names)
    stats = store.stats()
    assert stats.quarantined == 2 and stats.records == 1
    # the key can be built and stored again
    store.put(flipped, b"rebuilt", kind="target")
    assert store.get(flipped) == b"rebuilt"


def test_verify_detects_and_repairs_damage(store):
    store, good, flipped, truncated = _damaged_store(store)
    report = store.verify()
    assert report.checked == 3 and report.ok == 1 and not report.clean
    reasons = dict(report.damaged)
    assert reasons[flipped] == "payload checksum mismatch"
    assert reasons[truncated].startswith("truncated")
    assert not report.repaired
    # verify alone changes nothing (contains() would read, and quarantine, the blob)
    assert store.get_record(flipped) is not None and store.index.get_small(flipped)
    report = store.verify(repair=True)
    assert report.repaired and len(report.damaged) == 2
    assert store.get(flipped) is None and store.get(truncated) is None
    assert len(list((store.root / "quarantine").iterdir())) == 2
    assert store.verify().clean
    assert store.get(good) is not None


def test_missing_blob_is_a_miss_and_damage(open_local, store_dir):
    store = open_local(store_dir)
    store.put(key(1), b"x", kind="k")
    os.unlink(blob_path(store, key(1)))
    assert store.get(key(1)) is None
    assert not store.contains(key(1))
    report = store.verify(repair=True)
    assert report.damaged == [(key(1), "blob file is missing")]
    assert store.get_record(key(1)) is None


def test_blob_swapped_for_another_valid_blob_is_caught(open_local, store_dir):
    store = open_local(store_dir)
    store.put(key(1), b"original", kind="k")
    blob_path(store, key(1)).write_bytes(encode_blob(key(1), "k", b"substitute"))
    assert store.get(key(1)) is None
    assert store.stats().quarantined == 1


def test_signed_store_rejects_unsigned_and_tampered_blobs(open_local, store_dir):
    open_local(store_dir).put(key(1), b"unsigned", kind="k")
    signed = open_local(store_dir, signing_key=b"secret", require_signature=True)
    signed.put(key(2), b"signed", kind="k")
    assert signed.get(key(2)) == b"signed"
    assert signed.get(key(1)) is None  # unsigned: quarantined
    # rewritten with valid checksums by someone who does not know the signing key
    blob_path(signed, key(2)).write_bytes(encode_blob(key(2), "k", b"evil", b"guess"))
    assert signed.get(key(2)) is None
    assert signed.stats().quarantined == 2
    with pytest.raises(StoreError, match="signing key"):
        open_local(store_dir, require_signature=True)


# -- GC -------------------------------------------------------------------------------


def _lru_store(store: LocalStore, clock) -> tuple[LocalStore, list[str], int]:
    """Ten 10 kB entries used in order 0..9 (0 least recently used)."""
    keys = [key(f"lru{i}") for i in range(10)]
    for k in keys:
        store.put(k, os.urandom(10_000), kind="target")
    for k in keys:
        clock.advance(1)
        assert store.get(k) is not None
    return store, keys, os.path.getsize(blob_path(store, keys[0]))


def test_gc_max_size_evicts_least_recently_used_first(store, clock):
    store, keys, per_entry = _lru_store(store, clock)
    report = store.gc(max_size=4 * per_entry + 10)
    assert set(report.removed) == set(keys[:6])
    assert report.removed == keys[:6]  # in LRU order
    assert report.bytes_after <= 4 * per_entry + 10
    assert store.stats().disk_bytes <= 4 * per_entry + 10
    assert {r.key for r in store.records()} == set(keys[6:])


def test_gc_keeps_pins_and_what_they_refer_to(store, clock):
    store, keys, per_entry = _lru_store(store, clock)
    # an entry (least recently used of all) that refers to two old targets, pinned
    root = key("model-entry")
    store.put(root, b"entry", kind="entry", refs=[keys[0], keys[1]])
    store.put(key("leaf"), b"leaf", kind="target")
    with store.index.transact():  # make the entry the oldest of all
        small = store.index.get_small(root)
        small["last_used"] = 0.0
        store.index.set_small(root, small)
    store.pin(root)
    store.pin(keys[2])
    report = store.gc(max_size=0)
    survivors = {r.key for r in store.records()}
    assert survivors == {root, keys[0], keys[1], keys[2]}
    assert report.kept_pinned == 4 and report.over_cap
    store.unpin(root)
    store.gc(max_size=0)
    assert {r.key for r in store.records()} == {keys[2]}


def test_gc_refs_are_followed_transitively(open_local, store_dir):
    store = open_local(store_dir)
    a, b, c, d = key("a"), key("b"), key("c"), key("d")
    store.put(c, b"c", kind="target")
    store.put(b, b"b", kind="entry", refs=[c])
    store.put(a, b"a", kind="entry", refs=[b, key("absent")])
    store.put(d, b"d", kind="target")
    store.pin(a)
    store.gc(max_size=0)
    assert {r.key for r in store.records()} == {a, b, c}


def test_gc_counts_only_stored_records_where_an_entry_names_absent_targets(open_local,
                                                                           store_dir):
    """An entry whose targets are not stored (imported alone, or a target another process
    removed): GC's dry run says what would go and the run removes it, both counting stored
    records only (the absent targets were counted as removed, and the store was left with
    "-2 records")."""
    store = open_local(store_dir)
    entry, guards = key("entry"), key("guards")
    store.put(guards, b"g", kind="guards")
    store.put(entry, b"e", kind="entry", refs=[guards, key("absent1"), key("absent2")])
    dry = store.gc(max_size=0, dry_run=True)
    assert sorted(dry.removed) == sorted([entry, guards]) and dry.records_after == 0
    report = store.gc(max_size=0)
    assert sorted(report.removed) == sorted([entry, guards]) and report.vanished == 0
    assert report.records_after == 0 and not list(store.records())


def test_gc_older_than_and_dry_run(store, clock):
    store.put(key("old"), b"x" * 100, kind="k")
    clock.advance(0.3)
    store.put(key("new"), b"y" * 100, kind="k")
    dry = store.gc(older_than=0.2, dry_run=True)
    assert dry.dry_run and dry.removed == [key("old")] and dry.freed_bytes > 100
    assert store.contains(key("old"))
    report = store.gc(older_than=0.2)
    assert report.removed == [key("old")]
    assert not store.contains(key("old")) and store.contains(key("new"))
    with pytest.raises(ValueError):
        store.gc(max_size=-1)


def test_gc_and_verify_clean_leftovers(open_local, store_dir):
    store = open_local(store_dir)
    store.put(key(1), b"kept", kind="k")
    tmp = store.root / "tmp"
    abandoned = tmp / f"{key(2)}.99999.dead.tmp"
    abandoned.write_bytes(b"partial")
    in_progress = tmp / f"{key(3)}.{os.getpid()}.live.tmp"
    in_progress.write_bytes(b"being written")
    fd = os.open(in_progress, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a live writer holds
    orphan = blob_path(store, key(4))
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(encode_blob(key(4), "k", b"renamed, never recorded"))
    try:
        # A dry run counts the blob it would quarantine and touches nothing.
        dry = store.gc(dry_run=True)
        assert (dry.tmp_removed, dry.orphans_removed) == (0, 1)
        assert abandoned.exists() and orphan.exists()
        report = store.gc()
        assert (report.tmp_removed, report.orphans_removed) == (1, 1)
        assert not abandoned.exists() and not orphan.exists()
        # Never deleted outright: a blob without a record may be all a lost index left.
        assert [p.name.split(".")[0] for p in (store.root / "quarantine").iterdir()] == [key(4)]
        assert in_progress.exists()
    finally:
        os.close(fd)
    report = store.verify()
    assert report.clean and report.tmp_removed == 1
    assert list(tmp.iterdir()) == []
    assert store.get(key(1)) == b"kept"


def test_a_lost_index_loses_no_blob(open_local, store_dir):
    """A store whose index is gone (removed, or moved aside as damaged) holds blobs no
    record points to: a plain verify only counts them; gc and verify --repair move them
    into quarantine, never delete them."""
    import shutil

    store = open_local(store_dir)
    for i in range(3):
        store.put(key(i), b"blob %d" % i, kind="k")
    blobs = sorted(blob_path(store, key(i)).read_bytes() for i in range(3))
    store.close()
    shutil.rmtree(store_dir / "v1" / "index")
    store = open_local(store_dir)
    report = store.verify()
    assert (report.unrecorded, report.orphans_removed) == (3, 0)
    assert sorted(blob_path(store, key(i)).read_bytes() for i in range(3)) == blobs
    report = store.verify(repair=True)
    assert report.orphans_removed == 3
    kept = sorted(p.read_bytes() for p in (store.root / "quarantine").iterdir())
    assert kept == blobs


# -- permissions ----------------------------------------------------------------------


@pytest.mark.parametrize("mode, who", [(0o777, "group and others"), (0o720, "group"),
                                       (0o702, "others")])
def test_writable_by_others_is_refused(open_local, tmp_path, mode, who):
    d = tmp_path / "shared"
    d.mkdir()
    share_with_a_group(d, mode)
    with pytest.raises(StoreError) as info:
        open_local(d)
    msg = str(info.value)
    assert f"writable by {who}" in msg and "code that runs" in msg and f"chmod 700 {d}" in msg


def test_nothing_is_made_under_a_folder_others_may_write(tmp_path):
    """A store asked for under a folder anyone may write (not sticky) is refused before
    anything is made there: no empty folder left behind for another user to take."""
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)
    with pytest.raises(StoreError, match="writable by others"):
        LocalStore(open_folder / "deep" / "store")
    assert list(open_folder.iterdir()) == []


def test_a_fan_out_folder_made_writable_is_refused(open_local, store_dir):
    """``objects/ab/`` holds blobs too: whoever may write it could replace them."""
    store = open_local(store_dir)
    store.put(key(1), b"payload", kind="target")
    store.close()
    fan_out = blob_path(store, key(1)).parent
    os.chmod(fan_out, 0o777)
    with pytest.raises(StoreError, match=f"objects folder {fan_out}: it is writable"):
        open_local(store_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_blob_owned_by_another_user_is_never_read(open_local, store_dir):
    """Its owner could rewrite it in place: treated as damage (a miss), not loaded."""
    store = open_local(store_dir)
    store.put(key(2), b"payload", kind="target")
    os.chown(blob_path(store, key(2)), 65534, 65534)
    assert store.get(key(2)) is None
    assert not blob_path(store, key(2)).exists()  # quarantined, with its record dropped


def test_a_blob_others_may_write_is_never_read(open_local, store_dir):
    """Folders opened to readers (``chmod -R a+rX``, as a store served to another user is)
    let anyone reach a blob a careless ``chmod`` made writable: they could rewrite it in
    place, checksum included. Treated as damage (a miss), never loaded; ``verify`` says so."""
    store = open_local(store_dir)
    store.put(key(3), b"payload", kind="target")
    store.put(key(4), b"payload", kind="target")
    os.chmod(blob_path(store, key(3)), 0o666)
    assert store.get(key(3)) is None and store.get(key(4)) == b"payload"
    assert not blob_path(store, key(3)).exists()  # quarantined, with its record dropped


def give_write_by_acl(path, uid: int = 65534) -> None:
    """An access ACL letting user ``uid`` write ``path`` (``setfacl -m u:UID:rw``); the
    test is skipped where the file system keeps no ACLs."""
    import struct

    entries = [(0x01, 6, 0xFFFFFFFF), (0x02, 6, uid), (0x04, 4, 0xFFFFFFFF),
               (0x10, 6, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)]
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(path, "system.posix_acl_access", raw)
    except OSError as e:
        pytest.skip(f"no ACLs here: {e.strerror}")


def test_a_blob_or_index_another_user_may_write_by_an_acl_is_refused(open_local, store_dir):
    """The mode's group bits are an ACL's mask: a named user's write is found in the ACL
    itself (the owner's own group looked private, so the mode alone passed it)."""
    store = open_local(store_dir)
    store.put(key(6), b"payload", kind="target")
    give_write_by_acl(blob_path(store, key(6)))
    assert store.get(key(6)) is None and not blob_path(store, key(6)).exists()
    store.close()
    index_file = store_dir / "v1" / "index" / "cache.db"
    give_write_by_acl(index_file)
    with pytest.raises(StoreError, match="others may write it"):
        open_local(store_dir)


@pytest.mark.parametrize("name", ["cache.db", "cache.db-wal"])
def test_an_index_file_others_may_write_is_refused(open_local, store_dir, name):
    """Whoever may write the index may point a record at a blob of theirs: the store is
    refused in one line that says how to close it, read-only too; made private, it opens
    with every record. The index is made private whatever the umask."""
    store = open_local(store_dir)
    store.put(key(5), b"payload", kind="target")
    store.close()
    index_file = store_dir / "v1" / "index" / name
    assert stat.S_IMODE(os.stat(store_dir / "v1" / "index" / "cache.db").st_mode) == 0o600
    if not index_file.exists():
        index_file.touch(mode=0o600)
    os.chmod(index_file, 0o666 if name == "cache.db" else 0o606)
    for read_only in (False, True):
        with pytest.raises(StoreError, match=f"others may write it .*chmod go-w {index_file}"):
            open_local(store_dir, read_only=read_only)
    os.chmod(index_file, 0o600)
    assert open_local(store_dir).get(key(5)) == b"payload"


def test_subdirectory_made_writable_is_refused(open_local, store_dir):
    open_local(store_dir)
    os.chmod(store_dir / "v1" / "objects", 0o777)
    with pytest.raises(StoreError, match="objects: it is writable"):
        open_local(store_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_directory_of_another_user_is_refused(open_local, tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(StoreError, match="owned by uid 65534, not by you"):
        open_local(d)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a link to another user")
def test_a_link_of_another_users_on_the_way_is_refused(open_local, tmp_path):
    """A store reached through someone else's symlink (in a sticky ``/tmp``): they could
    point it at another of our stores later (which ``gc`` would then empty); refused,
    read-only too, and the store it pointed at is left as it was. Our own link is fine."""
    from cachebuild.store import LocalStore
    from cachebuild.store.layout import open_read_only

    real = tmp_path / "real"
    open_local(real).put(key(3), b"payload", kind="target")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    theirs = sticky / "theirs"
    theirs.symlink_to(real)
    os.lchown(theirs, 65534, 65534)
    with pytest.raises(StoreError, match=f"the link {theirs} on the way is owned by uid 65534"):
        LocalStore(theirs)
    with pytest.raises(StoreError, match="owned by uid 65534, who could point it elsewhere"):
        open_read_only(theirs)
    with pytest.raises(StoreError, match="on the way is owned by uid 65534"):
        LocalStore(theirs / "sub")  # a store below their link
    with pytest.raises(StoreError, match="on the way is owned by uid 65534"):
        LocalStore(theirs / ".." / ".." / "real")  # `..` goes up from where the link led
    through = tmp_path / "through"  # a link of ours to theirs
    through.symlink_to(theirs)
    with pytest.raises(StoreError, match=f"the link {theirs} on the way is owned by uid"):
        LocalStore(through)
    mine = sticky / "mine"
    mine.symlink_to(real)
    with LocalStore(mine) as store:
        assert store.get(key(3)) is not None


# -- full and read-only disks -----------------------------------------------------------


def test_full_disk_put_fails_cleanly(open_local, tiny_fs):
    store = open_local(tiny_fs / "store")
    small = {key(i): os.urandom(20_000) for i in range(5)}
    for k, v in small.items():
        store.put(k, v, kind="target")
    with pytest.raises(StoreError, match="no space left on the device.*nothing was stored"):
        store.put(key("big"), os.urandom(2 << 20), kind="target")
    assert not store.contains(key("big")) and store.get(key("big")) is None
    assert list((store.root / "tmp").iterdir()) == []
    for k, v in small.items():
        assert store.get(k) == v
    assert store.verify().clean
    store.put(key("fits"), b"small again", kind="target")
    assert store.get(key("fits")) == b"small again"


def test_a_store_on_a_disk_too_full_to_open_its_index_is_still_read(open_local, tiny_fs,
                                                                      caplog):
    """A full disk (and no reserve left to give up): what is stored is still served, and
    a write is refused saying the disk is full (every command and start failed to open
    the index)."""
    store = open_local(tiny_fs / "store")
    stored = {key(i): os.urandom(10_000) for i in range(3)}
    for k, v in stored.items():
        store.put(k, v, kind="target")
    store.close()
    fd = os.open(tiny_fs / "filler", os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # every byte left
        while os.write(fd, b"\0" * 4096):
            pass
    os.close(fd)
    damaged = blob_path(store, key(2))
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")  # in place: no room for more
    with caplog.at_level("WARNING", logger="cachebuild"):
        full = LocalStore(tiny_fs / "store")
    assert "is full: the store is only read" in caplog.text and full.read_only
    for k in (key(0), key(1)):
        assert full.get(k) == stored[k]
    assert full.get(key(2)) is None and damaged.exists()  # a miss; nothing moved
    for write in (lambda: full.put(key("new"), b"x", kind="target"), lambda: full.gc()):
        with pytest.raises(StoreError, match="disk holding it is full"):
            write()
    full.close()
    # A compiled model's start reads it as a read-only mount: what it builds goes to an
    # overlay (in memory here), so a model the store lacks still serves.
    from cachebuild.store import OverlayStore, StoreOptions, open_to_serve

    served = open_to_serve(StoreOptions(cache_dir=tiny_fs / "store"))
    assert isinstance(served, OverlayStore) and served.get(key(0)) == stored[key(0)]
    served.put(key("new"), b"built here", kind="target")
    assert served.get(key("new")) == b"built here" and not served.base.contains(key("new"))
    served.close()
    damaged.write_bytes(damaged.read_bytes()[:-1] + stored[key(2)][-1:])
    os.unlink(tiny_fs / "filler")
    again = open_local(tiny_fs / "store")
    assert again.verify().clean and all(again.get(k) == v for k, v in stored.items())


def test_an_index_folder_this_user_may_not_write_is_said_so(open_local, tmp_path):
    """Not called damaged, with advice to move the index aside (all records lost over a
    permission): the message says who may not write what."""
    from mounts import mounted

    store = open_local(tmp_path / "store")
    store.put(key(1), b"kept", kind="target")
    store.close()
    index = tmp_path / "store" / "v1" / "index"
    if os.geteuid() == 0:  # root writes through modes: a read-only bind of the folder
        context = mounted(["--bind", "-o", "ro", str(index)], index, "a read-only bind")
    else:
        os.chmod(index, 0o500)
        context = contextlib.nullcontext()
    try:
        with context, pytest.raises(StoreError) as info:
            LocalStore(tmp_path / "store")
    finally:
        os.chmod(index, 0o700)
    said = str(info.value)
    assert "may not write that folder" in said and "move that folder aside" not in said, said
    assert open_local(tmp_path / "store").get(key(1)) == b"kept"


def test_read_only_directory_put_fails_cleanly(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    store.put(key(1), b"earlier", kind="target")
    dirs = [store.root / "tmp", store.root / "objects"]
    if os.geteuid() != 0:
        for d in dirs:
            os.chmod(d, 0o500)
        try:
            _check_read_only_put(store)
        finally:
            for d in dirs:
                os.chmod(d, 0o700)
        return
    # Root writes through permission bits: only a read-only mount stops it. Bind each
    # directory onto itself and make that mount read-only.
    mounted = []
    try:
        for d in dirs:
            done = subprocess.run(["mount", "--bind", str(d), str(d)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
            mounted.append(d)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True)
        _check_read_only_put(store)
    finally:
        for d in reversed(mounted):
            subprocess.run(["umount", "-l", str(d)], check=False)


def _check_read_only_put(store: LocalStore) -> None:
    with pytest.raises(StoreError, match="cannot write .* read-only|permission denied"):
        store.put(key(2), b"new", kind="target")
    assert store.get(key(1)) == b"earlier"
    assert store.get(key(2)) is None
    assert store.verify().clean


# -- build lock within one process ------------------------------------------------------


def _try_lock(store: LocalStore, k: str) -> str:
    try:
        with store.lock(k, timeout=0.2):
            return "acquired"
    except LockTimeout:
        return "timeout"


def test_lock_nests_in_a_thread_and_excludes_other_threads(open_local, store_dir):
    store = open_local(store_dir)
    k = key("lock")
    result: list[str] = []
    with store.lock(k):
        with store.lock(k, timeout=0.1):  # nested in the same thread: no deadlock
            pass
        other = threading.Thread(target=lambda: result.append(_try_lock(store, k)))
        other.start()
        other.join()
    other = threading.Thread(target=lambda: result.append(_try_lock(store, k)))
    other.start()
    other.join()
    assert result == ["timeout", "acquired"]
    assert (store.root / "locks" / k[:2] / f"{k}.lock").exists()


HOLD_LOCK = """
import sys, time
from cachebuild.store import LocalStore
with LocalStore(sys.argv[1]).lock(sys.argv[2]):
    print("held", flush=True)
    time.sleep(1.5)
"""


def test_a_build_that_waits_for_another_process_building_the_key_says_so(open_local, store_dir,
                                                                          caplog):
    """Waiting for the build lock another process holds (a second `warm` of the same
    model) is said at once, naming the target, then the lock is taken once it is free."""
    store = open_local(store_dir)
    k = key("busy")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(store_dir), k],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="cachebuild.store"), store.lock(k):
            waited = time.monotonic() - started
        assert holder.wait(timeout=30) == 0
        assert waited > 0.5  # taken once the other process let go (it holds it 1.5 s)
        said = [r.getMessage() for r in caplog.records if "waiting for another build" in r.getMessage()]
        assert len(said) == 1 and k in said[0]
        caplog.clear()
        with store.lock(k):  # free: nothing said
            pass
        assert "waiting" not in caplog.text
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("odd", ["folder", "link"])
def test_a_lock_path_that_is_no_file_is_cleared_and_the_key_builds(open_local, store_dir,
                                                                   tmp_path, odd):
    """A folder or a link where a key's lock file belongs (damage, a hand) made that key
    impossible to build, for good: it is removed, and a link's target is left alone."""
    store = open_local(store_dir)
    k = key("odd")
    path = store.root / "locks" / k[:2] / f"{k}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "elsewhere"
    target.write_text("kept")
    if odd == "folder":
        (path / "inside").mkdir(parents=True)
    else:
        path.symlink_to(target)
    with store.lock(k):
        store.put(k, b"built", kind="target")
    assert store.get(k) == b"built" and path.is_file() and not path.is_symlink()
    assert target.read_text() == "kept"


@pytest.mark.parametrize("what,named", [("store directory", "CACHEBUILD_DIR"),
                                        ("work folder", "CACHEBUILD_WORK_DIR"),
                                        ("environment folder", "CACHEBUILD_PROBE_DIR")])
def test_a_file_where_a_folder_goes_names_the_variable_that_set_it(tmp_path, what, named):
    from cachebuild.store import UnsafeStore
    from cachebuild.store.layout import check_private_dir

    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(UnsafeStore, match=f"{what} {file} is not a directory: give it a "
                                          f"folder \\(.*{named}\\)"):
        check_private_dir(file, what)


# -- a user's umask and groups ----------------------------------------------------------

NEW_HOME_CHILD = """
import os, sys
os.umask(0o002)  # what systems that give each user a group of their own set
from cachebuild.backends.probe import checked_dir
from cachebuild.store import LocalStore, cache_home
store = LocalStore(cache_home() / "cachebuild")
store.put("ab" * 16, b"x", kind="target")
print(checked_dir())
"""


def test_a_new_home_under_umask_002_gets_private_folders(tmp_path):
    """A newcomer's first run with umask 002 and no ~/.cache: the store and environment
    folders, and the parents made for them, are made 0700 and used (they were made 0775,
    then refused as writable by others, at every later run too)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CACHEBUILD_") and k != "XDG_CACHE_HOME"}
    for _ in range(2):  # the first run makes them, the second finds them
        done = subprocess.run([sys.executable, "-c", NEW_HOME_CHILD], capture_output=True,
                              text=True, env={**env, "HOME": str(home)}, timeout=300)
        assert done.returncode == 0, done.stderr
    made = [home / ".cache", home / ".cache" / "cachebuild", home / ".cache" / "cachebuild" / "env",
            Path(done.stdout.strip())]
    assert {oct(stat.S_IMODE(os.stat(p).st_mode)) for p in made} == {"0o700"}


@pytest.mark.parametrize("home", ["", "relative/home"])
def test_an_empty_or_relative_home_is_the_accounts_home(monkeypatch, home):
    """``HOME=`` put every user's store at /.cache/cachebuild (and a relative HOME under
    the working directory, which another user may own): the account's home is used."""
    import pwd

    from cachebuild.backends import environment
    from cachebuild.store.options import default_dir

    monkeypatch.setenv("HOME", home)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    account = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert default_dir() == account / ".cache" / "cachebuild"
    assert environment.root() == account / ".cache" / "cachebuild" / "env"


def test_only_a_group_of_the_owner_alone_may_write_a_folder(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir(mode=0o700)
    assert not others_can_write(os.stat(folder))
    os.chmod(folder, 0o707)
    assert others_can_write(os.stat(folder))
    import grp
    import pwd

    me = pwd.getpwuid(os.geteuid())
    own = grp.getgrgid(me.pw_gid)
    if own.gr_name == me.pw_name and not set(own.gr_mem) - {me.pw_name}:
        os.chown(folder, -1, me.pw_gid)  # the user's own group (root's, "root", here)
        os.chmod(folder, 0o770)
        assert not others_can_write(os.stat(folder))
    os.chmod(folder, 0o770)
    shared = next((g for g in grp.getgrall() if g.gr_mem or any(
        u.pw_gid == g.gr_gid and u.pw_uid != os.geteuid() for u in pwd.getpwall())), None)
    if os.geteuid() == 0 and shared is not None:  # a group another user is in
        os.chown(folder, -1, shared.gr_gid)
        assert others_can_write(os.stat(folder))
    named_otherwise = next((g for g in grp.getgrall() if g.gr_name != me.pw_name
                            and not g.gr_mem), None)
    if os.geteuid() == 0 and named_otherwise is not None:  # a group no one is listed in,
        os.chown(folder, -1, named_otherwise.gr_gid)     # but not the user's own
        assert others_can_write(os.stat(folder))


def test_gc_goes_on_past_a_record_another_process_removed_meanwhile(open_local, store_dir,
                                                                    monkeypatch):
    """A unit's record removed by another process (a second gc, a warm) between GC's
    listing and its eviction: GC removed the records before it, then stopped as if the
    record had been pinned, left the rest of the unit and said pins kept it over the cap."""
    from cachebuild.store import maintenance

    store = open_local(store_dir)
    t1, t2, g, e = (f"{i:032x}" for i in (0x11, 0x22, 0x33, 0x44))
    store.put(t1, b"a" * 1000, kind="data")
    store.put(t2, b"b" * 1000, kind="data")
    store.put(g, b"", kind="guards")
    store.put(e, b"entry", kind="entry", refs=[t1, t2, g])
    listed = maintenance.disk_usage

    def usage_then_removed(layout):
        found = listed(layout)
        open_local(store_dir).delete(t1)  # another process, after GC listed the records
        return found

    monkeypatch.setattr(maintenance, "disk_usage", usage_then_removed)
    report = store.gc(max_size=0)
    assert not list(store.records())
    assert sorted(report.removed) == sorted([e, t2, g]) and report.vanished == 1
    assert not report.over_cap and report.records_after == 0 and report.bytes_after == 0
