"""The pass manager as an Inductor ``CustomGraphPass``.

Kept apart from ``manager`` because importing it imports ``torch._inductor``; only code
that compiles with Inductor needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

if TYPE_CHECKING:
    from cachebuild.passes.rewrites.manager import PassManager


class InductorPassAdapter(CustomGraphPass):
    """Runs a ``PassManager`` as Inductor's post-grad custom pass."""

    def __init__(self, manager: PassManager):
        self.manager = manager

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.manager(graph)

    def uuid(self) -> str:
        return self.manager.uuid()

    def __repr__(self) -> str:
        return f"InductorPassAdapter({self.manager!r})"
