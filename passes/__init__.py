"""Fusion passes, the pass manager, the custom ops they match and the kernels they emit.

``PassConfig`` says which built-in passes run; ``PassManager.from_config`` builds them.
"""

from cachebuild.passes.manager import FusionPass, PassConfig, PassManager, pass_uuid

__all__ = ["FusionPass", "PassConfig", "PassManager", "pass_uuid"]
