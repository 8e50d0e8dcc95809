"""Graph facts: what is known about a graph's inputs and values, shared by every layer.

``InputMeta`` describes one graph input (kind, dtype, shape, strides, device), with sizes
that follow a dynamic dim written as symbolic expressions (``"s0"``, ``"64*s0"``);
``meta_of`` reads it off a real or fake tensor, a SymInt or an int, and
``record_example_values`` runs a graph on fake inputs to keep every node's fake value.
Tracing, splitting, the backends and the runtime all speak of inputs this way; this module
depends on torch alone, so the backends need nothing of the planning layers above it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from cachebuild.errors import UsageError
from cachebuild.keys import plain_data

log = logging.getLogger("cachebuild")

SYMBOL = re.compile(r"\b[su]\d+\b")


@dataclass(frozen=True)
class InputMeta:
    """What a graph input must look like: enough to check a call and to fake an input.

    ``shape``/``stride`` entries are ints, or strings of symbolic expressions (``"s0"``,
    ``"64*s0"``) for dims that follow the dynamic dim.
    """

    kind: str  # "tensor" | "symint" | "int" | "float"
    dtype: str | None = None
    shape: tuple[int | str, ...] = ()
    stride: tuple[int | str, ...] = ()
    device: str = "cpu"
    requires_grad: bool = False

    def to_data(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                "stride": list(self.stride), "device": self.device}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> InputMeta:
        return cls(kind=data["kind"], dtype=data["dtype"], shape=tuple(data["shape"]),
                   stride=tuple(data["stride"]), device=data["device"])

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]


def holds_at(guard: Any, symbols: set[Any], size: int) -> bool:
    """Whether the symbolic-shape ``guard`` (a sympy boolean of torch's shape guards) holds
    when each of ``symbols``, which all stand for the token count, is ``size``; a guard
    that does not come out true there (false, or not decided) does not."""
    import sympy

    value = sympy.Integer(size)
    return guard.xreplace({s: value for s in guard.free_symbols & symbols}) is sympy.true


def _dim(value: Any) -> int | str:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if getattr(expr, "is_number", False) else str(expr)
    return int(value)


def meta_of(value: Any) -> InputMeta:
    """InputMeta of a (fake or real) tensor, a SymInt or an int."""
    if isinstance(value, torch.Tensor):
        return InputMeta(
            kind="tensor",
            dtype=str(value.dtype).removeprefix("torch."),
            shape=tuple(_dim(d) for d in value.shape),
            stride=tuple(_dim(s) for s in value.stride()),
            device=str(value.device),
        )
    if isinstance(value, torch.SymInt):
        return InputMeta(kind="symint", shape=(_dim(value),))
    if isinstance(value, int):
        return InputMeta(kind="int", shape=(value,))
    if isinstance(value, (float, torch.SymFloat)):
        return InputMeta(kind="float")  # a scalar the torch.compile front door bakes in
    raise UsageError(f"unsupported graph input of type {type(value).__name__}")


def fake_mode_of(values: list[Any]) -> Any:
    """The fake mode of the first fake tensor among ``values`` (None if there is none)."""
    return next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)


def record_example_values(gm: fx.GraphModule, fake_inputs: list[Any]) -> None:
    """Run ``gm`` on fake inputs and keep each node's fake value in ``meta["example_value"]``.

    Splitting needs what each piece receives; Inductor's caches need the values to
    accept a graph (its AOT-autograd cache refuses nodes without them).
    """
    fake_mode = fake_mode_of(fake_inputs)

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            n.meta["example_value"] = result
            return result

    from cachebuild import compat

    # As Dynamo runs ops on fake values, keeping symbolic sizes symbolic.
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), \
            compat.composites_keep_symbolic_sizes():
        Recorder(gm).run(*fake_inputs)


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (nodes keep their names and ``meta``)."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


@functools.cache
def torch_dir() -> str:
    """The directory torch is installed in (its code is in every key through its version)."""
    return os.path.dirname(torch.__file__) + os.sep


@functools.cache
def stdlib_dir() -> str:
    """The directory of Python's standard library (it comes with the Python version)."""
    import sysconfig  # here: no warm start needs it

    return os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


#: Namespaces whose ops are torch's own (their code is in every key through its version)
#: or cachebuild's fusion ops (whose sources the pass manager's factors hold).
KEYED_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d",
                              "_c10d_functional_autograd", "cachebuild"})
_REGISTERED_AT = re.compile(r"registered at (.+?):\d+")


