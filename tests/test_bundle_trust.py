"""Importing a bundle into a store that already holds its keys: what the bundle brings is
compared with what is stored, trust goes to bytes and to the bundle file imported (never
to a name a bundle writes into its records), and the counts say what happened."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from trust import flip_payload_byte

from cachebuild.cli import main as cli
from cachebuild.keys import make_key
from cachebuild.store import LocalStore, encode_blob, export_bundle, import_bundle
from cachebuild.store.blob import parse_header, payload_checksum

PAYLOADS = {"t1": b"a" * 3000, "t2": b"b" * 2000, "entry": b"entry", "loose": b"c" * 5000}


def key(name: str) -> str:
    return make_key({"bundle-trust": name})


def run(store_dir: Path, *args: str):
    return CliRunner().invoke(cli.main, ["--cache-dir", str(store_dir), *args])


@pytest.fixture
def genuine(tmp_path) -> Path:
    """A genuine bundle ``good/cache.tar`` of four records from a store built here."""
    with LocalStore(tmp_path / "source") as store:
        for name, payload in PAYLOADS.items():
            store.put(key(name), payload, kind="target", manifest={"graph": name})
        (tmp_path / "good").mkdir()
        export_bundle(store, tmp_path / "good" / "cache.tar")
    return tmp_path / "good" / "cache.tar"


def members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]


def write_bundle(path: Path, content: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in content:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def forged(genuine: Path, out: Path, victim: str, payload: bytes, *,
           claim: str | None = "bundle cache.tar") -> Path:
    """``genuine`` with ``victim``'s blob holding ``payload`` under a valid checksum, and
    every record claiming to come unsigned from ``claim`` (what evil.py does)."""
    content = []
    for name, data in members(genuine):
        if name == f"objects/{victim}":
            kind = parse_header(data).kind
            data = encode_blob(victim, kind, payload)
        elif name.startswith("records/"):
            record = json.loads(data)
            record["unsigned_from"] = claim
            if record["key"] == victim:
                record["size"], record["checksum"] = len(payload), payload_checksum(payload)
            data = json.dumps(record).encode()
        content.append((name, data))
    return write_bundle(out, content)


EVIL = b"import os; os.system('owned')  # " + b"x" * 64


def test_a_forged_bundle_then_the_genuine_one_trusted_serves_the_genuine_bytes(
        open_local, tmp_path, genuine):
    store_dir, victim = tmp_path / "store", key("t1")
    evil = forged(genuine, tmp_path / "evil.tar", victim, EVIL)
    first = run(store_dir, "import", str(evil))
    assert first.exit_code == 0 and "imported 4 records" in first.stdout, first.output
    # The claim inside the bundle is not its source: the file it came from is.
    assert "not trusted: 4 records from bundle evil.tar" in first.stderr
    borrowed = run(store_dir, "trust", "bundle cache.tar")
    assert borrowed.exit_code == 2, borrowed.output

    result = run(store_dir, "import", "--trust", str(genuine))
    assert result.exit_code == 0, result.output
    # The forged copy was never served, and the operator vouches for this bundle: its
    # bytes take the key; the three identical records are already present.
    assert "imported 1 record from" in result.stdout and "3 already present" in result.stdout
    store = open_local(store_dir)
    for name, payload in PAYLOADS.items():
        assert store.get(key(name)) == payload
    record = store.get_record(victim)
    assert record.checksum == payload_checksum(PAYLOADS["t1"]) and record.trusted
    assert store.verify().clean


def test_the_genuine_bundle_without_trust_refuses_the_key_a_forgery_holds(
        open_local, tmp_path, genuine):
    store_dir, victim = tmp_path / "store", key("t1")
    evil = forged(genuine, tmp_path / "elsewhere" / "cache.tar", victim, EVIL)  # same name
    assert run(store_dir, "import", str(evil)).exit_code == 0
    result = run(store_dir, "import", str(genuine))
    assert result.exit_code == 1, result.output
    assert "imported 0 records" in result.stdout and "3 already present" in result.stdout
    assert f"refused {victim}: differs from the blob already stored" in result.stderr
    store = open_local(store_dir)
    assert store.get_record(victim).checksum == payload_checksum(EVIL)
    assert store.get(victim) is None  # untrusted, never served
    # --trust of the genuine one afterwards still replaces the forgery by content.
    assert run(store_dir, "import", "--trust", str(genuine)).exit_code == 0
    assert store.get(victim) == PAYLOADS["t1"]


def test_trust_marks_only_records_holding_the_bytes_the_bundle_brought(
        open_local, tmp_path, genuine):
    store_dir, victim = tmp_path / "store", key("t1")
    evil = forged(genuine, tmp_path / "evil.tar", victim, EVIL)
    assert run(store_dir, "import", str(evil)).exit_code == 0
    store = open_local(store_dir)
    brought = {key(n): payload_checksum(p) for n, p in PAYLOADS.items()}
    marked = store.trust_blobs("test", brought)
    assert sorted(marked) == sorted(k for k in brought if k != victim)
    assert store.get_record(victim).is_untrusted and store.get(victim) is None


def test_a_trusted_record_is_never_replaced_by_a_bundle(open_local, tmp_path, genuine):
    victim = key("t1")
    evil = forged(genuine, tmp_path / "evil.tar", victim, EVIL, claim=None)
    # The store the genuine bundle was exported from: built here, so trusted.
    result = run(tmp_path / "source", "import", "--trust", str(evil))
    # Kept out, not an error: the store holds a copy it serves, as after a server rebuilt
    # what an earlier untrusted import brought (two builds of a target seldom match).
    assert result.exit_code == 0, result.output
    assert "refused" not in result.stderr
    assert "imported 0 records" in result.stdout and "3 already present" in result.stdout
    assert "1 kept as built here" in result.stdout
    assert f"kept {victim}: built here" in result.stderr
    store = open_local(tmp_path / "source")
    assert store.get(victim) == PAYLOADS["t1"] and store.get_record(victim).trusted is None
    assert store.verify().clean


def test_a_copy_trusted_from_another_bundle_stays_a_conflict(open_local, tmp_path, genuine):
    """Only a copy this store built itself keeps its key quietly: one another bundle
    brought and someone trusted, differing from this bundle's, is a conflict to see."""
    store_dir, victim = tmp_path / "store", key("t1")
    evil = forged(genuine, tmp_path / "evil.tar", victim, EVIL)
    assert run(store_dir, "import", "--trust", str(evil)).exit_code == 0
    result = run(store_dir, "import", "--trust", str(genuine))
    assert result.exit_code == 1, result.output
    assert f"refused {victim}: differs from the blob already stored" in result.stderr
    assert "kept as built here" not in result.output


