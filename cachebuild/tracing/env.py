"""The environment factors that enter every key.

Anything about the machine or the software stack that can change what a compiler emits
is named here once: torch version and build, triton version (for the CPU only where
Triton can build for it), CUDA runtime and driver,
device kind and compute capability (or the CPU's instruction-set level), Python version
the schema version of cachebuild's own format, and the version of the table of what
stored graphs may call (``allowed.VERSION``: a graph stored under an older table is then
never found, only built and checked again).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import sys
from typing import Any

import torch

from cachebuild import compat

#: Bumped whenever the layout of an artifact or an entry changes incompatibly.
from cachebuild.trust import allowed

SCHEMA_VERSION = 2  # 2: entries keep guards, output recipes, config and code factors


@functools.cache
def _triton_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:
        return None


@functools.cache
def _triton_builds_for_cpu() -> bool:
    """Whether the installed Triton has a CPU backend (a triton-cpu build), found without
    importing it: only then can Triton compile anything for the CPU (torch's
    ``has_triton()`` asks the same for ``cpu``), so only then is its version a factor of
    CPU targets. A stock Triton (GPUs alone) installed or upgraded leaves CPU keys alone."""
    spec = importlib.util.find_spec("triton")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isdir(os.path.join(str(loc), "backends", "cpu")) for loc in locations)


@functools.cache
def _cpu_isa() -> str:
    """The CPU's vector ISA level as torch sees it (e.g. ``AVX512``), or the arch name."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return platform.machine()


def env_factors(device: str = "cpu") -> dict[str, Any]:
    """Environment factors for artifacts built for ``device`` ("cpu" or "cuda[:N]")."""
    kind = torch.device(device).type
    factors: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "graph_language": allowed.VERSION,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__,
        "torch_git": compat.torch_git_version(),
        "triton": _triton_version() if kind != "cpu" or _triton_builds_for_cpu() else None,
        "device": kind,
        "machine": platform.machine(),
    }
    if kind == "cuda":
        factors.update(compat.cuda_factors(torch.device(device)))
    else:
        factors["cpu_isa"] = _cpu_isa()
    return factors
