"""The built-in passes, by the ``PassConfig`` flag that enables each.

Order matters: the QK-norm + RoPE fusion consumes ``rms_norm`` nodes before anything else
looks at them, the quantization fusions follow, and clean-up runs last to drop what the
rewrites left behind.
"""

from __future__ import annotations

# flag -> (module, class); imported on demand (``PassManager.from_config``) so that reading
# a config imports nothing.
BUILTIN_PASSES: dict[str, tuple[str, str]] = {
    "qk_norm_rope": ("cachebuild.passes.rewrites.fusions", "QKNormRoPEFusion"),
    "add_rms_quant": ("cachebuild.passes.rewrites.fusions", "AddRMSNormQuantFusion"),
    "rms_quant": ("cachebuild.passes.rewrites.fusions", "RMSNormQuantFusion"),
    "act_quant": ("cachebuild.passes.rewrites.fusions", "ActQuantFusion"),
    "cleanup": ("cachebuild.passes.rewrites.cleanup", "Cleanup"),
}