def test_a_flipped_byte_into_a_store_holding_the_keys_is_refused(open_local, tmp_path, genuine):
    store_dir = tmp_path / "store"
    assert run(store_dir, "import", "--trust", str(genuine)).exit_code == 0
    before = {r.key: r for r in open_local(store_dir).records()}
    flip_payload_byte(genuine, key("t2"))
    result = run(store_dir, "import", "--trust", str(genuine))
    assert result.exit_code == 1, result.output
    assert f"refused {key('t2')}: payload checksum mismatch" in result.stderr
    assert "imported 0 records" in result.stdout and "3 already present" in result.stdout
    store = open_local(store_dir)
    assert {r.key: r for r in store.records()} == before
    assert store.get(key("t2")) == PAYLOADS["t2"] and store.verify().clean


def test_a_duplicate_member_is_counted_once(open_local, tmp_path, genuine):
    k = key("t2")
    content = members(genuine)
    blob = dict(content)[f"objects/{k}"]
    damaged = blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:]
    dup = write_bundle(tmp_path / "dup.tar", [*content, (f"records/{k}.json",
                                                         dict(content)[f"records/{k}.json"]),
                                              (f"objects/{k}", damaged)])
    report = import_bundle(open_local(tmp_path / "store"), dup)
    assert sorted(report.imported) == sorted(key(n) for n in PAYLOADS)
    assert not report.existing and not report.ok
    assert report.refused == [(k, "blob appears more than once in the bundle; "
                                  "only the first copy was read")]
    again = import_bundle(open_local(tmp_path / "store"), dup)
    assert not again.imported and len(again.existing) == len(PAYLOADS)
    assert len(again.refused) == 1


