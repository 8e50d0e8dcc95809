"""Model-level entries: everything a warm process needs instead of Dynamo.

An entry (store kind ``entry``, refs = its target keys) records the stitching graph, each
piece (compiled pieces by graph and target keys, splitting-op pieces by graph), how each
graph input is bound to the live model and call, how to rebuild the output, the source
files Dynamo traced with the hash of their syntax trees, and the guards: every value the
trace read besides tensors (``guards.py``). Its key is computed from the live model and
call without a trace (``entry_key.entry_factors``).

The recorded guards are the source of truth: an entry whose guards fail on the live model
is not used, and the model's own entry is then looked for under a key derived from the
failing entry's key and the live values (``keys.variant_key``). Guards are data: their list is
checked for its shape when an entry is read, and covered by a seal stored beside the
entry under a key made from the entry's key and that list (``Entry.seal``); an entry whose
guards were edited or deleted has no seal, and is a miss.

This module owns how an entry is kept in a store: ``record_entry`` writes one (its seal
first), ``stored_entry`` reads one back with every check but the guards', and
``payload_refs`` tells the store what a stored entry refers to.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild.graph.facts import InputMeta, device_of
from cachebuild.keys import guard_seal_key, make_key
from cachebuild.store import register_refs
from cachebuild.store.interface import Store
from cachebuild.tracing.guards import GuardSet, check_data
from cachebuild.tracing.split import SplitPlan
from cachebuild.tracing.targets import Target, piece_data
from cachebuild.tracing.trace import Binding, TracedGraph
from cachebuild.trust.fxjson import GraphFormatError, data_to_graph, graph_to_data
from cachebuild.trust.sources import labels_in, source_data, stale

log = logging.getLogger("cachebuild")

#: The layout of a stored entry; bumped when it changes, so older entries are never misread
#: (it is an entry-key factor: an old entry is simply not found, and the model retraced).
ENTRY_FORMAT = 10  # 9: target keys name their recipe (``targets.RECIPE``): an older entry
#: names targets an older version built under settings their keys did not name. 10: the
#: files an operator's inlined kernel runs are traced sources (``facts.kernel_files``): an
#: older entry does not name a kernel's file other than the one registering it


@dataclass(frozen=True)
class TargetRef:
    """One target of a compiled piece: the bucket it serves and its key."""

    bucket: dict[str, Any]
    key: str


@dataclass
class PieceRecord:
    """One piece of the split forward, as a warm process needs it.

    ``nodes`` is the piece's graph as stored data (``fxjson``); ``targets`` are in dispatch
    order (exact sizes, then ranges). ``weights[i]`` says input ``i`` is a model weight (the
    same tensor at every call); ``inner`` lists the inputs made inside the model (a
    splitting op's or another piece's output), whose layout the runtime keeps;
    ``written`` the inputs the piece writes in place, which the runtime hands it as the
    very tensors (never a copy).
    """

    name: str
    compiled: bool
    nodes: list[dict[str, Any]]
    input_metas: list[InputMeta]
    single_output: bool
    size_input: tuple[int, int] | None
    targets: list[TargetRef]
    weights: list[bool]
    inner: list[int]
    sources: list[str | None]  # per node: where the trace recorded it (for ``explain``)
    written: list[int] = field(default_factory=list)


@dataclass
class Entry:
    """Everything a warm process needs instead of Dynamo (see the module doc). Typed
    values throughout; only ``to_bytes``/``from_bytes`` see JSON."""

    key: str
    factors: dict[str, Any]
    bindings: list[Binding]
    input_metas: list[InputMeta]
    stitch: list[dict[str, Any]]  # the stitching graph as stored data (``fxjson``)
    pieces: list[PieceRecord]
    out_spec: str
    source_files: dict[str, str]
    manifests: dict[str, dict[str, Any]]  # target key → its manifest, once per unique key
    guards: list[list[Any]]  # GuardSet data: what the trace read besides tensors
    written_inputs: list[int] = field(default_factory=list)  # graph inputs written in place
    #: What the tracing process knew of each source label its guards name (file name,
    #: module name, hash): how ``explain`` names a change of code.
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Each traced file's size and times as of its hash (``sources.stamp``).
    source_stamps: dict[str, list[int]] = field(default_factory=dict)
    #: Each traced file of an installed library: its path inside the library folder
    #: (``peft/config.py``), by which it is found and never confused with a file of the
    #: same name elsewhere (``sources.stale``).
    source_libraries: dict[str, str] = field(default_factory=dict)
    #: Where the seal of its guard list is stored (made from its key and that list): an
    #: entry whose guards no key can be made of is not made (ValueError, TypeError).
    seal: str = field(init=False)
    #: What each graph output is (dims as sizes or symbols; None where unknown): how a
    #: padded call's outputs are cut back (``cudagraphs.pad_plan``).
    output_metas: list[InputMeta | None] = field(default_factory=list)
    #: Why this entry may not be stored (its trace read what a warm start cannot check
    #: without Dynamo), or None; never stored itself.
    unrecordable: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.seal = guard_seal_key(self.key, self.guards)

    def target_keys(self) -> list[str]:
        keys: list[str] = []
        for p in self.pieces:
            keys += [t.key for t in p.targets if t.key not in keys]
        return keys

    def stored_keys(self) -> list[str]:
        """Everything besides the entry that a store must hold for it: its targets and
        its seal (what its refs list, and what push and pull move with it)."""
        return [*self.target_keys(), self.seal]

    def targets(self) -> list[Target]:
        return [Target(t.key, i, t.bucket, self.manifests[t.key], tuple(p.sources))
                for i, p in enumerate(self.pieces) for t in p.targets]

    def layouts(self) -> list[dict[str, Any]]:
        """The distinct process-group layouts its targets were keyed with (none for a
        model without collectives)."""
        found: list[dict[str, Any]] = []
        for manifest in self.manifests.values():
            layout = manifest.get("distributed")
            if layout is not None and layout not in found:
                found.append(layout)
        return found

    @property
    def device(self) -> str:
        """Where the traced call's tensors were."""
        return device_of(self.input_metas)

    def guard_set(self) -> GuardSet:
        return GuardSet.from_data(self.guards)

    def stale_files(self) -> list[str]:
        """Traced sources whose code is not the code of this process (``sources.stale``:
        found by content, wherever the file lies now), each named where it differs."""
        return stale(self.source_files, self.source_stamps, self.source_libraries)

    def to_bytes(self) -> bytes:
        data = {
            "key": self.key, "factors": self.factors,
            "bindings": [b.to_data() for b in self.bindings],
            "input_metas": [m.to_data() for m in self.input_metas],
            "stitch": self.stitch,
            "pieces": [{
                "name": p.name, "compiled": p.compiled, "nodes": p.nodes,
                "input_metas": [m.to_data() for m in p.input_metas],
                "single_output": p.single_output,
                "size_input": list(p.size_input) if p.size_input else None,
                "targets": [{"bucket": t.bucket, "key": t.key} for t in p.targets],
                "weights": p.weights, "inner": p.inner, "sources": p.sources,
                "written": p.written,
            } for p in self.pieces],
            "out_spec": self.out_spec, "source_files": self.source_files,
            "manifests": self.manifests, "guards": self.guards,
            "written_inputs": self.written_inputs, "sources": self.sources,
            "source_stamps": self.source_stamps, "source_libraries": self.source_libraries,
            "output_metas": [m.to_data() if m is not None else None
                             for m in self.output_metas],
        }
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Entry:
        """The entry ``to_bytes`` wrote; ValueError, KeyError or TypeError if it is not one."""
        raw = json.loads(data)
        pieces = [PieceRecord(
            name=p["name"], compiled=bool(p["compiled"]), nodes=p["nodes"],
            input_metas=[InputMeta.from_data(m) for m in p["input_metas"]],
            single_output=bool(p["single_output"]),
            size_input=tuple(p["size_input"]) if p["size_input"] else None,
            targets=[TargetRef(t["bucket"], t["key"]) for t in p["targets"]],
            weights=[bool(w) for w in p["weights"]], inner=[int(i) for i in p["inner"]],
            sources=[str(x) if x is not None else None for x in p["sources"]],
            written=[int(i) for i in p["written"]],
        ) for p in raw["pieces"]]
        return cls(
            key=raw["key"], factors=raw["factors"],
            bindings=[Binding.from_data(b) for b in raw["bindings"]],
            input_metas=[InputMeta.from_data(m) for m in raw["input_metas"]],
            stitch=raw["stitch"], pieces=pieces, out_spec=raw["out_spec"],
            source_files=raw["source_files"], manifests=raw["manifests"],
            guards=check_data(raw["guards"]),
            written_inputs=[int(i) for i in raw["written_inputs"]],
            sources={str(k): dict(v) for k, v in raw["sources"].items()},
            source_stamps={str(k): [int(x) for x in v] for k, v in raw["source_stamps"].items()},
            # Entries written before libraries were recorded have none (``stale`` then
            # finds them by where they lie here).
            source_libraries={str(k): str(v)
                              for k, v in raw.get("source_libraries", {}).items()},
            output_metas=[InputMeta.from_data(m) if m is not None else None
                          for m in raw["output_metas"]],
        )


