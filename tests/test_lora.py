"""Multi-LoRA serving (``examples/lora.py``): two peft adapters switched between requests,
every output equal to the eager model's with the same adapter, in fresh processes.

Through ``cachebuild.compile``, a cold process traces each adapter's forward once and
switches between them afterwards with no trace; a warm process (every variant stored)
traces nothing. Through torch.compile's door, Dynamo's guards see the switch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lora.py"


def _serve(store: Path, door: str = "compile", requests: int = 4) -> list[tuple[int, int, int]]:
    env = {**os.environ, "CACHEBUILD_DIR": str(store), "LLAMA_BACKEND": "eager_fusion",
           "LORA_REQUESTS": str(requests), "LORA_DOOR": door, "LLAMA_LAYERS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]  # 1: an output differed from eager
    return [tuple(int(n) for n in m.groups()) for m in re.finditer(
        r"traced (\d+), built (\d+), switched (\d+)", proc.stderr)]


def test_two_adapters_served_alternately_cold_then_warm(tmp_path):
    store = tmp_path / "store"
    cold = _serve(store)
    assert [t for t, _, _ in cold] == [1, 2, 2, 2]  # one trace per adapter, then none
    assert cold[-1][2] == 2  # requests 2 and 3 switched to a forward made before
    warm = _serve(store)
    assert [t for t, _, _ in warm] == [0, 0, 0, 0]
    assert warm[-1][1] == 0  # nothing built


def test_two_adapters_through_torch_compile(tmp_path):
    _serve(tmp_path / "store", door="torch")
