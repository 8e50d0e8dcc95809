"""Does an AOTInductor shared library load and run here?

Some builds cannot load AOTI libraries at all (torch 2.11 with CUDA 13 segfaults on any
of them), so the ``auto`` flavour asks once per environment: a child process compiles a
two-op library, loads it through the C++ runner and checks its output. A crash of the
child is a verdict, not a crash of ours. The verdict is cached in a small JSON file
keyed by the environment fingerprint (``env.py``), under ``$CACHEBUILD_PROBE_DIR``
(default ``~/.cache/cachebuild/probe``).

Run ``python -m cachebuild.backends.probe DEVICE`` to probe by hand.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from cachebuild.env import env_factors
from cachebuild.keys import make_key

log = logging.getLogger("cachebuild.probe")

PROBE_TIMEOUT_S = 900.0
_VERDICTS: dict[str, bool] = {}


def probe_dir() -> Path:
    default = Path.home() / ".cache" / "cachebuild" / "probe"
    return Path(os.environ.get("CACHEBUILD_PROBE_DIR", default))


def aoti_loads(device: str) -> bool:
    """True if AOTI libraries for ``device`` load and run in this environment."""
    kind = device.split(":")[0]
    fingerprint = make_key({"probe": "aoti", "env": env_factors(device)})
    if fingerprint in _VERDICTS:
        return _VERDICTS[fingerprint]
    folder = probe_dir()
    folder.mkdir(parents=True, exist_ok=True)
    verdict_file = folder / f"aoti-{kind}-{fingerprint}.json"
    with FileLock(str(verdict_file) + ".lock"):
        if verdict_file.exists():
            verdict = json.loads(verdict_file.read_text())["loads"]
        else:
            verdict, detail = _run_probe(device)
            verdict_file.write_text(json.dumps({"loads": verdict, "detail": detail}))
            log.info("AOTI probe for %s: %s (%s)", kind, "loads" if verdict else "does not load",
                     detail)
    _VERDICTS[fingerprint] = verdict
    return verdict


def _run_probe(device: str) -> tuple[bool, str]:
    try:
        proc = subprocess.run([sys.executable, "-m", "cachebuild.backends.probe", device],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, "probe timed out"
    if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
        return True, "ok"
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return False, f"exit {proc.returncode}: {tail}"


def _probe(device: str) -> None:
    import tempfile

    import torch

    from cachebuild.compat import aoti_single_file_options

    class Tiny(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ w) + 1

    x = torch.randn(8, 16, device=device)
    w = torch.randn(16, 16, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        ep = torch.export.export(Tiny(), (x, w), strict=False)
        options = aoti_single_file_options(device)
        options["aot_inductor.output_path"] = os.path.join(tmp, "probe.so")
        so = torch._inductor.aot_compile(ep.module(), (x, w), options=options)
        if device.startswith("cuda"):
            runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1)
        else:
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
        (out,) = runner.run([x, w])
        torch.testing.assert_close(out, torch.relu(x @ w) + 1)
    print("ok")


if __name__ == "__main__":
    _probe(sys.argv[1] if len(sys.argv) > 1 else "cpu")