def user_ops(graph: fx.Graph) -> list[str]:
    """The operators ``graph`` calls (``ns::name``) outside ``KEYED_NAMESPACES``, sorted."""
    names = {_op_name(n) for n in graph.nodes} - {None}
    return sorted(q for q in names if q.split("::")[0] not in KEYED_NAMESPACES)


def _op_name(node: fx.Node) -> str | None:
    """The operator ``node`` calls (``ns::name``), if it calls one."""
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name
    if isinstance(node.target, torch._ops.OpOverloadPacket):  # Dynamo's ``torch.ops.ns.op``
        return node.target._qualified_op_name
    return None


def _calls(graph: fx.Graph) -> dict[str, list[tuple[torch._ops.OpOverload, fx.Node]]]:
    """Each user operator's calls in ``graph`` (overload and node), by operator name."""
    calls: dict[str, list[tuple[torch._ops.OpOverload, fx.Node]]] = {}
    for n in graph.nodes:
        name = _op_name(n)
        if name is not None:
            calls.setdefault(name, []).extend((op, n) for op in _overloads(n.target))
    return calls


def user_op_files(graph: fx.Graph) -> dict[str, tuple[str, ...]]:
    """For each operator of ``user_ops(graph)`` with any, the files a build of ``graph``
    may take its code from: those that registered it (``op_files``) and those the
    ``CompositeImplicitAutograd`` kernel of each overload it calls runs (``kernel_files``,
    at each call: another call's values may take another branch)."""
    calls = _calls(graph)
    out = {}
    for qualname in user_ops(graph):
        files = set(op_files(qualname))
        for op, node in calls.get(qualname, []):
            files.update(kernel_files(op, node))
        if files:
            out[qualname] = tuple(sorted(files))
    return out


def user_op_state(graph: fx.Graph) -> dict[str, list[str]]:
    """For each operator of ``user_ops(graph)`` whose inlined kernel read any, what it
    read besides its code, as it is now: each environment variable (``env NAME='value'``)
    and each module global of plain value (``value module.NAME=repr``, a scale computed
    from the environment as its module was imported, say). A build bakes them into the
    target as the kernel read them, which no file's hash shows."""
    out = {}
    for qualname, (env, values) in _user_op_reads(graph).items():
        said = {f"env {name}={os.environ.get(name)!r}" for name in env}
        for module_name, name in values:
            value = getattr(sys.modules.get(module_name), name, None)
            if plain_data(value):
                said.add(f"value {module_name}.{name}={value!r}")
        if said:
            out[qualname] = sorted(said)
    return out


def user_op_reads(graph: fx.Graph) -> tuple[list[str], list[tuple[str, str]]]:
    """The environment variables, and the module globals of plain value (module, name),
    that the inlined kernels of ``graph``'s user operators read: what a call checks, as
    it checks what the forward reads."""
    env: set[str] = set()
    values: set[tuple[str, str]] = set()
    for names, globals_read in _user_op_reads(graph).values():
        env |= names
        values |= globals_read
    return sorted(env), sorted(values)


def _user_op_reads(graph: fx.Graph) -> dict[str, tuple[set[str], set[tuple[str, str]]]]:
    calls = _calls(graph)
    out = {}
    for qualname in user_ops(graph):
        env: set[str] = set()
        values: set[tuple[str, str]] = set()
        for op, node in calls.get(qualname, []):
            run = kernel_run(op, node)
            if run is not None:
                env |= run.env
                values |= run.values
        if env or values:
            out[qualname] = (env, values)
    return out


@functools.cache
def op_files(qualname: str) -> tuple[str, ...]:
    """The Python files outside torch that registered operator ``qualname`` or one of its
    kernels, as torch's dispatcher records them (the file that made its
    ``torch.library.Library``), and the file of a ``torch.library.custom_op``'s function.
    A build may inline what they define (a ``CompositeImplicitAutograd`` kernel, a fake
    kernel's shapes), so a piece calling the op is made from them too. Once per process:
    a file edited after it was imported is not the code this process runs."""
    from torch._library import custom_ops

    try:
        dump = torch._C._dispatch_dump(qualname)
    except RuntimeError:
        dump = ""
    found = set(_REGISTERED_AT.findall(dump))
    opdef = custom_ops.OPDEFS.get(qualname)
    code = getattr(getattr(opdef, "_init_fn", None), "__code__", None)
    if code is not None:
        found.add(code.co_filename)
    return _python_files_outside_torch(found)


def _python_files_outside_torch(paths: Iterable[str]) -> tuple[str, ...]:
    """The existing ``.py`` files among ``paths``, absolute, sorted, but torch's own."""
    absolute = {os.path.abspath(p) for p in paths}
    return tuple(sorted(p for p in absolute if p.endswith(".py") and os.path.isfile(p)
                        and not p.startswith(torch_dir())))