def test_a_plain_reimport_is_all_already_present(open_local, tmp_path, genuine):
    store_dir = tmp_path / "store"
    first = run(store_dir, "import", str(genuine))
    assert first.exit_code == 0 and "imported 4 records" in first.stdout, first.output
    again = run(store_dir, "import", str(genuine))
    assert again.exit_code == 0, again.output
    assert "imported 0 records" in again.stdout and "4 already present" in again.stdout
    # --trust of the same bundle later trusts those very records.
    trusted = run(store_dir, "import", "--trust", str(genuine))
    assert trusted.exit_code == 0 and "4 already present" in trusted.stdout
    store = open_local(store_dir)
    assert all(store.get(key(n)) == p for n, p in PAYLOADS.items())


def test_a_stored_blob_damaged_on_disk_is_repaired_by_the_same_bytes(
        open_local, tmp_path, genuine):
    store_dir = tmp_path / "store"
    assert run(store_dir, "import", "--trust", str(genuine)).exit_code == 0
    store = open_local(store_dir)
    path = store.layout.blob(key("loose"))
    path.chmod(0o600)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    result = run(store_dir, "import", "--trust", str(genuine))
    assert result.exit_code == 0 and "imported 1 record" in result.stdout, result.output
    assert store.get(key("loose")) == PAYLOADS["loose"] and store.verify().clean


def test_a_start_over_an_untrusted_entry_says_why_it_is_not_served(tmp_path, caplog):
    """An imported entry nobody trusted yet is not served: the start that traces says so,
    not that the model was never warmed."""
    import logging

    import models
    import torch

    import cachebuild

    model = models.make(models.Decoder, layers=1)
    with LocalStore(tmp_path / "source") as source:
        warm = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=source)
        models.assert_matches_eager(warm, model, models.inputs(5))
        export_bundle(source, tmp_path / "cache.tar")
    caplog.clear()
    with LocalStore(tmp_path / "store") as store:
        import_bundle(store, tmp_path / "cache.tar")
        compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
        with caplog.at_level(logging.WARNING, logger="cachebuild"), torch.no_grad():
            models.assert_matches_eager(compiled, model, models.inputs(5))
    assert "its stored entry is not served here" in caplog.text
    assert "it was not warmed" not in caplog.text


def _bundle_of(path: Path, payloads: dict[str, bytes]) -> Path:
    with LocalStore(path.parent / f"{path.parent.name}-source") as store:
        for name, payload in payloads.items():
            store.put(key(name), payload, kind="target")
        path.parent.mkdir(parents=True, exist_ok=True)
        export_bundle(store, path)
    return path


def test_two_bundles_of_one_name_are_two_sources(open_local, tmp_path, genuine):
    """Trust goes to the bundle imported, not to its file name: another `cache.tar`
    imported before (looked at, not trusted) is not trusted with it."""
    store_dir = tmp_path / "store"
    other = _bundle_of(tmp_path / "other" / "cache.tar", {"x1": b"x" * 100, "x2": b"y" * 50})
    assert run(store_dir, "import", str(other)).exit_code == 0
    result = run(store_dir, "import", str(genuine))
    assert result.exit_code == 0, result.output
    said = result.stderr.split("`cachebuild trust '")[1].split("'`")[0]
    assert said.startswith("bundle cache.tar (") and said != "bundle cache.tar"
    ambiguous = run(store_dir, "trust", "bundle cache.tar")
    assert ambiguous.exit_code == 2 and "2 untrusted sources" in ambiguous.output
    assert run(store_dir, "trust", said).exit_code == 0
    store = open_local(store_dir)
    assert all(store.get(key(n)) == p for n, p in PAYLOADS.items())
    assert store.get(key("x1")) is None and store.get_record(key("x1")).is_untrusted
    # The other one, now the only untrusted source of that name, is named by it alone.
    assert run(store_dir, "trust", "bundle cache.tar").exit_code == 0
    assert store.get(key("x1")) == b"x" * 100


def test_a_bundle_decides_no_pin_and_no_ref(open_local, tmp_path, genuine):
    """A bundle's records may not say what GC keeps: refs are read from the blobs (a
    target's list none), and a pin is kept only where the importer trusts the bundle."""
    everything = [key(n) for n in PAYLOADS]
    content = []
    for name, data in members(genuine):
        if name.startswith("records/"):
            record = json.loads(data)
            record["pinned"], record["refs"] = True, everything
            data = json.dumps(record).encode()
        content.append((name, data))
    claims = write_bundle(tmp_path / "claims.tar", content)
    store_dir = tmp_path / "store"
    assert run(store_dir, "import", str(claims)).exit_code == 0
    store = open_local(store_dir)
    assert [(r.pinned, r.refs) for r in store.records()] == [(False, ())] * len(PAYLOADS)
    assert run(store_dir, "gc", "--max-size", "0").exit_code == 0
    assert list(store.records()) == []
    # Trusted at import, its pins are the importer's word; still no refs of its own.
    assert run(store_dir, "import", "--trust", str(claims)).exit_code == 0
    assert [(r.pinned, r.refs) for r in store.records()] == [(True, ())] * len(PAYLOADS)


