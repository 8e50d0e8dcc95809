"""Why a target or an entry is missing: the nearest stored one and what differs.

For an entry that is the factors of its key (a config value: ``config.rms_norm_eps:
1e-06 → 1e-05``) and the values its trace read, checked on the live model
(``layers.0.mlp.act_fn: SiLU → GELUActivation``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachebuild.keys import MISSING, Difference, canonical_json, diff_manifests
from cachebuild.targets import bucket_label


@dataclass
class Explanation:
    key: str
    nearest: str | None
    reasons: list[str]


def _pass_changes(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    before = {p["name"]: p["uuid"] for p in old}
    after = {p["name"]: p["uuid"] for p in new}
    out = []
    for name in sorted(set(before) | set(after)):
        if name not in before:
            out.append(f"pass {name} enabled")
        elif name not in after:
            out.append(f"pass {name} disabled")
        elif before[name] != after[name]:
            out.append(f"pass {name} changed")
    return out


def describe(d: Difference) -> list[str]:
    """A difference in words: "pass rms_quant changed", "torch 2.11.0 → 2.13.0"."""
    if d.path == "passes.passes" and isinstance(d.old, list) and isinstance(d.new, list):
        return _pass_changes(d.old, d.new)
    if d.path.startswith("env.") and not isinstance(d.old, dict):
        return [f"{d.path.removeprefix('env.')} {d.old} → {d.new}"]
    if d.path.startswith("bucket"):
        return ["a different shape bucket"]
    if d.path.startswith("graph."):
        return [f"the piece's {d.path.removeprefix('graph.')} differ (model code or shapes changed)"]
    return [d.describe()]


def explain(wanted: dict[str, Any], stored: list[tuple[str, dict[str, Any]]]) -> Explanation:
    """Compare a wanted manifest with the nearest of ``stored`` (key, manifest) pairs.

    Nearest = fewest differing factors, preferring the same bucket.
    """
    best: tuple[int, str, list[Difference]] | None = None
    for key, manifest in stored:
        diffs = diff_manifests(manifest, wanted)
        score = len(diffs) + (0 if manifest.get("bucket") == wanted.get("bucket") else 100)
        if best is None or score < best[0]:
            best = (score, key, diffs)
    if best is None:
        return Explanation(key="", nearest=None, reasons=["nothing comparable is stored"])
    reasons = [r for d in best[2] for r in describe(d)]
    return Explanation(key="", nearest=best[1], reasons=reasons or ["identical factors"])


def label(target: Any) -> str:
    return f"piece {target.piece} {bucket_label(target.bucket)}"


def _value(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list)) or value is MISSING:
        return "absent" if value is MISSING else canonical_json(value)[:60]
    return str(value)


def describe_entry(d: Difference) -> list[str]:
    """An entry factor that differs, in words: ``hf.config.rms_norm_eps: 1e-06 → 1e-05``."""
    if d.path.startswith("model_config."):
        return [f"{d.path.removeprefix('model_config.')}: {_value(d.old)} → {_value(d.new)}"]
    if d.path.startswith("model.code"):
        return [f"the code of {d.path.removeprefix('model.code.') or 'a class'} changed"]
    return describe(d)


def nearest_entry(factors: dict[str, Any], records: list[Any]) -> tuple[str, list[str]] | None:
    """The stored entry of the same model class whose key factors differ least from
    ``factors``, with those differences in words (None if there is none)."""
    best: tuple[int, str, list[Difference]] | None = None
    for record in records:
        manifest = record.manifest or {}
        if record.kind != "entry" or manifest.get("model", {}).get("class") != \
                factors["model"]["class"]:
            continue
        diffs = diff_manifests(manifest, factors)
        if best is None or len(diffs) < best[0]:
            best = (len(diffs), record.key, diffs)
    if best is None:
        return None
    return best[1], [r for d in best[2] for r in describe_entry(d)]
