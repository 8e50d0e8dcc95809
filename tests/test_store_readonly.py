"""A store this process may only read: a read-only mount, or a store root owns served to
another user. Reading works and writes nothing (no index write, no usage flushed, files
loaders need made in memory); writes are refused in one line or go to an overlay made on
first write; what may be read is checked like a writable store, root allowed as owner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachebuild.errors import StoreError, UsageError
from cachebuild.keys import make_key
from cachebuild.store import LocalStore, OverlaySummary, StoreOptions, open_store
from cachebuild.store.index import ReadOnlyStore
from cachebuild.store.layout import UnsafeStore, writable_here
from cachebuild.store.overlay import OverlayStore


def key(name: str) -> str:
    return make_key({"test": name})


def snapshot(folder: Path) -> set[tuple[str, int, int]]:
    return {(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


@pytest.fixture
def written(tmp_path) -> Path:
    """A store with a target (a large manifest: kept in a file of the index) and an entry
    referring to it, closed."""
    path = tmp_path / "store"
    with LocalStore(path) as store:
        store.put(key("target"), b"artifact bytes", kind="target",
                  manifest={"graph": "x" * 100_000})
        store.put(key("entry"), b"entry bytes", kind="entry", refs=[key("target")])
        assert store.materialize(key("target"), ".so") is not None
    return path


@pytest.fixture
def read_only(written, tmp_path) -> Path:
    """``written`` on a read-only bind mount (root only; skipped where not allowed)."""
    view = tmp_path / "view"
    view.mkdir()
    done = subprocess.run(["mount", "--bind", "-o", "ro", str(written), str(view)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {done.stderr.strip()}")
    yield view
    subprocess.run(["umount", "-l", str(view)], check=False)


def test_a_read_only_mount_is_read_and_nothing_is_written(read_only, written):
    before = snapshot(written)
    assert not writable_here(read_only)
    store = open_store(StoreOptions(cache_dir=read_only))
    assert isinstance(store, OverlayStore)
    assert store.get(key("target")) == b"artifact bytes"
    assert store.get_record(key("target")).manifest == {"graph": "x" * 100_000}
    assert store.contains(key("entry")) and store.get(key("nothing")) is None
    # The file materialized when the store was written is used as it is.
    assert store.materialize(key("target"), ".so").parent.parent == \
        store.base.root / "objects"
    # A file never materialized is made in memory.
    made = store.materialize(key("entry"), ".bin")
    assert str(made).startswith("/proc/self/fd/") and made.read_bytes() == b"entry bytes"
    assert {r.key for r in store.records()} == {key("target"), key("entry")}
    assert store.stats().read_only and store.overlay is None
    assert store.verify().clean
    # Repair is refused in one line, before anything is read (it said "quarantined"
    # and changed nothing).
    with pytest.raises(ReadOnlyStore, match="cannot repair damage"):
        store.verify(repair=True)
    store.count("warm_starts")
    store.close()
    assert snapshot(written) == before  # no usage flushed, no index touched


def test_writes_go_to_an_overlay_made_on_first_write(read_only, written, tmp_path, caplog):
    before = snapshot(written)
    overlay_dir = tmp_path / "overlay"
    store = open_store(StoreOptions(cache_dir=read_only, overlay_dir=overlay_dir))
    assert store.overlay is None and not overlay_dir.exists()
    assert store.stats().overlay == OverlaySummary(str(overlay_dir), 0)
    with caplog.at_level("WARNING", logger="cachebuild"):
        store.put(key("new"), b"built here", kind="target")
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"cachebuild: the store at {read_only} is read-only here, so what this "
                    f"process builds goes to {overlay_dir} (CACHEBUILD_OVERLAY_DIR)"]
    assert store.get(key("new")) == b"built here" and store.get(key("target"))
    # A newer entry in the overlay shadows the read-only store's under the same key.
    store.put(key("entry"), b"newer entry", kind="entry")
    assert store.get(key("entry")) == b"newer entry"
    assert store.delete(key("entry")) and store.get(key("entry")) == b"entry bytes"
    assert store.stats().overlay == OverlaySummary(str(store.overlay.root), 1)
    with pytest.raises(ReadOnlyStore, match="cannot pin .* read-only here"):
        store.pin(key("target"))
    store.close()
    # A later process reads the overlay too, without making anything.
    again = open_store(StoreOptions(cache_dir=read_only, overlay_dir=overlay_dir))
    assert again.get(key("new")) == b"built here"
    again.close()
    assert snapshot(written) == before


def test_an_overlay_folder_refused_names_the_variable_that_set_it(read_only, tmp_path):
    """An overlay folder that cannot take a build (a file, a folder inside the read-only
    store, a folder on that mount, one another user owns) is refused as the store opens,
    exit 2, naming CACHEBUILD_OVERLAY_DIR: not after a server's trace, at its first build,
    nor naming the store's --cache-dir and CACHEBUILD_DIR, which were not at fault."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [(a_file, "is not a folder"), (read_only / "v1" / "overlay", "lies inside the store"),
             (read_only, "lies inside the store")]
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        cases.append((theirs, "none can be made there"))
    for overlay_dir, says in cases:
        with pytest.raises(UsageError) as e:
            open_store(StoreOptions(cache_dir=read_only, overlay_dir=overlay_dir))
        said = str(e.value)
        assert says in said and f"CACHEBUILD_OVERLAY_DIR={overlay_dir}" in said, said
        assert "CACHEBUILD_DIR" not in said.replace("CACHEBUILD_OVERLAY_DIR", "")
        assert e.value.exit_code == 2 and "\n" not in said


