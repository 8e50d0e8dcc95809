"""A fuzzer with teeth for the closed language of stored graphs (issue 32, item 7).

Its pool is enumerated from torch's operator registry, not by hand: every ATen overload
that takes an integer (a size, stride, offset, index or address) or a storage, and every
public function of ``math``, ``operator`` and ``builtins`` and tensor method. Each is
refused by the loader, or admitted by the table and then run through the loader in a
child process with adversarial integers, on inputs that sit between canaries (see
``tests/op_fuzz.py``). The test fails on a crash, a hang, a canary written or read, or a
refusal missing; 0 of each. A few seconds to a minute or two on two CPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trust import clean_env

TESTS = Path(__file__).resolve().parent
DRIVER = str(TESTS / "op_fuzz.py")
#: A child that runs jobs is given this long before it is taken for hung.
CHILD_SECONDS = 300


def _lines(text: str | bytes | None) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").splitlines()


def test_every_integer_taking_operator_is_refused_or_checked(tmp_path):
    seed = os.environ.get("CACHEBUILD_FUZZ_SEED", "12")
    planned = subprocess.run([sys.executable, DRIVER, "plan", seed], env=clean_env(),
                             capture_output=True, text=True, timeout=600)
    assert planned.returncode == 0, planned.stderr[-3000:]
    records = [json.loads(line) for line in _lines(planned.stdout) if line.startswith("{")]
    failures = [r for r in records if "failure" in r]
    jobs = [r for r in records if "job" in r]
    assert len(jobs) > 100, "the pool is not what the registry holds"
    jobs_path = tmp_path / "jobs.jsonl"
    jobs_path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    first, children = 0, 0
    while first < len(jobs):
        children += 1
        try:
            done = subprocess.run([sys.executable, DRIVER, "run", str(jobs_path), str(first)],
                                  env=clean_env(), capture_output=True, timeout=CHILD_SECONDS)
            out, killed = _lines(done.stdout), None
        except subprocess.TimeoutExpired as e:
            out, killed = _lines(e.stdout), "hang"
            done = None
        failures += [json.loads(line) for line in out if line.startswith("{")]
        if "done" in out:
            break
        started = [int(line.split()[1]) for line in out if line.startswith("start ")]
        if not started:  # died before its first job: nothing to blame on a job
            raise AssertionError(f"a fuzz child did not start: {done.stderr[-3000:]!r}")
        where = started[-1]
        kind = killed or "crash"
        detail = json.dumps(jobs[where]) + (
            "" if done is None else f" (exit {done.returncode}) {done.stderr[-500:]!r}")
        failures.append({"failure": kind, "job": where, "detail": detail})
        first = where + 1
    print(f"op fuzz: {len(jobs)} jobs in {children} child processes, "
          f"{len(failures)} failures")
    assert failures == [], json.dumps(failures, indent=1)[:8000]
