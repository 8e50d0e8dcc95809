"""Fusion passes, the pass manager, the custom ops they match and the kernels they emit.

Two groups: ``ops`` is the op library (the ``torch.ops.cachebuild`` custom ops, their
reference implementations and their Triton kernels); ``rewrites`` holds the compiler passes
that match graphs and emit those ops (the pass framework, matching helpers, the fusions and
clean-up). ``PassConfig`` says which built-in passes run; ``PassManager.from_config`` builds
them.
Importing this package registers the ``torch.ops.cachebuild`` custom ops (``ops``), so a
graph that calls them can be loaded and run; Triton and Inductor are imported only when
a kernel runs or a pass is handed to Inductor.
"""

from cachebuild.config import PassConfig
from cachebuild.passes import ops
from cachebuild.passes.rewrites.manager import (
    FusionPass,
    PassManager,
    changed_passes,
    pass_uuid,
)

__all__ = ["FusionPass", "PassConfig", "PassManager", "changed_passes", "ops", "pass_uuid"]
