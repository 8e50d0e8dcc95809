"""What changed between two canonical piece graphs, in words.

A target's manifest holds its piece in canonical form (``targets.canonical_graph``): the
nodes in order as ``[op, target, args, kwargs]`` with every name replaced by its position
(``i0`` for the first input, ``v7`` for node 7), and each input's metadata. When a target
misses, ``explain`` diffs the graph it wants against the nearest stored one and says what
differs: an op that changed (``aten.silu → aten.gelu at node 12``), a constant (``1e-05 →
1e-06 in aten.add at node 4``), a node added or removed, an input added, removed or
reshaped. ``sources`` (one ``file:line`` or None per node of the wanted graph) names where
the trace recorded a node.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

#: At most this many differences are described; the rest are counted.
MAX_DESCRIBED = 6


def op_label(target: str) -> str:
    """A node target as people write it: ``op:aten::silu.default`` → ``aten.silu``."""
    if target.startswith("op:"):
        qual = target[3:]
        ns, _, rest = qual.partition("::")
        name, _, overload = rest.partition(".")
        return f"{ns}.{name}" if overload in ("", "default") else f"{ns}.{name}.{overload}"
    if target.startswith("fn:"):
        module, _, name = target[3:].partition(":")
        if module.split(".")[0] in ("torch", "builtins", "operator", "_operator", "math"):
            return name  # torch.nn.functional.silu and torch._C._nn.gelu: silu, gelu
        return f"{module}.{name}"
    return target


def user_frame(stack_trace: str | None, skip: str = "") -> str | None:
    """``file:line`` of the innermost frame of a recorded stack trace that is not inside
    the ``skip`` directory (torch's own), or None."""
    if not stack_trace:
        return None
    found = None
    for line in stack_trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            number = rest.split(",")[0]
            if not (skip and path.startswith(skip)) and number.isdigit():
                found = f"{path}:{number}"
    return found


def _signature(node: Sequence[Any]) -> str:
    op, target = node[0], node[1]
    return f"{op}:{target}"


def _constants(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """The constants inside an encoded argument, with where they sit (refs to other nodes
    are left out: they are names, and names are positions)."""
    if isinstance(value, dict):
        if set(value) == {"n"}:
            return []
        if set(value) == {"f"}:
            return [(path, float(value["f"]))]
        out: list[tuple[str, Any]] = []
        for k, v in value.items():
            out += _constants(v, f"{path}.{k}" if path else k)
        return out
    if isinstance(value, list):
        out = []
        for i, v in enumerate(value):
            out += _constants(v, f"{path}[{i}]")
        return out
    return [(path, value)]


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _where(index: int, sources: Sequence[str | None] | None) -> str:
    source = sources[index] if sources is not None and index < len(sources) else None
    return f"node {index}" + (f" ({source})" if source else "")


def _node_changes(old: Sequence[Any], new: Sequence[Any], index: int,
                  sources: Sequence[str | None] | None) -> list[str]:
    where = _where(index, sources)
    if old[0] != new[0] or old[1] != new[1]:
        return [f"{op_label(old[1]) or old[0]} → {op_label(new[1]) or new[0]} at {where}"]
    changes = []
    before = dict(_constants([old[2], old[3]]))
    after = dict(_constants([new[2], new[3]]))
    label = op_label(new[1]) or new[0]
    for path in sorted(set(before) | set(after)):
        if path in before and path in after and before[path] != after[path]:
            changes.append(f"constant {_show(before[path])} → {_show(after[path])} in {label} "
                           f"at {where}")
    if not changes and (old[2] != new[2] or old[3] != new[3]):
        changes.append(f"the inputs of {label} at {where} differ")
    return changes


def _input_label(meta: dict[str, Any]) -> str:
    if meta.get("kind") != "tensor":
        return f"{meta.get('kind')} {meta.get('shape')}"
    shape = ", ".join(str(d) for d in meta.get("shape", []))
    return f"{meta.get('dtype')} [{shape}]"


def _input_changes(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[str]:
    changes = []
    for i in range(max(len(old), len(new))):
        if i >= len(old):
            changes.append(f"input {i} added: {_input_label(new[i])}")
        elif i >= len(new):
            changes.append(f"input {i} removed (was {_input_label(old[i])})")
        elif old[i] != new[i]:
            a, b = old[i], new[i]
            if a.get("dtype") != b.get("dtype") or a.get("shape") != b.get("shape"):
                changes.append(f"input {i}: {_input_label(a)} → {_input_label(b)}")
            elif a.get("stride") != b.get("stride"):
                changes.append(f"input {i} strides {a.get('stride')} → {b.get('stride')}")
            else:
                changes.append(f"input {i} on {a.get('device')} → {b.get('device')}")
    return changes


def similarity(old: dict[str, Any], new: dict[str, Any]) -> float:
    """How alike two canonical piece graphs are, 0 to 1: the share of their nodes (by op
    and target, in order) and inputs (by metadata) that match."""
    a = [_signature(n) for n in old.get("nodes", [])] + [repr(m) for m in old.get("inputs", [])]
    b = [_signature(n) for n in new.get("nodes", [])] + [repr(m) for m in new.get("inputs", [])]
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def diff_graphs(old: dict[str, Any], new: dict[str, Any],
                sources: Sequence[str | None] | None = None) -> list[str]:
    """The differences between two canonical piece graphs, in words, most telling first:
    inputs, then nodes changed, added or removed (at most ``MAX_DESCRIBED``, then a count).
    """
    changes = _input_changes(old.get("inputs", []), new.get("inputs", []))
    a, b = old.get("nodes", []), new.get("nodes", [])
    matcher = difflib.SequenceMatcher(None, [_signature(n) for n in a],
                                      [_signature(n) for n in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2), strict=True):
                if a[i] != b[j]:
                    changes += _node_changes(a[i], b[j], j, sources)
        elif tag == "replace" and i2 - i1 == j2 - j1:
            for i, j in zip(range(i1, i2), range(j1, j2), strict=True):
                changes += _node_changes(a[i], b[j], j, sources)
        else:
            for j in range(j1, j2):
                changes.append(f"{op_label(b[j][1]) or b[j][0]} added at {_where(j, sources)}")
            for i in range(i1, i2):
                changes.append(f"{op_label(a[i][1]) or a[i][0]} removed (was node {i})")
    if len(changes) > MAX_DESCRIBED:
        rest = len(changes) - MAX_DESCRIBED
        changes = changes[:MAX_DESCRIBED] + [f"and {rest} more difference{'s' * (rest > 1)}"]
    return changes
