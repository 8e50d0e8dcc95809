"""The store commands of the ``cachebuild`` CLI: output, exit codes 0/1/2, bundles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from mounts import read_only
from trust import flip_payload_byte

from cachebuild.cli import main as cli
from cachebuild.keys import make_key
from cachebuild.store import LocalStore


def key(name: str) -> str:
    return make_key({"cli": name})


@pytest.fixture
def filled(store_dir):
    """A store with a pinned model entry referring to two targets, and a loose target."""
    with LocalStore(store_dir) as store:
        store.put(key("t1"), b"a" * 3000, kind="target", manifest={"graph": "g1"})
        store.put(key("t2"), b"b" * 2000, kind="target", manifest={"graph": "g2"})
        # As a model entry lists its targets (its guards have no seal here).
        entry = {"pieces": [{"targets": [{"key": key("t1")}, {"key": key("t2")}]}]}
        store.put(key("entry"), json.dumps(entry).encode(), kind="entry",
                  refs=[key("t1"), key("t2")])
        store.put(key("loose"), b"c" * 5000, kind="target")
        store.pin(key("entry"))
    return store_dir


def run(store_dir, *args, **kw):
    result = CliRunner().invoke(cli.main, ["--cache-dir", str(store_dir), *args], **kw)
    return result


def test_stats_json_and_table(filled):
    result = run(filled, "stats", "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["records"] == 4 and stats["pinned"] == 1
    assert stats["by_kind"]["target"]["records"] == 3
    table = run(filled, "stats")
    assert table.exit_code == 0 and "records" in table.stdout and "hit rate" in table.stdout
    # Piped, a row is as long as what it says: no padding to the longest cell.
    lines = table.stdout.splitlines()
    assert lines and all(line == line.rstrip() for line in lines), lines
    assert min(len(line) for line in lines if line) < max(len(line) for line in lines)


def test_cache_dir_from_env(filled, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_DIR", str(filled))
    result = CliRunner().invoke(cli.main, ["stats", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["records"] == 4


def test_ls(filled):
    result = run(filled, "ls", "--json")
    assert result.exit_code == 0
    records = json.loads(result.stdout)
    assert {r["key"] for r in records} == {key("t1"), key("t2"), key("entry"), key("loose")}
    entry = next(r for r in records if r["kind"] == "entry")
    assert entry["pinned"] and entry["refs"] == [key("t1"), key("t2")]
    assert next(r for r in records if r["key"] == key("t1"))["manifest"] == {"graph": "g1"}
    only = json.loads(run(filled, "ls", "--json", "--kind", "entry").stdout)
    assert [r["key"] for r in only] == [key("entry")]
    table = run(filled, "ls")
    assert table.exit_code == 0
    for k in (key("t1"), key("entry")):
        assert k in table.stdout  # full keys, never cut, so they can be pasted into pin
    typo = run(filled, "ls", "--kind", "entyr")  # no such records: the kinds it holds
    assert typo.exit_code == 0 and key("entry") not in typo.stdout
    assert "no records of kind 'entyr' in this store; it holds entry, target" in typo.stderr
    assert typo.stdout == ""  # no empty table under it


def on_a_terminal(args: list[str], env: dict[str, str], columns: int) -> str:
    """What ``cachebuild ARGS`` prints on a terminal ``columns`` wide (escapes removed)."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in env.items() if k != "COLUMNS"}
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild.cli", *args], stdin=follower,
                            stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    out = bytearray()
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed its side
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode())