#: What reading a stored payload that is not an entry of this format raises.
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError)


def read_entry(data: bytes) -> Entry | None:
    """The entry stored as ``data``, or None if it is not one this version reads (an
    older format, or not an entry at all)."""
    try:
        return Entry.from_bytes(data)
    except UNREADABLE:
        return None


def stored_entry(store: Store, key: str, *, touch: bool = True, stale_too: bool = False
                 ) -> tuple[Entry | None, str | None]:
    """The entry stored under ``key`` if a warm start may use it: ``(entry, None)``;
    else ``(None, why)``: not an entry this version reads, its guard list not the one
    sealed with it, or a source its trace read changed since; ``(None, None)`` if none
    is stored. Its guards are the caller's to check, on the live model. ``touch=False``:
    a look, not a use of the store. ``stale_too``: an entry whose traced sources changed
    is returned with why, ``(entry, why)`` (another version of the code: ``lookup``
    looks for that version's entry)."""
    recorded = store.get_record(key) is not None  # here; a remote tier's are fetched
    data = store.get(key, touch=touch)
    if data is None:
        # A record whose blob was not served: damaged (quarantined by the read), or from a
        # source not trusted; the store said which.
        if recorded:
            return None, ("its stored entry is not served here (damaged, or unsigned from a "
                          "source no one trusted: see the message above)")
        return None, None
    entry, why = _decoded(data)
    if entry is not None:
        why = _unusable(store, entry, key)
    if why is not None and not (stale_too and why.startswith(STALE)):
        entry = None
    return entry, why


