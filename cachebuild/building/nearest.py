"""Why a target or an entry is missing: the nearest stored one and what differs.

For a target, the factors of its manifest in words: the piece's graph diffed node by node
(``silu → gelu at node 5 (model.py:42)``, ``constant 1e-05 → 1e-06 in rms_norm at node 3``,
an input reshaped: another rank's uneven shard), a pass edited, the environment, the
toolchain, the process-group layout (``world size 2 → 4``). For an entry, the
factors of its key (a config value: ``config.rms_norm_eps: 1e-06 → 1e-05``) and the values
its trace read, checked on the live model (``layers.0.mlp.act_fn: SiLU → GELUActivation``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cachebuild.building.entry import STALE
from cachebuild.graph.graphdiff import diff_graphs, similarity
from cachebuild.keys import MISSING, Difference, canonical_json, diff_manifests
from cachebuild.store import Record
from cachebuild.store.interface import Store
from cachebuild.tracing.distributed import describe_change
from cachebuild.tracing.targets import Target, bucket_label


@dataclass
class Explanation:
    """The nearest stored manifest (None if nothing is comparable) and what differs."""

    nearest: str | None
    reasons: list[str]


def _pass_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    from cachebuild.passes import changed_passes

    before = {p["name"] for p in old.get("passes", [])}
    after = {p["name"] for p in new.get("passes", [])}
    out = []
    for name in changed_passes(old, new):
        if name not in before:
            out.append(f"pass {name} enabled")
        elif name not in after:
            out.append(f"pass {name} disabled")
        else:
            out.append(f"pass {name} changed")
    return out


def describe(d: Difference) -> list[str]:
    """A difference in words: "pass rms_quant changed", "torch 2.11.0 → 2.13.0"."""
    if d.path.startswith("env.") and not isinstance(d.old, dict):
        return [f"{d.path.removeprefix('env.')} {d.old} → {d.new}"]
    if d.path.startswith("bucket"):
        return ["a different shape bucket"]
    return [d.describe()]


def fold_owners(lines: list[str]) -> list[str]:
    """Differences of the form ``owner: Class: change`` that say the same ``change`` (one
    edited file seen from every module it defines: ``layers.0: DecoderLayer: source of
    llama.py a → b``) said once, with their owners grouped by class: ``source of llama.py
    a → b (the model: Llama; layers.0, layers.1: DecoderLayer)``. Other lines are kept as
    they are, in order."""
    owners: dict[str, dict[str, list[str]]] = {}
    out: list[str] = []
    for line in lines:
        owner, _, rest = line.partition(": ")
        qual, _, change = rest.partition(": ")
        if not change or " " in qual:
            out.append(line)
            continue
        if change not in owners:
            owners[change] = {}
            out.append(change)  # placeholder, filled in below
        owners[change].setdefault(qual, []).append(owner)

    def whose(change: str) -> str:
        return "; ".join(", ".join(names) + f": {qual}" for qual, names in owners[change].items())

    return [f"{line} ({whose(line)})" if line in owners else line for line in out]


def explain(wanted: dict[str, Any], stored: list[tuple[str, dict[str, Any]]],
            sources: Sequence[str | None] | None = None) -> Explanation:
    """Compare a wanted manifest with the nearest of ``stored`` (key, manifest) pairs.

    Nearest = fewest differing factors (the process-group layout counts as one), preferring
    the same bucket, then the most alike graph (another rank's shard of the same piece
    rather than another piece). The piece graphs are diffed node by node (``graphdiff``;
    ``sources``: where the trace recorded each node of the wanted graph), the passes pass
    by pass.
    """
    scored: list[tuple[int, str, list[Difference]]] = []
    for key, manifest in stored:
        try:
            diffs = diff_manifests(manifest, wanted)
        except (TypeError, ValueError, RecursionError, AttributeError):
            continue  # not a manifest cachebuild wrote: it explains nothing
        factors = {d.path if d.path.split(".")[0] != "distributed" else "distributed"
                   for d in diffs}
        score = len(factors) + (0 if manifest.get("bucket") == wanted.get("bucket") else 100)
        scored.append((score, key, diffs))
    if not scored:
        return Explanation(nearest=None, reasons=["nothing comparable is stored"])
    least = min(s[0] for s in scored)
    tied = [s for s in scored if s[0] == least]
    best = tied[0]
    by_key = dict(stored)
    if len(tied) > 1 and any(d.path.startswith("graph.") for d in best[2]):
        best = max(tied, key=lambda s: _graph_likeness(by_key[s[1]], wanted))
    nearest = by_key[best[1]]
    reasons: list[str] = []
    try:
        if any(d.path.startswith("graph.") for d in best[2]):
            reasons += diff_graphs(nearest.get("graph", {}), wanted.get("graph", {}), sources)
        if any(d.path.startswith("passes.") for d in best[2]):
            reasons += _pass_changes(nearest.get("passes", {}), wanted.get("passes", {}))
    except (TypeError, ValueError, KeyError, RecursionError, AttributeError, IndexError):
        reasons.append("the piece's graph or passes differ")  # a malformed stored manifest
    if any(d.path.split(".")[0] == "distributed" for d in best[2]):
        try:
            reasons += describe_change(nearest.get("distributed"), wanted.get("distributed"))
        except (TypeError, ValueError, KeyError, RecursionError, AttributeError):
            reasons.append("the process-group layout differs")  # a malformed stored manifest
    for d in best[2]:
        if d.path.startswith(("graph.", "passes.passes")) or d.path.split(".")[0] == "distributed":
            continue
        try:
            reasons += describe(d)
        except (TypeError, ValueError, KeyError, RecursionError, AttributeError):
            reasons.append(f"{d.path} differs")
    # The same change at several nodes (one constant in each of three splits) says it once.
    reasons = list(dict.fromkeys(reasons))
    return Explanation(nearest=best[1], reasons=reasons or ["identical factors"])


def _graph_likeness(manifest: dict[str, Any], wanted: dict[str, Any]) -> float:
    try:
        return similarity(manifest.get("graph", {}), wanted.get("graph", {}))
    except (TypeError, ValueError, KeyError, RecursionError, AttributeError, IndexError):
        return -1.0  # a malformed stored manifest: the least alike


def label(target: Target) -> str:
    """``piece 3 range 1-64``."""
    return f"piece {target.piece} {bucket_label(target.bucket)}"


def _value(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list)) or value is MISSING:
        return "absent" if value is MISSING else canonical_json(value)[:60]
    return str(value)


def _tensors(table: Any) -> dict[str, str]:
    """A parameter or buffer table of an entry's factors, by name: ``dtype [shape]``."""
    out = {}
    for row in table if isinstance(table, list) else []:
        if isinstance(row, list) and len(row) >= 3:
            shape = ", ".join(str(d) for d in row[1]) if isinstance(row[1], list) else row[1]
            out[str(row[0])] = f"{row[2]} [{shape}]"
    return out


