"""Tracing a model once with Dynamo into a TracedGraph.

The graph's placeholders are bound *by identity* at trace time: Dynamo hands the backend
the live tensors in placeholder order, so each one is either a parameter or buffer of
the model (bound by its path), a call argument (by position), or, for a SymInt, the size
of a dynamic dim of a call argument. That binding is all a warm process needs to feed a
stored graph from a live model, with no Dynamo.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from cachebuild import keep
from cachebuild.errors import UsageError, one_line, transient
from cachebuild.graph.effects import graph_effects, might_write
from cachebuild.graph.facts import (
    SYMBOL,
    InputMeta,
    device_of,
    holds_at,
    meta_of,
    torch_dir,
    unpin_device,
    user_op_files,
    user_op_reads,
)
from cachebuild.graph.inputs import copy_with_strides, refuse_subclass
from cachebuild.graph.outputs import item_outputs, output_builder, output_recipe, returned
from cachebuild.graph.weights import hooks_hidden
from cachebuild.tracing.guards import (
    GRAD_STATES,
    GuardRecord,
    GuardSet,
    fingerprint,
    is_grad_mode,
    process_state,
)
from cachebuild.trust.codehash import code_objects as code_objects_of
from cachebuild.trust.codehash import has_source, sourceless_classes
from cachebuild.trust.sources import digest_of, library_paths, module_root, stamped_digest


@dataclass(frozen=True)
class Binding:
    """Where a graph input comes from in a live call.

    kind ``param``/``buffer``: the model's tensor at ``path``; ``arg``: positional call
    argument ``arg``; ``size``: ``args[arg].shape[dim]``; ``const``: the int ``dim``.
    """

    kind: str
    path: str | None = None
    arg: int | None = None
    dim: int | None = None

    def to_data(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "arg": self.arg, "dim": self.dim}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Binding:
        return cls(**data)


@dataclass
class TracedGraph:
    """A model's forward as one FX graph plus how to feed it."""

    gm: fx.GraphModule
    bindings: list[Binding]
    input_metas: list[InputMeta]
    source_files: dict[str, str]
    out_spec: str  # how to rebuild the model's output (``outputs.output_recipe``)
    num_outputs: int
    fake_inputs: list[Any] = field(default_factory=list)
    guards: list[GuardRecord] = field(default_factory=list)  # what the trace read
    unrecordable: str | None = None  # why no entry may be stored for this trace
    source_stamps: dict[str, list[int]] = field(default_factory=dict)  # size, times per file
    #: Each traced file of an installed library: its path inside the library folder
    #: (``sources.library_path``), by which a later process finds it.
    source_libraries: dict[str, str] = field(default_factory=dict)
    #: What each graph output is (its dims, as sizes or symbols), None where unknown.
    output_metas: list[InputMeta | None] = field(default_factory=list)
    #: The model's whole forward (``cachebuild.compile``); False for one of the graphs
    #: Dynamo hands the torch.compile door between graph breaks, which need not call a
    #: splitting op.
    whole: bool = True


def output_metas(gm: fx.GraphModule) -> list[InputMeta | None]:
    """Each output of ``gm`` as its traced value says (a tensor's dims, a size's symbol);
    None where no value was recorded, or it is no tensor, size or number."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    metas: list[InputMeta | None] = []
    for value in out.args[0]:  # Dynamo's graphs return one flat tuple
        if isinstance(value, fx.Node):
            value = value.meta.get("example_value")
        try:
            metas.append(meta_of(value))
        except UsageError:
            metas.append(None)
    return metas


def _traced_files(code_objects: list[Any], more: Sequence[str] = ()
                  ) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Sources whose code Dynamo traced (and ``more``), outside torch itself (its version is
    in every key): files by their absolute path, code compiled from linecache text (a
    notebook cell) by its linecache name; each with the hash of its syntax tree. And each
    file's stamp (size, times) as of that hash, so that a warm start need not read an
    unchanged file again."""
    files: dict[str, str] = {}
    stamps: dict[str, list[int]] = {}
    for path in [code.co_filename for code in code_objects] + list(more):
        if os.path.isfile(path):
            path = os.path.abspath(path)
            if path.startswith(torch_dir()):
                continue
        if path in files:
            continue
        if os.path.isfile(path):
            digest, stamp = stamped_digest(path)
            if stamp is not None:
                stamps[path] = stamp
        else:
            digest = digest_of(path)
        if digest is not None:
            files[path] = digest
    return dict(sorted(files.items())), {p: stamps[p] for p in sorted(stamps) if p in files}


