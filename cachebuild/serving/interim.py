"""Serving while the targets build (``CompileConfig.while_building``).

A cold start whose entry has targets missing builds, first, the same pieces for a backend
that builds in seconds (``interim_entry``: every target's manifest with that backend's
factors instead, so the targets are content-addressed like any other and shared with any
later start that asks for them) and serves with those at once. The missing targets build
meanwhile in worker processes (``background.BackgroundBuild``): never in the serving
process, whose calls, random streams and environment a build must not touch. Once every
one of them is stored, it loads them (on its thread) and records the entry; the next call
of the model, on the serving thread, makes a runtime over them and runs on it: a call
runs on one runtime from its start to its end, so no call mixes the two kinds of targets.
The old runtime's graphs (captured for its artifacts) go with it, its background capture
stopped; the new runtime captures its own as the policy says (``eager``: in that call,
before it runs).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cachebuild.building.background import BackgroundBuild
from cachebuild.building.build import Builder, BuildJob, resolve_all
from cachebuild.building.entry import Entry
from cachebuild.building.planner import target_factors
from cachebuild.config import CompileConfig
from cachebuild.errors import ToolchainRefuted, one_line
from cachebuild.keys import make_key
from cachebuild.passes import PassManager

if TYPE_CHECKING:
    import torch

log = logging.getLogger("cachebuild")


def interim_config(config: CompileConfig) -> CompileConfig | None:
    """The config of the targets a cold start serves with while ``config``'s build, or
    None where there are none to serve with (``wait``, or the same backend anyway)."""
    choice = config.while_building
    if choice == "wait" or config.backend == "eager_fusion":  # nothing builds faster
        return None
    if choice == "eager_fusion":
        return replace(config, backend="eager_fusion", while_building="wait")
    if config.backend == "inductor" and config.flavour == "standalone":
        return None
    return replace(config, backend="inductor", flavour="standalone", while_building="wait")


def interim_entry(entry: Entry, config: CompileConfig, passes: PassManager) -> Entry:
    """``entry`` with every target keyed for ``config``'s backend instead (an entry that is
    used, never recorded: it shares the recorded one's key)."""
    from cachebuild.backends import get_backend

    factors = target_factors(get_backend(config.backend), config, passes, entry.device)
    keys: dict[str, str] = {}
    manifests: dict[str, dict[str, Any]] = {}
    for key, manifest in entry.manifests.items():
        new = {**manifest, "backend": factors["backend"], "passes": factors["passes"]}
        keys[key] = make_key(new)
        manifests[keys[key]] = new
    pieces = [replace(p, targets=[replace(t, key=keys[t.key]) for t in p.targets])
              for p in entry.pieces]
    return replace(entry, pieces=pieces, manifests=manifests)


def serve_while_building(model: torch.nn.Module, config: CompileConfig, builder: Builder,
                         entry: Entry, jobs: list[BuildJob], why: str, warm: bool,
                         swap: BackgroundBuild | None
                         ) -> tuple[Entry, dict[str, Any], BackgroundBuild] | None:
    """With ``while_building`` and targets missing (``jobs``, ``Builder.missing``): start
    building them in worker processes (unless ``swap`` already builds them), build (or
    load) the interim targets here, and return the entry to serve with, its targets and
    the background build; the first call after the missing targets are stored and loaded
    takes over (``take_over``). None where there is nothing to do, or no worker could
    build the missing targets as this process would (then the caller builds them here)."""
    interim = interim_config(config)
    if interim is None or not jobs:
        return None
    served = interim_entry(entry, interim, builder.passes)
    if swap is None or not swap.pending or swap.entry.key != entry.key:
        # Its targets all stored, the entry is recorded there: a later start is warm.
        swap = BackgroundBuild.start(entry, builder, jobs, record=why != "fresh")
        if swap is None:
            log.warning("cachebuild: %s builds its targets before serving "
                        "(while_building=%r): worker processes could not build them as "
                        "this process would (ops or passes of its own, or a store they "
                        "cannot open)", type(model).__name__, config.while_building)
            return None
    interim_builder = Builder(builder.store, interim, builder.passes, builder.device)
    try:
        loaded = resolve_all(served, interim_builder, warm=warm, workers=False)
    except ToolchainRefuted:
        raise  # the start plans again
    except Exception as e:  # nothing to serve with meanwhile: wait for the real ones
        log.warning("cachebuild: %s has no %s targets to serve with while it builds "
                    "(%s); waiting for its own", type(model).__name__,
                    config.while_building, one_line(e, typed=True))
        return entry, swap.take(), swap
    log.warning("cachebuild: %s serves with %s targets while its %d missing targets "
                "build in the background", type(model).__name__,
                config.while_building, len(jobs))
    return served, loaded, swap