def test_ls_on_an_80_column_terminal_keeps_each_row_on_one_line(open_local, filled):
    open_local(filled).pin(key("t1"))
    env = {**os.environ, "CACHEBUILD_DIR": str(filled), "TERM": "xterm"}
    lines = on_a_terminal(["ls"], env, 80).splitlines()
    rows = [line for line in lines if key("t1") in line or key("entry") in line]
    assert len(rows) == 2 and all(len(line.rstrip()) <= 80 for line in lines), lines
    assert all(" ago " in row and "B " in row for row in rows), rows
    pinned = next(row for row in rows if key("t1") in row)
    assert pinned.rstrip().endswith("yes")
    assert any("a wider terminal, or --json" in line for line in lines)
    wide = on_a_terminal(["ls"], env, 140)
    assert "created" in wide and "refs" in wide and "wider terminal" not in wide


def test_gc(open_local, filled):
    dry = run(filled, "gc", "--max-size", "4K", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert key("loose") in dry.stdout and "would remove" in dry.stdout
    assert open_local(filled).contains(key("loose"))
    done = run(filled, "gc", "--max-size", "4K")
    assert done.exit_code == 0 and "removed 1 record" in done.stdout
    assert "pinned records alone" in done.stderr  # the pinned closure is over the cap
    left = {r.key for r in open_local(filled).records()}
    assert left == {key("t1"), key("t2"), key("entry")}
    assert run(filled, "gc", "--older-than", "7d").exit_code == 0
    assert len(list(open_local(filled).records())) == 3
    # A blob no record points to: the dry run says it would be quarantined, and leaves it.
    store = open_local(filled)
    orphan = store.root / "objects" / key("orphan")[:2] / key("orphan")
    orphan.parent.mkdir(exist_ok=True)
    shutil.copyfile(store.root / "objects" / key("t1")[:2] / key("t1"), orphan)
    store.close()
    dry = run(filled, "gc", "--dry-run")
    assert "would move 1 blob no record points to into quarantine/" in dry.stdout, dry.stdout
    assert orphan.exists()
    assert "moved 1 blob no record points to" in run(filled, "gc").stdout
    assert not orphan.exists()


def test_a_lost_index_keeps_every_blob_in_quarantine_for_its_days(filled):
    """The index moved aside (as its error message says to do when it is damaged): `gc`
    moves every blob into quarantine/, kept there its days counted from the move, not
    from when the blob was written (a store warmed ten days ago lost everything at once)."""
    objects = filled / "v1" / "objects"
    blobs = [p for p in objects.rglob("*") if p.is_file()]
    sizes = sorted(p.stat().st_size for p in blobs)
    ten_days_ago = os.stat(blobs[0]).st_mtime - 10 * 86400
    for p in blobs:
        os.utime(p, (ten_days_ago, ten_days_ago))
    (filled / "v1" / "index").rename(filled / "v1" / "index.damaged")
    done = run(filled, "gc")
    assert done.exit_code == 0 and f"moved {len(blobs)} blobs" in done.stdout, done.output
    assert run(filled, "gc").exit_code == 0  # a later run within the days keeps them
    kept = list((filled / "v1" / "quarantine").iterdir())
    assert sorted(p.stat().st_size for p in kept) == sizes


def test_gc_evicts_an_entry_with_its_targets_and_never_strands_one(open_local, store_dir):
    """Two unpinned model entries share a target. GC under a small cap takes the older
    entry first with the target only it refers to, then the newer one with the rest; at
    no point (and in the dry run's plan) is an entry left whose targets are gone."""
    store = open_local(store_dir)
    for name, size in (("a1", 3000), ("a2", 3000), ("shared", 3000), ("b1", 3000)):
        store.put(key(name), bytes(size), kind="aoti-cpu")
    store.put(key("old-entry"), b"entry", kind="entry",
              refs=[key("a1"), key("a2"), key("shared")])
    store.put(key("new-entry"), b"entry", kind="entry", refs=[key("shared"), key("b1")])
    store.close()
    with open_local(store_dir) as s:  # the newer entry and its targets were used later
        later = s.clock.time() + 10
        for name in ("new-entry", "shared", "b1"):
            small = s.index.get_small(key(name))
            small["last_used"] = later
            s.index.set_small(key(name), small)

    dry = run(store_dir, "gc", "--max-size", "10K", "--dry-run")
    assert dry.exit_code == 0, dry.output
    lines = [line.strip() for line in dry.stdout.splitlines() if key("a1")[:8] in line
             or key("old-entry")[:8] in line or key("a2")[:8] in line]
    assert [line.split()[0] for line in lines] == [key("old-entry"), key("a1"), key("a2")]
    assert key("shared") not in dry.stdout and key("new-entry") not in dry.stdout

    done = run(store_dir, "gc", "--max-size", "10K")
    assert done.exit_code == 0 and "removed 3 records" in done.stdout, done.output
    left = {r.key for r in open_local(store_dir).records()}
    assert left == {key("new-entry"), key("shared"), key("b1")}
    assert run(store_dir, "gc", "--max-size", "1B").exit_code == 0
    assert list(open_local(store_dir).records()) == []  # the entry went first, then the rest
    report = open_local(store_dir).gc(max_size=0, dry_run=True)
    assert report.units == []


@pytest.mark.parametrize("args", [["gc", "--max-size", "20X"], ["gc", "--older-than", "soon"],
                                  ["ls", "--bogus"], ["nosuchcommand"]])
def test_bad_usage_exits_2(filled, args):
    result = run(filled, *args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output


def test_a_signing_key_anyone_could_guess_is_refused(filled, monkeypatch):
    """A short key signs nothing worth trusting: the store is not opened with it."""
    monkeypatch.setenv("CACHEBUILD_SIGNING_KEY", "x")
    result = run(filled, "stats")
    assert result.exit_code == 2, result.output
    assert "CACHEBUILD_SIGNING_KEY is 1 byte long: use at least 16 random bytes" in result.output
    assert len(result.output.strip().splitlines()) == 1
    monkeypatch.setenv("CACHEBUILD_SIGNING_KEY", "k" * 16)
    assert run(filled, "stats").exit_code == 0


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--older-than", "7", "'7' has no unit: give one, e.g. 7d or 7h (7s for seconds)"),
    ("--max-size", "20", "'20' has no unit: give one, e.g. 20G or 20M (20B for bytes)")])
