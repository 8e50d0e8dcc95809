"""The clean-up pass: no-op reshapes, reshapes of reshapes, dead code."""

from __future__ import annotations

from typing import ClassVar

import torch.fx

from cachebuild.passes.rewrites.manager import FusionPass
from cachebuild.passes.rewrites.matching import is_full_slice, is_reshape, same_shape, shape_of


class Cleanup(FusionPass):
    """Removes what fusion leaves behind and what hides matches.

    - a reshape whose output shape is known equal to its input shape is replaced by its
      input;
    - a reshape whose input is a reshape of the same kind with no other user reshapes the
      inner input directly (reshape order is logical row-major, so the outer shape alone
      decides the result);
    - a slice that keeps every element is replaced by its input;
    - nodes without users and without side effects are erased.

    Returns the number of nodes removed.
    """

    name: ClassVar[str] = "cleanup"
    source_modules: ClassVar[tuple[str, ...]] = ("cachebuild.passes.rewrites.matching",)

    def __call__(self, graph: torch.fx.Graph) -> int:
        removed = 0
        for node in list(graph.nodes):
            if is_full_slice(node) and isinstance(node.args[0], torch.fx.Node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                removed += 1
                continue
            if not is_reshape(node):
                continue
            source = node.args[0]
            if not isinstance(source, torch.fx.Node):
                continue
            if (
                is_reshape(source)
                and source.op == node.op
                and source.target == node.target
                and len(source.users) == 1
                and isinstance(source.args[0], torch.fx.Node)
            ):
                node.args = (source.args[0], *node.args[1:])
                graph.erase_node(source)
                removed += 1
                source = node.args[0]
            if same_shape(shape_of(node), shape_of(source)):
                node.replace_all_uses_with(source)
                graph.erase_node(node)
                removed += 1
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        return removed + before - len(graph.nodes)