def _tensor_changes(kind: str, old: Any, new: Any) -> list[str]:
    before, after = _tensors(old), _tensors(new)
    out = [f"{kind} {name}: {before[name]} → {after[name]}"
           for name in before if name in after and before[name] != after[name]]
    out += [f"{kind} {name} added ({after[name]})" for name in after if name not in before]
    out += [f"{kind} {name} removed (was {before[name]})" for name in before if name not in after]
    if len(out) > 4:
        out = out[:4] + [f"and {len(out) - 4} more {kind}s"]
    return out


def describe_entry(d: Difference) -> list[str]:
    """An entry factor that differs, in words: ``hf.config.rms_norm_eps: 1e-06 → 1e-05``,
    ``parameter layers.0.down.weight: float32 [64, 128] → float32 [64, 192]``."""
    if d.path == "entry_format":
        return [f"entry_format: {_value(d.old)} → {_value(d.new)} (an entry another version "
                "of cachebuild wrote, whose other factors it writes otherwise: not compared)"]
    if d.path in ("params", "buffers"):
        kind = "parameter" if d.path == "params" else "buffer"
        return _tensor_changes(kind, d.old, d.new) or [f"the {kind}s differ"]
    if d.path == "model.source":
        change = (f" (source {str(d.old)[:8]} → {str(d.new)[:8]})"
                  if isinstance(d.old, str) and isinstance(d.new, str) else "")
        return [f"the file defining the model's class differs{change}"]
    if d.path.startswith("model_config."):
        return [f"{d.path.removeprefix('model_config.')}: {_value(d.old)} → {_value(d.new)}"]
    if d.path.startswith("model.code"):
        return [f"the code of {d.path.removeprefix('model.code.') or 'a class'} changed"]
    if d.path in ("params", "buffers") and isinstance(d.old, list) and isinstance(d.new, list):
        return _tensor_table_changes(d.path[:-1], d.old, d.new)
    return describe(d)


