"""Trust, local store: what is on disk is never trusted for merely being there.

Every test drives real processes (the ``cachebuild`` command, or a Python child) against
a real store; attacks that need another user run as uid 65534 (root only, else skipped).
Items of issue 12: 5 (a swapped parent directory), 7 (GC racing a load), 8 (a full disk),
9 (bundle bounds), 10 (odd files and rows instead of a refused item), 11 (bad CLI input),
12 (bundle permissions, pack names, fsynced kernels), and 3 (unsigned bundles).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest
from mounts import tmpfs
from trust import (
    as_nobody,
    assert_one_line_error,
    clean_env,
    cli,
    fill,
    public_dir,
    python,
    require_root,
)

from cachebuild.errors import StoreError
from cachebuild.keys import make_key
from cachebuild.store import LocalStore, export_bundle
from cachebuild.store.blob import encode_blob

SIGNING_KEY = "store-trust-signing-key"


def key(name: str) -> str:
    return make_key({"trust": name})


def env_for(store: Path, **extra: str) -> dict[str, str]:
    return clean_env(CACHEBUILD_DIR=str(store), **extra)


# -- 5: a swapped parent directory --------------------------------------------------------


def test_store_under_a_directory_others_can_write_is_refused(open_local, tmp_path):
    prefix = as_nobody()
    with public_dir() as public:
        shared = public / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)  # no sticky bit: anyone may rename entries here
        (shared / "store").mkdir(mode=0o700)
        # The attack is real: another user can move the store away (and put theirs there).
        moved = subprocess.run([*prefix, "mv", str(shared / "store"), str(shared / "gone")],
                               capture_output=True, text=True)
        assert moved.returncode == 0, moved.stderr
        proc = cli("--cache-dir", str(shared / "store"), "stats")
        assert_one_line_error(proc, 2, r"refusing store directory .*shared above it is "
                                       r"writable by others")
        with pytest.raises(StoreError, match="writable by others"):
            open_local(shared / "store")


def test_store_in_a_sticky_directory_cannot_be_swapped_by_another_user(open_local, tmp_path):
    prefix = as_nobody()
    with public_dir() as public:
        shared = public / "sticky"
        shared.mkdir()
        os.chmod(shared, 0o1777)  # like /tmp: only an entry's owner may rename it
        store = open_local(shared / "store")
        store.put(key("a"), b"ours", kind="target")
        # Another user tries the attack: move our store away to put theirs in its place.
        moved = subprocess.run([*prefix, "mv", str(shared / "store"), str(shared / "stolen")],
                               capture_output=True, text=True)
        assert moved.returncode != 0 and "not permitted" in moved.stderr, moved.stderr
        assert not (shared / "stolen").exists() and store.get(key("a")) == b"ours"
        # A directory above the store owned by another user is refused: they could swap it.
        theirs = public / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 65534, 65534)
        proc = cli("--cache-dir", str(theirs / "store"), "ls")
        assert_one_line_error(proc, 2, r"theirs above it is owned by uid 65534")


def test_a_symlinked_store_path_is_resolved_once(open_local, tmp_path):
    real = tmp_path / "real"
    open_local(real).put(key("a"), b"x", kind="target")
    link = tmp_path / "link"
    link.symlink_to(real)
    store = open_local(link)
    assert store.root == real.resolve() / "v1"
    # Re-aiming the link later changes nothing for the open store.
    link.unlink()
    link.symlink_to(tmp_path)
    assert store.get(key("a")) == b"x"


# -- 7: GC racing a load ------------------------------------------------------------------

GC_RACE = r"""
import json, os, subprocess, sys
from cachebuild.backends.inductor import InductorBackend
from cachebuild.counters import COUNTERS
from cachebuild.store import LocalStore

store = LocalStore(sys.argv[1])
key = sys.argv[2]
original = store.materialize

def materialize_then_gc(k, suffix):
    path = original(k, suffix)
    # Another process collects everything between materialize() and the loader's read.
    done = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir", sys.argv[1],
                           "gc", "--max-size", "0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return path

