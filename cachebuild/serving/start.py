"""A model's start, in one pass: what ``CompiledModule.prepare`` runs.

``start`` finds the model's entry for the call (``Planner.lookup``: stored, its guards
holding on the live model); on a miss it says why (``notice.must_trace``) and traces the
model once. Then every target is loaded, or built and loaded (``build.resolve_all``; a
warm start whose artifacts need Inductor imports it at once and loads on threads), a new
entry is recorded, the stitched forward made (``runtime.ModelRuntime``), and, with the
``eager`` capture policy, every size captured.

A cold start whose targets build in worker processes where they can
(``build.resolve_all``) may serve meanwhile, if the config asks
(``CompileConfig.while_building``): it builds and serves the same pieces for a backend
that builds in seconds while its own targets build in the background
(``interim.serve_while_building``, ``background.BackgroundBuild``);
the entry is recorded once they are stored, and ``take_over`` makes the runtime over them
that a later call runs on.

A model that cannot be compiled is remembered by the key of the entry it would have had
(its code, config, input shapes and the values its trace read): a later start of the same
model in this process gets the same error at once, without tracing again. The machine's
or the store's trouble is never remembered: another start may succeed. That is a
``StoreError`` (a stored artifact that cannot be loaded, ``StoredArtifactError``, among
them: the store may be repaired meanwhile) or a transient error.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cachebuild import compat, process_state
from cachebuild.building import notice
from cachebuild.building.background import running_builds, while_building_setting
from cachebuild.building.build import Builder, early_pool, resolve_all
from cachebuild.building.entry import record_entry
from cachebuild.building.nearest import edited_since
from cachebuild.building.planner import Planner
from cachebuild.building.pool import builds_here
from cachebuild.errors import StoreError, ToolchainRefuted, one_line, transient
from cachebuild.graph.facts import device_of
from cachebuild.keys import make_key
from cachebuild.serving.interim import serve_while_building
from cachebuild.serving.runtime import CaptureReport, ModelRuntime
from cachebuild.tracing.guard_watch import CallGuards
from cachebuild.trust.codehash import code_objects

if TYPE_CHECKING:
    from cachebuild.building.background import BackgroundBuild
    from cachebuild.building.entry import Entry
    from cachebuild.config import CompileConfig
    from cachebuild.passes import PassManager
    from cachebuild.store.interface import Store

log = logging.getLogger("cachebuild")

@dataclass
class Started:
    """What a start gave: the runtime, or the error that keeps the model from compiling
    (``first``: met now, not remembered from an earlier start)."""

    runtime: ModelRuntime | None
    error: BaseException | None = None
    first: bool = False
    ready_at: float = 0.0  # perf_counter() when the forward was ready, before capture
    capture_report: CaptureReport | None = None
    #: The model's own targets building in the background while interim ones serve
    #: (``while_building``), if any.
    swap: BackgroundBuild | None = None


def start(model: torch.nn.Module, config: CompileConfig, dynamic_dims: dict[int, int],
          store: Store, passes: PassManager | None, args: tuple[Any, ...], *,
          capture: bool = True) -> Started:
    """The compiled forward of ``model`` for calls shaped like ``args`` (see the module
    doc); ``capture=False``: no eager capture now (``runtime.capture()`` does it later).
    A build of this process running in the background into ``store`` (``while_building``)
    counts as stored for the lookup, and a start of its entry joins it. Raises what is the
    machine's or the store's trouble, and a building variable set to a value it refuses
    (``settings.check_settings`` checked them at the compile call; one set since is the
    operator's to fix, not the model's failure); returns any other error.

    A build that finds the compiler its plan presumed refuted (``ToolchainRefuted``)
    plans once more: the verdict is known then, so the new plan keys its targets by it."""
    failed = process_state.current().failed
    device = device_of([*args, *model.parameters()])
    interim = interim_config(config, device)
    # What a failure before the end of its trace is remembered by: the state it began in.
    was = _state(model, args)
    for last_try in (False, True):
        planner = Planner(model, config, dynamic_dims, store, passes)
        pending = pending_entries(store)
        found = planner.lookup(args, pending)
        base = make_key(found.factors)  # the model's code, config and shapes
        remembered = next((f for f in failed.get(base, ()) if f.meets(found.key, model, args)),
                          None)
        if remembered is not None:
            return Started(None, remembered.error)
        warm = found.entry is not None
        pool = None
        traced: Entry | None = None
        values: tuple[Any, ...] | None = None
        try:
            if not warm and config.backend != "eager_fusion":
                # Every C++ build would fail on it, each saying so: said once, before the
                # trace, as `warm` says it.
                from cachebuild.backends.kernel_dir import check_cxx_work_dir

                check_cxx_work_dir(store.work_dir)
            if not warm and (interim is None or interim.backend != "eager_fusion"):
                # A cold start's build workers start before its trace: their imports
                # overlap it (fewer after an edit: its trace would share the CPUs). They
                # build its own targets, or those it serves with meanwhile.
                pool = early_pool(store, config, lambda found=found: edited_since(
                    found.why, store, found.factors))
            entry = found.entry
            if entry is None:
                notice.must_trace(model, found.why, store, found.factors)
                values = _values(model)
                with notice.tracing(model):
                    entry = traced = planner.trace(args, found)
            builder = Builder(store, config, planner.passes, device)
            # Serving meanwhile, where the config asks, while what is missing builds.
            serving = None
            if interim is not None:
                jobs = builder.missing(entry)
                serving = serve_while_building(model, config, interim, builder, entry, jobs,
                                               found.why, warm, pool)
            swap = None
            if serving is not None:
                entry, loaded, swap = serving
            else:
                # An entry building in the background (for another compiled model of this
                # one that serves meanwhile) is waited for, not built a second time.
                loaded = _joined(store, entry) if pending.get(entry.key) is entry else None
                if loaded is None:
                    loaded = resolve_all(
                        entry, builder, warm=warm, pool=pool,
                        on_missing=lambda n, total, warm=warm: notice.must_build(
                            model, n, total, warm))
                    if found.why != "fresh":
                        record_entry(entry, store)
            # A runtime that refuses the live model (a buffer viewing one it writes) is this
            # start's failure: remembered, and run eagerly where the config says.
            runtime = ModelRuntime(entry, loaded, model, config, dynamic_dims)
            break
        except ToolchainRefuted as e:
            if last_try:
                raise
            log.warning("cachebuild: %s; planning %s again", e, type(model).__name__)
            planner.backend.forget_refuted(e.device)
        except Exception as e:
            if isinstance(e, StoreError) or transient(e):
                raise  # the machine's or the store's trouble: another start may succeed
            # Remembered with what its trace read, where it got that far: the same model
            # with other values (eval() after train()) is another start, not this failure.
            if traced is None and values is not None and _values(model) != values:
                # Changed while it traced (another thread): this trace read no one state,
                # and the next call traces again rather than meet a failure of neither.
                return Started(None, e, first=True)
            failed.setdefault(base, []).append(process_state.Failure(
                e, found.key, _reads(traced) if traced is not None else
                lambda k, model, args, key=found.key, values=values:
                    k != key or _state(model, args) != was
                    or (values is not None and _values(model) != values)))
            return Started(None, e, first=True)
        finally:
            if pool is not None:
                pool.close()
    started = Started(runtime, ready_at=time.perf_counter(), swap=swap)
    if capture:
        started.capture_report = runtime.capture_if_eager(like=args)
    return started


def interim_config(config: CompileConfig, device: str) -> CompileConfig | None:
    """The config of the targets a cold start of ``config`` on ``device`` serves with while
    its own build (``CompileConfig.interim``, with the operator's word and where builds
    run taken from the environment), or None."""
    setting = while_building_setting() if config.while_building == "auto" else None
    return config.interim(device, setting=setting, builds_here=builds_here())


def _joined(store: Store, entry: Entry) -> dict[str, Any] | None:
    """The targets of ``entry``, waited for where a build of this process builds them in
    the background into ``store``; None where none does any more, or it failed (the
    caller loads or builds them itself)."""
    build = next(iter(running_builds(store, entry.key)), None)
    if build is None:
        return None
    log.warning("cachebuild: waiting for the targets of entry %s, building in the background "
                "for another start of this model", entry.key[:12])
    build.wait()
    return build.take() if build.error is None else None


def pending_entries(store: Store) -> dict[str, Entry]:
    """The entries of this process's builds running in the background into ``store``
    (``while_building``), by key: each is recorded there once its targets are stored, so
    a lookup counts it as stored already (another variant of the model, traced
    meanwhile, is keyed as a variant of it, not given its key). Another store has its
    own entries."""
    return {b.entry.key: b.entry for b in running_builds(store)}


def _reads(entry: Entry) -> Any:
    """Whether a live model and call read other values than ``entry``'s trace did."""
    guards = CallGuards(entry.guard_set(), entry.sources)
    return lambda key, model, args: bool(guards.mismatches(model, args))