def _tensor_table_changes(kind: str, old: list[Any], new: list[Any]) -> list[str]:
    """``param layers.0.qkv.weight: float32 [96, 64] → float32 [64, 64]`` (another rank's
    shard), for the first few tensors that differ; the rest counted."""
    def table(rows: list[Any]) -> dict[str, str]:
        return {str(r[0]): f"{r[2]} {r[1]}" for r in rows
                if isinstance(r, list) and len(r) == 4}

    a, b = table(old), table(new)
    changes = [f"{kind} {name}: {a.get(name, 'absent')} → {b.get(name, 'absent')}"
               for name in [*a, *(n for n in b if n not in a)] if a.get(name) != b.get(name)]
    if len(changes) > 3:
        changes = changes[:3] + [f"and {len(changes) - 3} more {kind}s"]
    return changes or [f"{kind}s differ"]


def entries_of(store: Store, model_class: str) -> list[Record]:
    """The records (manifests included) of the stored entries of ``model_class``: the
    local tier's, without reading a target's manifest."""
    out: list[Record] = []
    for record in store.records(manifests=False):
        if record.kind == "entry":
            full = store.get_record(record.key)
            manifest = full.manifest if full is not None else None
            if full is not None and isinstance(manifest, dict) and \
                    isinstance(manifest.get("model"), dict) and \
                    manifest["model"].get("class") == model_class:
                out.append(full)
    return out


def nearest_entry(factors: dict[str, Any], records: Iterable[Record]
                  ) -> tuple[str, list[str]] | None:
    """The stored entry of the same model class whose key factors differ least from
    ``factors`` (of those, the one recorded last: the version warmed before an edit, not
    the first ever), with those differences in words (None if there is none)."""
    best: tuple[int, float, str, list[Difference]] | None = None
    for record in records:
        manifest = record.manifest or {}
        if record.kind != "entry" or manifest.get("model", {}).get("class") != \
                factors["model"]["class"]:
            continue
        diffs = diff_manifests(manifest, factors)
        if best is None or (len(diffs), -record.created) < best[:2]:
            best = (len(diffs), -record.created, record.key, diffs)
    if best is None:
        return None
    diffs = best[3]
    # Another version's entry: its factors are written otherwise (a flag as a pair, a
    # setting named anew), so what else differs says nothing of the caller's model.
    diffs = [d for d in diffs if d.path == "entry_format"] or diffs
    return best[2], [r for d in diffs for r in describe_entry(d)]


def edited_since(why: str, store: Store, factors: dict[str, Any]) -> bool:
    """Whether a lookup that missed (``why``, the key's ``factors``) missed because the
    model's code was edited since it was warmed: a traced source file changed under its
    entry, or a stored entry of its class differs from ``factors`` in the model's code
    alone. Most of its targets are then likely stored already. False for anything else,
    or where the store cannot say (a damaged record)."""
    if why.startswith(STALE):
        return True
    if why != "no entry":
        return False
    try:
        for record in entries_of(store, factors["model"]["class"]):
            diffs = diff_manifests(record.manifest or {}, factors)
            if diffs and all(d.path == "model.source" or d.path.startswith("model.code")
                             for d in diffs):
                return True
    except Exception:  # no guess: the caller plans as for a model never warmed
        return False
    return False