#: Why an entry whose traced code changed since is not used (a miss, not damage).
STALE = "traced source changed"


def _decoded(data: bytes) -> tuple[Entry | None, str | None]:
    """The entry in a stored payload, or why there is none."""
    try:
        return Entry.from_bytes(data), None
    except UNREADABLE as e:  # not an entry of this format, or guards no key can be made of
        return None, f"stored entry unreadable ({type(e).__name__})"


def _unusable(store: Store, entry: Entry, key: str) -> str | None:
    """Why ``entry``, read from under ``key``, may not be used (None: it may): its guard
    list is not the one sealed with it, or a source its trace read changed since."""
    if entry.key != key or not store.contains(entry.seal):
        return "the stored entry's guards are not the ones recorded with it (no seal for them)"
    changed = entry.stale_files()
    if changed:
        return f"{STALE}: {', '.join(changed)}"
    return None


def record_entry(entry: Entry, store: Store) -> bool:
    """Store ``entry`` under its key (under the key's build lock), replacing a stale or
    unreadable one there; True. False, with one log line, where its trace cannot be
    checked without Dynamo (``unrecordable``), so no entry may exist.

    An entry a warm start may use that is stored meanwhile (by another process, or with a
    shared tier another machine) is kept: deleting it would also take the fleet's shared
    copy away. The seal of its guards is stored first: an entry is never stored without it
    (``contains`` verifies the one there, and moves a damaged or refused one out of the
    way of this put).
    """
    if entry.unrecordable is not None:
        log.warning("compiled %s without recording an entry (no warm start): %s",
                    entry.factors["model"]["class"].rsplit(".", 1)[-1], entry.unrecordable)
        return False
    with store.lock(entry.key):
        _put(entry, store)
    return True


def _put(entry: Entry, store: Store) -> None:
    payload, refs = entry.to_bytes(), entry.stored_keys()
    stored, why = stored_entry(store, entry.key)
    if stored is not None:
        return
    if why is not None:
        store.delete(entry.key)
    if not store.contains(entry.seal):
        store.put(entry.seal, b"", kind="guards")
    store.put(entry.key, payload, kind="entry", manifest=entry.factors, refs=refs)


#: Kinds of stored payloads that hold graphs a load rebuilds: model entries (the stitching
#: graph and every piece) and ``eager_fusion`` artifacts (``{"nodes": [...]}``).
GRAPH_KINDS = ("entry", "fx-graph")


def graph_refusal(kind: str, payload: bytes) -> str | None:
    """Why a load would refuse a graph that a verified payload of ``kind`` holds, in one
    line naming the graph and what it calls; None if every graph passes (or ``kind``
    holds none). The checks are the load's own (``fxjson.data_to_graph``: the table of
    ``cachebuild.trust.allowed``, constants, shape), so a graph that passes here is one a load
    does not refuse, except that an operator of a library this process has not imported
    (a splitting op) cannot be judged here and is let through. An entry this version
    cannot read is a miss when loaded, not a refusal: None."""
    if kind == "fx-graph":
        try:
            graphs = [("graph", json.loads(payload)["nodes"])]
        except (*UNREADABLE, UnicodeDecodeError):
            return "stored graph is not graph data"
    elif kind == "entry":
        entry = read_entry(payload)
        if entry is None:
            return None
        graphs = [("stitching graph", entry.stitch)] + [
            (f"piece {p.name}", p.nodes) for p in entry.pieces]
    else:
        return None
    for where, nodes in graphs:
        try:
            data_to_graph(nodes, absent_libraries=True)
        except GraphFormatError as e:
            return f"{where}: {' '.join(str(e).split())}"
    return None


