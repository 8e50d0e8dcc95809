"""A bounded fuzzer, quick enough for every CI run: mutated stored graphs, guard lists,
records, manifests and bundles never stop a server with a traceback, never hang it, never
import what a guard or graph names, never touch a file, and never load unverified from a
store that requires signatures (the driver is ``tests/store_fuzz.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trust import clean_env

TESTS = Path(__file__).resolve().parent


def test_stored_data_fuzz(tmp_path):
    """``CACHEBUILD_STORE_FUZZ_ROUNDS`` rounds (default 100) over
    stored graphs, guard lists, records, manifests and bundles, from seed
    ``CACHEBUILD_FUZZ_SEED``, in one process after one cold compile of the tiny model:
    0 tracebacks, 0 hangs, 0 imports a guard or graph named, 0 file effects in the watched
    folder, and nothing the signed store did not verify ever loads."""
    rounds = int(os.environ.get("CACHEBUILD_STORE_FUZZ_ROUNDS", "100"))
    seed = int(os.environ.get("CACHEBUILD_FUZZ_SEED", "12"))
    work = tmp_path / "work"
    work.mkdir()
    config = {"work": str(work), "tests": str(TESTS), "rounds": rounds, "seed": seed}
    (tmp_path / "fuzz.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, str(TESTS / "store_fuzz.py"),
                           str(tmp_path / "fuzz.json")], env=clean_env(),
                          capture_output=True, text=True, timeout=900, cwd=work)
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.splitlines()[-1])
    print(f"store fuzz: {report['rounds']} rounds (seed {seed}) in {report['seconds']} s "
          f"({report['setup_seconds']} s set-up): {report['by_surface']}")
    assert report["rounds"] == rounds
    assert report["failures"] == [], json.dumps(report["failures"], indent=1)[:8000]
