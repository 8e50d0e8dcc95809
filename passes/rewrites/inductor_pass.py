"""The pass manager as an Inductor ``CustomGraphPass``.

Kept apart from ``manager`` because importing it imports ``torch._inductor``; only code
that compiles with Inductor needs it.
"""

from __future__ import annotations

from typing import Protocol

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass


class GraphPass(Protocol):
    """What Inductor runs: a pass over a graph, named by a hash of what it does (a
    ``PassManager``)."""

    def __call__(self, graph: torch.fx.Graph) -> object: ...

    def uuid(self) -> str: ...


class InductorPassAdapter(CustomGraphPass):
    """Runs a ``PassManager`` as Inductor's post-grad custom pass."""

    def __init__(self, manager: GraphPass):
        self.manager = manager

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.manager(graph)

    def uuid(self) -> str:
        return self.manager.uuid()

    def __repr__(self) -> str:
        return f"InductorPassAdapter({self.manager!r})"
