"""Fusion passes, the pass manager, the custom ops they match and the kernels they emit.

``PassConfig`` says which built-in passes run; ``PassManager.from_config`` builds them.
Importing this package registers the ``torch.ops.cachebuild`` custom ops (``ops``), so a
graph that calls them can be loaded and run; Triton and Inductor are imported only when
a kernel runs or a pass is handed to Inductor.
"""

from cachebuild.passes import ops
from cachebuild.passes.manager import (
    FusionPass,
    PassConfig,
    PassManager,
    changed_passes,
    pass_uuid,
)

__all__ = ["FusionPass", "PassConfig", "PassManager", "changed_passes", "ops", "pass_uuid"]
