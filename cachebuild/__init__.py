"""cachebuild: a compile-artifact cache and build system for piecewise torch.compile."""

from cachebuild.api import ModelSpec, backend, compile, preload, stats
from cachebuild.config import CompileConfig

__all__ = ["CompileConfig", "ModelSpec", "backend", "compile", "preload", "stats"]
__version__ = "0.1.0"