def refused_graphs(store: Store, skip: Collection[str] = ()) -> list[tuple[str, str]]:
    """``(key, why)`` for every stored record whose graphs a load would refuse
    (``graph_refusal``): what ``cachebuild verify`` reports beside damaged blobs. Keys in
    ``skip`` are not read: blobs the caller found damaged (reading one would report it
    again and quarantine it, which only a repair may do) or not trusted (never served)."""
    found = []
    for kind in GRAPH_KINDS:
        for record in list(store.records(kind=kind, manifests=False)):
            if record.key in skip:
                continue
            payload = store.get(record.key, touch=False)
            if payload is not None:
                why = graph_refusal(kind, payload)
                if why is not None:
                    found.append((record.key, why))
    return found


def payload_parts(payload: bytes) -> tuple[list[str], str | None]:
    """A stored entry's target keys and the key of its guards' seal (None: it has none),
    read from the payload's JSON without building the entry, so that an entry of an
    older format still keeps its targets. ValueError, KeyError, TypeError or
    AttributeError if the payload names none; an entry whose guards no key can be made
    of has no seal (it is a miss anyway)."""
    doc = json.loads(payload)
    keys = [t["key"] for p in doc.get("pieces", []) for t in p.get("targets", [])]
    seal = None
    if "key" in doc and "guards" in doc:  # an entry that has a seal
        try:
            seal = guard_seal_key(doc["key"], doc["guards"])
        except (ValueError, TypeError, RecursionError):
            pass
    return keys, seal


def payload_refs(payload: bytes) -> list[str]:
    """The keys a stored entry needs beside it: its targets and the seal of its guards
    (``payload_parts``)."""
    keys, seal = payload_parts(payload)
    return keys if seal is None else [*keys, seal]


# The store reads what an entry refers to through this (also declared as the
# ``cachebuild.refs`` entry point, for processes that never import this module).
register_refs("entry", payload_refs)


def make_entry(factors: dict[str, Any], traced: TracedGraph, plan: SplitPlan,
               targets: dict[int, list[Target]], key: str | None = None) -> Entry:
    """The entry of a trace, stored under ``key`` (default: the key of ``factors``)."""
    weights, inner = _piece_inputs(plan, traced.bindings)
    pieces = [
        PieceRecord(
            name=p.name,
            compiled=p.compiled,
            nodes=piece_data(p),
            input_metas=list(p.input_metas),
            single_output=p.single_output,
            size_input=tuple(p.size_input) if p.size_input else None,
            targets=[TargetRef(t.bucket, t.key) for t in targets.get(p.index, [])],
            weights=weights[p.name],
            inner=inner[p.name],
            sources=list(targets[p.index][0].sources) if targets.get(p.index) else [],
            written=list(p.written),
        )
        for p in plan.pieces
    ]
    return Entry(
        key=key or make_key(factors),
        factors=factors,
        bindings=list(traced.bindings),
        input_metas=list(traced.input_metas),
        stitch=graph_to_data(plan.stitch.graph),
        pieces=pieces,
        out_spec=traced.out_spec,
        source_files=traced.source_files,
        manifests={t.key: t.manifest for ts in targets.values() for t in ts},
        guards=[g.to_data() for g in traced.guards],
        written_inputs=list(plan.written_inputs),
        sources=source_data(labels_in([g.to_data() for g in traced.guards])),
        source_stamps=dict(traced.source_stamps),
        source_libraries=dict(traced.source_libraries),
        output_metas=list(traced.output_metas),
        unrecordable=traced.unrecordable,
    )


def _piece_inputs(plan: SplitPlan, bindings: list[Binding]
                  ) -> tuple[dict[str, list[bool]], dict[str, list[int]]]:
    """Per piece: which inputs are model weights, and which are made inside the model.

    Without bindings (the torch.compile front door, where Dynamo hands in every input at
    each call) no input is known to be a weight."""
    placeholders = [n for n in plan.stitch.graph.nodes if n.op == "placeholder"]
    weight_nodes = {n for n, b in zip(placeholders, bindings or [None] * len(placeholders),
                                      strict=True)
                    if b is not None and b.kind in ("param", "buffer")}
    weights: dict[str, list[bool]] = {}
    inner: dict[str, list[int]] = {}
    for node in plan.stitch.graph.nodes:
        if node.op != "call_module":
            continue
        weights[node.target] = [a in weight_nodes for a in node.args]
        inner[node.target] = [i for i, a in enumerate(node.args)
                              if isinstance(a, torch.fx.Node) and a.op != "placeholder"]
    return weights, inner
