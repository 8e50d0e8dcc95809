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
from cachebuild.config import CompileConfig, check_config, check_dynamic_dims
from cachebuild.counters import COUNTERS, phase, snapshot
from cachebuild.entry import Entry, device_of, entry_factors, make_entry
from cachebuild.env import env_factors
from cachebuild.errors import UsageError
from cachebuild.keys import make_key
from cachebuild.runtime import ModelRuntime, direct_forward, resolve_all, stitch
from cachebuild.split import check_splitting_ops, split_graph
from cachebuild.store.base import Store
from cachebuild.targets import make_targets
from cachebuild.trace import TracedGraph, meta_of, trace_model

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
        self.dynamic_dims = check_dynamic_dims(self.dynamic_dims)


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


class Planner:
    """Trace → split → targets → entry for one model and call signature."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig,
                 dynamic_dims: dict[int, int], store: Any, passes: Any = None) -> None:
        self.model = model
        self.config = config
        self.dynamic_dims = dict(dynamic_dims)
        self.store = store
        self.builder = Builder(store, config, passes)

    def entry_key(self, args: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
        factors = entry_factors(self.model, args, self.dynamic_dims, self.config,
                                target_factors(self.builder))
        return make_key(factors), factors

    def stored_entry(self, args: tuple[Any, ...]) -> tuple[Entry | None, str]:
        """The stored, fresh entry for this call (None and why not, otherwise)."""
        key, _ = self.entry_key(args)
        data = self.store.get(key)
        if data is None:
            return None, "no entry"
        entry = Entry.from_bytes(data)
        stale = entry.stale_files()
        if stale:
            return None, f"traced source changed: {', '.join(stale)}"
        return entry, "fresh"

    def trace(self, args: tuple[Any, ...]) -> Entry:
        """Trace the model, split it, plan its targets: a new (not yet stored) Entry."""
        _, factors = self.entry_key(args)
        check_splitting_ops(self.config.splitting_ops)
        with phase("trace"):
            traced = trace_model(self.model, args, self.dynamic_dims)
            COUNTERS.traced += 1
        return self.plan(traced, factors)

    def plan(self, traced: TracedGraph, factors: dict[str, Any]) -> Entry:
        with phase("split"):
            split = split_graph(traced, self.config.splitting_ops)
        with phase("plan"):
            device = _device(traced)
            tf = target_factors(self.builder, device)
            targets = make_targets(split.pieces, self.config.buckets(), backend=tf["backend"],
                                   passes=tf["passes"], env=env_factors(device))
            entry = make_entry(factors, traced, split, targets)
        planned = sum(len(t) for t in targets.values())
        COUNTERS.planned += planned
        COUNTERS.unique += len(entry.target_keys())
        return entry

    def record(self, entry: Entry) -> None:
        """Store ``entry``, replacing a stale one under the same key.

        A fresh entry stored meanwhile (by another process, or with a remote tier by another
        machine) is kept: deleting it would also take the fleet's shared copy away.
        """
        with self.store.lock(entry.key):
            data = self.store.get(entry.key)
            if data is not None:
                try:
                    fresh = not Entry.from_bytes(data).stale_files()
                except (ValueError, KeyError, TypeError):
                    fresh = False
                if fresh:
                    return
                self.store.delete(entry.key)
            self.store.put(entry.key, entry.to_bytes(), kind="entry", manifest=entry.factors,
                           refs=entry.target_keys())


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
        entry, why = planner.stored_entry(args)
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
            entry = planner.trace(args)
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
    return CompiledModule(model, check_config(config), check_dynamic_dims(dynamic_dims), store,
                          passes)


def backend(config: CompileConfig | None = None, store: Any = None, passes: Any = None) -> Any:
    """A torch.compile backend: ``torch.compile(model, backend=cachebuild.backend(cfg))``."""
    config = check_config(config)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        import torch.utils._pytree as pytree

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fakes = [n.meta.get("example_value", v) for n, v in zip(placeholders, example_inputs,
                                                                 strict=True)]
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        traced = TracedGraph(
            gm=gm, bindings=[], input_metas=[meta_of(f) for f in fakes], source_files={},
            out_spec=pytree.treespec_dumps(pytree.tree_structure(list(range(n_out)))),
            num_outputs=n_out, fake_inputs=fakes,
        )
        planner = Planner(torch.nn.Module(), config, {}, open_default_store(store), passes)
        planner.builder.device = _device(traced)
        entry = planner.plan(traced, {"front_door": "torch.compile"})
        return direct_forward(stitch(entry, resolve_all(entry, planner.builder)))

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
    """This process's counters: planned, unique, loaded, built, failed, seconds per phase."""
    return snapshot()