def test_the_read_only_store_refuses_every_write_in_one_line(read_only):
    store = LocalStore(read_only, read_only=True)
    for write in (lambda: store.put(key("x"), b"x", kind="target"),
                  lambda: store.delete(key("target")), lambda: store.gc(),
                  lambda: store.verify(repair=True), lambda: store.pin(key("target"))):
        with pytest.raises(ReadOnlyStore) as e:
            write()
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
    with pytest.raises(ReadOnlyStore), store.lock(key("target")):
        pass


def test_read_only_mode_writes_nothing_even_where_the_folder_is_writable(written):
    """Read-only is the store's mode, not the mount's: on a folder this process could
    write, every write is refused before it touches anything, reads and loads work, and a
    damaged blob is a miss that stays where it is. (SQLite's reader files beside a WAL
    index, which any reader of a folder it may write makes, are not the store's.)"""
    def files() -> set[tuple[str, int, int]]:
        return {f for f in snapshot(written)
                if not f[0].endswith(("-wal", "-shm")) and f[0] != "v1/index"}

    before = files()
    store = LocalStore(written, read_only=True)
    assert store.read_only and store.reopen_options() is None and "read_only" in repr(store)
    blob = store.read_blob(key("target"))
    writes = {
        "put": lambda: store.put(key("x"), b"x", kind="target"),
        "write_blob": lambda: store.write_blob(key("x"), blob),
        "write_blob_chunks": lambda: store.write_blob_chunks(key("x"), [blob]),
        "delete": lambda: store.delete(key("target")),
        "pin": lambda: store.pin(key("target")),
        "unpin": lambda: store.unpin(key("target")),
        "trust": lambda: store.trust("somewhere", "me"),
        "gc": lambda: store.gc(max_size=0),
        "repair": lambda: store.verify(repair=True),
    }
    for name, write in writes.items():
        with pytest.raises(ReadOnlyStore, match="read-only here") as refused:
            write()
        assert refused.value.exit_code == 2 and "\n" not in str(refused.value), name
    with pytest.raises(ReadOnlyStore), store.lock(key("entry")):
        pass
    assert store.get(key("entry")) == b"entry bytes"
    assert store.verify().ok == 2
    loaded = store.materialize(key("target"), ".so")  # the stored file, verified
    assert loaded is not None and loaded.read_bytes() == b"artifact bytes"
    fresh = store.materialize(key("entry"), ".bin")  # none stored: made in memory
    assert fresh is not None and fresh.read_bytes() == b"entry bytes"
    assert not str(fresh).startswith(str(written))
    store.count("hits")
    store.close()
    assert files() == before
    # A damaged blob: a miss, said once, and left where it is.
    opened = LocalStore(written)  # closed before the snapshot: its index files go
    blob_path = opened.layout.blob(key("entry"))
    opened.close()
    data = bytearray(blob_path.read_bytes())
    data[-1] ^= 0xFF
    blob_path.write_bytes(bytes(data))
    damaged = files()
    store = LocalStore(written, read_only=True)
    assert store.get(key("entry")) is None and store.get(key("entry")) is None
    assert [k for k, _ in store.verify().damaged] == [key("entry")]
    store.close()
    assert files() == damaged