def _bind(model: torch.nn.Module, args: list[Any], inputs: list[Any],
          dynamic_dims: dict[int, int]) -> list[Binding]:
    by_id: dict[int, Binding] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), Binding("param", path=name))
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), Binding("buffer", path=name))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            by_id[id(a)] = Binding("arg", arg=i)
    bindings = []
    for value in inputs:
        if isinstance(value, torch.SymInt):
            bindings.append(_bind_symint(value, args, dynamic_dims))
        elif isinstance(value, int):
            bindings.append(Binding("const", dim=value))
        else:
            # Held in a container argument, it is that argument's at each call, even where
            # this call's is also a weight or another argument: refused before binding.
            _refuse_held_tensors(args, value)
            if id(value) in by_id:
                bindings.append(by_id[id(value)])
                continue
            forward = type(model).forward
            defaults = [*(getattr(forward, "__defaults__", None) or ()),
                        *(getattr(forward, "__kwdefaults__", None) or {}).values()]
            if any(d is value for d in defaults):
                raise UsageError(
                    "the traced graph reads a tensor that is the default of a parameter of "
                    "forward, which a warm process cannot bind: pass it as an argument, or "
                    "register it as a buffer (register_buffer) and read it from the model")
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                # Dynamo also passes a Python number the forward makes at each call (a
                # draw of its random module) to the graph as a 0-d tensor of its own.
                raise UsageError(
                    "the traced graph reads a 0-d tensor that is neither a parameter, a "
                    "buffer nor a call argument: a plain tensor attribute or global (register "
                    "it with register_buffer), a NumPy number (numpy.float32(...): make it a "
                    "Python float), or a number the forward draws in Python at each call "
                    "(random.randint, random.uniform: draw it with torch.rand instead, or "
                    "pass it as an argument)")
            raise UsageError(
                "the traced graph reads a tensor that is neither a parameter, a buffer nor a "
                "call argument of the model (a plain tensor attribute, a NumPy array or a "
                "global?): register it with register_buffer, as a tensor, so it can be bound "
                "in a warm process"
            )
    return bindings


def _refuse_held_tensors(args: list[Any], value: Any) -> None:
    """A UsageError naming the argument that holds the graph's input ``value`` in a
    container (a list of caches, a dict of extras), if one does: only tensors passed as
    arguments themselves are bound to a warm process's calls."""
    from torch.utils._pytree import tree_leaves

    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor) and any(leaf is value for leaf in tree_leaves(a)):
            raise UsageError(
                f"argument {i} holds tensors in a {type(a).__name__}, which "
                "cachebuild.compile does not bind to later calls (only tensors passed as "
                "arguments themselves): pass each tensor as an argument of its own, or "
                "compile with torch.compile(model, backend=cachebuild.backend(...)), whose "
                "Dynamo takes containers")


def _bind_symint(value: torch.SymInt, args: list[Any], dynamic_dims: dict[int, int]) -> Binding:
    # All dynamic dims have one size (check_call_dims), so Dynamo's duck sizing gives
    # them one symbol: any SymInt input is that symbol, read off the first dynamic dim.
    expr = str(value.node.expr)
    if not dynamic_dims or not SYMBOL.fullmatch(expr):
        raise UsageError(f"graph takes a symbolic size {expr} that no dynamic dim explains")
    i, d = min(dynamic_dims.items())
    return Binding("size", arg=i, dim=d)


def check_call_dims(args: list[Any], dynamic_dims: dict[int, int]) -> None:
    """Dynamic dims must name tensor arguments and be equal in size (one token count)."""
    sizes = set()
    for i, d in dynamic_dims.items():
        if i >= len(args):
            raise UsageError(f"expected at least {i + 1} arguments, got {len(args)}: "
                             f"dynamic_dims names argument {i}")
        if not isinstance(args[i], torch.Tensor):
            raise UsageError(f"dynamic_dims names argument {i}, which is not a tensor argument")
        if d >= args[i].dim() or d < -args[i].dim():
            raise UsageError(f"dynamic_dims names dim {d} of argument {i}, which has {args[i].dim()} dims")
        sizes.add(args[i].shape[d])
    if len(sizes) > 1:
        raise UsageError(f"dynamic dims must have one size (the token count); got sizes {sorted(sizes)}")
    if sizes and min(sizes) < 1:
        raise UsageError("a dynamic dim of size 0 cannot be traced: call with at least one token")


def _dynamic_symbols(fake_inputs: list[Any], bindings: list[Binding],
                     dynamic_dims: dict[int, int], shape_env: Any) -> set[Any]:
    """The symbols of the dynamic dims in the traced graph: they all stand for the token
    count (the dims have one size), including those Dynamo replaced by another."""
    found = set()
    for value, b in zip(fake_inputs, bindings, strict=True):
        if b.kind == "arg" and b.arg in dynamic_dims and isinstance(value, torch.Tensor):
            size = value.shape[dynamic_dims[b.arg]]
            if isinstance(size, torch.SymInt):
                found |= size.node.expr.free_symbols
    for symbol, replacement in shape_env.replacements.items():
        if replacement.free_symbols & found:
            found.add(symbol)
    return found


