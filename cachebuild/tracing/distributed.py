"""What a target key needs to know about the process groups a piece talks to.

A piece of a tensor-parallel model calls collectives (torch's functional collectives:
``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``...) and names its
process group by a string. The compiled artifact runs on any rank of any group of the same
shape, so a target's key takes the groups' *layout*: the world size, and each named group's
size and the spacing of its ranks (contiguous, strided), never a rank, a device index, an
id or an address. Ranks whose shards are equal then share every target; a rank with an
uneven shard has other input shapes, hence other keys. (The group's *name* stays in the
piece's graph, which the key holds: compiled code finds its group by that name, and torch
names groups alike on every rank, in the order they are created.)

Besides the key: ``layout_mismatches`` is what a warm start checks of an entry against the
live groups; ``local_groups`` lets one process compile, prove and run a piece alone, its
groups standing in as torch's fake process group of the same size; ``fake_world`` makes
this process a given rank of a world size under that fake group, for planning every rank
of a tensor-parallel model in one process (``cachebuild warm --world-size``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cachebuild.errors import UsageError
from cachebuild.tracing.guards import Mismatch

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

    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("the model calls collectives but no process group is initialised: "
                         "init_process_group() first (or warm it with --world-size)")
    return live_layout(names)


def live_layout(names: list[str]) -> dict[str, Any]:
    """The layout of the process groups ``names`` in this process, as ``layout_factors``
    gives it (the default group must be initialised)."""
    import torch.distributed as dist

    from cachebuild import compat

    groups = {}
    for name in names:
        ranks = compat.process_group_ranks(name)
        steps = sorted({b - a for a, b in zip(ranks, ranks[1:], strict=False)})
        groups[name] = {"size": len(ranks), "rank_steps": steps}
    return {"world_size": dist.get_world_size(), "groups": groups}


def layout_now(recorded: dict[str, Any]) -> dict[str, Any] | None:
    """The live layout of the groups a recorded layout names, or None where this process
    has no process group (or lacks one of them): what a warm start compares."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return live_layout(list(recorded.get("groups", {})))
    except (RuntimeError, ValueError, KeyError):
        return None


def describe_change(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """What differs between two layouts, in words: ``world size 2 → 4``, ``process group
    '0': 2 → 4 ranks``, ``no collectives → world size 2``."""
    if old is None or new is None:
        def said(layout: dict[str, Any] | None) -> str:
            return ("no process group" if layout is None
                    else f"world size {layout.get('world_size')}")
        return [f"process groups: {said(old)} → {said(new)}"]
    changes = []
    if old.get("world_size") != new.get("world_size"):
        changes.append(f"world size {old.get('world_size')} → {new.get('world_size')}")
    before, after = old.get("groups", {}), new.get("groups", {})
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a == b:
            continue
        if a is None or b is None:
            changes.append(f"process group {name!r} {'added' if a is None else 'removed'}")
        elif a.get("size") != b.get("size"):
            changes.append(f"process group {name!r}: {a.get('size')} → {b.get('size')} ranks")
        else:
            changes.append(f"process group {name!r}: rank spacing {a.get('rank_steps')} → "
                           f"{b.get('rank_steps')}")
    return changes or ["process-group layout differs"]


@dataclass(frozen=True)
class LayoutMismatch(Mismatch):
    """A warm start's process groups are not laid out as the entry's trace saw them."""

    def describe(self) -> str:
        return "; ".join(describe_change(self.old, self.new))


def layout_mismatches(recorded: list[dict[str, Any]]) -> tuple[list[Mismatch], list[Any]]:
    """Compare the layouts an entry's targets were keyed with (``recorded``, one per
    distinct layout) with this process's groups: the mismatches, and the live layouts
    (what the key of this process's own entry is derived from)."""
    wrong: list[Mismatch] = []
    live = []
    for layout in recorded:
        now = layout_now(layout)
        live.append(now)
        if now != layout:
            wrong.append(LayoutMismatch("process-group layout", layout, now))
    return wrong, live


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Within: this process is rank ``rank`` of ``world_size`` under torch's fake process
    group (no other process, no device, no communication), so a tensor-parallel model
    file builds that rank's shard and Dynamo traces it as a real rank would. UsageError
    where a process group is initialised already."""
    import torch.distributed as dist

    from cachebuild import compat

    if not dist.is_available():
        raise UsageError("this torch has no torch.distributed: a tensor-parallel model cannot "
                         "be warmed with --world-size here")
    if dist.is_initialized():
        raise UsageError("a process group is initialised in this process already; plan the "
                         "ranks of a world size from a process without one")
    compat.init_fake_world(rank, world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


#: One swap of the process-group registry at a time (builds on several threads).
_SWAP = threading.RLock()


@contextmanager
def local_groups(layout: dict[str, Any] | None) -> Iterator[None]:
    """Within: every process group ``layout`` names resolves to torch's fake process group
    of the same size, which communicates nothing (an all-reduce leaves its input as it is).

    So that one process can compile a piece that calls collectives and run it alone: a
    rank building a target while the other ranks wait for it on the key's lock (a real
    collective would wait for them forever), or ``cachebuild warm --world-size`` with no
    process group at all. The artifact and the piece run eagerly meet the same stand-in,
    so the proof at build compares like with like. The groups registered before (the
    real ones) are registered again on exit. A layout that is not one ``layout_factors``
    wrote raises ValueError.

    The registry is the process's: while a build runs, another thread's collectives on the
    same group names would meet the stand-ins too. Builds happen before a model serves
    (``compile``'s first call, ``warm``), not beside it.
    """
    if not layout:
        yield
        return
    from cachebuild import compat

    groups = layout.get("groups") if isinstance(layout, dict) else None
    if not isinstance(groups, dict) or not all(
            isinstance(n, str) and isinstance(g, dict) and isinstance(g.get("size"), int)
            and not isinstance(g.get("size"), bool) and g["size"] >= 1
            for n, g in groups.items()):
        raise ValueError("the target's process-group layout is malformed")
    with _SWAP:
        saved = {name: compat.registered_group(name) for name in groups}
        # The registry holds groups weakly: the stand-ins live as long as this block.
        stand_ins = {name: compat.fake_process_group(name, group["size"])
                     for name, group in groups.items()}
        try:
            for name, group in stand_ins.items():
                compat.register_group(name, group)
            yield
        finally:
            for name, group in saved.items():
                compat.register_group(name, group)
