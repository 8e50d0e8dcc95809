"""A model's start, in one pass: what ``CompiledModule.prepare`` runs.

``start`` finds the model's entry for the call (``Planner.lookup``: stored, its guards
holding on the live model); on a miss it says why (``notice.must_trace``) and traces the
model once. Then every target is loaded, or built and loaded (``build.resolve_all``; a
warm start whose artifacts need Inductor imports it at once and loads on threads), a new
entry is recorded, the stitched forward made (``runtime.ModelRuntime``), and, with the
``eager`` capture policy, every size captured.

A model that cannot be compiled is remembered by the key of the entry it would have had
(its code, config, input shapes and the values its trace read): a later start of the same
model in this process gets the same error at once, without tracing again. The machine's
or the store's trouble is never remembered: another start may succeed. That is a
``StoreError`` (a stored artifact that cannot be loaded, ``StoredArtifactError``, among
them: the store may be repaired meanwhile) or a transient error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachebuild import notice
from cachebuild.build import Builder, resolve_all
from cachebuild.counters import phase
from cachebuild.entry import record_entry
from cachebuild.errors import StoreError, transient
from cachebuild.facts import device_of
from cachebuild.planner import Planner
from cachebuild.runtime import CaptureReport, ModelRuntime

if TYPE_CHECKING:
    import torch

    from cachebuild.config import CompileConfig
    from cachebuild.passes import PassManager
    from cachebuild.store.base import Store

log = logging.getLogger("cachebuild")

#: Models that failed to compile in this process, by the key of the entry they would have
#: had: not tried again.
FAILED: dict[str, BaseException] = {}


@dataclass
class Started:
    """What a start gave: the runtime, or the error that keeps the model from compiling
    (``first``: met now, not remembered from an earlier start)."""

    runtime: ModelRuntime | None
    error: BaseException | None = None
    first: bool = False
    ready_at: float = 0.0  # perf_counter() when the forward was ready, before capture
    capture_report: CaptureReport | None = None


def start(model: torch.nn.Module, config: CompileConfig, dynamic_dims: dict[int, int],
          store: Store, passes: PassManager | None, args: tuple[Any, ...], *,
          capture: bool = True) -> Started:
    """The compiled forward of ``model`` for calls shaped like ``args`` (see the module
    doc); ``capture=False``: no eager capture now (``runtime.capture()`` does it later).
    Raises what is the machine's or the store's trouble; returns any other error."""
    planner = Planner(model, config, dynamic_dims, store, passes)
    found = planner.lookup(args)
    remembered = FAILED.get(found.key)
    if remembered is not None:
        return Started(None, remembered)
    warm = found.entry is not None
    try:
        entry = found.entry
        if entry is None:
            notice.must_trace(model, found.why, store, found.factors)
            entry = planner.trace(args, found)
        builder = Builder(store, config, planner.passes, device_of([*args, *model.parameters()]))
        loaded = resolve_all(entry, builder, warm=warm,
                             on_missing=lambda n, total: notice.must_build(model, n, total, warm))
        if found.why != "fresh":
            record_entry(entry, store)
    except Exception as e:
        if isinstance(e, StoreError) or transient(e):
            raise  # the machine's or the store's trouble: another start may succeed
        FAILED[found.key] = e
        return Started(None, e, first=True)
    runtime = ModelRuntime(entry, loaded, model, config, dynamic_dims)
    started = Started(runtime, ready_at=time.perf_counter())
    if capture and runtime.capturer is not None and runtime.capturer.policy == "eager":
        with phase("capture"):
            report = started.capture_report = runtime.capture(like=args)
        log.info("captured %d sizes in %.2f s (%d bytes of graph memory)", len(report.sizes),
                 report.seconds, report.pool_bytes)
    return started