store.materialize = materialize_then_gc
fn = InductorBackend().load("aoti-cpu", key, store, "cpu")
print(json.dumps({"loaded": fn is not None, "vanished": COUNTERS.vanished,
                  "exists": os.path.exists(store.root)}))
"""


def test_gc_between_materialize_and_read_is_a_counted_miss(open_local, tmp_path):
    store_dir = tmp_path / "store"
    k = key("aoti")
    open_local(store_dir).put(k, b"not a real package, never read", kind="aoti-cpu")
    proc = python(GC_RACE, str(store_dir), k)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"loaded": False, "vanished": 1, "exists": True}
    assert f"target {k} vanished from the store while it was loaded" in proc.stderr


# -- 8: a full disk -----------------------------------------------------------------------

READ_ALL = r"""
import json, sys
from pathlib import Path
from cachebuild.store import LocalStore
from trust import fill

store = LocalStore(sys.argv[1])  # on a full disk: gives up the store's reserve
keys = json.loads(sys.argv[2])
got = {k: (store.get(k) or b"").decode() for k in keys}
fill(Path(sys.argv[1]))  # full again, to the last byte
path = store.materialize(keys[0], ".bin")
print(json.dumps({"got": got, "materialized": open(path, "rb").read().decode(),
                  "in_memory": str(path).startswith("/proc/self/fd/")}))
"""


def test_a_full_disk_can_still_be_read_verified_and_cleaned(open_local, tmp_path):
    require_root()
    with tmpfs(tmp_path / "disk", "80m") as disk:
        store_dir = disk / "store"
        store = open_local(store_dir)
        assert (store.root / "reserve").stat().st_size == 1 << 20  # made while space is free
        blobs = {key(f"b{i}"): f"payload {i}" * 1000 for i in range(4)}
        for k, v in blobs.items():
            store.put(k, v.encode(), kind="target")
        store.close()
        fill(disk)
        (disk / "filler").rename(disk / "filler0")
        env = env_for(store_dir)
        # Reading: a server's loads, the first ever materialization included.
        proc = python(READ_ALL, str(store_dir), json.dumps(list(blobs)), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.splitlines()[-1])
        assert out["got"] == blobs and out["materialized"] == blobs[next(iter(blobs))]
        assert out["in_memory"]  # no room for the file: it was made in memory
        assert "is full" in proc.stderr
        # Full to the last byte, the reserve spent: the store is still read and verified;
        # a write, gc's too, is refused saying why, and works once there is room.
        proc = cli("verify", env=env)
        assert proc.returncode == 0 and "4 ok, 0 damaged" in proc.stdout, proc.stderr
        proc = cli("stats", "--json", env=env)
        assert proc.returncode == 0 and json.loads(proc.stdout)["records"] == 4
        proc = cli("gc", "--max-size", "0", env=env)
        if proc.returncode != 0:  # no room at all for the index to write: said so
            assert_one_line_error(proc, 1, "the disk holding it is full")
            (store_dir / "filler").unlink()
            proc = cli("gc", "--max-size", "0", env=env)
        assert proc.returncode == 0 and "removed 4 records" in proc.stdout, proc.stderr
        (store_dir / "filler").unlink(missing_ok=True)
        (disk / "filler0").unlink()
        assert cli("gc", env=env).returncode == 0
        assert (store_dir / "v1" / "reserve").exists()  # back once there is room


# -- 10: odd files and rows -----------------------------------------------------------------

GET = r"""
import json, sys
from cachebuild.store import LocalStore

store = LocalStore(sys.argv[1])
out = {}
for k in json.loads(sys.argv[2]):
    out[k] = [store.contains(k), store.get(k) is None]