def _state(model: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a failure before its trace was done (nothing says what it read) is told by
    besides its entry key: ``training`` on every module, torch's process state (a graph
    break in train() alone is not eval()'s), and the arguments' types (a tensor subclass
    refused is not a plain tensor's failure)."""
    return (tuple(m.training for m in model.modules()), compat.process_state_signature(),
            tuple(type(a) for a in args))


#: How deep ``_values`` reads into lists, dicts and plain objects an attribute holds, and
#: how many items of each.
_VALUES_DEPTH, _VALUES_ITEMS = 3, 64


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data to compare (scalars; lists, dicts and objects' attributes
    read ``_VALUES_DEPTH`` deep), or its type's name where it is none of those (a tensor,
    a module: its weights and modules are not read here)."""
    import torch

    if value is None or isinstance(value, bool | int | float | str | bytes | enum.Enum):
        return value
    if isinstance(value, torch.Tensor | torch.nn.Module) or depth >= _VALUES_DEPTH:
        return type(value).__qualname__
    if isinstance(value, functools.partial):
        return ("partial", _plain(value.func, depth + 1), _plain(value.args, depth + 1),
                _plain(value.keywords, depth + 1))
    if isinstance(value, types.MethodType):
        return ("method", _plain(value.__func__, depth + 1), id(value.__self__))
    if isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
        # By identity: every function's (and class's) own attributes are alike (none), and
        # the forward that calls one traces its code, which another function does not have.
        return (type(value).__name__, getattr(value, "__qualname__", ""), id(value))
    try:
        if isinstance(value, list | tuple | set | frozenset):
            items = list(value)[:_VALUES_ITEMS] if not isinstance(value, set | frozenset) \
                else sorted(map(repr, value))[:_VALUES_ITEMS]
            return (type(value).__name__, tuple(_plain(v, depth + 1) for v in items))
        if isinstance(value, dict):
            return ("dict", tuple((repr(k), _plain(v, depth + 1))
                                  for k, v in list(value.items())[:_VALUES_ITEMS]))
        held = vars(value) if hasattr(type(value), "__dict__") else None
    except Exception:  # a container or object that cannot be read plainly
        return type(value).__qualname__
    if isinstance(held, dict) and not isinstance(value, type):
        return (type(value).__qualname__, _plain(held, depth + 1))
    return type(value).__qualname__


def _values(model: torch.nn.Module) -> tuple[Any, ...]:
    """What a failed trace is remembered with besides ``_state``: every module's class and
    the plain values of its attributes (a flag, a mode string, an active adapter's name,
    a config's fields), its class's attributes, the module globals and environment
    variables its classes' code names (a flag set on the class, a module constant, an
    environment variable read by name) and the torch.Tensor methods of those names, so
    that the same model with other values (a branch that traces) is another start, not
    the failure. Only what the code names: a
    script's other globals (a loop's counter, a notebook's last output) change at every
    call, and the failure would never be met again. Read only before a trace
    (milliseconds)."""
    classes = list(dict.fromkeys(type(m) for m in model.modules()))
    named: dict[str, set[str]] = {}  # module name → the globals its classes' code names
    strings: set[str] = set()
    for cls in classes:
        names = named.setdefault(cls.__module__, set())
        for code in code_objects(cls):
            names.update(code.co_names)
            strings.update(c for c in code.co_consts if isinstance(c, str) and len(c) < 256)
    held = []
    for module_name, names in named.items():
        namespace = vars(sys.modules[module_name]) if module_name in sys.modules else {}
        held.append(_namespace({k: namespace[k] for k in sorted(names) if k in namespace}))
    return (
        tuple((name, type(m).__qualname__,
               tuple((k, _plain(v)) for k, v in vars(m).items() if not k.startswith("_")))
              for name, m in model.named_modules()),
        tuple(_namespace(vars(c)) for c in classes),
        tuple(held),
        tuple((k, os.environ.get(k)) for k in sorted(strings & os.environ.keys())),
        # torch.Tensor's methods by those names (one a library replaced: refused, until
        # it is torch's own again).
        tuple((k, _plain(getattr(torch.Tensor, k))) for k in sorted(set().union(*named.values()))
              if hasattr(torch.Tensor, k)),
    )


def _namespace(names: Any) -> tuple[Any, ...]:
    """The plain values of a class's or a module's names, modules and dunders left out
    (a module's namespace is read only as the names it holds)."""
    return tuple((k, _plain(v)) for k, v in list(names.items())
                 if not k.startswith("__") and not isinstance(v, types.ModuleType))


def take_over(swap: BackgroundBuild, owner: object, model: torch.nn.Module,
              config: CompileConfig, dynamic_dims: dict[int, int], args: tuple[Any, ...]
              ) -> Started | None:
    """Before a call: the runtime over the targets built in the background, if they are
    ready and ``owner`` has not taken them yet (``swap.claim``); with the ``eager`` capture
    policy it captures its sizes first, here. None while they build, after they failed
    (``swap.error`` says why), or where this owner's runtime could not be made (said in a
    warning; another owner of the same build may still take it): the model keeps serving
    with what runs."""
    loaded = swap.claim(owner)
    if loaded is None:
        return None
    try:
        runtime = ModelRuntime(swap.entry, loaded, model, config, dynamic_dims)
        started = Started(runtime, ready_at=time.perf_counter(), swap=swap)
        started.capture_report = runtime.capture_if_eager(like=args)
        return started
    except Exception as e:  # keep serving with what runs
        log.warning("cachebuild: %s keeps serving with its interim targets: its own "
                    "could not take over: %s", type(model).__name__, one_line(e, typed=True))
        return None