def test_a_manifest_nested_too_deep_is_refused_on_arrival(open_local, tmp_path, genuine):
    """A record whose manifest nests hundreds deep is refused at import, by name; the
    others come in, and every command reads the store after (`ls --json` and `export`
    once failed with a RecursionError on such a record)."""
    deep: object = "bottom"
    for _ in range(900):
        deep = [deep]
    victim = key("t2")
    content = []
    for name, data in members(genuine):
        if name == f"records/{victim}.json":
            record = json.loads(data)
            record["manifest"] = {"deep": deep}
            data = json.dumps(record).encode()
        content.append((name, data))
    store_dir = tmp_path / "store"
    result = run(store_dir, "import", "--trust", str(write_bundle(tmp_path / "deep.tar", content)))
    assert result.exit_code == 1 and "imported 3 records" in result.stdout, result.output
    assert f"refused {victim}: " in result.stderr and "nests more than" in result.stderr
    assert run(store_dir, "ls", "--json").exit_code == 0
    assert run(store_dir, "export", str(tmp_path / "again.tar")).exit_code == 0
    assert open_local(store_dir).get_record(victim) is None


def test_a_full_disk_stops_an_import_and_says_what_came_in(open_local, tmp_path):
    """A bundle larger than the disk: the import stops at the blob that does not fit,
    says how many records came in before it (once it said only "nothing was stored"), and
    what came in is whole and served."""
    from mounts import tmpfs

    payloads = {f"big{i}": bytes([i]) * (2 << 20) for i in range(6)}  # 12 MiB in all
    bundle = _bundle_of(tmp_path / "big" / "cache.tar", payloads)
    with tmpfs(tmp_path / "disk", "8m") as disk:
        result = run(disk / "store", "import", "--trust", str(bundle))
        assert result.exit_code == 1, result.output
        came = int(result.stdout.split("imported ")[1].split()[0])
        assert 0 < came < len(payloads), result.output
        said = result.stderr.strip().splitlines()[-1]
        assert said.startswith("error: no space left") and "the import stopped there" in said
        assert f"the {came} record" in said and "listed in the bundle" not in result.stderr
        verified = run(disk / "store", "verify")
        assert verified.exit_code == 0 and f"{came} ok, 0 damaged" in verified.stdout, \
            verified.output


def test_a_copy_signed_elsewhere_is_not_taken_for_one_built_here(open_local, tmp_path):
    """A store with the fleet key that imported a signed bundle holds copies it did not
    build: another bundle's differing copy is a conflict to see (exit 1), not "kept as
    built here"; a copy it built itself still is."""
    fleet = "k" * 32
    with LocalStore(tmp_path / "source", signing_key=fleet.encode()) as store:
        for name, payload in PAYLOADS.items():
            store.put(key(name), payload, kind="target", manifest={"graph": name})
        (tmp_path / "signed").mkdir()
        export_bundle(store, tmp_path / "signed" / "cache.tar")
    victim = key("t1")
    evil = forged(tmp_path / "signed" / "cache.tar", tmp_path / "evil.tar", victim, EVIL)
    env = {"CACHEBUILD_SIGNING_KEY": fleet}

    def run_keyed(store_dir: Path, *args: str):
        return CliRunner().invoke(cli.main, ["--cache-dir", str(store_dir), *args], env=env)

    assert run_keyed(tmp_path / "store", "import", str(tmp_path / "signed" / "cache.tar")
                     ).exit_code == 0
    assert open_local(tmp_path / "store").get_record(victim).trusted
    result = run_keyed(tmp_path / "store", "import", "--allow-unsigned", str(evil))
    assert result.exit_code == 1, result.output
    assert f"refused {victim}: differs from the blob already stored" in result.stderr
    assert "kept as built here" not in result.output
    built_here = run_keyed(tmp_path / "source", "import", "--allow-unsigned", str(evil))
    assert built_here.exit_code == 0, built_here.output
    assert "1 kept as built here" in built_here.stdout
