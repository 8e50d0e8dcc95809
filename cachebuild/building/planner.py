"""Planning: a model and a call → its entry (trace → split → targets → entry).

``Planner.lookup`` finds the stored entry whose recorded guards hold on the live model
(starting at the entry key, then the variants for other values the trace read); on a
miss, ``Planner.trace`` runs Dynamo once and ``Planner.plan`` splits the graph, plans every
target (piece × bucket, keyed by its factors) and makes the entry, which
``entry.record_entry`` stores.
``target_factors`` are the backend and pass factors every target of a config shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cachebuild.backends import Backend, get_backend
from cachebuild.building.entry import Entry, make_entry, stored_entry
from cachebuild.building.entry_key import entry_factors
from cachebuild.building.notice import VALUES_DIFFER
from cachebuild.config import CompileConfig, check_inductor_options
from cachebuild.counters import COUNTERS, timed
from cachebuild.errors import UsageError
from cachebuild.graph.facts import device_of
from cachebuild.keys import make_key, variant_key
from cachebuild.passes import PassManager
from cachebuild.store.interface import Store
from cachebuild.tracing.distributed import layout_mismatches
from cachebuild.tracing.env import env_factors
from cachebuild.tracing.guards import Mismatch, describe_all, is_grad_mode
from cachebuild.tracing.split import check_splitting_ops, split_graph
from cachebuild.tracing.targets import make_targets
from cachebuild.tracing.trace import TracedGraph, trace_model
from cachebuild.trust.fxjson import GraphFormatError
from cachebuild.trust.sources import code_here


def target_factors(backend: Backend, config: CompileConfig, passes: PassManager,
                   device: str | None = None, probe_dir: Path | None = None) -> dict[str, Any]:
    """Backend and pass factors, shared by every target of a config.

    With ``device``, the backend's factors include its toolchain there (the C++ compiler,
    which may need a probe, kept in ``probe_dir``): what target keys take. Without, what
    the entry key takes, computed without probing, so a warm start finds its entry at once.
    """
    factors = backend.factors(config)
    if device is not None:
        factors = {**factors, "toolchain": backend.toolchain(config, device, probe_dir)}
    return {"backend": factors, "passes": passes.factors()}


#: How many entries of one model, differing in values the trace read, a lookup visits.
MAX_VARIANTS = 8


@dataclass
class Lookup:
    """What a warm start found: the entry (None on a miss), why not, and the key where
    this model's entry is or is to be stored, with the factors of the entry key."""

    entry: Entry | None
    why: str
    key: str
    factors: dict[str, Any]
    mismatches: list[Mismatch] = field(default_factory=list)  # of the last entry tried


def autocast_refusal(config: CompileConfig) -> str | None:
    """Why a call may not run now, where it runs under ``torch.autocast`` and the config's
    backend compiles its pieces: they are built without autocast and never apply the one
    around the call (their outputs would keep the model's dtype); else None. ``eager_fusion``
    pieces run eagerly, under it. About this call, never remembered as a failure."""
    if config.backend == "eager_fusion" or not torch._C._is_any_autocast_enabled():
        return None
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if not on:
        return None
    return (f"the model is called under torch.autocast ({', '.join(on)}), which the pieces "
            f"the {config.backend} backend compiles do not apply (they are built without it, "
            "and would answer in the model's own dtype): convert the model instead "
            "(model.to(torch.bfloat16)) and call it outside autocast, or use "
            "backend='eager_fusion', whose pieces run under it")


