"""The front doors: ``cachebuild.compile``, ``cachebuild.backend`` and ``ModelSpec``.

``compile(model, ...)`` returns a module that behaves like the model. Its first call
computes the model's entry key; if the store holds that entry and the traced source files
are unchanged, the forward is rebuilt from the entry and stored targets with no Dynamo
(a warm start); otherwise the model is traced once, split, every target built or loaded,
and a new entry recorded.

``backend(config)`` is the same build graph behind torch.compile's extension point: Dynamo
traces every process, but targets are still built once and loaded from then on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild.build import Builder
from cachebuild.config import CompileConfig
from cachebuild.counters import COUNTERS, phase, snapshot
from cachebuild.dynamo_backend import GraphForward
from cachebuild.entry import Entry, device_of, entry_factors, make_entry, variant_key
from cachebuild.env import env_factors
from cachebuild.errors import UsageError
from cachebuild.guards import Mismatch
from cachebuild.keys import make_key
from cachebuild.runtime import ModelRuntime, direct_forward, resolve_all, stitch
from cachebuild.split import split_graph
from cachebuild.store.base import Store
from cachebuild.targets import make_targets
from cachebuild.trace import TracedGraph, trace_model

log = logging.getLogger("cachebuild")


def open_default_store(store: Store | None = None) -> Store:
    """``store`` itself, or the store the environment configures (``StoreOptions.from_env``:
    the same policy as the command line's, signing included)."""
    if store is not None:
        return store
    from cachebuild.store.options import open_store

    return open_store()


@dataclass
class ModelSpec:
    """What a MODEL.py's ``build()`` returns: a model, how to call it, how to compile it.

    ``dynamic_dims`` maps a positional argument's index to its dynamic dim (the token
    dim); ``example_inputs`` are traced once, with that dim at least 2.
    """

    model: torch.nn.Module
    example_inputs: tuple[Any, ...]
    dynamic_dims: dict[int, int] = field(default_factory=dict)
    config: CompileConfig = field(default_factory=CompileConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise UsageError("ModelSpec.model must be a torch.nn.Module")
        self.example_inputs = tuple(self.example_inputs)
        if not isinstance(self.config, CompileConfig):
            raise UsageError("ModelSpec.config must be a cachebuild.CompileConfig")


def target_factors(builder: Builder, device: str | None = None) -> dict[str, Any]:
    """Backend and pass factors, shared by every target of a config.

    With ``device``, the backend's factors include its toolchain there (the C++ compiler,
    which may need a probe): what target keys take. Without, what the entry key takes,
    computed without probing, so a warm start finds its entry at once.
    """
    backend = builder.backend.factors(builder.config)
    if device is not None:
        backend = {**backend, "toolchain": builder.toolchain(device)}
    return {"backend": backend, "passes": builder.passes.factors()}


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


class Planner:
    """Trace → split → targets → entry for one model and call signature."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig,
                 dynamic_dims: dict[int, int], store: Any, passes: Any = None) -> None:
        self.model = model
        self.config = config
        self.dynamic_dims = dict(dynamic_dims)
        self.store = store
        self.builder = Builder(store, config, passes)
        self.unrecordable: str | None = None  # why the latest trace cannot be recorded

    def entry_key(self, args: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
        factors = entry_factors(self.model, args, self.dynamic_dims, self.config,
                                target_factors(self.builder))
        return make_key(factors), factors

    def lookup(self, args: tuple[Any, ...]) -> Lookup:
        """The stored entry for this call whose guards hold on the live model, if any.

        Starts at the entry key; an entry whose guards fail leads to the key of the variant
        for the live values (``variant_key``), and so on, a few steps at most.
        """
        key, factors = self.entry_key(args)
        why = "no entry"
        wrong: list[Mismatch] = []
        for _ in range(MAX_VARIANTS):
            data = self.store.get(key)
            if data is None:
                return Lookup(None, why, key, factors, wrong)
            entry = Entry.from_bytes(data)
            stale = entry.stale_files()
            if stale:
                return Lookup(None, f"traced source changed: {', '.join(stale)}", key, factors)
            with phase("guards"):
                guards = entry.guard_set()
                values = guards.values(self.model, args)
                wrong = guards.mismatches(self.model, args, values)
            if not wrong:
                return Lookup(entry, "fresh", key, factors)
            why = "a value the trace read differs: " + "; ".join(
                m.describe() for m in wrong[:3]) + (f" (and {len(wrong) - 3} more)"
                                                    if len(wrong) > 3 else "")
            key = variant_key(key, values)
        return Lookup(None, why, key, factors, wrong)

    def trace(self, args: tuple[Any, ...], found: Lookup | None = None) -> Entry:
        """Trace the model, split it, plan its targets: a new (not yet stored) Entry, to be
        stored where ``found`` (the lookup that missed) says."""
        found = found or self.lookup(args)
        with phase("trace"):
            traced = trace_model(self.model, args, self.dynamic_dims,
                                 self.config.compile_ranges)
            COUNTERS.traced += 1
        return self.plan(traced, found.factors, found.key)

    def plan(self, traced: TracedGraph, factors: dict[str, Any], key: str | None = None) -> Entry:
        with phase("split"):
            split = split_graph(traced, self.config.splitting_ops)
        with phase("plan"):
            device = _device(traced)
            tf = target_factors(self.builder, device)
            targets = make_targets(split.pieces, self.config.buckets(), backend=tf["backend"],
                                   passes=tf["passes"], env=env_factors(device))
            entry = make_entry(factors, traced, split, targets, key)
            self.unrecordable = traced.unrecordable
        planned = sum(len(t) for t in targets.values())
        COUNTERS.planned += planned
        COUNTERS.unique += len(entry.target_keys())
        return entry

    def record(self, entry: Entry) -> bool:
        """Store ``entry``, replacing a stale one under the same key; False (and one log
        line) where the trace cannot be checked without Dynamo, so no entry may exist.

        A fresh entry stored meanwhile (by another process, or with a remote tier by another
        machine) is kept: deleting it would also take the fleet's shared copy away.
        """
        if self.unrecordable is not None:
            log.warning("compiled %s without recording an entry (no warm start): %s",
                        type(self.model).__name__, self.unrecordable)
            return False
        with self.store.lock(entry.key):
            data = self.store.get(entry.key)
            if data is not None:
                try:
                    fresh = not Entry.from_bytes(data).stale_files()
                except (ValueError, KeyError, TypeError):
                    fresh = False
                if fresh:
                    return True
                self.store.delete(entry.key)
            self.store.put(entry.key, entry.to_bytes(), kind="entry", manifest=entry.factors,
                           refs=entry.target_keys())
        return True


def _device(traced: TracedGraph) -> str:
    for m in traced.input_metas:
        if m.kind == "tensor":
            return m.device
    return "cpu"


class CompiledModule(torch.nn.Module):
    """Behaves like the model; compiled through cachebuild on the first call."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig,
                 dynamic_dims: dict[int, int], store: Any, passes: Any = None) -> None:
        super().__init__()
        self.model = model
        self.config = config
        self.dynamic_dims = dict(dynamic_dims)
        self._store = store
        self._passes = passes
        self._runtime: ModelRuntime | None = None
        self.capture_report: Any = None  # CaptureReport of the latest capture, if any

    @property
    def runtime(self) -> ModelRuntime | None:
        return self._runtime

    def prepare(self, *args: Any, capture: bool = True) -> ModelRuntime:
        """Load (warm) or build (cold) the compiled forward for calls shaped like ``args``.

        With a graph mode, graphs are captured too, unless ``capture`` is False (then
        ``runtime.capture()`` does it later).
        """
        start = time.perf_counter()
        store = open_default_store(self._store)
        planner = Planner(self.model, self.config, self.dynamic_dims, store, self._passes)
        planner.builder.device = device_of(self.model, args)
        found = planner.lookup(args)
        entry, why = found.entry, found.why
        slow_loads = False
        if entry is not None:
            slow_loads = _needs_inductor(entry, store)
            if slow_loads:
                preload()
            COUNTERS.entries_loaded += 1
            COUNTERS.planned += len(entry.targets())
            COUNTERS.unique += len(entry.target_keys())
            log.info("warm start from entry %s", entry.key[:12])
        else:
            log.info("tracing %s (%s)", type(self.model).__name__, why)
            entry = planner.trace(args, found)
        loaded = resolve_all(entry, planner.builder, parallel=slow_loads)
        if why != "fresh":
            planner.record(entry)
        self._runtime = ModelRuntime(entry, loaded, self.model, self.config, self.dynamic_dims)
        COUNTERS.add_time("prepare", time.perf_counter() - start)
        if self.config.cudagraph_mode != "none" and capture:
            with phase("capture"):
                self.capture_report = self._runtime.capture()
            log.info("captured %d sizes in %.2f s (%d bytes of graph memory)",
                     len(self.capture_report.sizes), self.capture_report.seconds,
                     self.capture_report.pool_bytes)
        return self._runtime

    def forward(self, *args: Any) -> Any:
        if self._runtime is None:
            self.prepare(*args)
        assert self._runtime is not None
        return self._runtime(*args)


def _needs_inductor(entry: Entry, store: Any) -> bool:
    """True if loading the entry's targets initialises Inductor (standalone artifacts)."""
    for key in entry.target_keys():
        record = store.get_record(key)
        if record is not None and record.kind == "standalone":
            return True
    return False


def compile(model: torch.nn.Module, config: CompileConfig | None = None,
            dynamic_dims: dict[int, int] | None = None, store: Any = None,
            passes: Any = None) -> CompiledModule:
    """A module that runs ``model`` through cachebuild's piecewise build graph.

    ``dynamic_dims`` maps a positional argument's index to its dynamic dim, e.g.
    ``{0: 0, 1: 0}`` for ``forward(input_ids, positions)`` with a token dim. The store is
    ``CACHEBUILD_DIR`` (default ``~/.cache/cachebuild``) unless ``store`` is given.
    ``passes``: a ``cachebuild.passes.PassManager`` of custom passes, used instead of the
    built-in passes ``config.passes`` enables.
    """
    return CompiledModule(model, config or CompileConfig(), dynamic_dims or {}, store, passes)


def backend(config: CompileConfig | None = None, store: Any = None, passes: Any = None) -> Any:
    """A torch.compile backend: ``torch.compile(model, backend=cachebuild.backend(cfg))``.

    Every graph Dynamo hands over is split and planned at once and its targets are built
    or loaded on its first call (``dynamo_backend.GraphForward``).
    """
    config = config or CompileConfig()

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        planner = Planner(torch.nn.Module(), config, {}, open_default_store(store), passes)

        def plan(traced: TracedGraph) -> Any:
            planner.builder.device = _device(traced)
            entry = planner.plan(traced, {"front_door": "torch.compile"})
            return lambda: direct_forward(stitch(entry, resolve_all(entry, planner.builder)))

        return GraphForward(gm, example_inputs, plan)

    return compile_graph


_PRELOAD: threading.Thread | None = None


def preload() -> threading.Thread:
    """Start initialising Inductor's runtime in the background (idempotent).

    Loading ``standalone`` artifacts needs Inductor, whose import takes seconds; a server
    calls this first thing so that the import overlaps building its model and loading
    weights. Loading ``aoti`` artifacts needs none of it. Only the import happens
    here: also loading an artifact in the background, to pay Inductor's first-load set-up
    early, made the warm start slower on an H200 (it contended with the foreground loads).
    """
    global _PRELOAD
    if _PRELOAD is None:
        _PRELOAD = threading.Thread(target=_preload, name="cachebuild-preload", daemon=True)
        _PRELOAD.start()
    return _PRELOAD


def _preload() -> None:
    with phase("preload"):
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401  # the first load imports it otherwise
        from torch._inductor import CompiledArtifact  # noqa: F401


def stats() -> dict[str, Any]:
    """This process's counters: targets planned and unique, store hits and misses, loaded,
    built, failed and fallbacks, layout copies, traces and warm starts, and seconds per
    phase (trace, split, plan, build, load, prepare, capture)."""
    return snapshot()


def prometheus_text() -> str:
    """``stats()`` in the Prometheus text format (write it where a collector reads it)."""
    from cachebuild.metrics import process_metrics, render

    return render(process_metrics(snapshot()))