def test_gc_refuses_a_bare_number_and_removes_nothing(open_local, filled, option, value, says):
    """A slip (7 for 7d, 20 for 20G) would evict every record: refused, exit 2."""
    result = run(filled, "gc", option, value)
    assert result.exit_code == 2 and says in result.output, result.output
    assert len(list(open_local(filled).records())) == 4
    assert run(filled, "gc", option, "0", "--dry-run").exit_code == 0  # 0 is 0 in any unit


def test_pin_and_unpin(open_local, filled):
    assert run(filled, "pin", key("loose")).exit_code == 0
    assert open_local(filled).get_record(key("loose")).pinned
    result = run(filled, "unpin", key("loose"))
    assert result.exit_code == 0 and f"unpinned {key('loose')}" in result.stdout
    assert not open_local(filled).get_record(key("loose")).pinned
    # Said as it is where nothing changes: a script reading the line is not misled.
    again = run(filled, "unpin", key("loose"))
    assert again.exit_code == 0 and f"{key('loose')} was not pinned" in again.stdout
    assert run(filled, "pin", key("loose")).exit_code == 0
    twice = run(filled, "pin", key("loose"))
    assert twice.exit_code == 0 and f"{key('loose')} was already pinned" in twice.stdout


def test_keys_like_gits_a_unique_prefix_of_eight_will_do(open_local, store_dir):
    store = open_local(store_dir)
    store.put("abcdef0123" + "0" * 22, b"x", kind="target")
    store.put("abcdef0199" + "0" * 22, b"y", kind="target")
    store.close()
    result = run(store_dir, "pin", "abcdef0123")
    assert result.exit_code == 0, result.output
    assert f"pinned abcdef0123{'0' * 22}" in result.stdout
    ambiguous = run(store_dir, "unpin", "abcdef01")
    assert ambiguous.exit_code == 2 and ambiguous.stderr.count("\n") == 1
    assert ("key prefix abcdef01 is ambiguous: it matches "
            f"abcdef0123{'0' * 22}, abcdef0199{'0' * 22}") in ambiguous.stderr
    short = run(store_dir, "pin", "abcdef0")
    assert short.exit_code == 2 and "at least 8 characters" in short.stderr