@dataclass(frozen=True)
class KernelRun:
    """What a user operator's inlined kernel ran on one call's fake values: the files of
    its Python code, the environment variables it read, and the module globals its code
    names (module, name): their values are read when a key is made."""

    files: frozenset[str]
    env: frozenset[str]
    values: frozenset[tuple[str, str]]


#: The files each user operator overload's ``CompositeImplicitAutograd`` kernel ran, by
#: overload (``ns::name.overload``), over every call seen in this process.
_KERNEL_FILES: dict[str, tuple[str, ...]] = {}
#: Each kernel's run, by overload and call (``_signature``): found once per process.
_KERNEL_RUNS: dict[tuple[str, str], KernelRun] = {}


def kernel_files(op: torch._ops.OpOverload, node: fx.Node) -> tuple[str, ...]:
    """The Python files outside torch whose code the ``CompositeImplicitAutograd`` kernel
    of the user operator overload ``op``, which ``node`` calls, runs (``kernel_run``),
    and the files of the modules those import; none where it has no such kernel or
    cannot run here."""
    run = kernel_run(op, node)
    return tuple(sorted(run.files)) if run is not None else ()


def kernel_run(op: torch._ops.OpOverload, node: fx.Node) -> KernelRun | None:
    """The ``KernelRun`` of ``op``'s inlined kernels on ``node``'s fake values (what the
    build does with them): they may live in another file than the one that registered
    the op (``op_files``), call helpers of other files, read the environment or a
    module's constants. Found once per overload and call signature (another call's
    values may take another branch). Where a kernel cannot run (no fake values here, a
    kernel that needs real tensors: the build then fails or keeps the op), None, said in
    the debug log and tried again at the next graph."""
    name = op.name()
    key = (name, _signature(node))
    if key in _KERNEL_RUNS:
        return _KERNEL_RUNS[key]
    files: set[str] = set()
    env: set[str] = set()
    values: set[tuple[str, str]] = set()
    for kernel in _inlined_kernels(op):
        ran = _run_kernel(kernel, node, name)
        if ran is None:
            return None
        files |= ran.files
        env |= ran.env
        values |= ran.values
    # And the files of the modules those import (``from consts import SCALE``): a value
    # read at import leaves no frame of its file while the kernel runs.
    files |= {f for path in files for f in _imported_files(path)}
    run = _KERNEL_RUNS[key] = KernelRun(frozenset(_python_files_outside_torch(files)),
                                        frozenset(env), frozenset(values))
    _KERNEL_FILES[name] = tuple(sorted(set(_KERNEL_FILES.get(name, ())) | run.files))
    return run


def _signature(node: fx.Node) -> str:
    """A call's arguments as a kernel sees them: each tensor's shape, dtype and strides,
    every other value as it is."""
    def meta(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val", a.meta.get("example_value"))
            if isinstance(v, torch.Tensor):
                return ("tensor", str(tuple(v.shape)), str(v.dtype), str(v.stride()))
            return ("value", repr(v))
        return a

    return repr(fx.node.map_aggregate((node.args, node.kwargs), meta))


def _inlined_kernels(op: torch._ops.OpOverload) -> list[Callable[..., Any]]:
    """What a build may inline for ``op``: its ``CompositeImplicitAutograd`` kernel (a C++
    registration's, or a ``py_impl``'s, which ``decompose`` prefers), and a decomposition
    registered in Inductor's table."""
    kernels: list[Callable[..., Any]] = []
    try:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # not an operator the dispatcher knows by that name
        composite = False
    if composite or torch._C.DispatchKey.CompositeImplicitAutograd in op.py_kernels:
        kernels.append(op.decompose)
    inductor = sys.modules.get("torch._inductor.decomposition")
    table = getattr(inductor, "decompositions", None)
    if isinstance(table, dict) and op in table:
        kernels.append(table[op])
    return kernels


def _imported_files(path: str) -> set[str]:
    """The files of the modules that the module loaded from ``path`` imports by name
    (``import a``, ``from a import b``, relative ones too), as this process loaded them,
    and what those import in turn where they are not installed libraries' (a value two
    modules away: ``from helpers import SCALE``, where helpers has it from consts)."""
    from cachebuild.trust.sources import is_library_file

    found: set[str] = set()
    todo = [path]
    while todo:
        for name, file in _imports_of(todo.pop()).items():
            if file not in found and file != path:
                found.add(file)
                # cachebuild's own version is in every key
                if not is_library_file(file) and name.split(".")[0] != "cachebuild":
                    todo.append(file)
    return found


def _imports_of(path: str) -> dict[str, str]:
    """The files of the modules the module loaded from ``path`` imports by name, by
    module name; none where it is not loaded or does not parse."""
    module = next((m for m in list(sys.modules.values())
                   if getattr(m, "__file__", None) and os.path.abspath(m.__file__) == path),
                  None)
    if module is None:
        return {}
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    package = getattr(module, "__package__", None) or ""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *filter(None, [base])])
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}  # submodules
    files = {}
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(file, str) and not os.path.abspath(file).startswith(stdlib_dir()) \
                and not os.path.abspath(file).startswith(torch_dir()):
            files[name] = os.path.abspath(file)
    return files


