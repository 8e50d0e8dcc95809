"""cachebuild: a compile-artifact cache and build system for piecewise torch.compile.

The front doors are imported on first use, so that ``import cachebuild.store`` (and the
store commands of the CLI) never import torch.
"""

from typing import Any

__all__ = ["CompileConfig", "ExplainReport", "ModelSpec", "PlanReport", "WarmReport", "backend",
           "compile", "decoding", "plan", "preload", "prometheus_text", "stats", "warm"]
__version__ = "0.1.0"

_LAZY = {
    "CompileConfig": "cachebuild.config",
    "ModelSpec": "cachebuild.api",
    "backend": "cachebuild.api",
    "compile": "cachebuild.api",
    "decoding": "cachebuild.calls",
    "preload": "cachebuild.building.build",
    "stats": "cachebuild.api",
    "prometheus_text": "cachebuild.api",
    "warm": "cachebuild.warming",
    "plan": "cachebuild.warming",
    "WarmReport": "cachebuild.warming",
    "PlanReport": "cachebuild.warming",
    # The library call that explains a model is ``cachebuild.explain.explain``.
    "ExplainReport": "cachebuild.explain",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cachebuild' has no attribute {name!r}")