class Planner:
    """Trace → split → targets → entry for one model and call signature."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig,
                 dynamic_dims: dict[int, int], store: Store | None,
                 passes: PassManager | None = None,
                 touch: bool = True) -> None:
        """``touch=False``: looking, not using (``plan``, ``explain``): reading the stored
        entry does not count as a hit nor refresh what GC goes by."""
        self.model = model
        self.config = config
        self.dynamic_dims = dict(dynamic_dims)
        self.store = store
        self.backend = get_backend(config.backend)
        self._passes = passes
        self.touch = touch

    @property
    def passes(self) -> PassManager:
        """The pass manager: the one given, else the built-in passes the config enables."""
        if self._passes is None:
            self._passes = PassManager.from_config(self.config.passes)
        return self._passes

    def entry_key(self, args: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
        factors = entry_factors(self.model, args, self.dynamic_dims, self.config,
                                target_factors(self.backend, self.config, self.passes))
        return make_key(factors), factors

    def lookup(self, args: tuple[Any, ...],
               pending: Mapping[str, Entry] | None = None) -> Lookup:
        """The stored entry for this call whose guards hold on the live model, if any.

        Starts at the entry key; an entry whose guards fail leads to the key of the variant
        for the live values (``variant_key``), and so on, a few steps at most.
        ``pending``: entries by key that count as stored (planned, not yet recorded: the
        ranks of a world size planned one after another share the entry of equal shards).
        """
        key, factors = self.entry_key(args)
        why = "no entry"
        wrong: list[Mismatch] = []
        for _ in range(MAX_VARIANTS):
            # An entry planned for another rank is this process's own trace: its sources
            # are this process's code.
            entry = (pending or {}).get(key)
            if entry is None:
                entry, unusable = stored_entry(self.store, key, touch=self.touch,
                                               stale_too=True)
                if unusable is not None and entry is not None:
                    # Traced from other code (a module it imports differs): that code's
                    # entry stays where it is, and this code's is at a variant of its
                    # own, so two versions served from one store never replace each
                    # other's entry (a rolling deploy).
                    why, wrong = unusable, []
                    key = variant_key(key, [{"code": code_here(entry.stale_files())}])
                    continue
                if unusable is not None:
                    return Lookup(None, unusable, key, factors)
                if entry is None:
                    return Lookup(None, why, key, factors, wrong)
            with timed("guards"):
                guards = entry.guard_set()
                values = guards.values(self.model, args)
                # A call in another autograd mode is told apart at each call (it runs
                # eagerly): the entry still serves this model.
                wrong = [m for m in guards.mismatches(self.model, args, values, entry.sources)
                         if not is_grad_mode(m)]
                layouts = entry.layouts()
                if layouts:  # a tensor-parallel model: its process groups as traced?
                    moved, live = layout_mismatches(layouts)
                    wrong += moved
                    values = [*values, {"process_groups": live}]
            if not wrong:
                return Lookup(entry, "fresh", key, factors)
            why = f"{VALUES_DIFFER}: {describe_all(wrong)}"
            key = variant_key(key, values)
        return Lookup(None, why, key, factors, wrong)

    def trace(self, args: tuple[Any, ...], found: Lookup | None = None) -> Entry:
        """Trace the model, split it, plan its targets: a new (not yet stored) Entry, to be
        stored where ``found`` (the lookup that missed) says."""
        found = found or self.lookup(args)
        check_splitting_ops(self.config.splitting_ops)
        check_inductor_options(self.config)
        self.start_toolchain(args)
        with timed("trace"):
            traced = trace_model(self.model, args, self.dynamic_dims,
                                 self.config.compile_ranges)
            COUNTERS.traced += 1
            if self.store is not None:
                self.store.count("traces")
        return self.plan(traced, found.factors, found.key)

    def start_toolchain(self, args: tuple[Any, ...]) -> None:
        """Let the backend begin finding its toolchain for the device of ``args`` (a probe,
        once per environment) beside the trace that follows: the first build then waits
        for what is left of it, not for all of it."""
        start = getattr(self.backend, "start_toolchain", None)
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if start is not None and tensor is not None and tensor.device.type != "meta":
            start(self.config, str(tensor.device))

    def plan(self, traced: TracedGraph, factors: dict[str, Any], key: str | None = None) -> Entry:
        why = autocast_refusal(self.config)  # the torch.compile door plans as Dynamo traces
        if why is not None:
            raise UsageError(why)
        check_inductor_options(self.config)  # a trace has loaded Inductor's config
        with timed("split"):
            split = split_graph(traced, self.config.splitting_ops)
        with timed("plan"):
            device = device_of(traced.input_metas)
            tf = target_factors(self.backend, self.config, self.passes, device)
            try:
                targets = make_targets(split.pieces, self.config.buckets(),
                                       backend=tf["backend"], passes=tf["passes"],
                                       env=env_factors(device))
            except GraphFormatError as e:  # a call the model makes: bad input, not a failure
                raise UsageError(str(e)) from e
            entry = make_entry(factors, traced, split, targets, key)
        planned = sum(len(t) for t in targets.values())
        COUNTERS.planned += planned
        COUNTERS.unique += len(entry.target_keys())
        return entry
