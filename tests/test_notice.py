"""A server start that must trace or build says so first: one line naming what is missing,
why, and the command that avoids it; then a line per target built (stderr is no terminal
here). A warm start says nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import models

SERVER = """
import logging, os, sys
import cachebuild, models
import cachebuild.building.notice as notice
notice.QUIET_S = float(os.environ.get("TEST_QUIET_S", notice.QUIET_S))
from cachebuild.store import LocalStore
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
model = models.make(models.Decoder, layers=1)
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=LocalStore(sys.argv[1]))
models.assert_matches_eager(compiled, model, models.inputs(4))
print("ok")
"""


def start(store, quiet: float | None = None) -> str:
    """A server's start on ``store``; its stderr. ``quiet``: seconds a wait may say nothing
    (``notice.QUIET_S``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(models.TESTS_DIR),
                                                        os.environ.get("PYTHONPATH", "")])}
    if quiet is not None:
        env["TEST_QUIET_S"] = str(quiet)
    proc = subprocess.run([sys.executable, "-c", SERVER, str(store)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    return proc.stderr


def notices(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("cachebuild: ")]


def test_a_start_that_must_build_says_so_and_a_warm_one_is_silent(open_local, tmp_path):
    store = tmp_path / "store"
    cold = notices(start(store, quiet=0.05))
    assert re.fullmatch(
        r"cachebuild: compiling Decoder \(defined in .*models\.py\) from scratch because it "
        r"was not warmed \(no stored entry for this model, config and input shapes\); "
        r"tracing and building what is missing can take minutes; `cachebuild warm MODEL\.py` "
        r"\(a file whose build\(\) returns this model's ModelSpec\) before the server starts "
        r"avoids this", cold[0]), cold
    # The trace, which has no target to say done, is never silent for long either.
    beats = [line for line in cold if line.startswith("cachebuild: still tracing Decoder (")]
    assert beats and cold.index(beats[0]) == 1, cold
    built = [line for line in cold[1:] if line.startswith("cachebuild: built piece ")]
    assert len(built) == 2 and built[-1].endswith(re.search(r"\(2 of 2, .*", built[-1])[0])
    assert re.fullmatch(r"cachebuild: built piece \d range 1-32 in [\d.]+ s \(1 of 2, \d+ s so far\)",
                        built[0]), built

    assert notices(start(store)) == []  # warm: silent

    with open_local(store) as s:  # a target lost (damaged and quarantined, say)
        target = next(r.key for r in s.records() if r.kind not in ("entry", "guards"))
        s.delete(target)
    lost = notices(start(store))
    assert lost[0] == ("cachebuild: 1 of 2 targets of Decoder's stored entry are missing "
                       "(their build failed when it was warmed, or gc evicted them, or "
                       "they were damaged and quarantined); building them; "
                       "`cachebuild warm MODEL.py` (a file whose build() returns this "
                       "model's ModelSpec) before the server starts avoids this"), lost
    assert len([line for line in lost if line.startswith("cachebuild: built piece ")]) == 1


def test_a_target_built_again_is_not_counted_twice(caplog):
    """A target removed from the store meanwhile (a gc) and built again: said as built
    again, never "3 of 2"."""
    import logging

    from cachebuild.building.notice import build_progress

    with caplog.at_level(logging.WARNING, logger="cachebuild"), build_progress(2) as done:
        done("piece 0", 1.0)
        done("piece 0", 1.0)
        done("piece 2", 1.0)
    said = [r.getMessage() for r in caplog.records if "built" in r.getMessage()]
    assert "(1 of 2" in said[0] and "built piece 0 again" in said[1]
    assert "(2 of 2" in said[2] and not any("3 of 2" in s for s in said)


def test_the_hint_for_other_values_says_which_warm_avoids_the_trace():
    """A stored entry traced for other values (another adapter active): a warm of the
    model file avoids the trace only where its build() leaves the model as it is called."""
    import torch

    from cachebuild.building.notice import HINT, VALUES_DIFFER, hint

    model = torch.nn.Linear(2, 2)
    assert hint(model) == HINT
    said = hint(model, f"{VALUES_DIFFER}: active_adapter: 'a' → 'b'")
    assert said != HINT and "build() leaves the model as this call finds it" in said
