"""Explaining as a library call: why a model's entry or targets are not stored.

``explain(model)`` plans the model as ``plan`` does (``warming``: one rank, or each rank
of a world size under torch's fake process group) and says, without building or storing
anything:

- for each entry that is not used, why: the values its trace read that differ now, its
  traced source that changed, or, where none is stored for the model's key, the nearest
  stored entry of the same class and what differs from it (its key's factors, then the
  values its guards read, checked on the live model);
- for each target that is not stored (each once, with the ranks that use it), the nearest
  stored target and the factors that differ, in words (``explain.explain``).

Manifests from a shared tier explain too; the report keeps their words as they are, so a
caller that prints them escapes them. The ``explain`` command prints this report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachebuild.store import Record
    from cachebuild.warming import ModelSource, Planned, StoreArg


@dataclass
class EntryExplanation:
    """Why a model's entry was not used: ``why`` is the lookup's (``no entry``, ``traced
    source changed: ...``, ...); ``mismatches`` the values its trace read that differ
    now; with no entry stored, ``nearest`` is the nearest stored entry of the class and
    ``differences`` what differs from it (None: nothing of the class is stored)."""

    key: str
    why: str
    mismatches: list[str] = field(default_factory=list)
    nearest: str | None = None
    differences: list[str] = field(default_factory=list)


@dataclass
class MissingTarget:
    """A target that is not stored: its state (``stale`` or ``missing``), the ranks using
    it (with a world size), the nearest stored target (None: nothing comparable) and what
    differs from it."""

    key: str
    label: str  # "piece 3 range 1-64"
    state: str
    ranks: list[int]
    nearest: str | None
    reasons: list[str]


@dataclass
class ExplainReport:
    """Every entry not used and every target not stored, with why."""

    entries: list[EntryExplanation]
    targets: list[MissingTarget]
    world_size: int | None = None


def explain(model: ModelSource, *, store: StoreArg = None, device: str | None = None,
            world_size: int | None = None) -> ExplainReport:
    """Why ``model``'s entry and targets are not stored (see the module doc); ``store``,
    ``device`` and ``world_size`` as for ``cachebuild.plan``. Changes nothing in the
    store and counts no use of it."""
    from cachebuild.building.nearest import explain as explain_target
    from cachebuild.building.nearest import label
    from cachebuild.warming import (
        open_given,
        per_entry,
        plan_group,
        source_of,
        target_states,
        target_users,
    )

    opened, owned = open_given(store)
    try:
        records: list[Record] | None = None
        group: list[Planned] = []
        entries: list[EntryExplanation] = []
        for planned in plan_group(source_of(model), opened, device, world_size):
            group.append(planned)
            if records is None:  # a shared tier's manifests explain too
                records = list(opened.records(shared=True))
            if planned.why != "fresh" and \
                    planned.found.key not in {p.found.key for p in group[:-1]}:
                entries.append(_entry(planned, records))  # with this rank's group up
        stored = [(r.key, r.manifest) for r in records or []
                  if r.kind != "entry" and r.manifest]
        users = target_users(group)
        targets: list[MissingTarget] = []
        seen: set[str] = set()
        for planned in per_entry(group):
            states = target_states(planned, opened)
            for t in planned.entry.targets():
                if t.key in seen or states[t.key] == "stored":
                    continue
                seen.add(t.key)
                why = explain_target(t.manifest, stored, t.sources)
                targets.append(MissingTarget(
                    t.key, label(t), states[t.key],
                    users[t.key] if world_size is not None else [], why.nearest, why.reasons))
        return ExplainReport(entries, targets, world_size)
    finally:
        if owned:
            opened.close()


def _entry(planned: Planned, records: list[Record]) -> EntryExplanation:
    """Why the planned model's entry was not used (see ``EntryExplanation``)."""
    from cachebuild.building.entry import read_entry
    from cachebuild.building.nearest import fold_owners, nearest_entry

    found = planned.found
    said = EntryExplanation(found.key, found.why, [m.describe() for m in found.mismatches])
    if found.mismatches or found.why != "no entry":
        return said
    nearest = nearest_entry(found.factors, records)
    if nearest is None:
        return said
    said.nearest, said.differences = nearest
    data = planned.planner.store.get(said.nearest, touch=False)
    stored = read_entry(data) if data is not None else None  # None: another format
    if stored is not None:
        spec = planned.spec
        said.differences += fold_owners([m.describe() for m in stored.guard_set().mismatches(
            spec.model, spec.example_inputs, known=stored.sources)])
    return said