print(json.dumps(out))
"""


def test_fifo_directory_and_symlink_instead_of_blobs_are_misses(open_local, tmp_path):
    store_dir = tmp_path / "store"
    store = open_local(store_dir)
    outside = tmp_path / "outside"
    outside.write_bytes(encode_blob(key("link"), "target", b"planted"))
    odd = {"fifo": os.mkfifo, "dir": os.mkdir, "link": lambda p: os.symlink(outside, p)}
    for name, make in odd.items():
        store.put(key(name), b"real", kind="target")
        blob = store.root / "objects" / key(name)[:2] / key(name)
        blob.unlink()
        make(blob)
    store.close()
    env = env_for(store_dir)
    # verify reports them (and does not hang on the FIFO); --repair moves them away.
    proc = cli("verify", env=env, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    for what in ("a FIFO", "a directory", "a symlink"):
        assert f"{what} where the blob should be" in proc.stderr
    proc = python(GET, str(store_dir), json.dumps([key(n) for n in odd]), env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {key(n): [False, True] for n in odd}
    assert outside.read_bytes().endswith(b"planted")  # never followed, never moved
    assert cli("verify", env=env).returncode == 0


def test_odd_files_where_a_materialized_file_should_be_are_replaced(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    secret = tmp_path / "secret"
    secret.write_text("not the store's")
    for i, make in enumerate((os.mkdir, os.mkfifo, lambda p: os.symlink(secret, p))):
        k = key(f"mat{i}")
        store.put(k, b"payload %d" % i, kind="target")
        make(store.root / "objects" / k[:2] / (k + ".so"))
        path = store.materialize(k, ".so")
        assert stat.S_ISREG(os.lstat(path).st_mode) and path.read_bytes() == b"payload %d" % i
    assert secret.read_text() == "not the store's"


def test_damaged_index_rows_and_a_wrong_kind_are_misses(open_local, tmp_path):
    store_dir = tmp_path / "store"
    store = open_local(store_dir)
    for name in ("json", "types", "kind", "good"):
        store.put(key(name), name.encode(), kind="target")
    db = store.index._db
    db.set(key("json"), "{not json")
    db.set(key("types"), json.dumps({"kind": 5, "size": "big", "checksum": None}))
    row = json.loads(db.get(key("kind")))
    db.set(key("kind"), json.dumps({**row, "kind": "entry"}))  # the blob's header says target
    store.close()
    env = env_for(store_dir)
    proc = python(GET, str(store_dir), json.dumps([key(n) for n in ("json", "types", "kind",
                                                                   "good")]), env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        key("json"): [False, True], key("types"): [False, True], key("kind"): [False, True],
        key("good"): [True, False]}
    proc = cli("verify", env=env)
    assert proc.returncode == 1 and "index row is not valid JSON" in proc.stderr, proc.stderr
    assert "record field 'checksum'" in proc.stderr  # the row of the wrong types
    assert cli("verify", "--repair", env=env).returncode == 0
    assert cli("verify", env=env).returncode == 0


# -- 11: bad command-line input -------------------------------------------------------------


def test_bad_sizes_and_an_empty_cache_dir_are_usage_errors(tmp_path):
    env = env_for(tmp_path / "store")
    assert_one_line_error(cli("gc", "--max-size", "9" * 400, env=env), 2, "too large")
    assert_one_line_error(cli("gc", "--older-than", "9" * 400, env=env), 2, "too long")
    assert_one_line_error(cli("--cache-dir", "", "stats"), 2, "cache directory is empty")


# -- 3, 9, 10, 12: bundles ----------------------------------------------------------------


def _bundle(tmp_path: Path, signing_key: bytes | None) -> Path:
    path = tmp_path / "bundle.tar"
    with LocalStore(tmp_path / "source", signing_key=signing_key) as store:
        store.put(key("t"), b"target bytes" * 100, kind="target", manifest={"graph": "g"})
        store.put(key("e"), b"entry", kind="entry", refs=[key("t")])
        export_bundle(store, path)
    return path


def test_bundles_are_written_private(tmp_path):
    path = _bundle(tmp_path, None)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    proc = cli("export", str(tmp_path / "again.tar.gz"), env=env_for(tmp_path / "source"))
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE((tmp_path / "again.tar.gz").stat().st_mode) == 0o600


def test_unsigned_bundle_into_a_store_with_a_key_needs_a_flag(tmp_path):
    path = _bundle(tmp_path, None)
    env = env_for(tmp_path / "target", CACHEBUILD_SIGNING_KEY=SIGNING_KEY)
    proc = cli("import", str(path), env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("unsigned, and this store has a signing key") == 2
    assert "imported 0 records" in proc.stdout
    proc = cli("import", "--allow-unsigned", str(path), env=env)
    assert proc.returncode == 0 and "imported 2 records" in proc.stdout, proc.stderr
    # A signed bundle goes in without the flag.
    signed = _bundle(tmp_path / "s", SIGNING_KEY.encode())
    env = env_for(tmp_path / "target2", CACHEBUILD_SIGNING_KEY=SIGNING_KEY)
    assert cli("import", str(signed), env=env).returncode == 0


def _rewrite(path: Path, out: Path, change) -> Path:
    """A copy of bundle ``path`` with each member's bytes passed through ``change``."""
    with tarfile.open(path) as src, tarfile.open(out, "w") as dst:
        for member in src:
            data = src.extractfile(member).read()
            data = change(member.name, data)
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out


