"""Serving while the targets build (``CompileConfig.while_building``).

A cold start whose entry has targets missing builds, first, the same pieces for a backend
that builds in seconds (``interim_entry``: every missing target's manifest with that
backend's factors instead, so the targets are content-addressed like any other and shared
with any later start that asks for them; those stored serve as they are where that
backend loads them) and serves with those at once. A stored entry that lacks no more than
half its targets builds them and waits instead. The missing targets build
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

from cachebuild.building.background import BackgroundBuild, running_builds
from cachebuild.building.build import Builder, BuildJob, resolve_all
from cachebuild.building.entry import Entry
from cachebuild.building.planner import target_factors
from cachebuild.building.pool import BuildPool, background_jobs, setup_for
from cachebuild.config import CompileConfig
from cachebuild.errors import ToolchainRefuted, one_line
from cachebuild.keys import make_key
from cachebuild.passes import PassManager

if TYPE_CHECKING:
    import torch

log = logging.getLogger("cachebuild")


def interim_entry(entry: Entry, config: CompileConfig, passes: PassManager,
                  stored: frozenset[str] = frozenset()) -> Entry:
    """``entry`` with every target keyed for ``config``'s backend instead, but those in
    ``stored`` (its own targets stored already, which that backend loads too): an entry
    that is used, never recorded (it shares the recorded one's key)."""
    from cachebuild.backends import get_backend

    factors = target_factors(get_backend(config.backend), config, passes, entry.device)
    keys: dict[str, str] = {}
    manifests: dict[str, dict[str, Any]] = {}
    for key, manifest in entry.manifests.items():
        if key in stored:
            keys[key], manifests[key] = key, manifest
            continue
        new = {**manifest, "backend": factors["backend"], "passes": factors["passes"]}
        keys[key] = make_key(new)
        manifests[keys[key]] = new
    pieces = [replace(p, targets=[replace(t, key=keys[t.key]) for t in p.targets])
              for p in entry.pieces]
    return replace(entry, pieces=pieces, manifests=manifests)


def serve_while_building(model: torch.nn.Module, config: CompileConfig,
                         interim: CompileConfig, builder: Builder, entry: Entry,
                         jobs: list[BuildJob], why: str, warm: bool,
                         pool: BuildPool | None = None
                         ) -> tuple[Entry, dict[str, Any], BackgroundBuild | None] | None:
    """With the config of the targets to serve meanwhile (``start.interim_config``) and targets
    missing (``jobs``, ``Builder.missing``): load the interim targets, or build them
    (eager_fusion ones here, in seconds; code-generating ones in worker processes,
    ``pool`` if started already, and proven there: nothing a compiler the probe only
    presumed made runs here before a worker ran it), then start building the missing
    targets in worker processes (unless a build of this process already builds them into
    this store: ``running_builds``), and return the entry to serve with, its targets and
    the background build; the first call after the missing targets are stored and loaded
    takes over (``take_over``). None where there is nothing to do, or no worker could
    build the missing targets as this process would (then the caller builds them here)."""
    if not jobs:
        return None
    if warm and 2 * len(jobs) <= len(entry.target_keys()):
        # A few targets of a stored entry missing (evicted, damaged): building them is
        # about as quick as building interim pieces for them and loading those (which
        # takes Inductor into this process): the start builds them and waits.
        return None
    if interim.backend == "inductor" and not all(
            m["backend"].get("toolchain", {}).get("aoti") for m in entry.manifests.values()):
        return None  # no compiler makes packages that load here: its own are standalone
    # The targets stored already serve as they are where the interim backend loads them
    # (the same backend, another flavour): one target gc evicted costs one interim build,
    # not one per piece.
    missing = {job.target.key for job in jobs}
    stored = frozenset(k for k in entry.manifests if k not in missing) \
        if interim.backend == config.backend else frozenset()
    served = interim_entry(entry, interim, builder.passes, stored)
    # How workers would build them (None: none can as this process would), and how many.
    setup = setup_for(jobs, builder.store, builder.passes)
    workers = background_jobs(len(jobs))
    # Building already (for another compiled model of this one, say), or to be started.
    swap = next(iter(running_builds(builder.store, entry.key)), None)
    if swap is None and setup is None:
        log.log(logging.INFO if config.while_building == "auto" else logging.WARNING,
                "cachebuild: %s builds its targets before serving (while_building=%r): "
                "worker processes could not build them as this process would (ops or "
                "passes of its own, or a store they cannot open)", type(model).__name__,
                config.while_building)
        return None
    interim_builder = Builder(builder.store, interim, builder.passes, builder.device)
    kind = interim.backend if interim.backend != "inductor" else interim.flavour
    failed = None
    try:
        loaded = resolve_all(served, interim_builder, warm=warm, pool=pool,
                             workers=interim_builder.backend.generates_code)
    except ToolchainRefuted:
        raise  # the start plans again
    except Exception as e:  # nothing to serve with meanwhile: wait for the real ones
        failed = e
    if swap is None:
        # Started once the interim targets are ready, not beside their build: a first
        # output is what a cold server waits for, and the two would share the CPUs.
        # Its targets all stored, the entry is recorded there: a later start is warm.
        swap = BackgroundBuild(entry, builder, jobs, workers, setup, record=why != "fresh")
    if failed is not None:
        log.warning("cachebuild: %s has no %s targets to serve with while it builds "
                    "(%s); waiting for its own", type(model).__name__, kind,
                    one_line(failed, typed=True))
        return entry, swap.take(), None  # its own targets: nothing to swap to later
    log.warning("cachebuild: %s serves with %s targets while its %d missing targets "
                "build in the background", type(model).__name__, kind, len(jobs))
    return served, loaded, swap
