"""The built-in passes, by the ``PassConfig`` flag that enables each.

Order matters: the QK-norm + RoPE fusion consumes ``rms_norm`` nodes before anything else
looks at them, the quantization fusions follow, and clean-up runs last to drop what the
rewrites left behind.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from cachebuild.config import PassConfig

if TYPE_CHECKING:
    from cachebuild.passes.rewrites.manager import FusionPass

# flag -> (module, class); imported on demand so that reading a config imports nothing.
BUILTIN_PASSES: dict[str, tuple[str, str]] = {
    "qk_norm_rope": ("cachebuild.passes.rewrites.fusions", "QKNormRoPEFusion"),
    "add_rms_quant": ("cachebuild.passes.rewrites.fusions", "AddRMSNormQuantFusion"),
    "rms_quant": ("cachebuild.passes.rewrites.fusions", "RMSNormQuantFusion"),
    "act_quant": ("cachebuild.passes.rewrites.fusions", "ActQuantFusion"),
    "cleanup": ("cachebuild.passes.rewrites.cleanup", "Cleanup"),
}


def pass_class(flag: str) -> type[FusionPass]:
    """The pass class behind a ``PassConfig`` flag."""
    module_name, class_name = BUILTIN_PASSES[flag]
    return getattr(importlib.import_module(module_name), class_name)


def passes_for_config(config: PassConfig) -> list[FusionPass]:
    """One instance of every built-in pass ``config`` enables, in running order."""
    enabled = set(config.enabled())
    return [pass_class(flag)() for flag in BUILTIN_PASSES if flag in enabled]