@pytest.mark.parametrize("target, message", [
    (key("absent"), f"error: no record with key {key('absent')} in the store; "
                    "`cachebuild ls` lists"),
    (key("absent")[:12], f"error: no record with key {key('absent')[:12]} in the store; "
                         "`cachebuild ls` lists"),
    ("not-a-key", "error: 'not-a-key' is neither a store key"),
    ("nosuch/model.py", "error: "),
])
def test_pin_bad_input_is_one_line_exit_2(filled, target, message):
    result = run(filled, "pin", target)
    assert result.exit_code == 2
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_pin_of_a_model_file_that_is_not_there(filled, tmp_path):
    missing = tmp_path / "model.py"
    result = run(filled, "pin", str(missing))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {missing}: no such model file; a model file is ")
    assert result.stderr.count("\n") == 1
    missing.mkdir()
    result = run(filled, "pin", str(missing))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {missing} is a directory; a model file is ")


def test_model_resolver_can_be_plugged_in(open_local, filled, monkeypatch):
    seen = []

    def resolve(path, store):
        seen.append(path)
        return key("entry")

    monkeypatch.setattr("cachebuild.modelfile.stored_entry_key", resolve)
    assert run(filled, "unpin", "model.py").exit_code == 0
    assert seen == ["model.py"]
    assert not open_local(filled).get_record(key("entry")).pinned


def test_main_owns_the_table_of_commands():
    names = {c.name for c in cli.COMMANDS}
    assert names == set(cli.main.commands)
    assert {"ls", "stats", "gc", "verify", "pin", "unpin", "export", "import", "trust", "warm",
            "plan", "explain", "push", "pull"} == names


def _blob(store_dir, k):
    with LocalStore(store_dir) as store:
        return store.root / "objects" / k[:2] / k