def test_bundle_records_that_are_lists_or_strings_are_refused(tmp_path):
    path = _bundle(tmp_path, None)
    weird = {key("t"): b'["a", "list"]', key("e"): b'"a string"'}

    def change(name: str, data: bytes) -> bytes:
        for k, record in weird.items():
            if name == f"records/{k}.json":
                return record
        return data

    bad = _rewrite(path, tmp_path / "bad.tar", change)
    proc = cli("import", str(bad), env=env_for(tmp_path / "target"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("a record must be a JSON object") == 2


def test_a_blob_longer_than_declared_is_refused_early(tmp_path):
    path = _bundle(tmp_path, None)
    grown = _rewrite(path, tmp_path / "grown.tar",
                     lambda name, data: data + b"\0" * 5000 if name.startswith("objects/")
                     else data)
    proc = cli("import", str(grown), env=env_for(tmp_path / "target"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "longer than the" in proc.stderr and "bytes its header declares" in proc.stderr


def test_a_bundle_that_inflates_past_memory_is_streamed(tmp_path):
    # 768 MiB of zeros compress to under a megabyte; the importer runs with less address
    # space than that, so reading the member whole would die with MemoryError.
    k = key("bomb")
    bomb = tmp_path / "bomb.tar.gz"
    size = 768 << 20
    with gzip.open(bomb, "wb", compresslevel=1) as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in (("cachebuild-bundle.json",
                            json.dumps({"format": "cachebuild-bundle", "version": 1,
                                        "entries": [k]}).encode()),
                           (f"records/{k}.json",
                            json.dumps({"key": k, "kind": "target", "size": size - 100,
                                        "checksum": "0" * 32, "created": 1.0,
                                        "last_used": 1.0}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(f"objects/{k}")
        info.size = size

        class Zeros(io.RawIOBase):
            left = size

            def readable(self) -> bool:
                return True

            def readinto(self, b):  # type: ignore[override]
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        tar.addfile(info, io.BufferedReader(Zeros(), 1 << 20))
    assert bomb.stat().st_size < 4 << 20
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to run the importer with bounded memory")
    limit = ("prlimit", f"--as={640 << 20}")
    # An importer that hung on the bomb would run past the timeout, and fail here.
    proc = cli("import", str(bomb), env=env_for(tmp_path / "target"), prefix=limit,
               timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "MemoryError" not in proc.stderr and "not a cachebuild blob" in proc.stderr


def test_pack_names_that_leave_the_directory_are_refused_before_writing(open_local, tmp_path):
    from cachebuild.backends.pack import PACK_MAGIC

    evil = tmp_path / "evil.so"
    table = json.dumps([["artifact.bin", 1], ["../../../../evil.so", 4]]).encode()
    payload = PACK_MAGIC + len(table).to_bytes(8, "little") + table + b"A" + b"EVIL"
    store_dir = tmp_path / "store"
    k = key("pack")
    open_local(store_dir).put(k, payload, kind="standalone")
    code = ("import sys\nfrom cachebuild.backends.inductor import InductorBackend\n"
            "from cachebuild.cli.main import main\nfrom cachebuild.errors import CachebuildError\n"
            "from cachebuild.store import LocalStore\n"
            "try:\n    InductorBackend().load('standalone', sys.argv[2], LocalStore(sys.argv[1]), 'cpu')\n"
            "except CachebuildError as e:\n    print('error:', e, file=sys.stderr); sys.exit(1)\n")
    proc = python(code, str(store_dir), k)
    assert_one_line_error(proc, 1, r"not a plain relative path")
    assert not evil.exists() and not list(tmp_path.rglob("evil.so"))


FSYNCED = r"""
import json, os, sys
from pathlib import Path
from cachebuild.backends import kernel_dir

synced = []
real_fsync = os.fsync

def fsync(fd):
    synced.append(os.readlink(f"/proc/self/fd/{fd}"))
    real_fsync(fd)

os.fsync = fsync
root = Path(sys.argv[1])
path = kernel_dir.write_file(root, "ab/cabc.main.so", b"kernel bytes")
print(json.dumps({"path": str(path), "synced": synced,
                  "mode": oct(os.stat(path).st_mode & 0o777), "data": path.read_text()}))
"""


def test_kernel_files_are_fsynced_before_they_are_used(tmp_path):
    proc = python(FSYNCED, str(tmp_path / "kernels"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["data"] == "kernel bytes" and out["mode"] == "0o700"
    # The temp file is synced before it is renamed to the name Inductor looks up.
    assert len(out["synced"]) == 1 and out["synced"][0].startswith(str(tmp_path / "kernels"))
    assert out["synced"][0] != out["path"] and ".tmp" in out["synced"][0]


# -- issue 25, 4: bounds on totals --------------------------------------------------------


def _write_members(path: Path, members: list[tuple[str, bytes]], entries: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        header = json.dumps({"format": "cachebuild-bundle", "version": 1,
                             "entries": entries}).encode()
        for name, data in [("cachebuild-bundle.json", header), *members]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_bundle_of_countless_members_is_read_up_to_a_bound_and_said_in_a_few_lines(open_local, tmp_path):
    from cachebuild.cli.common import MAX_LISTED
    from cachebuild.store.bundle import MAX_MEMBERS

    # Every member is within every per-member cap: empty blobs without records.
    names = [f"objects/{i:032x}" for i in range(MAX_MEMBERS + 2000)]
    bundle = tmp_path / "many.tar"
    _write_members(bundle, [(n, b"") for n in names], [])
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to run the importer with bounded memory")
    proc = cli("import", str(bundle), env=env_for(tmp_path / "target"),
               prefix=("prlimit", f"--as={384 << 20}"), timeout=600)
    assert_one_line_error(proc, 1, rf"refused {MAX_MEMBERS} records \(damaged, incomplete.*"
                                   r"and the rest of the bundle \(damaged or truncated")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == MAX_LISTED + 2, lines[-5:]  # the first ones, "and N more", error
    assert f"refused: and {MAX_MEMBERS + 1 - MAX_LISTED} more" in proc.stderr
    from cachebuild.store.bundle import import_bundle

    report = import_bundle(open_local(tmp_path / "direct"), bundle)
    assert report.refused_count == MAX_MEMBERS and report.rest_refused
    assert len(report.refused) < 2000


def test_records_waiting_for_their_blobs_are_bounded_together(tmp_path):
    from cachebuild.store.bundle import MAX_PENDING_RECORD_BYTES, MAX_RECORD_BYTES

    members = []
    filler = "x" * (MAX_RECORD_BYTES - 300)
    count = MAX_PENDING_RECORD_BYTES // MAX_RECORD_BYTES + 2
    for i in range(count):
        k = key(f"pending {i}")
        members.append((f"records/{k}.json", json.dumps({
            "key": k, "kind": "target", "size": 1, "checksum": "0" * 32, "created": 1.0,
            "manifest": {"filler": filler}}).encode()))
    bundle = tmp_path / "records.tar"
    _write_members(bundle, members, [])
    proc = cli("import", str(bundle), env=env_for(tmp_path / "target"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("index records without their blobs would take more than") == \
        count - MAX_PENDING_RECORD_BYTES // MAX_RECORD_BYTES
    assert proc.stderr.count("index record without a blob") == \
        MAX_PENDING_RECORD_BYTES // MAX_RECORD_BYTES
