"""What a target key needs to know about the process groups a piece talks to.

A piece of a tensor-parallel model calls collectives (torch's functional collectives:
``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``...) and names its
process group by a string. The compiled artifact runs on any rank of any group of the same
shape, so a target's key takes the groups' *layout*: the world size, and each named group's
size and the spacing of its ranks (contiguous, strided), never a rank, a device index, an
id or an address. Ranks whose shards are equal then share every target; a rank with an
uneven shard has other input shapes, hence other keys.
"""

from __future__ import annotations

from typing import Any

from cachebuild.errors import UsageError

#: Namespaces of the ops that take a process group by name.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


def _string_args(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and set(value) == {"t"}:
        value = value["t"]
    if isinstance(value, list):
        return [s for v in value if isinstance(v, str) for s in [v]]
    return []


def group_names(nodes: list[dict[str, Any]]) -> list[str]:
    """The process-group names a piece's collectives use (graph data, in order)."""
    names: list[str] = []
    for node in nodes:
        target = node.get("target", "")
        if not (isinstance(target, str) and target.startswith("op:")):
            continue
        if target[3:].split("::")[0] not in COLLECTIVE_NAMESPACES:
            continue
        strings = _string_args(node.get("args"))
        if strings and strings[-1] not in names:  # the group's name is the last string
            names.append(strings[-1])
    return names


def layout_factors(nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The layout of the process groups a piece uses, or None if it uses none.

    Needs the groups to exist in this process (a real process group, or a fake one when a
    tensor-parallel model is warmed without its ranks).
    """
    names = group_names(nodes)
    if not names:
        return None
    import torch.distributed as dist

    from cachebuild import compat

    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("the model calls collectives but no process group is initialised: "
                         "init_process_group() first (or warm it with --world-size)")
    groups = {}
    for name in names:
        ranks = compat.process_group_ranks(name)
        steps = sorted({b - a for a, b in zip(ranks, ranks[1:], strict=False)})
        groups[name] = {"size": len(ranks), "rank_steps": steps}
    return {"world_size": dist.get_world_size(), "groups": groups}
