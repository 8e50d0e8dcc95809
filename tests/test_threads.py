"""Calls on many threads of one compiled module, in a real process: the first calls of a
cold start, and the first calls after a value the forward reads changed, find or trace
the forward once, the other threads waiting for it and taking it; every output matches
eager for the values of its call."""

from __future__ import annotations

import models

CODE = """
import json, threading
import torch
import cachebuild
import models
from cachebuild.store import LocalStore

model = models.make(models.Decoder, layers=1)
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                              store=LocalStore(STORE))
THREADS = 6


def race(label):
    barrier, errors = threading.Barrier(THREADS), []

    def call(i):
        args = models.inputs(3 + i)
        barrier.wait()
        try:
            models.assert_matches_eager(compiled, model, args)
        except BaseException as e:
            errors.append(f"{label} thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors

errors = race("cold")
cold = cachebuild.stats()["traced"]
with torch.no_grad():
    model.norm.eps = 1e-2  # read by the trace: another forward
errors += race("changed")
print(json.dumps({"errors": errors, "cold": cold, "changed": cachebuild.stats()["traced"] - cold}))
"""


def test_threads_racing_a_first_call_trace_once(tmp_path):
    out = models.run_python(CODE.replace("STORE", repr(str(tmp_path / "store"))))
    assert out["errors"] == []
    assert out["cold"] == 1 and out["changed"] == 1, out