def test_a_store_root_owns_is_read_by_another_user_and_checked_for_writers(open_local, written):
    """Root's store, served to uid 65534: read-only, accepted while only root may write;
    refused once anyone else may (the checks for writing are unchanged)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    from trust import NOBODY, public_dir

    with public_dir() as public:
        subprocess.run(["cp", "-a", str(written), str(public / "store")], check=True)
        subprocess.run(["chmod", "-R", "a+rX", str(public / "store")], check=True)
        # Imports happen before the switch (this interpreter may live where others cannot
        # read): the child loads the store modules, then becomes the other user.
        code = ("import os, sys\n"
                "from cachebuild.store import StoreOptions, open_store\n"
                "import cachebuild.store.overlay, cachebuild.store.access, sqlite3, json\n"
                f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
                "store = open_store(StoreOptions(cache_dir=sys.argv[1]))\n"
                "print(type(store).__name__, store.get(sys.argv[2]).decode())\n")
        done = subprocess.run([sys.executable, "-c", code, str(public / "store"),
                               key("target")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split(maxsplit=1) == ["OverlayStore", "artifact bytes\n"]
        os.chmod(public / "store" / "v1" / "index", 0o777)
        done = subprocess.run([sys.executable, "-c", code, str(public / "store"),
                               key("target")], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "writable by others" in done.stderr, done.stderr
    # Root itself keeps writing its store as before; another owner is refused for writing.
    with pytest.raises(UnsafeStore, match="owned by uid 65534"):
        os.chown(written, 65534, 65534)
        open_local(written)


def test_a_store_is_never_read_from_a_directory_another_user_owns(open_local, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    path = tmp_path / "theirs"
    open_local(path).close()
    os.chown(path, 65534, 65534)
    from cachebuild.store.layout import check_readable_dir

    with pytest.raises(UnsafeStore, match="neither you .* nor root"):
        check_readable_dir(path)
    with pytest.raises(StoreError):
        LocalStore(path, read_only=True)


def test_a_store_says_how_another_process_opens_it(read_only, written, tmp_path):
    """Build workers open the store their parent uses from ``reopen_options``: a store
    whose writes another process sees (a local store, an overlay on disk) answers with
    options that open that very store; one it may only read, or an overlay in memory,
    answers None, and its targets build in the calling process."""
    with LocalStore(written) as store:
        options = store.reopen_options()
        with open_store(options) as again:
            assert type(again) is LocalStore and again.root == store.root
            assert again.get(key("target")) == b"artifact bytes"
    assert LocalStore(read_only, read_only=True).reopen_options() is None
    in_memory = open_store(StoreOptions(cache_dir=read_only))
    assert in_memory.reopen_options() is None
    on_disk = StoreOptions(cache_dir=read_only, overlay_dir=tmp_path / "overlay")
    overlay = open_store(on_disk)
    assert overlay.reopen_options() == on_disk
    overlay.put(key("built"), b"built here", kind="target")
    overlay.close()
    worker = open_store(overlay.reopen_options())  # as a worker would
    assert isinstance(worker, OverlayStore) and worker.get(key("built")) == b"built here"
    worker.close()


def test_an_index_never_written_reads_as_no_records(tmp_path):
    """A store whose first write never happened (its disk filled as SQLite made the index
    file: a database with no table) opened read-only, as a full disk opens it: no records,
    every lookup a miss, no error."""
    with LocalStore(tmp_path / "store") as store:
        pass
    index_file = tmp_path / "store" / "v1" / "index" / "cache.db"
    for name in ("cache.db-wal", "cache.db-shm"):
        (index_file.parent / name).unlink(missing_ok=True)
    index_file.write_bytes(b"")
    with LocalStore(tmp_path / "store", read_only=True) as store:
        assert store.get(key("target")) is None and list(store.records()) == []
