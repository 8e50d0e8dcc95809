"""Targets are built under the settings Inductor generates code under, as the process that
traced them had them: deterministic algorithms and float32 matmul precisions key a target
(``targets.CODEGEN``), a build worker takes them on (``targets.traced_settings``), and the
caller's own settings are left as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow

#: Each setting as a process makes it, read back as ``compat.codegen_settings`` says it.
MADE = {
    "pass": {},
    'torch.set_float32_matmul_precision("high")': {"cuda/matmul": "tf32", "mkldnn/matmul": "tf32"},
    'torch.set_float32_matmul_precision("medium")': {"cuda/matmul": "tf32",
                                                     "mkldnn/matmul": "bf16"},
    "torch.backends.cuda.matmul.allow_tf32 = True": {"cuda/matmul": "tf32"},
    "torch.backends.cudnn.allow_tf32 = False": {"cuda/conv": "ieee"},
    'torch.backends.mkldnn.matmul.fp32_precision = "bf16"': {"mkldnn/matmul": "bf16"},
    'torch.backends.fp32_precision = "tf32"': {"cuda/all": "tf32", "cuda/matmul": "tf32",
                                               "mkldnn/all": "tf32", "mkldnn/matmul": "tf32"},
    "torch.use_deterministic_algorithms(True)": {"deterministic": True},
    "torch.use_deterministic_algorithms(True, warn_only=True)": {"deterministic": True,
                                                                 "warn_only": True},
    'torch.backends.cudnn.conv.fp32_precision = "ieee"': {"cuda/conv": "ieee"},
    "torch.use_deterministic_algorithms(True); "
    "torch.utils.deterministic.fill_uninitialized_memory = False":
        {"deterministic": True, "fill_uninitialized_memory": False},
}

_PROBE = """
import json, sys, torch
from cachebuild import compat, keep

def legacy():
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None

def state():
    return [compat.codegen_settings(), compat.raw_precisions(),
            torch.utils.deterministic.fill_uninitialized_memory,
            torch.is_deterministic_algorithms_warn_only_enabled()]

exec(sys.argv[1])
out = []
for wanted in json.loads(sys.argv[2]):
    before, was = state(), legacy()
    with keep.codegen_settings(wanted):  # as a build of a target traced elsewhere
        inside = compat.codegen_settings()
        readable = legacy() is not None
    # Kept; the older reader, where it answered, answers as before (where the newer
    # setters had made it raise, it may answer after).
    out.append({"made": before[0], "inside": inside, "readable": readable,
                "kept": state() == before and (was is None or legacy() == was)})
print(json.dumps(out))
"""


def _probe(made: str, wanted: list[dict]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, made, json.dumps(wanted)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("made", list(MADE))
def test_each_setting_is_read_and_put_back(made):
    """What a process made is read as ``MADE`` says; made to have torch's defaults for a
    while (a build of a target traced with them), it has its own again after."""
    [back] = _probe(made, [{}])
    assert back["made"] == MADE[made] and back["inside"] == {} and back["kept"], back


def test_a_fresh_process_takes_each_setting_on():
    """A process with torch's defaults (a build worker), made to have each setting for a
    while, has it, through the older setters where they can say it (so that
    ``torch.get_float32_matmul_precision()``, which Inductor reads, still answers), and
    the defaults again after."""
    for made, seen in zip(MADE, _probe("pass", list(MADE.values())), strict=True):
        assert seen["inside"] == MADE[made] and seen["kept"], (made, seen)
        if "mkldnn.matmul" not in made:  # the one no older setter says
            assert seen["readable"], made


def _run(store: Path, model: str, setting: str, backend: str = "inductor") -> dict:
    env = {**os.environ, "CACHEBUILD_DIR": str(store)}
    proc = subprocess.run([sys.executable, str(HERE / "codegen_models.py"), model, setting,
                           backend], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_a_deterministic_process_gets_code_built_deterministic(tmp_path):
    """A forward returning memory ``torch.empty`` left unset: under deterministic
    algorithms eager fills it with NaN, and so must the target, built in a worker whose
    own default is not deterministic (else its proof against eager fails, and so would
    the call); a second process loads it."""
    store = tmp_path / "store"
    cold = _run(store, "unset", "deterministic")
    assert cold["nan"] and cold["same_nan"] and cold["error"] < 1e-5, cold
    assert cold["traced"] == 1 and cold["built"] >= 1
    warm = _run(store, "unset", "deterministic")
    assert warm["same_nan"] and warm["error"] < 1e-5 and warm["traced"] == 0, warm


@pytest.mark.parametrize("setting", ["onednn bf16", "tf32"])
def test_a_process_with_another_matmul_precision_builds_its_own_targets(tmp_path, setting):
    """A store warmed by a process with torch's defaults: a process that lowered its
    float32 matmul precision does not get those targets (built for full float32), but
    its own, keyed by the precision; a second such process loads them."""
    store = tmp_path / "store"
    default = _run(store, "wide", "default", "eager_fusion")
    assert default["error"] < 1e-4 and default["built"] >= 1
    other = _run(store, "wide", setting, "eager_fusion")
    assert other["error"] < 1e-4 and other["traced"] == 1 and other["built"] >= 1, other
    again = _run(store, "wide", setting, "eager_fusion")
    assert again["error"] < 1e-4 and again["traced"] == 0 and again["built"] == 0, again
