"""Nothing from outside runs unvetted (issue 32, item 2): what enters a store without a
signature the store's key verifies is served only once the user trusted its source by
name, and that decision is kept in the record.

End to end with real processes: a store warmed with a fleet key is exported; imported into
a fresh keyless store, a server start does not load it (one line says what to do; it
builds its own); ``import --trust`` or ``cachebuild trust SOURCE`` makes it serve with
nothing traced or built, outputs equal to eager; a bundle's records cannot claim trust; a
store with the fleet key takes the signed bundle unchanged, no flag.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_trust_model import SERVER, model_file, warm
from trust import assert_one_line_error, clean_env, cli, python

pytestmark = pytest.mark.slow

KEY = "fleet-key-for-tests"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model (two ``eager_fusion`` targets) warmed into a store with the fleet
    key, exported whole to ``cache.tar``."""
    base = tmp_path_factory.mktemp("sources")
    model = model_file(base)
    env = clean_env(CACHEBUILD_DIR=str(base / "golden"), CACHEBUILD_SIGNING_KEY=KEY)
    assert warm(model, env)[2] == 2
    path = base / "cache.tar"
    exported = cli("export", str(path), env=env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    return model, path


@pytest.fixture(scope="module")
def source(bundle) -> str:
    """The source what comes unsigned from the bundle is marked with."""
    from cachebuild.store import bundle_source

    return bundle_source(bundle[1])


def serve(model: Path, env: dict[str, str]) -> tuple[dict, str]:
    """A server start (outputs checked against eager at three sizes): its counters and
    its stderr."""
    proc = python(SERVER, str(model), env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def records(env: dict[str, str]) -> list[dict]:
    """The store's records as ``ls --json`` prints them (read in this process: cheaper)."""
    from cachebuild.store import LocalStore

    with LocalStore(env["CACHEBUILD_DIR"]) as store:
        return [r.to_json() for r in store.records(manifests=False)]


def test_an_unsigned_import_is_not_served_until_its_source_is_trusted(bundle, source, tmp_path):
    model, path = bundle
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "keyless"))
    imported = cli("import", str(path), env=env)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert f"cachebuild trust '{source}'" in imported.stderr
    assert all(r["unsigned_from"] == source and r["trusted"] is None for r in records(env))
    listed = cli("ls", env=env)
    assert listed.returncode == 0 and "NOT TRUSTED" in listed.stdout, listed.stdout
    verified = cli("verify", env=env)
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert re.search(r": 0 ok, 0 damaged, \d+ not trusted", verified.stdout), verified.stdout
    assert "not trusted: " in verified.stderr and source in verified.stderr

    # A server does not load it: it says so in one line, naming the command, and builds
    # its own (the outputs are checked against eager all the same).
    stats, err = serve(model, env)
    assert stats["built"] == 2 and stats["traced"] == 1, stats
    told = [line for line in err.splitlines() if "not loading what came unsigned" in line]
    assert len(told) == 1 and f"cachebuild trust '{source}'" in told[0], err[-3000:]
    # What it built replaced what it would not load; a second start loads that, silently.
    assert all(r["unsigned_from"] is None for r in records(env))
    stats, err = serve(model, env)
    assert stats["built"] == 0 and stats["traced"] == 0 and "not loading" not in err


def test_trusting_the_source_by_name_serves_it_and_is_kept_in_the_record(bundle, source, tmp_path):
    model, path = bundle
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "later"))
    assert cli("import", str(path), env=env).returncode == 0
    assert_one_line_error(cli("trust", "bundle other.tar", env=env), 2,
                          rf"no untrusted record came from 'bundle other.tar'.*'{re.escape(source)}'")
    trusted = cli("trust", source, env=env)
    assert trusted.returncode == 0 and "trusted 4 records" in trusted.stdout, trusted.stderr
    assert {r["trusted"] for r in records(env)} == {f"cachebuild trust ({source})"}
    stats, err = serve(model, env)
    assert stats["built"] == 0 and stats["traced"] == 0 and "not loading" not in err, stats

    # At import, with the one flag the README's deploy flow names (also over an import
    # made without it).
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "at-once"))
    assert cli("import", str(path), env=env).returncode == 0
    assert cli("import", "--trust", str(path), env=env).returncode == 0
    assert {r["trusted"] for r in records(env)} == {f"cachebuild import --trust ({source})"}
    stats, err = serve(model, env)
    assert stats["built"] == 0 and stats["traced"] == 0 and "not loading" not in err, stats

    # Trust never travels: a bundle of that store says "trusted" in its records, and a
    # store it is imported into still does not serve it.
    again = tmp_path / "again.tar"
    assert cli("export", str(again), env=env).returncode == 0
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "third"))
    assert cli("import", str(again), env=env).returncode == 0
    assert all(r["trusted"] is None for r in records(env))
    stats, err = serve(model, env)
    assert stats["built"] == 2 and "not loading what came unsigned" in err


def test_a_store_with_the_fleet_key_takes_the_signed_bundle_unchanged(bundle, tmp_path):
    model, path = bundle
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "keyed"), CACHEBUILD_SIGNING_KEY=KEY)
    imported = cli("import", str(path), env=env)
    assert imported.returncode == 0 and "not trusted" not in imported.stderr, imported.stderr
    assert all(r["unsigned_from"] is None for r in records(env))
    stats, err = serve(model, env)
    assert stats["built"] == 0 and stats["traced"] == 0 and "not loading" not in err, stats