def test_verify_exit_codes(open_local, filled):
    clean = run(filled, "verify")
    assert clean.exit_code == 0 and "incomplete" not in clean.output
    path = _blob(filled, key("t1"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    result = run(filled, "verify")
    assert result.exit_code == 1
    assert f"damaged {key('t1')}: payload checksum mismatch" in result.stderr
    assert "1 damaged" in result.stdout
    assert f"incomplete entry {key('entry')}: 1 of its 2 targets damaged or not stored here " \
        "(1 damaged)" in " ".join(result.stderr.split())
    repaired = run(filled, "verify", "--repair")
    assert repaired.exit_code == 0 and "(quarantined)" in repaired.stderr
    # The entry whose target went is named: not damage, but a start using it builds first.
    for result in (repaired, run(filled, "verify")):
        assert result.exit_code == 0
        assert f"incomplete entry {key('entry')}: 1 of its 2 targets not stored here" in \
            " ".join(result.stderr.split())
        assert "; 1 entry incomplete" in result.stdout
    assert not open_local(filled).contains(key("t1"))
    # An entry whose guards' seal is gone is not used at all: said as such.
    from cachebuild.keys import guard_seal_key

    sealed = {"key": key("sealed"), "guards": [], "pieces": [{"targets": [{"key": key("t2")}]}]}
    with LocalStore(filled) as store:
        store.put(key("sealed"), json.dumps(sealed).encode(), kind="entry",
                  refs=[key("t2"), guard_seal_key(key("sealed"), [])])
    said = " ".join(run(filled, "verify").stderr.split())
    assert f"incomplete entry {key('sealed')}: the seal of its guards is not stored here" in said


def test_unsafe_or_unusable_store_directory_is_bad_input_exit_2(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    result = run(d, "stats")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: refusing store directory")
    assert "chmod 700" in result.stderr and result.stderr.count("\n") == 1
    file = tmp_path / "a-file"
    file.write_text("")
    result = run(file, "stats")
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    assert result.stderr.count("\n") == 1
    # Under a file: no store there, and none can be (said so, not 'cannot create').
    result = run(file / "sub", "ls")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: there is no store directory {file / 'sub'}, and "
                                    f"none can be: {file} is a file, not a directory; give "
                                    "another path")


def test_a_read_only_folder_without_a_store_is_named_not_made(filled, tmp_path):
    """A folder that holds no store and cannot be written (a read-only mount): importing
    into it, warming or planning there is one line naming it, exit 2, before any work."""
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    bundle = tmp_path / "b.tar"
    assert run(filled, "export", str(bundle)).exit_code == 0
    model = os.path.join(os.path.dirname(__file__), "..", "examples", "llama.py")
    with read_only(empty, tmp_path / "view") as view:
        said = f"error: no store at {view}, and none can be made there: {view} is not writable"
        for args in (["import", str(bundle)], ["plan", model], ["warm", "--dry-run", model],
                     ["warm", model]):
            result = run(view, *args)
            assert result.exit_code == 2, (args, result.output)
            assert result.stderr.startswith(said) and result.stderr.count("\n") == 1, \
                (args, result.stderr)


def test_export_to_standard_output_is_refused_not_a_file_named_dash(filled, tmp_path,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run(filled, "export", "-")
    assert result.exit_code == 2 and "not standard output" in result.stderr
    assert not (tmp_path / "-").exists()


def test_export_to_a_missing_directory_is_bad_input(filled, tmp_path):
    result = run(filled, "export", str(tmp_path / "nowhere" / "b.tar"))
    assert result.exit_code == 2
    assert result.stderr == (f"error: cannot write the bundle {tmp_path / 'nowhere' / 'b.tar'}: "
                             f"directory {tmp_path / 'nowhere'} does not exist\n")


def test_a_path_that_cannot_be_a_store_is_one_line(tmp_path):
    """A file where a folder must be, or a name too long: one line naming the path, exit 2,
    for a command that reads a store and for one that makes it."""
    file = tmp_path / "a-file"
    file.write_text("")
    bundle = tmp_path / "b.tar"
    bundle.write_bytes(b"")
    cases = [(file / "sub", ["import", str(bundle)]), (tmp_path / ("x" * 300), ["stats"])]
    if os.path.isdir("/proc/self"):  # a file system that makes no folders
        cases.append((Path("/proc/cachebuild-store"), ["import", str(bundle)]))
    for store, args in cases:
        result = run(store, *args)
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, \
            result.stderr
        assert "Traceback" not in result.output


def test_export_never_replaces_what_is_not_a_bundle(filled, tmp_path):
    """No file name, a path inside the store (its index, say) or something that is not a
    regular file (a FIFO here, a device as root): refused before anything is written, and
    the store still reads; so is a metrics file (``stats --prometheus``) there."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    index = next((filled / "v1" / "index").glob("*.db"))
    for target, says in (("", "give the bundle a file name"),
                         (str(index), "inside the store"),
                         (str(fifo), "exists and is not a regular file"),
                         (str(notes), "exists and is not a bundle"),
                         (str(tmp_path / "cache.zip"), "use cache.tar, or cache.tar.gz")):
        result = run(filled, "export", target)
        assert result.exit_code == 2 and says in result.stderr, result.output
    result = run(filled, "stats", "--prometheus", str(fifo))
    assert result.exit_code == 2 and "not a regular file" in result.stderr, result.output
    blob = next(p for p in (filled / "v1" / "objects").rglob("*") if p.is_file())
    for inside in (index, blob):  # the metrics file would replace the store's own
        before = inside.read_bytes()
        result = run(filled, "stats", "--prometheus", str(inside))
        assert result.exit_code == 2 and "inside the store" in result.stderr, result.output
        assert inside.read_bytes() == before
    assert run(filled, "ls").exit_code == 0 and run(filled, "verify").exit_code == 0
    assert not (tmp_path / "cache.zip").exists() and notes.read_text() == "mine"


# -- export / import ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cache.tar", "cache.tar.gz", "cache.tgz"])
def test_export_import_round_trip(open_local, filled, tmp_path, name):
    bundle = tmp_path / name
    result = run(filled, "export", str(bundle))
    assert result.exit_code == 0 and "exported 4 records" in result.stdout
    target = tmp_path / "elsewhere"
    # Unsigned (a keyless store): imported, but not served until the bundle is trusted.
    result = run(target, "import", str(bundle))
    assert result.exit_code == 0, result.output
    assert "imported 4 records" in result.stdout
    assert f"not trusted: 4 records from bundle {name}" in result.stderr
    dst = open_local(target)
    assert all(dst.get(r.key) is None for r in dst.records())
    result = run(target, "trust", f"bundle {name}")
    assert result.exit_code == 0 and "trusted 4 records" in result.stdout, result.output
    result = run(target, "trust", f"bundle {name}")  # again, as a script does: done already
    assert result.exit_code == 0 and "4 records from bundle" in result.stdout
    assert "already trusted" in result.stdout
    assert run(target, "trust", "bundle typo.tar").exit_code == 2  # a source never seen
    src = open_local(filled)
    for record in src.records():
        copy = dst.get_record(record.key)
        # refs read again from the blob; a pin only where the importer trusts the bundle
        assert (copy.kind, copy.size, copy.checksum, copy.refs, copy.manifest) == (
            record.kind, record.size, record.checksum, record.refs, record.manifest)
        assert not copy.pinned
        assert dst.get(record.key) == src.get(record.key)
    again = run(target, "import", str(bundle))
    assert again.exit_code == 0 and "4 already present" in again.stdout
    trusted = tmp_path / "trusting"
    assert run(trusted, "import", "--trust", str(bundle)).exit_code == 0
    assert {(r.key, r.pinned) for r in open_local(trusted).records()} == {
        (r.key, r.pinned) for r in src.records()} and any(r.pinned for r in src.records())


def test_export_selection(filled, tmp_path):
    bundle = tmp_path / "entry.tar"
    assert run(filled, "export", str(bundle), key("entry")).exit_code == 0
    with tarfile.open(bundle) as tar:
        objects = {m.name.split("/")[1] for m in tar if m.name.startswith("objects/")}
    assert objects == {key("entry"), key("t1"), key("t2")}  # the entry and its refs
    kinds = tmp_path / "targets.tar"
    assert run(filled, "export", str(kinds), "--kind", "target").exit_code == 0
    with tarfile.open(kinds) as tar:
        assert sum(m.name.startswith("objects/") for m in tar) == 3
    typo = run(filled, "export", str(tmp_path / "typo.tar"), "--kind", "targte")
    assert typo.exit_code == 2 and "no records of kind 'targte' in this store; it holds " \
        in typo.output, typo.output
    assert not (tmp_path / "typo.tar").exists()


def test_import_refuses_damaged_entries_and_names_them(open_local, filled, tmp_path):
    bundle = tmp_path / "cache.tar"
    assert run(filled, "export", str(bundle)).exit_code == 0
    flip_payload_byte(bundle, key("t2"))
    target = tmp_path / "elsewhere"
    result = run(target, "import", str(bundle))
    assert result.exit_code == 1
    assert f"refused {key('t2')}: payload checksum mismatch" in result.stderr
    # The entry came whole, but one of its targets did not: not kept without it.
    assert f"refused {key('entry')}: refers to 1 record the bundle held but that" in result.stderr
    assert "imported 2 records" in result.stdout
    dst = open_local(target)
    assert not dst.contains(key("t2")) and not dst.contains(key("entry"))
    assert {r.key for r in dst.records()} == {key("t1"), key("loose")}
    assert dst.verify().clean


def test_import_of_entries_alone_keeps_them(open_local, filled, tmp_path):
    """A bundle of entries without their targets (which a remote tier serves, say): the
    import keeps them; only a target the bundle held and did not store strands one."""
    bundle = tmp_path / "entries.tar"
    assert run(filled, "export", str(bundle), "--kind", "entry").exit_code == 0
    target = tmp_path / "elsewhere"
    result = run(target, "import", str(bundle))
    assert result.exit_code == 0, result.output
    assert {r.key for r in open_local(target).records()} == {key("entry")}


def test_entries_are_exported_with_their_guards_seals(open_local, store_dir, tmp_path):
    """An entry's seal is a record of kind ``guards``: part of the entry, without which
    an importer could not use it."""
    with LocalStore(store_dir) as store:
        store.put(key("seal"), b"", kind="guards")
        store.put(key("entry"), b"{}", kind="entry", refs=[key("seal")])
    bundle = tmp_path / "entries.tar"
    assert run(store_dir, "export", str(bundle), "--kind", "entry").exit_code == 0
    target = tmp_path / "elsewhere"
    assert run(target, "import", str(bundle)).exit_code == 0
    assert {r.key for r in open_local(target).records()} == {key("entry"), key("seal")}


def _refusal_counts_records_only(stderr: str) -> None:
    """The import's last line counts the records refused by name, and says apart that the
    rest of the bundle could not be read (it was counted as one more record)."""
    named = [line for line in stderr.splitlines()
             if line.startswith("refused ") and not line.startswith("refused (rest")]
    rest = any(line.startswith("refused (rest of bundle)") for line in stderr.splitlines())
    last = " ".join(stderr.split()).rsplit("error: refused ", 1)[-1]
    if named:
        n = len(named)
        assert last.startswith(f"{n} record{'s' if n != 1 else ''} (damaged"), last
    assert ("the rest of the bundle (damaged or truncated: not read)" in last) == rest, last


def test_import_truncated_bundle(open_local, filled, tmp_path):
    bundle = tmp_path / "cache.tar"
    assert run(filled, "export", str(bundle)).exit_code == 0
    data = bundle.read_bytes()
    with tarfile.open(bundle) as tar:
        third = [m for m in tar if m.name.startswith("objects/")][2]
    bundle.write_bytes(data[:third.offset_data + 100])
    target = tmp_path / "elsewhere"
    result = run(target, "import", str(bundle))
    assert result.exit_code == 1
    assert "bundle is damaged or truncated" in result.stderr
    _refusal_counts_records_only(result.stderr)
    # Cut inside a member's header: the rest of the bundle is refused, not counted as a record.
    bundle.write_bytes(data[:3000])
    again = run(tmp_path / "third", "import", str(bundle))
    assert again.exit_code == 1
    _refusal_counts_records_only(again.stderr)
    dst = open_local(target)
    # What came before the damage, but the entry whose target it held: no record is kept
    # without what it refers to.
    records = list(dst.records())
    assert len(records) == 1 and dst.verify().clean, records
    assert all(dst.get_record(ref) is not None for r in records for ref in r.refs)
    missing = third.name.split("/")[1]
    assert missing in result.stderr and not dst.contains(missing)


def test_import_not_a_bundle_exits_2(filled, tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar file at all" * 100)
    result = run(filled, "import", str(junk))
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    result = run(filled, "import", str(tmp_path / "absent.tar"))
    assert result.exit_code == 2 and "no such bundle" in result.stderr
    # A tar archive, but not one `export` wrote.
    other = tmp_path / "other.tar"
    with tarfile.open(other, "w") as tar:
        tar.add(junk, arcname="junk.txt")
    result = run(filled, "import", str(other))
    assert result.exit_code == 2 and "is not a cachebuild bundle" in result.stderr
    # Refused before a store is opened: none is made where none was.
    for bundle in (junk, tmp_path / "absent.tar", other, tmp_path):
        result = run(tmp_path / "new-store", "import", str(bundle))
        assert result.exit_code == 2 and not (tmp_path / "new-store").exists()


# -- a real process ---------------------------------------------------------------------------


def test_real_process_exit_codes(filled, tmp_path):
    damaged_dir = tmp_path / "damaged"
    shutil.copytree(filled, damaged_dir)
    path = _blob(damaged_dir, key("loose"))
    path.write_bytes(path.read_bytes()[:-7])
    module = [sys.executable, "-m", "cachebuild.cli"]
    script = shutil.which("cachebuild")  # the console script, where it is installed
    runs = {
        "ok": ([*module, "--cache-dir", str(filled), "stats", "--json"]),
        "damaged": ([*module, "--cache-dir", str(damaged_dir), "verify"]),
        "usage": ([*([script] if script else module), "--cache-dir", str(filled), "pin",
                   "nonsense"]),
    }
    # Each process imports torch (through the cachebuild package): run them side by side.
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in runs.items()}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stdout, stderr)
    code, stdout, stderr = out["ok"]
    assert code == 0, stderr
    assert json.loads(stdout)["records"] == 4
    code, stdout, stderr = out["damaged"]
    assert code == 1 and f"damaged {key('loose')}: truncated" in stderr
    code, stdout, stderr = out["usage"]
    assert code == 2
    assert stderr.startswith("error: ") and stderr.count("\n") == 1
    assert "Traceback" not in stderr


@pytest.mark.parametrize("args, message", [
    (["gc", "--max-size", "20X"], "error: invalid value for '--max-size': not a size: '20X'"),
    (["nosuchcommand"], "error: no such command 'nosuchcommand' (see `cachebuild --help`)"),
    (["ls", "--bogus"], "error: no such option '--bogus' (see `cachebuild ls --help`)"),
    (["pin"], "error: missing argument 'KEY|MODEL.py' (see `cachebuild pin --help`)"),
])
def test_click_usage_errors_are_one_line_like_ours(filled, args, message):
    proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir", str(filled),
                           *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == ""


def test_piped_output_is_never_wrapped_and_repair_reports_once(filled):
    path = _blob(filled, key("t1"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir", str(filled),
                           "verify", "--repair"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(key("t1")) == 1, proc.stderr  # said once, not by a log line too
    listing = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir", str(filled),
                              "ls"], capture_output=True, text=True, env=env, timeout=120)
    rows = [line for line in listing.stdout.splitlines() if key("entry") in line]
    assert len(rows) == 1 and "entry" in rows[0].split()[1:]  # one line per record, uncut
    assert max(len(line) for line in listing.stdout.splitlines()) > 80


def test_the_command_alone_prints_its_help_as_it_reads():
    result = CliRunner().invoke(cli.main, [], prog_name="cachebuild")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage: cachebuild")
    assert "\nCommands:\n" in result.output and "error:" not in result.output


@pytest.mark.parametrize("command", [["verify"], ["ls"], ["stats", "--json"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(filled, command):
    """`cachebuild verify | true`: the pipe closed under the command is no error of the
    paths given (it said "Broken pipe; check the paths given", exit 2): nothing is said,
    and the exit code is the one a shell gives a process SIGPIPE ends. Also where rich
    writes the lines (`ls`, `stats`: rich's own handler of it exited 1)."""
    import signal

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir",
                               str(filled), *command], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(write)
    assert proc.returncode == 128 + signal.SIGPIPE and proc.stderr == "", proc.stderr
