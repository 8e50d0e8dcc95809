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
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cachebuild import compat
from cachebuild.building.build import Builder, resolve_all
from cachebuild.building.planner import Planner, autocast_refusal
from cachebuild.config import (
    CompileConfig,
    check_config,
    check_dynamic_dims,
    check_inductor_options,
)
from cachebuild.counters import COUNTERS, snapshot
from cachebuild.dynamo_backend import GraphForward, graph_fakes, within_guards
from cachebuild.errors import CompileFailed, UsageError, one_line, warn_caller
from cachebuild.graph.facts import device_of
from cachebuild.graph.inputs import layout_guards
from cachebuild.passes import PassManager
from cachebuild.serving.hooks import global_hooks, not_run, own_forward
from cachebuild.serving.runtime import CaptureReport, ModelRuntime
from cachebuild.serving.start import start, take_over
from cachebuild.serving.stitch import direct_forward, on_device_forward, stitch
from cachebuild.store.interface import Store
from cachebuild.tracing.guards import Mismatch, describe_all, grad_mode_changed
from cachebuild.tracing.split import check_splitting_ops
from cachebuild.tracing.trace import TracedGraph, check_call_dims

if TYPE_CHECKING:
    from cachebuild.building.background import BackgroundBuild

log = logging.getLogger("cachebuild")

#: How many forwards for different values of what the trace read (adapters, flags) a
#: compiled module keeps in one process.
KEPT_FORWARDS = 16


def open_default_store(store: Store | None = None) -> Store:
    """``store`` itself, or the store the environment configures (``StoreOptions.from_env``:
    the same policy as the command line's, signing included)."""
    if store is not None:
        return store
    from cachebuild.store import open_to_serve

    return open_to_serve()


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
        if not isinstance(self.example_inputs, tuple | list):
            given = type(self.example_inputs).__name__
            raise UsageError(f"ModelSpec.example_inputs must be a tuple of the forward's "
                             f"arguments, not a {given}: for one argument write (x,)")
        self.example_inputs = tuple(self.example_inputs)
        if not isinstance(self.config, CompileConfig):
            raise UsageError("ModelSpec.config must be a cachebuild.CompileConfig")
        self.dynamic_dims = check_dynamic_dims(self.dynamic_dims)
        for i, d in self.dynamic_dims.items():
            given = self.example_inputs[i] if i < len(self.example_inputs) else None
            if isinstance(given, torch.Tensor) and -given.dim() <= d < given.dim() and \
                    not self.config.in_buckets(given.shape[d]):
                raise UsageError(
                    f"ModelSpec's example inputs are {given.shape[d]} long at the dynamic "
                    f"dim (argument {i}, dim {d}), outside every compile range "
                    f"{list(self.config.compile_ranges)}: the trace runs at that size, "
                    "which no call is served at; give example inputs a range holds")


#: What nn.Module keeps on each instance (hooks, ``_parameters``...): the wrapper's own.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