def check_shape_guards(guards: list[Any], symbols: set[Any],
                       compile_ranges: Sequence[tuple[int, int]], traced_at: int) -> None:
    """Raise UsageError if a symbolic-shape guard of the trace fails at a size of a range.

    Such a guard is a branch of the forward on the token count (a sliding window, a
    special case for short inputs): the one traced graph is only right on its side.
    ``symbols`` all stand for the token count.
    """
    for guard in guards:
        if not guard.free_symbols & symbols:
            continue
        if guard.free_symbols - symbols:
            raise UsageError(f"the traced forward depends on sizes other than the token count "
                             f"({guard}): mark only the token dim dynamic")
        for lo, hi in compile_ranges:
            failing = [n for n in range(lo, hi + 1) if not holds_at(guard, symbols, n)]
            if failing:
                bad = min(failing, key=lambda n: abs(n - traced_at))  # where the branch flips
                text = str(guard)
                for s in symbols:
                    text = re.sub(rf"\b{s}\b", "T", text)
                branch = (f"the model's forward (its code, or an op it calls that torch "
                          f"handles otherwise by size, as a convolution) takes another branch "
                          f"at size {bad} than at {traced_at} (it holds only where {text})")
                if len(failing) < hi - lo + 1:
                    raise UsageError(f"{branch}, and compile range ({lo}, {hi}) holds both: "
                                     "keep every compile range on one side of that size")
                raise UsageError(
                    f"{branch}, and one trace serves every compile range of a model: range "
                    f"({lo}, {hi}) lies on the other side. Compile it apart (a model compiled "
                    f"with compile_ranges=(({lo}, {hi}),) alone), or serve the model through "
                    "torch.compile(model, backend=cachebuild.backend(...)), which traces each "
                    "side")


#: Written tensors larger than this in all are put back after the one-token check but not
#: compared (their copies would not fit beside a cache that fills a GPU): outputs only.
COMPARED_WRITES_BYTES = 256 << 20