def _overloads(target: Any) -> list[torch._ops.OpOverload]:
    """The overloads a call of ``target`` may reach: itself, or each of a packet's (Dynamo
    keeps ``torch.ops.ns.op`` as called)."""
    if isinstance(target, torch._ops.OpOverload):
        return [target]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, name) for name in target.overloads()]
    return []


def _run_kernel(kernel: Callable[..., Any], node: fx.Node, name: str) -> KernelRun | None:
    """What ``kernel`` (a decomposition of operator ``name``) runs on ``node``'s fake
    values: the files of the Python functions it calls, the environment variables they
    read (``os.environ``'s ``__getitem__``, which ``get``, ``getenv`` and ``in`` go
    through) and the module globals of plain value their code names; None where the
    values are not all there, or the call fails.

    Run on a thread of its own: its profile hook is that thread's alone (a caller's
    profiler on this one is left as it is), and no tracing context of this thread
    (Dynamo's, at a ``torch.compile`` backend's call) gives the kernel another fake mode
    than its values'."""
    values = []

    def value(a: Any) -> Any:
        if isinstance(a, fx.Node):  # Dynamo's graph has ``example_value``, others ``val``
            fake = a.meta.get("val", a.meta.get("example_value"))
            if fake is None:
                raise LookupError(a.name)
            values.append(fake)
            return fake
        return a

    try:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), value)
    except LookupError:
        return None
    mode = fake_mode_of(values)
    if mode is None:
        return None
    files: set[str] = set()
    env: set[str] = set()
    codes: list[tuple[Any, dict[str, Any]]] = []
    failed: list[BaseException] = []
    # The kernel is called from torch's ``_ops.py`` (through the dispatcher) or from here;
    # what it calls outside torch, and what that calls, is its code. torch's own machinery
    # on the way (fake tensors, symbolic shapes, and what they call) is not.
    callers = {os.path.abspath(torch._ops.__file__), os.path.abspath(__file__)}
    kernel_frames: set[Any] = set()  # the frames themselves: an id could be reused

    def note(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        file = os.path.abspath(frame.f_code.co_filename)
        if file.startswith(torch_dir()):
            return
        caller = frame.f_back
        if caller in kernel_frames or os.path.abspath(caller.f_code.co_filename) in callers:
            kernel_frames.add(frame)
            files.add(file)
            if frame.f_code.co_name == "__getitem__" and \
                    frame.f_locals.get("self") is os.environ:
                key = frame.f_locals.get("key")
                if isinstance(key, str):
                    env.add(key)
            elif not file.startswith(stdlib_dir()) and \
                    not frame.f_code.co_filename.startswith("<frozen "):
                codes.append((frame.f_code, frame.f_globals))

    def run() -> None:
        try:
            with mode, torch.no_grad():
                sys.setprofile(note)
                try:
                    kernel(*args, **kwargs)
                finally:
                    sys.setprofile(None)
        except Exception as e:  # a kernel that runs only on real tensors: the build's to say
            failed.append(e)

    thread = threading.Thread(target=run, name="cachebuild-kernel-files", daemon=True)
    thread.start()
    thread.join()
    kernel_frames.clear()
    if failed:
        log.debug(
            "the kernel of %s did not run on fake values (%s: %s): the files it calls are "
            "not known", name, type(failed[0]).__name__, failed[0])
        return None
    constants = {(str(g.get("__name__")), n) for code, g in codes for n in code.co_names
                 if n in g and plain_data(g[n]) and not n.startswith("__")}
    return KernelRun(frozenset(files), frozenset(env), frozenset(constants))


#: Dropout's functions, which draw only in training and at a probability above 0:
#: ``F.dropout(x, p, training, inplace)``, ``torch.dropout(x, p, train)``.
_DROPOUTS = frozenset({"dropout", "dropout_", "native_dropout", "alpha_dropout",
                       "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
                       "feature_dropout", "feature_dropout_", "dropout1d", "dropout2d",
                       "dropout3d"})
#: Ops that draw from torch's generators, by their last name (dropout's where its
#: arguments say so).
RANDOM_OPS = _DROPOUTS | frozenset({
    "bernoulli", "bernoulli_", "rand", "randn", "randint", "rand_like", "randn_like",
    "randint_like", "randperm", "multinomial", "normal", "normal_", "uniform_",
    "exponential_", "poisson", "random_", "cauchy_", "geometric_", "log_normal_", "rrelu",
    "rrelu_", "rrelu_with_noise", "rrelu_with_noise_", "fused_dropout", "_fused_dropout"})
#: Ops that draw only where an argument says so: name → (position, keyword) of the
#: probability they drop with (none drawn at 0).
_DROPPING = {"scaled_dot_product_attention": (4, "dropout_p"),
             "_scaled_dot_product_attention_math": (4, "dropout_p"),
             "_scaled_dot_product_flash_attention": (3, "dropout_p"),
             "_scaled_dot_product_flash_attention_for_cpu": (3, "dropout_p"),
             "_scaled_dot_product_efficient_attention": (5, "dropout_p"),
             "_scaled_dot_product_cudnn_attention": (5, "dropout_p")}


def _argument(node: fx.Node, position: int, keyword: str, default: Any) -> Any:
    if keyword in node.kwargs:
        return node.kwargs[keyword]
    return node.args[position] if len(node.args) > position else default


def _draws(node: fx.Node, name: str) -> bool:
    """Whether a call of ``name`` at ``node`` draws random numbers (where its arguments say
    it does not, a constant ``training=False`` or a probability of 0, it does not)."""
    if name in _DROPPING:
        return _argument(node, *_DROPPING[name], 0.0) not in (0, 0.0)
    if name not in RANDOM_OPS:
        return False
    if name in _DROPOUTS and node.op == "call_function":
        # F.alpha_dropout's and F.feature_alpha_dropout's ``training`` is False unless
        # given; every other one's is True, or must be given.
        functional = getattr(node.target, "__module__", "") == "torch.nn.functional"
        default = not (functional and name in ("alpha_dropout", "feature_alpha_dropout"))
        training = _argument(node, 2, "training" if functional else "train", default)
        return training is not False and _argument(node, 1, "p", 0.5) not in (0, 0.0)
    return True


def random_ops(graph: fx.Graph) -> list[str]:
    """The ops of ``graph`` that draw random numbers, by name, each once, in graph order:
    its code must draw them as eager does (Inductor's own random kernels draw others).
    Dropout in eval mode, or at 0, and attention without dropout draw nothing."""
    found: list[str] = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        name = name.split(".")[0]
        if name not in found and _draws(node, name):
            found.append(name)
    return found


def on_device(device: str | torch.device) -> Any:
    """A context in which ``device`` (``cuda:1``) is the current device of its type, which
    is what a bare ``cuda`` in a graph (``unpin_device``) means; a no-op context for a
    device without an index (the CPU). Reusable: enter it at every call."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        return torch.cuda.device(dev)
    return contextlib.nullcontext()


def without_autograd(run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)`` recording no autograd, as every compiled piece runs (pieces are
    traced without it: an ``eager_fusion`` piece, which runs its ops eagerly, has lost its
    code's ``no_grad`` blocks and ``detach`` calls). A call made under ``no_grad`` or
    ``inference_mode``, a server's, enters no context: this is on every call's path."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return run(*args)
    return run(*args)


def unpin_device(gm: fx.GraphModule, device: str) -> int:
    """Name ``device`` (the traced call's, e.g. ``cuda:1``) by its bare type (``cuda``)
    wherever the graph holds it as a constant (``torch.arange(n, device=x.device)``);
    returns how many arguments changed.

    Then every rank's graph is the same, so are the keys and the artifacts made from it,
    and each runs on whichever GPU is current (``on_device``). Other devices the graph
    names keep their index: a model that places work on two GPUs on purpose still does.
    """
    pinned = torch.device(device)
    if pinned.index is None:
        return 0
    bare = torch.device(pinned.type)
    changed = 0

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value == pinned:
            changed += 1
            return bare
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            node.args = swap(node.args)
            node.kwargs = swap(node.kwargs)
    if changed:
        gm.recompile()
    return changed


def device_of(values: Any, default: str = "cpu") -> str:
    """The device of the first tensor (or tensor ``InputMeta``) among ``values``: where a
    model, a call or a graph lives. ``default`` when there is none."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return str(value.device)
        if isinstance(value, InputMeta) and value.kind == "tensor":
            return value.device
    return default
