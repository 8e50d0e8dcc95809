"""A fleet on one Redis, model level: ``warm``, ``pull`` and ``push`` through the CLI and
``cachebuild.compile`` in fresh processes, each with its own L1, against a real redis-server.

The model is examples/llama.py at a tiny size with the ``eager_fusion`` backend (3 unique
targets, quick to build), written as a MODEL.py into the test's directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from redis_server import RedisServer, require_redis_server

from cachebuild.store.local import LocalStore

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SIGNING_KEY = "model-test-signing-key"
TINY = {"LLAMA_LAYERS": "2", "LLAMA_HIDDEN": "64", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2",
        "LLAMA_MLP": "128", "LLAMA_VOCAB": "128"}
UNIQUE_TARGETS = 3  # the pieces before, between and after the two attention calls
STORED = UNIQUE_TARGETS + 2  # and the entry, and the seal of its guards
KINDS = {"entry": 1, "fx-graph": UNIQUE_TARGETS, "guards": 1}

MODEL_PY = """
import dataclasses
import sys

sys.path.insert(0, {examples!r})
import llama  # noqa: E402

import cachebuild  # noqa: E402


def build():
    model = llama.make_model()
    config = dataclasses.replace(llama.config(), backend="eager_fusion")
    return cachebuild.ModelSpec(model, llama.example_inputs(model), {{0: 0, 1: 0}}, config)
"""

#: Runs the model in a fresh process through cachebuild.compile with the store the
#: environment configures; compares with eager and prints counters and tier stats.
RUN_CHILD = """
import json, sys

import torch

import cachebuild
from cachebuild.modelfile import load_spec
from cachebuild.store import open_store

spec = load_spec(sys.argv[1])
store = open_store()
compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims, store=store)
torch.manual_seed(0)
with torch.no_grad():
    for tokens in (1, 7, 33):
        ids = torch.randint(0, 128, (tokens,))
        pos = torch.arange(tokens)
        torch.testing.assert_close(compiled(ids, pos), spec.model(ids, pos),
                                   rtol=1e-5, atol=1e-5)
