"""A bounded fuzzer: mutated Redis records, manifests, chunks, index rows and bundle
members never stop a server with a traceback, never hang it, and never run anything
unverified. (Stored graphs and guard lists: ``test_trust_fuzz_store.py``.)

After a clean ``warm`` (real processes, a real redis-server), one server process
(``tests/trust_fuzz.py``) runs ``CACHEBUILD_FUZZ_ROUNDS`` rounds (default 50) from seed
``CACHEBUILD_FUZZ_SEED`` (default 12): each restores Redis, mutates one thing, and starts
the tiny model from that state (see the driver's docstring). A round either runs
correctly (the same outputs as eager) or gives a one-line error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import RedisServer, require_redis_server
from trust import clean_env, cli

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TESTS = Path(__file__).resolve().parent
KEY = "fuzz-fleet-signing-key"
MODEL_PY = """
import cachebuild
import models


def build():
    model = models.make(models.Decoder, layers=1)
    return cachebuild.ModelSpec(model, models.inputs(8), {0: 0, 1: 0}, models.config())
"""


def test_fuzzed_state_never_stops_a_server_with_a_traceback(tmp_path):
    require_redis_server()
    rounds = int(os.environ.get("CACHEBUILD_FUZZ_ROUNDS", "50"))
    seed = int(os.environ.get("CACHEBUILD_FUZZ_SEED", "12"))
    model = tmp_path / "model.py"
    model.write_text(MODEL_PY)
    golden = tmp_path / "golden"
    with RedisServer() as server:
        env = clean_env(CACHEBUILD_DIR=str(golden), CACHEBUILD_REMOTE=server.url,
                        CACHEBUILD_SIGNING_KEY=KEY)
        proc = cli("warm", str(model), "--jobs", "1", env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        bundle = tmp_path / "golden.tar"
        assert cli("export", str(bundle), env=env).returncode == 0
        work = tmp_path / "work"
        work.mkdir()
        config = {"url": server.url, "key": KEY, "model": str(model), "golden": str(golden),
                  "bundle": str(bundle), "work": str(work), "tests": str(TESTS),
                  "rounds": rounds, "seed": seed}
        (tmp_path / "fuzz.json").write_text(json.dumps(config))
        done = subprocess.run([sys.executable, str(TESTS / "trust_fuzz.py"),
                               str(tmp_path / "fuzz.json")], env=clean_env(),
                              capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.splitlines()[-1])
    print(f"fuzz: {report['rounds']} rounds (seed {seed}) in {report['seconds']} s: "
          f"{report['ok']} ok, {report['errors']} one-line errors; {report['by_surface']}")
    assert report["rounds"] == rounds
    assert report["failures"] == [], json.dumps(report["failures"], indent=1)[:8000]