def check_size_one(model: torch.nn.Module, gm: fx.GraphModule, out_spec: str,
                   bindings: list[Binding], inputs: list[Any], fakes: list[Any],
                   args: list[Any], dynamic_dims: dict[int, int],
                   compile_ranges: Sequence[tuple[int, int]], traced_at: int) -> None:
    """Raise UsageError where a compile range serves one token and the traced graph, run
    at one token, answers otherwise than the forward does.

    Dynamo traces a dynamic dim as at least 2 (it specialises sizes 0 and 1), so a branch
    on the token count being 1 (``if x.shape[0] == 1``, a decode fast path) is decided
    without a guard for ``check_shape_guards`` to see. Both are run on the call's
    arguments cut to one token, with what either writes put back after: outputs and
    writes compared. A forward that does not run on those (it raises) is not judged, nor
    one in a process group."""
    if not dynamic_dims or not any(lo <= 1 <= hi for lo, hi in compile_ranges):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Its collectives would wait for ranks that run no such check (a rank that finds
        # the entry another stored traces nothing).
        return
    one = list(args)
    for i, d in dynamic_dims.items():
        one[i] = args[i].narrow(d, 0, 1)
    flat = [one[b.arg] if b.kind == "arg" else one[b.arg].shape[b.dim] if b.kind == "size"
            else v for b, v in zip(bindings, inputs, strict=True)]
    # What either writes (the same tensors: one forward's code), kept and put back.
    written = (graph_effects(gm, fakes).written_inputs
               if any(might_write(n) for n in gm.graph.nodes) else [])
    state = list({id(t): t for t in (flat[i] for i in written)
                  if isinstance(t, torch.Tensor)}.values())
    compared = state if sum(t.nbytes for t in state) <= COMPARED_WRITES_BYTES else []
    kept = keep.Tensors(state)
    try:
        with keep.rng(), torch.inference_mode(False), torch.no_grad():
            _seed()  # the same draws for both (dropout in train mode)
            want = _flat_values(model(*one)) + [t.clone() for t in compared]
            kept.restore()
            _seed()
            got = _flat_values(output_builder(out_spec)(gm.forward(*flat), flat, one))
            got += [t.clone() for t in compared]
    except Exception:
        return
    finally:
        kept.restore()
    if _same_values(got, want):
        return
    hi = next(hi for lo, hi in compile_ranges if lo <= 1 <= hi)
    raise UsageError(
        f"the model's forward takes another branch at size 1 than at {traced_at} (run at one "
        f"token, the graph traced at {traced_at} answers otherwise), and compile range (1, "
        f"{hi}) holds both: start the compile ranges at 2, or serve the model through "
        "torch.compile(model, backend=cachebuild.backend(...)), which traces size 1 apart")


def _seed() -> None:
    """Seed the generators ``keep.rng`` puts back: the CPU's and, where CUDA is set up,
    every device's (never queue a seed for a device the caller has not set up)."""
    torch.random.default_generator.manual_seed(0)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(0)


def _flat_values(value: Any, depth: int = 0) -> list[Any]:
    """The tensors and plain values of an output, in order; an object that is neither (a
    cache object) by its class and what its attributes hold."""
    out: list[Any] = []
    for v in torch.utils._pytree.tree_leaves(value):
        if isinstance(v, torch.Tensor):
            out.append(v.detach())
        elif v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
            out.append(v)
        else:
            out.append(type(v))
            if depth < 4 and hasattr(v, "__dict__"):
                out += _flat_values(list(vars(v).values()), depth + 1)
    return out


def _same_values(got: list[Any], want: list[Any]) -> bool:
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            loose = 2e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-3
            if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(
                    a.float(), b.float(), rtol=loose, atol=loose, equal_nan=True):
                return False
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            return False
    return True


@contextlib.contextmanager
def _quiet_meta_failures() -> Iterator[None]:
    """While the block runs, drop the traceback torch logs (at ERROR) when an op's meta
    kernel refuses a call's shapes: the same error reaches the trace, which says it in one
    line (``_op_error``); and Dynamo's warning about a builtin it cannot trace. The caller's
    logging and warning filters are as they were after."""
    said = {"torch._subclasses.fake_tensor": ("failed while attempting to run meta",),
            # a guard Dynamo could not make (the same error reaches the trace)
            "torch._guards": ("Error while creating guard", "Created at")}
    filters = []
    for name, starts in said.items():
        def keep_others(record: logging.LogRecord, starts: tuple[str, ...] = starts) -> bool:
            return not str(record.msg).startswith(starts)

        logging.getLogger(name).addFilter(keep_others)
        filters.append((name, keep_others))
    try:
        with warnings.catch_warnings():
            # Dynamo's page-long warning about a builtin it cannot trace (``random.random``)
            # comes before the graph break it leads to, which the trace says in one line.
            warnings.filterwarnings("ignore", message="Dynamo does not know how to trace",
                                    category=UserWarning)
            yield
    finally:
        for name, keep_others in filters:
            logging.getLogger(name).removeFilter(keep_others)


def _graph_break(e: BaseException) -> str:
    """Dynamo's reason for a graph break in one line: its first line, what it says of the
    cause (``Developer debug context``: the exception the forward raised, the call it
    could not follow) and where in the user's code, as ``file:line in function``."""
    lines = str(e).splitlines()
    said = lines[0].strip() if lines else type(e).__name__
    context = next((line.split(":", 1)[1].strip() for line in lines
                    if line.strip().startswith("Developer debug context:")), "")
    if context:
        said += f" ({context})"
    return said + _where(e)


def _where(e: BaseException) -> str:
    """`` at file:line in function`` of the innermost frame Dynamo was tracing, or ""."""
    stack = getattr(e, "real_stack", None) or []
    if not stack:
        return ""
    frame = stack[-1]
    return f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


def _op_error(e: BaseException) -> str:
    """The error an op raised under Dynamo, in one line, with where in the user's code:
    the first exception of ``e``'s chain that is not Dynamo's own."""
    import torch._dynamo.exc

    seen: set[int] = set()
    error: BaseException | None = e
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if not isinstance(error, torch._dynamo.exc.TorchDynamoException):
            break
        error = error.__cause__ or error.__context__
    return one_line(error if error is not None else e, typed=True) + _where(e)


def _user_error(e: BaseException) -> str:
    """Dynamo's page about a forward it cannot trace (a ``UserError``) in one line: its
    first line, where in the forward, and for a tensor's value used as an index or a size
    (data-dependent), what to do instead."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    first = (lines[0] if lines else type(e).__name__).split(" (unhinted")[0]
    caused = next((line.removeprefix("Caused by:").strip() for line in lines
                   if line.startswith("Caused by:")), "")
    said = first + (f" (at {caused.split('  #')[0]})" if caused else _where(e))
    if "data-dependent" in first:
        said += ("; a value known only as the forward runs (a tensor's value, NumPy's "
                 "random numbers) is used as a Python number, an index or a size "
                 "(h[ids.argmax()], x[:n.item()], float(np.random.rand())), which one graph "
                 "cannot follow: keep it a tensor (torch.index_select, torch.gather, a mask; "
                 "torch.rand for random numbers)")
    return said


def trace_model(model: torch.nn.Module, args: tuple[Any, ...] | list[Any],
                dynamic_dims: dict[int, int],
                compile_ranges: Sequence[tuple[int, int]] = ()) -> TracedGraph:
    """See ``_trace``: the same, with cachebuild's own weight hooks out of the way (Dynamo
    would record them as globals the trace read)."""
    # The trace's run of the forward is not the caller's, nor is what importing Dynamo
    # writes into the environment.
    with hooks_hidden(), keep.rng(), keep.environment():
        return _trace(model, args, dynamic_dims, compile_ranges)


def _trace(model: torch.nn.Module, args: tuple[Any, ...] | list[Any],
           dynamic_dims: dict[int, int], compile_ranges: Sequence[tuple[int, int]]) -> TracedGraph:
    """Run Dynamo once over ``model(*args)`` and capture its whole forward as one graph.

    The dims in ``dynamic_dims`` (argument index → dim) are traced symbolically. Raises
    UsageError if the forward does not trace into one graph, changes objects that existed
    before the call (cachebuild replays no side effects), or branches on the token count
    inside one of ``compile_ranges``. What the trace read besides tensors comes back as
    ``guards``; a trace that cannot be checked without Dynamo says why in ``unrecordable``.
    """
    import torch._dynamo

    from cachebuild import compat
    from cachebuild.tracing.guard_export import (
        Collected,
        Unrecordable,
        arity_record,
        environment_records,
        grad_mode_records,
        method_records,
        records_from,
        requires_grad_records,
        shadow_records,
    )

    _check_takes(model, args)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            refuse_subclass(i, a)
    # Copies, so that the trace writes nothing of the caller's; each as the caller's
    # argument is, its requires_grad too (a clone made under no_grad drops it). Made, and
    # traced, outside inference mode: tensors made in it keep no version counter, which
    # the trace's look at what a graph writes reads (``graph_effects``).
    with torch.inference_mode(False):
        args = [_copy_as_is(a, dynamic=i in dynamic_dims) if isinstance(a, torch.Tensor)
                else a for i, a in enumerate(args)]
    check_call_dims(args, dynamic_dims)
    for i, d in dynamic_dims.items():
        if args[i].shape[d] == 1:
            # Torch specialises a size of 1; the graph is the same for every size, so a
            # first call with one token is traced with it repeated.
            args[i] = torch.cat([args[i], args[i]], dim=d)
        torch._dynamo.mark_dynamic(args[i], d)

    captured: dict[str, Any] = {}

    class _SideEffects(Exception):
        """The traced frame changes objects that existed before it (refused below)."""

    class _RunFails(Exception):
        """The traced graph, run on the call's tensors, raised (an op refused them)."""

    def capture(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        if "gm" in captured:
            raise UsageError("the model's forward traced into more than one graph")
        captured["gm"] = gm
        captured["inputs"] = list(example_inputs)
        context = torch._guards.TracingContext.try_get()
        captured["code"] = list(context.traced_code) if context is not None else []
        captured["fake_mode"] = torch._guards.detect_fake_mode(example_inputs)
        captured["mutated"] = compat.mutated_sources()
        captured["modes"] = {state: process_state(state) for state in GRAD_STATES}
        items = item_outputs(gm)

        def run(*inputs: Any) -> Any:
            # Refused before the frame applies its side effects, which come after this
            # call in the code Dynamo made: a refused trace changes nothing.
            if captured["mutated"]:
                raise _SideEffects
            # Tracing leaves the model as it was: what the forward writes in place (a
            # buffer, a cache) is put back afterwards, in the same tensors (Dynamo then
            # stores them where the forward did). Runs after Dynamo's compile, so looking
            # at the graph adds no guard to its frame.
            written: list[int] = []
            if any(might_write(n) for n in gm.graph.nodes):
                fakes = [n.meta.get("example_value", v) for n, v in zip(
                    [n for n in gm.graph.nodes if n.op == "placeholder"], inputs, strict=True)]
                written = graph_effects(gm, fakes).written_inputs
            saved = keep.Tensors(inputs[i] for i in written)
            try:
                captured["outputs"] = out = returned(gm.forward(*inputs), items)
            except Exception as e:
                raise _RunFails from e
            finally:
                saved.restore()
            return out

        return run

    # Imported here: it brings sympy (seconds), which a warm start never needs.
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    collected = Collected()
    # A fresh Dynamo state: an earlier trace of the same code would otherwise be reused
    # from Dynamo's own cache and never reach our backend.
    torch._dynamo.reset()
    marked = "_is_torch_compile" in vars(model)  # torch.compile marks the model it wraps
    compiled = torch.compile(model, backend=capture, fullgraph=True, dynamic=False,
                             options={"guard_filter_fn": collected})
    try:
        with torch.inference_mode(False), torch.no_grad(), _quiet_meta_failures(), \
                compat.guards_rebuilt_by_identity():
            output = compiled(*args)
    except _SideEffects:
        output = None  # refused below
    except _RunFails as e:
        if transient(e.__cause__):  # out of memory: the machine's, not the model's
            raise e.__cause__ from None
        # An op that fake tensors let through refused the real ones (an integer input to
        # a float matmul): as it would eagerly, said in one line.
        raise UsageError(f"the model's forward fails on these inputs (check that the same "
                         f"call runs eagerly): {one_line(e.__cause__, typed=True)}") from e
    except torch._dynamo.exc.Unsupported as e:
        if str(e).lstrip().startswith("Observed exception"):  # the forward itself raised
            raise UsageError(f"the model's forward raises on these inputs (check that the "
                             f"same call runs eagerly): {_graph_break(e)}") from e
        said = _graph_break(e)
        if "Generator" in said and "proxy" in said:  # Dynamo's words for generator=g
            said += ("; a torch.Generator of the model's own cannot be given to an op in "
                     "one graph: draw from torch's global generator (seeded with "
                     "torch.manual_seed), or draw the random values outside and pass them in")
        raise UsageError(f"the model's forward does not trace as one graph: {said}") from e
    except torch._dynamo.exc.UserError as e:
        raise UsageError(f"the model's forward does not trace: {_user_error(e)}") from e
    except torch._dynamo.exc.TorchRuntimeError as e:
        # An op refused the call's shapes or dtypes (as it would eagerly): the error is the
        # op's, said in one line, not Dynamo's page about running FX nodes on fake tensors.
        raise UsageError(f"the model's forward fails on these inputs (check that the same "
                         f"call runs eagerly): {_op_error(e)}") from e
    except ConstraintViolationError as e:
        # The forward fixed a dim marked dynamic (``x + table`` with a table of one size).
        said = next((line.strip(" -") for line in str(e).splitlines()
                     if "specialized" in line), one_line(e))
        raise UsageError(f"the model's forward fixes the size of a dim given as dynamic "
                         f"({said.split(' If you')[0]}): it ties that dim to a size that "
                         "does not vary: another argument's dim of that size left out of "
                         "dynamic_dims (give that argument's dim there too, one per "
                         "argument), or a weight or constant of that size (then leave the "
                         "dim out: give in dynamic_dims only dims the forward lets vary)") from e
    except AssertionError as e:
        if not compat.is_rebuilt_object_guard(e):
            raise
        raise UsageError(
            f"torch {torch.__version__}'s Dynamo cannot export the guards of this forward: "
            "it reads an object it builds afresh at each read (transformers' cache does "
            "with use_cache=True); pass use_cache=False, or compile with torch.compile("
            "model, backend=cachebuild.backend(...))") from e
    finally:
        torch._dynamo.reset()
        if not marked:  # the caller's model as it was
            vars(model).pop("_is_torch_compile", None)

    if "gm" not in captured:  # Dynamo hands a backend no graph that computes nothing
        raise UsageError(
            "the model's forward computes no tensor (it returns None, or values made "
            "without a tensor op): there is nothing to compile; return what the forward "
            "computes, or call the model itself")
    if captured["mutated"]:
        raise UsageError(
            f"the model's forward changes {', '.join(captured['mutated'][:3])}, which existed "
            "before the call; cachebuild replays no side effects: keep such state out of "
            "forward, or use torch.compile(model, backend=cachebuild.backend(...))")
    gm: fx.GraphModule = captured["gm"]
    methods = _tensor_methods(gm.graph)
    _refuse_replaced_methods(methods)
    inputs = captured["inputs"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta.get("example_value", v) for n, v in zip(placeholders, inputs, strict=True)]
    metas = [meta_of(f) for f in fakes]
    # The call's GPU by type only: ranks on other GPUs trace the same graph (same keys).
    unpin_device(gm, device_of([*metas, *model.parameters()]))
    num_outputs = len(next(iter(n for n in gm.graph.nodes if n.op == "output")).args[0])
    bindings = _bind(model, args, inputs, dynamic_dims)

    shape_env = getattr(captured["fake_mode"], "shape_env", None)
    if shape_env is not None and dynamic_dims:
        traced_at = args[min(dynamic_dims)].shape[dynamic_dims[min(dynamic_dims)]]
        check_shape_guards([g.expr for g in shape_env.guards],
                           _dynamic_symbols(fakes, bindings, dynamic_dims, shape_env), compile_ranges,
                           traced_at)
    out_spec = output_recipe(output, list(captured.get("outputs", ())), inputs, args)
    if shape_env is not None and dynamic_dims:
        check_size_one(model, gm, out_spec, bindings, inputs, fakes, args, dynamic_dims,
                       compile_ranges, traced_at)

    bound = {id(v) for v, b in zip(inputs, bindings, strict=True) if b.kind != "const"}
    guards: list[GuardRecord] = []
    generated_from: list[str] = []
    if captured["mutated"] is None:
        unrecordable = "this torch does not show Dynamo's side effects, so none can be ruled out"
    else:
        unrecordable = None
        try:
            guards = records_from(collected, model, args, bound, dynamic_dims)
            guards += environment_records(guards, captured["code"], model, args)
            guards += method_records(captured["code"], model)
            guards += shadow_records(guards, model, args)
            guards += grad_mode_records(captured["code"], captured["modes"])
            guards.append(arity_record(args))
            guards += requires_grad_records(
                captured["code"], [(b.kind, b.arg if b.kind == "arg" else b.path)
                                   for b in bindings if b.kind in ("param", "buffer", "arg")],
                model, args)
            unrecordable, generated_from = _unkeyed_code(model, captured["code"])
        except Unrecordable as e:
            unrecordable = str(e)
    if unrecordable is None:
        # A caller in another autograd mode than the trace's (which runs without grad) is
        # told apart at each call; it does not make the entry unrecordable.
        wrong = [m for m in GuardSet.of(guards).mismatches(model, args)
                 if not is_grad_mode(m)]
        if wrong:
            unrecordable = f"{wrong[0].describe()} right after tracing"
    # The files that registered the ops the graph calls: a build may inline their kernels,
    # so an edit of one makes the entry stale (and its targets other ones).
    op_defs = [f for files in user_op_files(gm.graph).values() for f in files]
    if unrecordable is None:  # read at each call, as the forward's own reads are
        guards += kernel_records(gm.graph, guards) + tensor_method_records(methods)
    files, stamps = _traced_files(captured["code"], [*generated_from, *op_defs])
    return TracedGraph(
        gm=gm,
        bindings=bindings,
        input_metas=metas,
        source_files=files,
        source_stamps=stamps,
        source_libraries=library_paths(files),
        out_spec=out_spec,
        output_metas=output_metas(gm),
        num_outputs=num_outputs,
        fake_inputs=fakes,
        guards=guards,
        unrecordable=unrecordable,
    )


def _check_takes(model: torch.nn.Module, args: Sequence[Any]) -> None:
    """UsageError where ``model``'s forward cannot be called with ``args`` as its
    positional arguments (too many, too few), before Dynamo raises it as a bare TypeError.
    Only where the call reaches ``forward`` as given: not through a pre-hook (which may
    change the arguments), another ``__call__``, or a wrapper (``functools.wraps``)."""
    if type(model).__call__ is not torch.nn.Module.__call__ or model._forward_pre_hooks \
            or torch.nn.modules.module._global_forward_pre_hooks:
        return
    try:
        signature = inspect.signature(model.forward, follow_wrapped=False)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will say
        return
    try:
        signature.bind(*args)
    except TypeError as e:
        raise UsageError(f"the model's forward cannot take these {len(args)} inputs as its "
                         f"positional arguments ({e}): give the inputs of one forward "
                         "call, in its order") from None


def _copy_as_is(t: torch.Tensor, dynamic: bool) -> torch.Tensor:
    """A copy of ``t`` with its strides (a column slice of a larger cache, an expanded
    view), its requires_grad too: traced as the caller passes it, so that calls with the
    same layout are served (``clone`` of a view with gaps would be contiguous). One with a
    dynamic dim (``dynamic``) is cloned: Dynamo would give a view's other strides symbols
    of their own, which no build reads from the call."""
    if dynamic or t.is_contiguous() or t.layout != torch.strided:
        copy = t.detach().clone()
    else:
        copy = copy_with_strides(t.detach())
    return copy.requires_grad_(t.requires_grad)


def _tensor_methods(graph: fx.Graph) -> dict[str, Any]:
    """The torch.Tensor methods ``graph`` calls by name (its ``call_method`` nodes), each
    as this process resolves it: a graph names them, and wherever it is built or run they
    are looked up again."""
    names = {n.target for n in graph.nodes if n.op == "call_method" and isinstance(n.target, str)}
    return {name: getattr(torch.Tensor, name, None) for name in sorted(names)}


#: What torch's C tensor type holds under a method's name: its own methods (descriptors).
_C_METHODS = (types.MethodDescriptorType, types.WrapperDescriptorType,
              types.BuiltinFunctionType, types.GetSetDescriptorType,
              types.MemberDescriptorType)


def _replaced(name: str) -> bool:
    """Whether ``torch.Tensor.<name>`` is not torch's own method of that name (a library
    or the model's file set it: ``torch.Tensor.relu = ...``, a lambda, another method of
    torch's, a function of ``torch.nn.functional``). Torch's own is the C tensor type's
    method where torch.Tensor does not set the name (that type cannot be given
    attributes), else what ``torch/_tensor.py`` sets: a function of torch's of that name,
    or a C method of that name (a few operators there are other methods' aliases:
    ``__abs__`` is ``abs``)."""
    own = vars(torch.Tensor).get(name)
    if own is None:
        return False
    f = own.__func__ if isinstance(own, classmethod | staticmethod) else own
    named = getattr(f, "__name__", None) == name or name.startswith("__")
    if isinstance(f, types.FunctionType):
        return not (named and f.__code__.co_filename.startswith(torch_dir()))
    return not (named and isinstance(f, _C_METHODS))


def _refuse_replaced_methods(methods: dict[str, Any]) -> None:
    """UsageError where the graph calls a torch.Tensor method (of ``methods``:
    ``_tensor_methods``) replaced in this process: the graph names the method, so builds
    in other processes (and stored targets, keyed by the graph) would run torch's own one
    where eager runs the replacement."""
    replaced = [name for name in methods if _replaced(name)]
    if replaced:
        method = methods[replaced[0]]
        where = getattr(method, "__module__", None)
        raise UsageError(
            f"torch.Tensor.{replaced[0]} is replaced in this process (by "
            f"{getattr(method, '__qualname__', method)!s}{f' from {where}' if where else ''})"
            ", and the traced "
            "graph calls it by name: builds, and later processes, would run torch's own. "
            "Call the replacement as a function in forward instead of patching "
            "torch.Tensor, or run the model eagerly")


def tensor_method_records(methods: dict[str, Any]) -> list[GuardRecord]:
    """Records of which function each torch.Tensor method a graph calls by name is
    (``methods``: ``_tensor_methods``): a process where one is replaced (an activation
    patched by a library imported there) is another forward, not this one."""
    root = tuple(module_root("torch"))
    return [GuardRecord((root, ("attr", "Tensor"), ("attr", name)), "id", None,
                        fingerprint("id", method, None))
            for name, method in methods.items()]


def kernel_records(graph: fx.Graph, guards: list[GuardRecord]) -> list[GuardRecord]:
    """Records of what the inlined kernels of ``graph``'s user operators read besides
    their code (``facts.user_op_reads``), which a build bakes in: each environment
    variable, and each module constant as it is now (a call after it changed, or a
    process where it is another, is a mismatch, as for the forward's own reads)."""
    from cachebuild.tracing.guard_export import env_record

    env, values = user_op_reads(graph)
    read = {r.path[0][1] for r in guards if r.path and r.path[0][0] == "env"}
    records = [env_record(name) for name in env if name not in read]
    for module_name, name in values:
        if module_name in sys.modules:
            value = getattr(sys.modules[module_name], name, None)
            records.append(GuardRecord((tuple(module_root(module_name)), ("attr", name)),
                                       "equals", None, fingerprint("equals", value, None)))
    return records


def _unkeyed_code(model: torch.nn.Module, code_objects: list[Any]) -> tuple[str | None, list[str]]:
    """Why the entry cannot cover all traced code (None if it can), and the files that
    cover generated code.

    Code from files is checked by its file's hash. Code with no file is covered where it
    belongs to a class of the model's modules (whose code is hashed into the key), or
    where a class with a source file generated it (a dataclass ``__init__``): that class's
    file is then checked too. Frozen standard-library code comes with the Python version.
    """
    sourceless = [c for c in code_objects
                  if not has_source(c) and not c.co_filename.startswith("<frozen ")]
    if not sourceless:
        return None, []
    known = {id(c) for cls in sourceless_classes(model) for c in code_objects_of(cls)}
    sourceless = [c for c in sourceless if id(c) not in known]
    if not sourceless:
        return None, []
    files = []
    owners = _defining_classes(sourceless)
    for code in sourceless:
        cls = owners.get(id(code))
        path = _source_file(cls) if cls is not None else None
        if path is None:
            name = getattr(code, "co_qualname", code.co_name)
            return (f"traced code {name} ({code.co_filename}) has no source file and belongs "
                    "to no class of the model"), []
        files.append(path)
    return None, files


def _defining_classes(codes: list[Any]) -> dict[int, type]:
    """For code objects of methods, the class that holds the function (one scan of the
    heap for all of them: a function is the only thing that refers to its code)."""
    import gc

    wanted = {id(c) for c in codes}
    found: dict[int, type] = {}
    for fn in gc.get_referrers(*codes):
        code = getattr(fn, "__code__", None)
        if code is None or id(code) not in wanted:
            continue
        owner: Any = sys.modules.get(getattr(fn, "__module__", None) or "")
        for part in fn.__qualname__.split(".")[:-1]:
            owner = getattr(owner, part, None)
        if not isinstance(owner, type) and fn.__qualname__.endswith(".__new__"):
            from cachebuild.tracing.guard_export import class_made_with

            owner = class_made_with(lambda new, fn=fn: new is fn)
        if isinstance(owner, type):
            found[id(code)] = owner
    return found


def _source_file(cls: type) -> str | None:
    try:
        path = inspect.getsourcefile(cls)
    except (OSError, TypeError):
        return None
    return os.path.abspath(path) if path and os.path.isfile(path) else None
