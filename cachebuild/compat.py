"""Every difference between the torch versions cachebuild supports (2.11 through 2.13).

Code elsewhere never tests ``torch.__version__`` nor works around one version's behaviour
itself (a retry, a match on a message, an allow-list): it asks this module, whose names
say what each difference papers over.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


def torch_git_version() -> str:
    return getattr(torch.version, "git_version", "unknown") or "unknown"


def cuda_factors(device: torch.device) -> dict[str, Any]:
    """CUDA runtime, driver and the device's compute capability, for keys."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    driver = None
    try:
        driver = torch._C._cuda_getDriverVersion()  # type: ignore[attr-defined]
    except Exception:
        pass
    return {
        "cuda": torch.version.cuda,
        "cuda_driver": driver,
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
    }


def fp8_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` for e4m3 ``a`` (row-major) and ``b`` (column-major)
    with per-tensor float32 scales, on CUDA, through ``torch._scaled_mm`` (a private op
    whose signature is the same on torch 2.11 through 2.13)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def fresh_inductor_cache() -> Any:
    """A context with an empty, temporary Inductor cache directory (renamed in torch 2.8)."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh()


def vec_isa() -> dict[str, str]:
    """The vector ISA Inductor builds CPU kernels for here: its name (``avx512``) and the
    compiler flags it gives them (``vec_isa_flags``), which enter every kernel's cache key.
    Empty where Inductor picks none."""
    from torch._inductor.cpu_vec_isa import invalid_vec_isa, pick_vec_isa

    isa = pick_vec_isa()
    if isa == invalid_vec_isa:
        return {}
    return {"vec_isa": str(isa), "vec_isa_flags": isa.build_arch_flags()}


def pin_vec_isa(name: str | None, flags: str | None) -> Callable[[], None]:
    """Make Inductor use the vector ISA ``name`` with compiler ``flags`` (what
    ``vec_isa()`` said where kernels were built), without compiling its ISA checks;
    returns a function that undoes it.

    Only where the CPU reports every feature of that ISA (else nothing changes, and
    Inductor checks as usual): kernels built for an ISA the CPU lacks would crash.
    """
    from torch._inductor import cpu_vec_isa

    if not name or flags is None or platform.machine() not in ("x86_64", "AMD64"):
        return lambda: None
    try:
        features = cpu_vec_isa.x86_isa_checker()
    except Exception:  # an unreadable /proc/cpuinfo: let Inductor check as usual
        return lambda: None
    base = next((isa for isa in cpu_vec_isa.supported_vec_isa_list if str(isa) == name), None)
    if base is None or not all(f in features for f in name.split()):
        return lambda: None

    class AsBuilt(type(base)):  # type: ignore[misc, valid-type]
        """The ISA the kernels were built for: its flags as recorded, checked already."""

        __hash__ = type(base).__hash__

        def build_arch_flags(self) -> str:
            return flags

        def __bool__(self) -> bool:
            return True

    pinned = AsBuilt()
    original = cpu_vec_isa.valid_vec_isa_list
    cpu_vec_isa.valid_vec_isa_list = lambda: [pinned]

    def undo() -> None:
        cpu_vec_isa.valid_vec_isa_list = original

    return undo


def cuda_graph_for_capture() -> tuple[Any, bool]:
    """A ``torch.cuda.CUDAGraph`` and whether it must be instantiated by a call of its own:
    True where this torch has ``keep_graph`` (capture and instantiation then time apart),
    False where ``capture_end`` instantiates it."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        return torch.cuda.CUDAGraph(), False


def unowned_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor at ``t``'s address, shape and strides whose storage does not own the memory
    (what torch's CUDA graph trees build for graph outputs: the pool keeps the memory, and a
    later capture may reuse it)."""
    storage = t.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device,
                                                            storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        unowned, t.storage_offset(), t.size(), t.stride())


def custom_ops_without_dynamo() -> None:
    """Let kernels of ops made with ``torch.library.custom_op`` run without importing Dynamo.

    torch wraps each such kernel in ``torch._disable_dynamo``, whose first call imports
    ``torch._dynamo`` (0.5 s and more) to build the wrapper it caches on the function as
    ``__dynamo_disable``. Where Dynamo is not imported, nothing can be tracing, so the
    kernel may run as it is: the wrapper cached here does that until Dynamo is imported,
    then removes itself and lets torch build its own. Ops registered later, and kernels
    registered through ``torch.library.impl(..., disable_dynamo=True)``, keep torch's.
    """
    import sys

    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return
    for opdef in list(OPDEFS.values()):
        for wrapped in list(getattr(opdef, "_backend_fns", {}).values()):
            raw = getattr(wrapped, "__wrapped__", None)
            if raw is not None and "__dynamo_disable" not in getattr(raw, "__dict__", {}):
                setattr(raw, "__dynamo_disable", _until_dynamo(raw, wrapped, sys.modules))


def _until_dynamo(raw: Callable[..., Any], wrapped: Callable[..., Any],
                  modules: dict[str, Any]) -> Callable[..., Any]:
    """``raw`` itself while ``torch._dynamo`` is not in ``modules``; from then on torch's
    own wrapper ``wrapped`` (this one removes itself from ``raw``)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in modules:
            vars(raw).pop("__dynamo_disable", None)
            return wrapped(*args, **kwargs)
        return raw(*args, **kwargs)

    return call


def process_group_ranks(group_name: str) -> list[int]:
    """The global ranks of the process group registered under ``group_name`` (the name a
    functional collective carries in a graph)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return dist.get_process_group_ranks(distributed_c10d._resolve_process_group(group_name))


def registered_group(group_name: str) -> Any | None:
    """The process group registered under ``group_name`` in this process (the registry
    that functional collectives, eager or compiled, resolve a group's name through), or
    None."""
    from torch._C import _distributed_c10d as c10d

    try:
        return c10d._resolve_process_group(group_name)
    except RuntimeError:
        return None


def register_group(group_name: str, group: Any | None) -> None:
    """Make ``group`` (None: nothing) what ``group_name`` resolves to in this process.

    The registry holds groups weakly: the caller keeps ``group`` alive while it is used.
    """
    from torch._C import _distributed_c10d as c10d

    c10d._unregister_process_group(group_name)  # also a name whose group is gone; no-op if none
    if group is not None:
        c10d._register_process_group(group_name, group)


def fake_process_group(group_name: str, size: int) -> Any:
    """A process group of ``size`` ranks (this one rank 0) backed by torch's fake backend,
    which communicates nothing: an all-reduce leaves its input as it is, an all-gather
    repeats it. Not registered anywhere."""
    from torch._C._distributed_c10d import FakeProcessGroup, HashStore, ProcessGroup

    # torch 2.13 builds one through a factory; its constructor did before.
    create = getattr(FakeProcessGroup, "_create_internal", None)
    backend = create(0, size) if create is not None else FakeProcessGroup(0, size)
    group = ProcessGroup(HashStore(), 0, size)
    group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, backend)
    group._set_group_name(group_name)
    return group


def init_fake_world(rank: int, world_size: int) -> None:
    """Initialise the default process group as torch's fake one: rank ``rank`` of
    ``world_size``, no other process, no communication (what a model file sees when
    ``cachebuild warm --world-size`` plans one rank)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def source_name(source: Any) -> str:
    """A Dynamo source's name (a property from torch 2.13, a method before)."""
    name = source.name
    return name() if callable(name) else name


def attribute_guard(guard: Any) -> tuple[Any, str, bool]:
    """What a ``HASATTR`` or ``NOT_PRESENT_IN_GENERIC_DICT`` guard checks: the source of
    the object, the attribute's name, and whether the guard's own source is the object's
    (then the value Dynamo recorded for it is the object; else it is the attribute's).

    torch 2.13 passes the name as the guard function's ``attr`` keyword, on the object's
    source. Before, ``HASATTR`` sat on the attribute's own source (an ``AttrSource``,
    possibly inside an ``NNModuleSource``) and took the name from it."""
    import functools

    from torch._dynamo.source import AttrSource, NNModuleSource

    fn = guard.create_fn
    keywords = fn.keywords if isinstance(fn, functools.partial) else {}
    source = guard.originating_source
    if keywords.get("attr") is not None:
        return source, keywords["attr"], True
    if isinstance(source, NNModuleSource):
        source = source.base
    if isinstance(source, AttrSource):
        return source.base, source.member, False
    raise ValueError(f"an attribute guard on {type(source).__name__} names no attribute")


def mutated_sources() -> list[str] | None:
    """Names of objects (or their attributes) that existed before the frame Dynamo is
    tracing and that the frame leaves changed: its side effects. Called from a backend,
    while the frame is traced; None where this torch does not let them be seen.

    An attribute set during the frame and set back to the value it had (a flag raised
    and lowered around a call) is no change.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        side_effects = tx.output.side_effects
        variables = list(side_effects.id_to_variable.values())
    except (ImportError, AttributeError):
        return None
    names = []
    for variable in variables:
        source = getattr(variable, "source", None)
        if source is None:
            continue  # created by the frame itself: part of what it returns
        try:
            modified = side_effects.is_modified(variable)
        except AssertionError:
            modified = True
        if not modified:
            continue
        try:
            name = source_name(source)
        except NotImplementedError:
            continue  # a temporary of the frame (TempLocalSource), not an object before it
        changed = _changed_attributes(variable, side_effects.store_attr_mutations.get(variable))
        if changed is None:
            changed = _changed_items(variable)
            if changed == []:
                continue  # a dict given back what it held (``self.buf += x`` on a buffer)
            names.append(name)
        else:
            names += [f"{name}.{attr}" for attr in changed]
    return names


def _tensor_value(variable: Any) -> Any:
    """The fake tensor a realized tensor variable holds (None for anything else: an
    unrealized lazy one is never realized here, which would add graph inputs after the
    backend has its graph)."""
    if not getattr(variable, "is_realized", lambda: True)():
        return None
    if not getattr(variable, "is_tensor", lambda: False)():
        return None
    try:
        return variable.as_proxy().node.meta.get("example_value")
    except Exception:
        return None


def _changed_items(variable: Any) -> list[Any] | None:
    """The keys of a dict the frame changed, where it is a dict whose every item kept
    its value: the same variable, or the same tensor (an in-place update stored back under
    its own key, as ``self.buf += x`` does with a module's ``_buffers``); None where that
    cannot be told."""
    items, original = _held(variable, "items"), _held(variable, "original_items")
    if not isinstance(items, dict) or not isinstance(original, dict) or len(items) != len(original):
        return None

    def name(key: Any) -> Any:
        key = getattr(key, "vt", key)
        try:
            return key.as_python_constant()
        except Exception:
            return None

    before = {name(k): v for k, v in original.items()}
    changed = []
    for key, value in items.items():
        old = before.get(name(key))
        if old is value:
            continue
        tensor = _tensor_value(value)
        if tensor is None or old is None or tensor is not _tensor_value(old):
            changed.append(key)
    return changed


def _held(variable: Any, name: str) -> Any:
    """``variable.name``, or None: some of Dynamo's variables raise other errors than
    AttributeError for what they cannot give (a list's ``value`` holding a symbolic
    size raises ``AsPythonConstantNotImplementedError``)."""
    try:
        return getattr(variable, name, None)
    except Exception:
        return None


def _changed_attributes(variable: Any, pending: dict[str, Any] | None) -> list[str] | None:
    """The attributes the frame sets on ``variable``'s object to another value than they
    had (None where that cannot be told: not an attribute change)."""
    obj = _held(variable, "value")
    if not pending or obj is None:
        return None
    missing = object()
    changed = []
    for name, value in pending.items():
        try:
            final = value.as_python_constant() if value.is_python_constant() else missing
        except Exception:
            final = missing
        before = getattr(obj, name, missing)
        if final is missing or before is missing or not (
                before is final or (type(before) is type(final) and before == final)):
            changed.append(name)
    return changed


def point_header_dir(folder: str | None) -> Callable[[], None]:
    """Make Inductor keep its precompiled C++ headers under ``folder`` (None: where it
    would keep them by default); returns a function that puts the previous folder back.

    torch 2.11-2.13 computes that folder once, at import, from the system's temp folder
    (``codecache._HEADER_DIR``), ignoring ``TORCHINDUCTOR_CACHE_DIR``: hundreds of MB per
    compiler flag set land in ``/tmp/torchinductor_<user>`` wherever the cache is pointed.
    Where Inductor is not imported yet, it computes the folder from the temp folder when
    it is, which ``build_work_dir`` points at the work folder too.
    """
    import sys

    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is None or not hasattr(codecache, "_HEADER_DIR"):
        return lambda: None
    saved = codecache._HEADER_DIR, getattr(codecache, "_HEADER_LOCK_DIR", None)
    if folder is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        folder = os.path.join(default_cache_dir(), "precompiled_headers")
    _set_header_dir(codecache, folder, os.path.join(folder, "locks") if saved[1] else None)
    return lambda: _set_header_dir(codecache, *saved)


def drop_precompiled_headers() -> list[str]:
    """Remove the precompiled C++ headers (``*.gch``) of the folder Inductor keeps them in
    now, and forget the ones this process made (Inductor's memo of their paths): the
    next build that wants one precompiles it again. Returns the files removed."""
    import glob
    import sys

    codecache = sys.modules.get("torch._inductor.codecache")
    folder = getattr(codecache, "_HEADER_DIR", None)
    if not isinstance(folder, str):
        return []
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), "*.gch")):
        try:
            os.unlink(path)  # a compile reading it meanwhile keeps its open copy
        except OSError:
            continue
        removed.append(path)
    _forget_precompiled(codecache)
    return removed


def _forget_precompiled(codecache: Any) -> None:
    """Clear Inductor's memo of the headers it precompiled (``_precompile_header``, keyed
    without their folder): a path it hands out must be one still there."""
    clear = getattr(getattr(codecache, "_precompile_header", None), "cache_clear", None)
    if clear is not None:
        clear()


def _set_header_dir(codecache: Any, folder: str, lock_dir: str | None) -> None:
    """Point ``codecache``'s precompiled headers at ``folder``. Inductor memoizes the path
    of each header it precompiled (``_precompile_header``, keyed without the folder): a
    path under another folder, which may be gone (an earlier store's work folder), must not
    be handed out, so the memo is cleared whenever the folder changes."""
    if codecache._HEADER_DIR != folder:
        _forget_precompiled(codecache)
    codecache._HEADER_DIR = folder
    if lock_dir is not None:
        codecache._HEADER_LOCK_DIR = lock_dir


def export_keeping_unproven_guards(export: Callable[..., Any]) -> tuple[Any, bool]:
    """``export()``, the program torch.export makes of a piece over a range of sizes;
    ``(program, deferred)``.

    torch 2.11's export cannot prove some guards that hold over the whole range
    (``min(16*s, 32*s) == 16*s``) and raises "Constraints violated". It may keep such
    guards as checks the program runs instead: then ``export`` is called again with
    ``prefer_deferred_runtime_asserts_over_guards=True`` and ``deferred`` is True, and the
    caller checks that the range the program accepts is still the whole range.
    """
    try:
        return export(), False
    except Exception as e:
        if "Constraints violated" not in str(e):
            raise
    return export(prefer_deferred_runtime_asserts_over_guards=True), True


#: Threads inside ``guards_rebuilt_by_identity`` (the patch, once made, stays: a thread
#: outside it gets torch's own comparison).
_BY_IDENTITY = threading.local()
_PATCHING = threading.Lock()


@contextlib.contextmanager
def guards_rebuilt_by_identity() -> Iterator[None]:
    """Let Dynamo build a frame's guards twice over an object whose ``==`` is elementwise
    (a NumPy array attribute): a ``guard_filter_fn`` makes it build them again, and
    ``Guard.set_export_info`` then compares its two weak references to the object with
    ``==``, which compares the objects (torch 2.11-2.13). On this thread, for the block,
    they are compared by identity."""
    from torch._guards import Guard

    with _PATCHING:
        if not getattr(Guard.set_export_info, "_cachebuild", False):
            original = Guard.set_export_info

            def set_export_info(self: Any, guard_type: Any, guarded_class: Any,
                                code_list: Any, obj_weakref: Any = None) -> Any:
                held = self.obj_weakref
                if getattr(_BY_IDENTITY, "on", False) and isinstance(held, weakref.ref) \
                        and isinstance(obj_weakref, weakref.ref):
                    # The same object, or a stand-in made anew for each build (an array's
                    # tensor view): no comparison of the objects themselves.
                    self.obj_weakref = obj_weakref if held() is obj_weakref() else None
                return original(self, guard_type, guarded_class, code_list, obj_weakref)

            set_export_info._cachebuild = True  # type: ignore[attr-defined]
            Guard.set_export_info = set_export_info  # type: ignore[method-assign]
    was = getattr(_BY_IDENTITY, "on", False)
    _BY_IDENTITY.on = True
    try:
        yield
    finally:
        _BY_IDENTITY.on = was


def is_rebuilt_object_guard(error: BaseException) -> bool:
    """True if ``error`` is torch 2.11 and 2.12's guard builder meeting, when asked for
    the guards' values, an object the forward builds afresh at each read (transformers'
    cache with ``use_cache=True``): an AssertionError "Guarded object must be identical".
    """
    return isinstance(error, AssertionError) and "Guarded object must be identical" in str(error)


#: Guard kinds Dynamo puts on a process group: an ``ID_MATCH`` before torch 2.13, an opaque
#: object's type and guard function from 2.13.
PROCESS_GROUP_GUARD_KINDS = frozenset({"ID_MATCH", "TYPE_MATCH", "FAKE_SCRIPT_TYPE_MATCH",
                                       "OPAQUE_OBJ_GUARD_FN_MATCH"})


def composites_keep_symbolic_sizes() -> Any:
    """A context in which composite ops (a linear on a 3-D input) run on fake values read
    symbolic sizes as such, as they do under Dynamo: torch's Python dispatcher. Without it
    torch 2.11 reads them as ints, which pins a dynamic dim to the traced size."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()


# -- what Inductor's compilers do, seen from outside (``backends/compilers.py``) ------------

@dataclass(frozen=True)
class CxxBuild:
    """One C++ compiler run of Inductor's: its command line, its sources, the file it
    makes, and which step it is (``header``: a precompiled or preprocessed header;
    ``object``: a source compiled, not linked; ``library``: linked, from sources or
    objects)."""

    command: str
    sources: tuple[str, ...]
    target: str
    step: str


_HOOKED: dict[str, bool] = {}


def hook_compilers(cxx: Callable[[CxxBuild, Callable[[], None]], None],
                   mark: Callable[[str], Any]) -> None:
    """Route Inductor's compiler work in this process through cachebuild (once; later
    calls do nothing): every C++ build Inductor runs becomes ``cxx(build, run)``, where
    ``run()`` does it; its vector-ISA checks run inside ``mark("cxx_isa")``, Triton
    compiles (and waits for them) inside ``mark("triton")``, AOTInductor's packaging
    inside ``mark("packaging")``. ``mark(name)`` returns a context manager.

    torch 2.11-2.13 run every C++ build through ``CppBuilder.build``; a name this torch
    lacks is left alone (its time then counts where it falls).
    """
    if _HOOKED.get("done"):
        return
    _HOOKED["done"] = True
    import importlib

    from torch._inductor import cpp_builder

    original_build = cpp_builder.CppBuilder.build

    def build(self: Any) -> None:
        step = ("header" if getattr(self, "_precompiling", False)
                or getattr(self, "_preprocessing", False)
                else "object" if getattr(self, "_compile_only", False) else "library")
        # The sources as given (fbcode remote builds keep them apart), else as the command
        # line names them.
        named = getattr(self, "_orig_source_paths", None) or [
            w for w in str(getattr(self, "_sources_args", "")).split()
            if w not in ("-x", "c++-header")]
        sources = tuple(str(s) for s in named)
        try:
            command = self.get_command_line()
            target = self.get_target_file_path()
        except Exception:  # nothing to key it by: build as Inductor would
            original_build(self)
            return
        cxx(CxxBuild(command, sources, target, step), lambda: original_build(self))

    cpp_builder.CppBuilder.build = build

    def wrap(module_name: str, owner: str | None, name: str, phase: str) -> None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # no Triton here, say
            return
        holder = getattr(module, owner, None) if owner else module
        fn = getattr(holder, name, None) if holder is not None else None
        if fn is None:
            return

        def marked(*args: Any, **kwargs: Any) -> Any:
            with mark(phase):
                return fn(*args, **kwargs)

        setattr(holder, name, marked)

    wrap("torch._inductor.cpu_vec_isa", "VecISA", "check_build", "cxx_isa")
    wrap("torch._inductor.package", None, "package_aoti", "packaging")
    wrap("torch._inductor.async_compile", "AsyncCompile", "triton", "triton")
    wrap("torch._inductor.async_compile", "AsyncCompile", "wait", "triton")
    if importlib.util.find_spec("triton") is not None:
        wrap("torch._inductor.runtime.triton_heuristics", "CachingAutotuner", "precompile",
             "triton")


def hook_autotuning(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Route Inductor's choice of a Triton kernel's launch configuration in this process
    through ``wrap`` (once; later calls do nothing): ``CachingAutotuner.
    autotune_to_one_config`` becomes ``wrap(original)``. torch 2.11-2.13 time the
    candidates there with ``benchmark_all_configs``; a torch without those names, or
    without Triton, is left alone."""
    if _HOOKED.get("autotune"):
        return
    _HOOKED["autotune"] = True
    try:
        from torch._inductor.runtime import triton_heuristics
    except ImportError:
        return
    tuner = getattr(triton_heuristics, "CachingAutotuner", None)
    original = getattr(tuner, "autotune_to_one_config", None)
    if original is None or not hasattr(tuner, "benchmark_all_configs"):
        return
    tuner.autotune_to_one_config = wrap(original)


def hook_vec_isa_list(choose: Callable[[Callable[[], list[Any]]], list[Any]]) -> None:
    """Once per process: Inductor's list of the vector ISAs usable here
    (``cpu_vec_isa.valid_vec_isa_list``, which it computes by compiling and loading a
    check program per ISA) becomes ``choose(original)``."""
    if _HOOKED.get("vec_isa"):
        return
    _HOOKED["vec_isa"] = True
    from torch._inductor import cpu_vec_isa

    original = cpu_vec_isa.valid_vec_isa_list
    cpu_vec_isa.valid_vec_isa_list = lambda: choose(original)


def check_vec_isas_at_once(run: Callable[[Callable[[], object]], object]) -> None:
    """Inductor's check of every vector ISA this x86 CPU claims, all at once, one thread
    apiece (each compiles a program and loads it in a child process: seconds apiece,
    which ``valid_vec_isa_list`` spends one after another); ``valid_vec_isa_list`` then
    finds each answer cached (``VecISA.__bool__`` caches it per ISA). ``run(check)`` runs
    each check on its thread (the caller's bookkeeping), with this thread's Inductor config
    (its compiler). An error in a check is left for ``valid_vec_isa_list`` to meet."""
    import contextlib
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    from torch._inductor import config, cpu_vec_isa

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    if config.cpp.vec_isa_ok is not None:  # decided by the operator: nothing is checked
        return
    try:
        features = cpu_vec_isa.x86_isa_checker()
    except Exception:
        return
    isas = [isa for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in features for flag in str(isa).split())]

    def check(isa: Any) -> None:
        with contextlib.suppress(Exception):
            run(lambda: bool(isa))

    if len(isas) > 1:
        # Each thread in a copy of this one's context: Inductor's config patches (the
        # compiler being checked, ``cpp.cxx``) live in context variables.
        with ThreadPoolExecutor(len(isas), thread_name_prefix="cachebuild-isa") as pool:
            for done in [pool.submit(contextvars.copy_context().run, check, isa)
                         for isa in isas]:
                done.result()


def hook_header_precompiles(side: Callable[[Callable[[], object]], object]) -> None:
    """Once per process: AOTInductor's two precompiled headers on a CPU, side by side.

    A CPU package's build precompiles the wrapper's header and then the kernels' prefix
    header, one after the other, each under a lock of its own (seconds apiece, once per
    environment): a second build waiting for the first header leaves a CPU idle. Here the
    call for the wrapper's header (the one given ``min_optimize``) also precompiles the
    prefix header, with the same command, on a thread of its own (``side(run)`` runs
    it: the caller's bookkeeping), and returns once both are made; Inductor's own call
    for the prefix header then finds it made. Where this torch names these otherwise,
    nothing changes."""
    if _HOOKED.get("headers"):
        return
    _HOOKED["headers"] = True
    import contextvars
    import threading

    from torch._inductor import codecache

    original = getattr(codecache, "_precompile_header", None)
    prefix_of = getattr(codecache, "_get_cpp_prefix_header", None)
    if original is None or prefix_of is None:
        return

    def precompile(header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        device = str(compile_command.get("device_type", ""))
        prefix = prefix_of(device) if "min_optimize" in compile_command else None
        if prefix is None or prefix == header:
            return original(header, hashable_cmd_line, **compile_command)
        rest = {k: v for k, v in compile_command.items() if k != "min_optimize"}
        run = contextvars.copy_context().run  # Inductor's config patches (the compiler)
        beside = threading.Thread(
            target=run, args=(side, lambda: original(prefix, hashable_cmd_line, **rest)),
            name="cachebuild-header", daemon=True)
        beside.start()
        try:
            return original(header, hashable_cmd_line, **compile_command)
        finally:
            beside.join()

    codecache._precompile_header = precompile


def vec_isa_record(isas: list[Any]) -> list[list[str]]:
    """Inductor's usable ISAs as data: ``[[name, flags], ...]``."""
    return [[str(isa), isa.build_arch_flags()] for isa in isas]


def vec_isas_from_record(record: list[list[str]]) -> list[Any] | None:
    """The ISAs ``vec_isa_record`` wrote, as Inductor's objects that check nothing, or
    None where this CPU lacks a feature of one of them (then Inductor must check)."""
    from torch._inductor import cpu_vec_isa

    try:
        features = cpu_vec_isa.x86_isa_checker() if platform.machine() in (
            "x86_64", "AMD64") else None
    except Exception:
        return None
    out = []
    for name, flags in record:
        base = next((i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == name), None)
        if base is None or features is None or not all(f in features for f in name.split()):
            return None

        class AsChecked(type(base)):  # type: ignore[misc, valid-type]
            __hash__ = type(base).__hash__

            def build_arch_flags(self, _flags: str = flags) -> str:
                return _flags

            def __bool__(self) -> bool:
                return True

        out.append(AsChecked())
    return out


def cpu_features() -> str:
    """The CPU's vector features as Inductor reads them (empty off x86)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return platform.machine()
    from torch._inductor import cpu_vec_isa

    try:
        return " ".join(sorted(cpu_vec_isa.x86_isa_checker()))
    except Exception:
        return ""


def inductor_cxx() -> str:
    """The C++ compiler Inductor's config names now (``cpp.cxx``)."""
    from torch._inductor import config

    cxx = config.cpp.cxx
    return str(cxx[-1] if isinstance(cxx, tuple | list) else cxx)


def dict_watcher() -> Any:
    """How this Python says that a dict changed (``dictwatch``): CPython's dict watchers
    from 3.12, its dicts' version tags before (both CPython only)."""
    import sys

    from cachebuild import dictwatch

    return dictwatch.watcher(sys.version_info >= (3, 12)
                             and sys.implementation.name == "cpython")


def environ_dict() -> tuple[dict[Any, Any], Callable[[str], Any]] | None:
    """The dict behind ``os.environ`` and how a variable's name is its key there (CPython's
    ``os._Environ``), or None where it has none."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    return (data, encode) if isinstance(data, dict) and callable(encode) else None


def process_state_signature() -> tuple[Any, ...]:
    """A cheap summary of torch's process-wide state that ``guards.process_state`` reads:
    equal summaries mean equal states (default dtype and device, deterministic algorithms,
    autocast and its dtypes, how matmuls may round, the torch-function modes that set a
    default device). A few C calls, where ``torch.get_default_device()`` alone costs
    microseconds."""
    c = torch._C
    depth = c._len_torch_function_stack()
    modes = tuple(c._get_function_stack_at(i) for i in range(depth)) if depth else ()
    autocast = c._is_any_autocast_enabled()
    # Which dtype autocast casts to matters where it is on (a forward reads it then).
    detail = (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
              c.get_autocast_dtype("cpu"), c.get_autocast_dtype("cuda")) if autocast else ()
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            c._get_deterministic_algorithms_warn_only(),
            c._get_deterministic_fill_uninitialized_memory(), autocast, detail,
            c._get_cublas_allow_fp16_reduced_precision_reduction(),
            c._get_cublas_allow_bf16_reduced_precision_reduction(), _precisions(), modes)


def matmul_rounding() -> tuple[Any, ...]:
    """How matmuls and convolutions may round, as a forward, or Inductor generating its
    code, could read it: whether float16 and bfloat16 reductions may round in cuBLAS, and
    the float32 precisions of ``_PRECISIONS`` (TF32, bfloat16)."""
    c = torch._C
    return (c._get_cublas_allow_fp16_reduced_precision_reduction(),
            c._get_cublas_allow_bf16_reduced_precision_reduction(),
            *_precision_settings().values())


#: The float32 precisions Inductor reads while it generates a piece's code (TF32 in Triton's
#: matmul and convolution templates, bfloat16 or TF32 in oneDNN's packed matmuls), as
#: torch's ``(backend, op)`` pairs, parents first, each with its value in a process that set
#: none (torch's defaults: cuDNN's convolutions may use TF32). An op's value is its
#: backend's where the process set none for it, and "none" rounds as "ieee" does; the older
#: settings (``allow_tf32``, ``set_float32_matmul_precision``) read through them.
_PRECISIONS = {("cuda", "all"): "ieee", ("cuda", "matmul"): "ieee", ("cuda", "conv"): "tf32",
               ("mkldnn", "all"): "ieee", ("mkldnn", "matmul"): "ieee"}
#: torch's readers and setters of those (torch 2.9+).
_FP32_PRECISION: Any = getattr(torch._C, "_get_fp32_precision_getter", None)
_SET_FP32_PRECISION: Any = getattr(torch._C, "_set_fp32_precision_setter", None)
#: The older setting that gives CUDA's and oneDNN's matmuls these precisions.
_MATMUL_PRECISION = {("ieee", "ieee"): "highest", ("tf32", "tf32"): "high",
                     ("tf32", "bf16"): "medium"}


def _precisions() -> tuple[Any, ...]:
    """The values of ``_PRECISIONS`` in this process, in its order (C calls only)."""
    if _FP32_PRECISION is None:
        return ()
    return tuple(_FP32_PRECISION(backend, op) for backend, op in _PRECISIONS)


def _precision_settings() -> dict[str, str]:
    """Every precision of ``_PRECISIONS`` by name (``"cuda/matmul"``), "none" read as
    "ieee"."""
    return {f"{backend}/{op}": "ieee" if value == "none" else value
            for (backend, op), value in zip(_PRECISIONS, _precisions(), strict=False)}


#: Every float32 precision torch keeps, as ``(backend, op)`` pairs, parents first.
_ALL_PRECISIONS = (("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"),
                   ("cuda", "rnn"), ("mkldnn", "all"), ("mkldnn", "matmul"),
                   ("mkldnn", "conv"), ("mkldnn", "rnn"))


def raw_precisions() -> tuple[Any, ...]:
    """Every float32 precision of this process as torch holds it (``_ALL_PRECISIONS``),
    to put back exactly with ``set_raw_precisions``."""
    if _FP32_PRECISION is None:
        return ()
    return tuple(_FP32_PRECISION(backend, op) for backend, op in _ALL_PRECISIONS)


def set_raw_precisions(values: tuple[Any, ...]) -> None:
    """Put back what ``raw_precisions`` read, changing only what differs now."""
    if _SET_FP32_PRECISION is None:
        return
    for (backend, op), value in zip(_ALL_PRECISIONS, values, strict=False):
        if _FP32_PRECISION(backend, op) != value:
            _SET_FP32_PRECISION(backend, op, value)


def codegen_settings() -> dict[str, Any]:
    """The process-wide settings Inductor generates other code under, where this process
    differs from torch's defaults: a float32 precision (``"cuda/matmul": "tf32"``), and
    deterministic algorithms (``"deterministic": True``, whether they only warn where an
    op has no deterministic kernel, and whether they fill memory ``torch.empty`` leaves
    unset). Empty in a process that changed none of them."""
    defaults = {f"{backend}/{op}": value for (backend, op), value in _PRECISIONS.items()}
    out: dict[str, Any] = {name: value for name, value in _precision_settings().items()
                           if value != defaults[name]}
    if torch.are_deterministic_algorithms_enabled():
        out["deterministic"] = True
        if torch.is_deterministic_algorithms_warn_only_enabled():
            out["warn_only"] = True
        if not torch._C._get_deterministic_fill_uninitialized_memory():
            out["fill_uninitialized_memory"] = False
    return out


def set_codegen_settings(settings: dict[str, Any]) -> None:
    """Make this process's settings those ``settings`` names (``codegen_settings``' form:
    what it leaves out is torch's default), changing only those that differ. Through the
    older setters where they give the precisions asked for, which keep
    ``torch.get_float32_matmul_precision()`` readable (Inductor reads it; the newer
    setters make it raise)."""
    wanted = {f"{backend}/{op}": settings.get(f"{backend}/{op}", default)
              for (backend, op), default in _PRECISIONS.items()}
    now = _precision_settings()
    pair = (wanted["cuda/matmul"], wanted["mkldnn/matmul"])
    if pair != (now["cuda/matmul"], now["mkldnn/matmul"]):
        if pair in _MATMUL_PRECISION:
            torch.set_float32_matmul_precision(_MATMUL_PRECISION[pair])
        elif pair[1] == "ieee" and pair[0] in ("tf32", "ieee"):
            torch.set_float32_matmul_precision("highest")
            torch.backends.cuda.matmul.allow_tf32 = pair[0] == "tf32"
    if wanted["cuda/conv"] != _precision_settings()["cuda/conv"] and \
            wanted["cuda/conv"] in ("tf32", "ieee"):
        torch.backends.cudnn.allow_tf32 = wanted["cuda/conv"] == "tf32"
    for backend, op in _PRECISIONS:  # what the older setters cannot say; parents first
        name = f"{backend}/{op}"
        if _precision_settings()[name] != wanted[name] and _SET_FP32_PRECISION is not None:
            _SET_FP32_PRECISION(backend, op, wanted[name])
    wanted_fill = settings.get("fill_uninitialized_memory", True)  # read where deterministic
    if settings.get("deterministic") and \
            torch._C._get_deterministic_fill_uninitialized_memory() != wanted_fill:
        torch._C._set_deterministic_fill_uninitialized_memory(wanted_fill)
    deterministic = bool(settings.get("deterministic"))
    if torch.are_deterministic_algorithms_enabled() != deterministic or (
            deterministic and torch.is_deterministic_algorithms_warn_only_enabled()
            != bool(settings.get("warn_only"))):
        torch.use_deterministic_algorithms(
            deterministic, warn_only=bool(settings.get("warn_only")) if deterministic
            else torch.is_deterministic_algorithms_warn_only_enabled())


def user_function_mode() -> bool:
    """Whether a TorchFunctionMode of the caller's is active on this thread (one that
    changes what ``F.linear`` returns, say): a trace would bake it into the graph, and a
    call under another mode (or none) read the graph as if under it. torch's own modes
    (``with torch.device(...)``, which the trace's process state records) do not count.
    One C call where no mode is active."""
    depth = torch._C._len_torch_function_stack()
    if not depth:
        return False
    return any(not type(torch._C._get_function_stack_at(i)).__module__.startswith("torch.")
               for i in range(depth))


def user_dispatch_mode() -> bool:
    """Whether a TorchDispatchMode of the caller's is active on this thread (``with
    FlopCounterMode():``): torch.compile runs the model eagerly under one, as compiled code
    would bypass it. torch's own infrastructure modes, and modes that ask to be left out
    of compiled code (``ignore_compile_internals``, torch 2.11+), do not count. One C call
    where no mode is active."""
    depth = torch._C._len_torch_dispatch_stack()  # this thread's stack
    if not depth:
        return False
    from torch.utils._python_dispatch import _get_dispatch_stack_at

    for i in range(depth):
        mode = _get_dispatch_stack_at(i)
        infra = getattr(mode, "is_infra_mode", None)
        ignored = getattr(mode, "ignore_compile_internals", None)
        if (infra is not None and infra()) or (ignored is not None and ignored()):
            continue
        return True
    return False


def _gpu_ready(device: torch.device) -> None:
    """The GPU's context made: what a first GPU build in a process pays before anything
    else. (Not Triton's driver: it builds and loads a helper library from its cache
    folder, which is trusted only inside a build's own work folder, ``kernel_dir``.)"""
    torch.empty(1, device=device)


def prepare_inductor(devices: list[torch.device]) -> None:
    """Inductor's first-use set-up, done before a build needs it (about a second on a
    CPU): its pattern passes for ``devices`` (registered lazily, per input device), the
    system description its caches hash, and on a GPU its context.
    Only a head start: a part this torch lacks or that fails is left to the build, which
    sets it up as it always does."""
    from torch._inductor import codecache
    from torch._inductor.fx_passes import joint_graph, post_grad

    steps: list[Callable[[], object]] = [post_grad.lazy_init,
                                          getattr(codecache.CacheBase, "get_system", None)]
    steps += [functools.partial(joint_graph.lazy_init, d) for d in devices]
    steps += [functools.partial(_gpu_ready, d) for d in devices if d.type == "cuda"]
    for step in steps:
        if step is not None:
            with contextlib.suppress(Exception):
                step()