print(json.dumps({"stats": cachebuild.stats(), "tiers": store.stats().to_json()["tiers"]}))
"""

SUMMARY = re.compile(r"(\d+) targets?: (\d+) already stored, (\d+) built, (\d+) failed")


def env_for(l1: Path, url: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEBUILD_")
           or k == "CACHEBUILD_PROBE_DIR"}
    env.update(TINY)
    env.update(CACHEBUILD_DIR=str(l1), CACHEBUILD_SIGNING_KEY=SIGNING_KEY,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    if url:
        env["CACHEBUILD_REMOTE"] = url
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str], timeout: float = 170) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachebuild.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def warm_args(model: Path) -> list[str]:
    return ["warm", "-j", "1", str(model)]


def summary(stderr: str) -> dict[str, int]:
    match = SUMMARY.search(stderr)
    assert match, stderr
    total, stored, built, failed = map(int, match.groups())
    return {"total": total, "stored": stored, "built": built, "failed": failed}


def run_child(model: Path, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN_CHILD, str(model)], env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "warning" in line.lower()]


def write_model(folder: Path) -> Path:
    path = folder / "tiny_llama_model.py"
    path.write_text(textwrap.dedent(MODEL_PY.format(examples=str(ROOT / "examples"))))
    return path


def l1_kinds(l1: Path) -> dict[str, int]:
    with LocalStore(l1) as store:
        return {k: v.records for k, v in store.stats().by_kind.items()}


@pytest.fixture
def server():
    require_redis_server()
    with RedisServer() as s:
        yield s


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """One Redis warmed by ``cachebuild warm`` from a first machine (L1 ``a``)."""
    require_redis_server()
    folder = tmp_path_factory.mktemp("fleet")
    model = write_model(folder)
    with RedisServer() as s:
        proc = cli(*warm_args(model), env=env_for(folder / "a", s.url))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert summary(proc.stderr) == {"total": UNIQUE_TARGETS, "stored": 0,
                                        "built": UNIQUE_TARGETS, "failed": 0}
        assert not warning_lines(proc.stderr), proc.stderr
        yield {"server": s, "model": model, "folder": folder}


def test_second_machine_runs_from_redis_without_building(warmed):
    s, model, folder = warmed["server"], warmed["model"], warmed["folder"]
    # Every target, the entry and its seal are in Redis (a record per key).
    records = s.client().keys("cachebuild:v1:rec:*")
    assert len(records) == STORED
    l1 = folder / "b"
    child = run_child(model, env_for(l1, s.url))
    stats, tiers = child["stats"], child["tiers"]
    assert stats["built"] == 0 and stats["traced"] == 0 and stats["failed"] == 0
    assert stats["entries_loaded"] == 1 and stats["loaded"] == UNIQUE_TARGETS
    assert tiers["l2_hits"] >= UNIQUE_TARGETS + 1 and tiers["remote_rejected"] == 0
    # What came from Redis is in the second machine's L1 now, and its `stats` says so
    # (the counts of one process were all it showed: L2 hits 0, always).
    assert l1_kinds(l1) == KINDS
    table = cli("stats", "--json", env=env_for(l1, s.url))
    assert json.loads(table.stdout)["l2_hits"] == STORED, table.stdout


def test_pull_then_run_with_the_remote_off(warmed):
    s, model, folder = warmed["server"], warmed["model"], warmed["folder"]
    l1 = folder / "c"
    proc = cli("pull", str(model), env=env_for(l1, s.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Finding the entry's key copied the entry and its seal in (a lookup checks it): they
    # are pulled too, with their bytes (they were said to be "already there").
    counts = re.search(r"pulled (\d+) .*, (\d+) already there", proc.stdout)
    assert counts and tuple(map(int, counts.groups())) == (STORED, 0), proc.stdout
    assert "MB/s" in proc.stdout
    assert l1_kinds(l1) == KINDS
    again = cli("pull", str(model), env=env_for(l1, s.url))
    assert again.returncode == 0 and f"{STORED} already there" in again.stdout
    child = run_child(model, env_for(l1, s.url, CACHEBUILD_REMOTE_MODE="off"))
    stats, tiers = child["stats"], child["tiers"]
    assert stats["built"] == 0 and stats["traced"] == 0 and stats["loaded"] == UNIQUE_TARGETS
    assert tiers is None  # with the remote off, the store is the local one alone


def test_push_model_and_all(warmed, tmp_path):
    """A machine that warmed without the remote pushes its model (then --all) to a new Redis."""
    model, folder = warmed["model"], warmed["folder"]
    with RedisServer() as other:
        proc = cli("push", str(model), env=env_for(folder / "a", other.url))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"pushed {STORED} " in proc.stdout
        assert len(other.client().keys("cachebuild:v1:rec:*")) == STORED
        again = cli("push", "--all", env=env_for(folder / "a", other.url))
        assert again.returncode == 0 and "pushed 0 " in again.stdout
        stats = cli("stats", "--json", env=env_for(folder / "a", other.url))
        assert stats.returncode == 0, stats.stderr
        tiers = json.loads(stats.stdout)["tiers"]
        assert tiers["remote_available"] and tiers["remote_mode"] == "rw" and tiers["signed"]
        table = cli("stats", env=env_for(folder / "a", other.url))
        assert "L2 hits" in table.stdout and "remote rejected" in table.stdout
        ro = cli("--remote-mode", "ro", "push", "--all", env=env_for(folder / "a", other.url))
        assert ro.returncode == 2 and ro.stderr.count("\n") == 1 and "read-only" in ro.stderr


def test_a_pull_the_remote_cannot_serve_whole_says_what_builds_the_rest(warmed):
    model, folder = warmed["model"], warmed["folder"]
    with RedisServer() as other:
        assert cli("push", str(model), env=env_for(folder / "a", other.url)).returncode == 0
        client = other.client()
        target = next(k for k in client.keys("cachebuild:v1:rec:*")
                      if json.loads(client.get(k))["record"]["kind"] == "fx-graph")
        client.delete(target)
        proc = cli("pull", str(model), env=env_for(folder / "d", other.url))
        assert proc.returncode == 1 and "1 missing" in proc.stdout, proc.stdout
        assert f"`cachebuild warm {model}` with the remote read-write" in proc.stderr, \
            proc.stderr


def test_two_machines_warming_at_once_build_each_target_once(server, tmp_path):
    model = write_model(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-m", "cachebuild.cli", *warm_args(model)],
                              env=env_for(tmp_path / name, server.url), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for name in ("m1", "m2")]
    results = [p.communicate(timeout=170) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    counts = [summary(err) for _, err in results]
    assert sum(c["built"] for c in counts) == UNIQUE_TARGETS, counts
    assert all(c["failed"] == 0 and c["total"] == UNIQUE_TARGETS for c in counts)
    assert len(server.client().keys("cachebuild:v1:rec:*")) == STORED
    assert not server.client().keys("cachebuild:v1:lock:*")  # every lock released


WRITE_COMMANDS = ("set", "setex", "psetex", "del", "unlink", "expire", "pexpire", "eval",
                  "evalsha", "mset", "append", "getdel", "getex", "flushdb", "flushall")


def write_calls(server: RedisServer) -> dict[str, int]:
    info = server.client().info("commandstats")
    return {name: info.get(f"cmdstat_{name}", {}).get("calls", 0) for name in WRITE_COMMANDS}


def test_read_only_warm_writes_nothing(server, tmp_path):
    model = write_model(tmp_path)
    server.client().set("unrelated", b"1")
    size, keys, writes = server.client().dbsize(), server.client().keys("*"), write_calls(server)
    proc = cli(*warm_args(model), env=env_for(tmp_path / "l1", server.url,
                                              CACHEBUILD_REMOTE_MODE="ro"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(proc.stderr)["built"] == UNIQUE_TARGETS  # Redis had nothing: built locally
    assert not warning_lines(proc.stderr), proc.stderr
    assert server.client().dbsize() == size and server.client().keys("*") == keys
    assert write_calls(server) == writes  # not even a lock taken and released
    assert l1_kinds(tmp_path / "l1") == KINDS


def test_redis_killed_mid_warm_completes_locally_with_one_warning(server, tmp_path):
    model = write_model(tmp_path)
    client = server.client()
    # Told by Redis when a record is written (keyspace notifications), not by polling.
    client.config_set("notify-keyspace-events", "K$")
    uploads = client.pubsub()
    uploads.psubscribe("__keyspace@*__:cachebuild:v1:rec:*")
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild.cli", *warm_args(model)],
                            env=env_for(tmp_path / "l1", server.url), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # Kill Redis as soon as the first target has been uploaded (the build lock of the next
    # one is then about to be taken), or at the latest when the warm ends.
    while proc.poll() is None:
        message = uploads.get_message(ignore_subscribe_messages=True, timeout=1.0)
        if message is not None:
            break
    uploaded_before_kill = len(client.keys("cachebuild:v1:rec:*"))
    uploads.close()
    server.kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    counts = summary(err)
    assert counts["failed"] == 0 and counts["stored"] + counts["built"] == UNIQUE_TARGETS
    assert uploaded_before_kill < STORED  # the entry was not uploaded yet
    warned = warning_lines(err)
    assert len(warned) == 1 and "unavailable" in warned[0], err
    assert "Traceback" not in err
    assert l1_kinds(tmp_path / "l1") == KINDS


def test_remote_down_before_start_and_usage_errors(tmp_path, open_local):
    """Commands with a dead remote run locally with one warning; bad remote settings exit 2
    with one line."""
    require_redis_server()
    open_local(tmp_path / "l1")  # a store there: stats and ls never make one
    with RedisServer() as s:
        url = s.url
    # The server is gone: nothing listens on its port.
    stats = cli("stats", "--json", env=env_for(tmp_path / "l1", url))
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["tiers"]["remote_available"] is False
    assert len(warning_lines(stats.stderr)) == 1 and "unavailable" in stats.stderr
    for args, extra, words in [
        (["--remote", "http://cache:6379/0", "stats"], {}, "bad remote URL"),
        (["--remote-mode", "sometimes", "stats"], {}, "--remote-mode"),
        (["stats"], {"CACHEBUILD_SIGNING_KEY": ""}, "needs a signing key"),
        (["pull", "missing.py"], {"CACHEBUILD_REMOTE_MODE": "off"}, "needs a remote"),
    ]:
        proc = cli(*args, env=env_for(tmp_path / "l1", url, **extra))
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and words in proc.stderr, (args, proc.stderr)
    unsigned = cli("--allow-unsigned", "stats", "--json",
                   env=env_for(tmp_path / "l1", url, CACHEBUILD_SIGNING_KEY=""))
    assert unsigned.returncode == 0
    assert "without a signing key" in unsigned.stderr and "unavailable" in unsigned.stderr
    assert len(warning_lines(unsigned.stderr)) == 2  # one per kind, each said once
    # The Python front door (what cachebuild.compile opens) reads the same variables.
    opened = subprocess.run(
        [sys.executable, "-c", "from cachebuild.store import open_store; "
         "t = open_store().stats().tiers; print(t.remote_mode, t.signed)"],
        env=env_for(tmp_path / "l1", url, CACHEBUILD_SIGNING_KEY="",
                    CACHEBUILD_ALLOW_UNSIGNED="1", CACHEBUILD_REMOTE_MODE="ro"),
        capture_output=True, text=True, timeout=60)
    assert opened.returncode == 0 and opened.stdout.split() == ["ro", "False"], opened.stderr