class CompiledModule(torch.nn.Module):
    """Behaves like the model; compiled through cachebuild on the first call.

    Attributes other than its own (``OWN``) are the model's, read, set and deleted there
    (as torch.compile's module does): ``compiled.use_bias = False`` or
    ``compiled.lin = other`` changes the model, whose guards then see it; set on this
    wrapper they would change nothing the forward reads. ``training`` is the model's too,
    and so is ``config`` (a transformers model's): cachebuild's is ``compile_config``.
    """

    #: The attributes this wrapper keeps itself; every other one is the model's.
    OWN = frozenset({
        "model", "compile_config", "dynamic_dims", "capture_report", "swap", "_store", "_passes",
        "_runtime", "_variants", "_eager", "_dynamo", "_interim", "_swapping", "_starting",
        "_starting_pid", "_forward", "_said_not_run", "_said_grad_mode"})

    def __init__(self, model: torch.nn.Module, config: CompileConfig,
                 dynamic_dims: dict[int, int], store: Store | None,
                 passes: PassManager | None = None) -> None:
        super().__init__()
        self.model = model
        self.compile_config = config
        self.dynamic_dims = dict(dynamic_dims)
        self._store = store
        self._passes = passes
        self._runtime: ModelRuntime | None = None
        #: The forwards made in this process, latest last: the values their traces read
        #: differ (an adapter, a flag); a call runs on one whose guards hold, so switching
        #: back traces and loads nothing.
        self._variants: list[ModelRuntime] = []
        self._eager = False  # cannot be compiled and on_failure="eager": runs the model
        #: For a model whose trace read values no record can check without Dynamo
        #: (``Entry.unrecordable``): torch.compile with cachebuild's backend, whose guards
        #: Dynamo checks at every call.
        self._dynamo: Any = None
        self.capture_report: CaptureReport | None = None  # of the latest eager capture
        #: The targets building in the background while interim ones serve
        #: (``while_building``): the latest start's, if any; and each interim runtime
        #: (one per variant) with the build it swaps to once that is ready.
        self.swap: BackgroundBuild | None = None
        self._interim: list[tuple[ModelRuntime, BackgroundBuild]] = []
        self._swapping = threading.Lock()  # calls on two threads swap one pair once
        #: Held while a forward is found or traced: calls on other threads that need one
        #: wait for it and take it, rather than each tracing and building the same.
        self._starting = threading.RLock()
        self._starting_pid = os.getpid()
        #: The instance's own forward as compiled (``hooks.own_forward``): one set later
        #: is refused, never skipped.
        self._forward = own_forward(model)
        self._said_not_run = False
        self._said_grad_mode = False

    def __setattr__(self, name: str, value: Any) -> None:
        # Its forwards are bound to the model it was compiled from (weights, guards, the
        # watches on its dicts): another model set here would be served the old one's.
        if name == "model" and "model" in self._modules:
            raise UsageError("a compiled module serves the model it was compiled from; "
                             "compile the other model: cachebuild.compile(other, ...)")
        if self._keeps(name):
            super().__setattr__(name, value)
        else:
            setattr(self._modules["model"], name, value)

    def __getattr__(self, name: str) -> Any:
        # Only for what is not found the usual way (this wrapper's own attributes, its
        # ``model`` submodule): the model's.
        modules = self.__dict__.get("_modules", {})
        if name in modules:
            return modules[name]
        model = self._model_if_set()
        if self._keeps(name) or model is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(model, name)

    def __delattr__(self, name: str) -> None:
        if self._keeps(name):
            super().__delattr__(name)
        else:
            delattr(self._modules["model"], name)

    @classmethod
    def _keeps(cls, name: str) -> bool:
        """Whether ``name`` is this wrapper's own (``OWN``, nn.Module's per-instance
        state, or its class's), not the model's."""
        return name in cls.OWN or name in _MODULE_INTERNALS or hasattr(cls, name)

    def _model_if_set(self) -> torch.nn.Module | None:
        """The model, or None while nn.Module's own __init__ runs (before it is set)."""
        return self.__dict__.get("_modules", {}).get("model")

    @property  # type: ignore[override]
    def training(self) -> bool:
        model = self._model_if_set()
        return True if model is None else model.training

    @training.setter
    def training(self, value: bool) -> None:
        model = self._model_if_set()  # none yet while nn.Module's __init__ sets it
        if model is not None:
            model.training = value

    @property
    def runtime(self) -> ModelRuntime | None:
        return self._runtime

    def prepare(self, *args: Any, capture: bool = True) -> ModelRuntime | None:
        """Load (warm) or build (cold) the compiled forward for calls shaped like ``args``.

        With a graph mode and the ``eager`` capture policy, every size is captured too,
        unless ``capture`` is False (``runtime.capture()`` does it later); the ``lazy`` and
        ``background`` policies capture as calls come (background: after the first one).
        A model that cannot be compiled raises, and raises again at once for every later
        call like it in this process (``CompileFailed``, without tracing again); with
        ``on_failure="eager"`` it runs eagerly instead, after one warning, and this returns
        None.
        """
        began = time.perf_counter()
        # About this call or this process (an op library imported later), never remembered:
        why = not_run(self.model, self._forward)
        if why is not None:
            return self._failed(UsageError(why), first=True)
        why = autocast_refusal(self.compile_config)
        if why is not None:  # about this call: raised, not remembered
            raise UsageError(why)
        check_call_dims(list(args), self.dynamic_dims)
        check_splitting_ops(self.compile_config.splitting_ops)
        started = start(self.model, self.compile_config, self.dynamic_dims,
                        open_default_store(self._store), self._passes, args, capture=capture)
        if started.runtime is None:
            assert started.error is not None
            return self._failed(started.error, first=started.first)
        COUNTERS.add_time("prepare", started.ready_at - began)
        self._remember(started.runtime)
        unrecordable = started.runtime.entry.unrecordable
        if unrecordable is not None and self._dynamo is None:
            log.warning("cachebuild: %s is served through torch.compile with cachebuild's "
                        "backend (Dynamo checks what its trace read at every call; no CUDA "
                        "graphs): its trace read values that cannot be checked without "
                        "Dynamo: %s", type(self.model).__name__, unrecordable)
            self._dynamo = torch.compile(self.model, backend=backend(
                self.compile_config, self._store, self._passes))
        if started.swap is not None:
            self.swap = started.swap
            self._interim.append((started.runtime, started.swap))
        if started.capture_report is not None:
            self.capture_report = started.capture_report
        # Last: a call on another thread that finds it set serves it as set up above.
        self._runtime = started.runtime
        return self._runtime

    def _swap_in(self, args: tuple[Any, ...]) -> None:
        """Before a call: the interim runtime (one per variant, ``while_building``) that
        serves this call, once its own targets are ready, is replaced by a runtime over
        them (``start.take_over``); its graphs go with it. Another variant's swaps at a
        call of its own: the runtime over its targets binds the live model as that variant
        has it (an adapter of another rank has other weights). Which runtime the call runs
        on is decided after, as ever."""
        with self._swapping:
            for pair in list(self._interim):
                interim, swap = pair
                if swap.running or interim.mismatches(self.model, args):
                    continue
                self._interim.remove(pair)
                self._take_over(interim, swap, args)

    def _take_over(self, interim: ModelRuntime, swap: BackgroundBuild,
                   args: tuple[Any, ...]) -> None:
        """Serve with the runtime over ``swap``'s targets where ``interim`` served; its
        graphs stop with it."""
        started = take_over(swap, self, self.model, self.compile_config, self.dynamic_dims, args)
        if started is None:
            return  # failed to build or to take over: the interim runtime keeps serving
        if started.capture_report is not None:
            self.capture_report = started.capture_report
        if interim in self._variants:
            self._variants.remove(interim)  # its targets were the interim ones
        self._remember(started.runtime)
        if self._runtime is interim:
            self._runtime = started.runtime
        if interim.capturer is not None:
            interim.capturer.stop()  # its graphs replay the interim targets
        COUNTERS.swaps += 1
        log.info("cachebuild: %s now serves with its %d targets, built in %.1f s in the "
                 "background", type(self.model).__name__,
                 len(set(started.runtime.entry.target_keys())), swap.seconds)

    def wait_built(self, timeout: float | None = None) -> bool:
        """Wait until the targets building in the background (``while_building``) for
        every variant this model started are stored and loaded, or failed to build
        (``swap.error`` says why); True when nothing is building any more. The next call
        then runs on them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        builds = [swap for _, swap in self._interim] + ([self.swap] if self.swap else [])
        for swap in builds:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not swap.wait(left):
                return False
        return True

    def _failed(self, error: BaseException, first: bool) -> None:
        """A model that cannot be compiled: raise (the error itself the first time, then
        ``CompileFailed`` at once), or with ``on_failure="eager"`` run eagerly from now on,
        saying so once per model and process."""
        name = type(self.model).__name__
        if self.compile_config.on_failure == "eager":
            self._eager = True
            if first:
                log.warning("cachebuild: %s cannot be compiled, so it runs eagerly "
                            "(on_failure='eager'): %s", name, one_line(error, typed=True))
            return None
        if first:
            raise error
        raise CompileFailed(f"{name} cannot be compiled: it failed earlier in this process "
                            f"and nothing it depends on changed (the same code, config, "
                            f"input shapes and values), so it is not traced again: "
                            f"{one_line(error, typed=True)}", error) from error

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Wait until background capture has captured every size (True), or ``timeout``
        seconds passed (False). Without background capture: at once, True."""
        capturer = self._runtime.capturer if self._runtime is not None else None
        return capturer.wait(timeout) if capturer is not None else True

    def capture_state(self) -> Any:
        """Where graph capture stands (``capture.CaptureState``: sizes captured, pending and
        failed, seconds, graph memory), or None before the first call or without a graph
        mode."""
        return self._runtime.capture_state() if self._runtime is not None else None

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledModule:
        """A copy of the model, compiled as this one is (its first call finds what this
        one stored): a process's loaded libraries, graphs and locks are not copied."""
        import copy

        return CompiledModule(copy.deepcopy(self.model, memo), self.compile_config, self.dynamic_dims,
                              self._store, self._passes)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``torch.save``) as its model and how it was compiled: unpickled, it is
        compiled again on the store the environment configures there, its first call
        finding what this one stored (as ``__deepcopy__``). One given a store or custom
        passes cannot be pickled (a store's keys and a remote's password are not written
        into a file): TypeError, saying what to pickle instead."""
        if self._store is not None or self._passes is not None:
            raise TypeError(f"a compiled {type(self.model).__name__} given a store or "
                            "custom passes cannot be pickled: pickle its model (.model) and "
                            "compile it again where it is loaded")
        return (_compiled_again, (self.model, self.compile_config, self.dynamic_dims))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # a call's inputs are bound by position, as its entry and guards are
            raise UsageError(_keywords_refused(self.model, sorted(kwargs)))
        if self._eager:
            return self.model(*args)  # cannot be compiled, on_failure="eager"
        if compat.user_dispatch_mode() or compat.user_function_mode():
            # A mode of the caller's sees every op the model runs (counting, checking,
            # changing them); compiled code would run past it. As torch.compile does for a
            # dispatch mode (a function mode it traces into one graph per mode, which a
            # stored entry cannot name).
            return self.model(*args)
        # Dynamo runs the model's own hooks and forward, not torch's global module hooks.
        why = global_hooks() if self._dynamo is not None else not_run(self.model, self._forward)
        if why is None:
            why = autocast_refusal(self.compile_config)
        if why is not None:
            return self._not_run(why, args)
        if self._runtime is None:
            said = self._outside(args)
            if said is not None and self.compile_config.out_of_range == "eager":
                # Nothing to trace or look up for it: run as every later such call is.
                warn_caller(said)
                return self.model(*args)
            with self._start_lock():
                if self._runtime is None and not self._eager:  # else another thread's start
                    self.prepare(*args)
        if self._dynamo is not None:
            return self._through_dynamo(args)
        if self._interim:
            self._swap_in(args)
        runtime = self._runtime  # read once: a call runs on one runtime from start to end
        if runtime is None:
            return self.model(*args)  # on_failure="eager"
        wrong = runtime.mismatches(self.model, args)
        if wrong and grad_mode_changed(wrong):
            return self._in_other_grad_mode(args)
        if wrong:
            runtime = self._resolve(args, wrong)
            if runtime is None:
                return self.model(*args)  # on_failure="eager"
        return runtime(*args)

    def _outside(self, args: tuple[Any, ...]) -> str | None:
        """Why the call's token count is outside every compile range, if it is (None
        also where the call names no token count a dynamic dim could give)."""
        for i, d in self.dynamic_dims.items():
            a = args[i] if i < len(args) else None
            if isinstance(a, torch.Tensor) and -a.dim() <= d < a.dim():
                return self.compile_config.outside(a.shape[d])
        return None

    def _not_run(self, why: str, args: tuple[Any, ...]) -> Any:
        """A call that would skip what ``model(x)`` runs besides its traced code (``why``:
        a hook on the model, a global module hook, a forward set on the instance): refused,
        or with ``on_failure="eager"`` run eagerly while it lasts, said once."""
        if self.compile_config.on_failure != "eager":
            raise UsageError(why)
        if not self._said_not_run:
            self._said_not_run = True
            log.warning("cachebuild: %s runs eagerly while this lasts (on_failure='eager'): "
                        "%s", type(self.model).__name__, why)
        return self.model(*args)

    def _in_other_grad_mode(self, args: tuple[Any, ...]) -> Any:
        """A call in another autograd mode than the trace's (no grad) to a forward that
        reads the mode: run eagerly, said once. Every forward is traced without autograd,
        so none serves it."""
        if not self._said_grad_mode:
            self._said_grad_mode = True
            log.warning("cachebuild: %s's forward reads autograd's mode (torch.is_grad_enabled"
                        "() or is_inference_mode_enabled()) and was traced without autograd: "
                        "a call with autograd on (or under inference_mode) runs eagerly; call "
                        "it under torch.no_grad() to serve it compiled", type(self.model).__name__)
        return self.model(*args)

    def _through_dynamo(self, args: tuple[Any, ...]) -> Any:
        import torch._dynamo

        for i, d in self.dynamic_dims.items():
            torch._dynamo.maybe_mark_dynamic(args[i], d)
        # Guards on every module's hooks: by default Dynamo builds none on empty hook
        # dicts, and a hook set on a submodule later would not run.
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            return self._dynamo(*args)

    def _remember(self, runtime: ModelRuntime) -> None:
        """Keep ``runtime`` among the variants, the oldest forgotten past ``KEPT_FORWARDS``."""
        self._variants.append(runtime)
        del self._variants[:-KEPT_FORWARDS]

    def _resolve(self, args: tuple[Any, ...], wrong: list[Mismatch]) -> ModelRuntime | None:
        """The forward for values that changed since the current one was made (``wrong``
        names them): one made earlier in this process whose guards hold, else a start for
        the live values (a stored entry for them, found without tracing, or a trace). None
        where that variant cannot be compiled and ``on_failure="eager"``; raises where it
        cannot be compiled otherwise. Never the old forward."""
        COUNTERS.guard_misses += 1
        with self._start_lock():  # a forward another thread makes for these values is taken
            return self._find_or_start(args, wrong)

    def _start_lock(self) -> threading.RLock:
        """``_starting``, made anew in a process forked while a thread of its parent held
        it (a pre-fork server's worker): that thread is not here to let it go."""
        if self._starting_pid != os.getpid():
            self._starting, self._starting_pid = threading.RLock(), os.getpid()
        return self._starting

    def _find_or_start(self, args: tuple[Any, ...], wrong: list[Mismatch]) -> ModelRuntime | None:
        name = type(self.model).__name__
        changed = describe_all(wrong)
        current = self._runtime
        if current is not None and not current.mismatches(self.model, args):
            return current  # made by another thread while this one waited
        for runtime in reversed(self._variants):
            if runtime is not current and not runtime.mismatches(self.model, args):
                COUNTERS.variant_switches += 1
                log.info("cachebuild: %s changed since its last call (%s): it runs on the "
                         "forward this process made earlier for these values", name, changed)
                self._runtime = runtime
                return runtime
        log.info("cachebuild: %s changed since its last call (%s): finding or tracing its "
                 "forward for these values", name, changed)
        left: list[Mismatch] = []
        for _ in range(3):
            # The current forward stays until another replaces it: a call on another
            # thread meanwhile finds it wrong for its values and waits here for this one.
            runtime = self.prepare(*args)
            if runtime is None:
                return None
            left = runtime.mismatches(self.model, args)
            if not left:
                return runtime
            # A trace must read what it was given: never run a forward that differs. A
            # value another thread changed meanwhile is traced again as it is now.
        raise UsageError(f"{name}'s forward for its current values does not hold right "
                         f"after it was made ({left[0].describe()}), so it is not run: if "
                         "another thread changes it as calls run, change it between calls; "
                         "else compile it with torch.compile(model, "
                         "backend=cachebuild.backend())")


def _compiled_again(model: torch.nn.Module, config: CompileConfig,
                    dynamic_dims: dict[int, int]) -> CompiledModule:
    """A pickled ``CompiledModule`` (``CompiledModule.__reduce__``), compiled again."""
    return compile(model, config, dynamic_dims)


def _keywords_refused(model: torch.nn.Module, names: list[str]) -> str:
    """Why a call with keyword arguments ``names`` is refused, and what to do: pass them
    by position, or, for a forward whose parameters take keywords only, use the
    torch.compile door."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    only = [n for n in names if n in params and params[n].kind is inspect.Parameter.KEYWORD_ONLY]
    if only:
        return (f"the module cachebuild.compile returned takes its inputs by position only, "
                f"and {type(model).__name__}.forward takes {', '.join(only)} by keyword only: "
                "serve it through torch.compile(model, backend=cachebuild.backend(...))")
    return (f"the module cachebuild.compile returned takes its inputs by position only; pass "
            f"{', '.join(names)} positionally (in the order of the model's forward)")


def compile(model: torch.nn.Module, config: CompileConfig | None = None,
            dynamic_dims: dict[int, int] | None = None, store: Store | None = None,
            passes: PassManager | None = None) -> CompiledModule:
    """A module that runs ``model`` through cachebuild's piecewise build graph.

    ``dynamic_dims`` maps a positional argument's index to its dynamic dim, e.g.
    ``{0: 0, 1: 0}`` for ``forward(input_ids, positions)`` with a token dim. The store is
    ``CACHEBUILD_DIR`` (default ``~/.cache/cachebuild``) unless ``store`` is given.
    ``passes``: a ``cachebuild.passes.PassManager`` of custom passes, used instead of the
    built-in passes ``config.passes`` enables. A building variable of the environment set
    to a value it does not take is a UsageError here (``building.settings``).
    """
    from cachebuild.building.settings import check_settings

    check_settings()
    return CompiledModule(model, check_config(config), check_dynamic_dims(dynamic_dims), store,
                          passes)


def backend(config: CompileConfig | None = None, store: Store | None = None,
            passes: PassManager | None = None) -> Any:
    """A torch.compile backend: ``torch.compile(model, backend=cachebuild.backend(cfg))``.

    Every graph Dynamo hands over is split and planned at once and its targets are built
    or loaded on its first call (``dynamo_backend.GraphForward``).
    """
    config = check_config(config)
    check_inductor_options(config)  # before torch.compile: Dynamo would wrap the error

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        check_inductor_options(config)  # a setting changed since
        graph_config = within_guards(config, graph_fakes(gm, example_inputs))
        planner = Planner(torch.nn.Module(), graph_config, {},
                          open_default_store(store), passes)

        def plan(traced: TracedGraph) -> Any:
            entry = planner.plan(traced, {"front_door": "torch.compile"})
            device = device_of(traced.input_metas)
            builder = Builder(planner.store, config, planner.passes, device)
            return lambda: on_device_forward(direct_forward(
                stitch(entry, resolve_all(entry, builder), layout_guards(entry.pieces))), device)

        return GraphForward(gm, example_inputs, plan, graph_config)

    return compile_graph


def stats() -> dict[str, Any]:
    """This process's counters: targets planned and unique, store hits and misses, loaded,
    built, failed and fallbacks, layout copies, traces and warm starts, and seconds per
    phase (trace, split, plan, build, load, prepare, capture)."""
    return snapshot()


def prometheus_text() -> str:
    """``stats()`` in the Prometheus text format (write it where a collector reads it)."""
    from cachebuild.metrics import process_metrics, render

    return render(process_metrics(snapshot()))

