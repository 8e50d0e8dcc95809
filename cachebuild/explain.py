"""Why a target is missing: the nearest stored manifest and the factors that differ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachebuild.keys import Difference, diff_manifests
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
        try:
            diffs = diff_manifests(manifest, wanted)
        except (TypeError, ValueError, RecursionError, AttributeError):
            continue  # not a manifest cachebuild wrote: it explains nothing
        score = len(diffs) + (0 if manifest.get("bucket") == wanted.get("bucket") else 100)
        if best is None or score < best[0]:
            best = (score, key, diffs)
    if best is None:
        return Explanation(key="", nearest=None, reasons=["nothing comparable is stored"])
    reasons = []
    for d in best[2]:
        try:
            reasons += describe(d)
        except (TypeError, ValueError, KeyError, RecursionError, AttributeError):
            reasons.append(f"{d.path} differs")
    return Explanation(key="", nearest=best[1], reasons=reasons or ["identical factors"])


def label(target: Any) -> str:
    return f"piece {target.piece} {bucket_label(target.bucket)}"
