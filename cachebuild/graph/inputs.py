"""What compiled code assumes about the tensors it reads, checked before it reads them.

A compiled piece reads its inputs by pointer, with the sizes and strides it was traced
with: an AOTI library does not look at a tensor's metadata at all. So before native code
runs:

- ``CallCheck`` checks a model call's tensors against the traced call: device, dtype,
  number of dims, every size (static sizes, and every dim that carries the dynamic symbol
  must have the one dynamic size) and layout (contiguous where the trace was). A call that
  does not fit raises ``UsageError``: never a crash, never a wrong answer.
- ``LayoutGuard`` makes the tensors that reach a compiled piece from inside the model (an
  eager splitting op's output, another piece's output) have the strides the piece was
  compiled for, copying the ones that do not; each copy is counted (``layout_copies``).

Sizes and strides in the metadata are ints, or strings of symbolic expressions over the
trace's size symbols (``"s0"``, ``"64*s0"``); ``eval_dim`` evaluates them with plain Python
(no sympy: a warm start does not import it).
"""

from __future__ import annotations

import ast
import bisect
import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol

import torch

from cachebuild.counters import COUNTERS
from cachebuild.errors import UsageError
from cachebuild.graph.facts import SYMBOL, InputMeta

_FUNCTIONS: dict[str, Callable[..., int]] = {
    "Max": max, "Min": min, "FloorDiv": lambda a, b: a // b,
    "CeilDiv": lambda a, b: -(-a // b), "Mod": lambda a, b: a % b,
    "PythonMod": lambda a, b: a % b,
}
_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Call,
          ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub)


#: The tensor types a compiled forward takes as call arguments. A subclass runs its own
#: code around each op (``__torch_function__``), and eager returns it, where compiled code
#: traced and built for plain tensors would run plain ops and return a plain tensor.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def refuse_subclass(i: int, a: torch.Tensor) -> None:
    """UsageError where argument ``i`` is a tensor of a subclass (see ``PLAIN_TENSORS``)."""
    if type(a) not in PLAIN_TENSORS:
        kind = type(a)
        raise UsageError(f"argument {i} is a {kind.__module__}.{kind.__qualname__}, a "
                         "subclass of torch.Tensor: a compiled forward takes plain tensors "
                         "(eager runs the subclass's own code around each op, which compiled "
                         "code would skip); pass a plain tensor (x.as_subclass(torch.Tensor))"
                         " or run the model itself for such inputs")


@functools.cache
def _compiled(expr: str) -> Any:
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            raise ValueError(f"unsupported size expression {expr!r}")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name)
                                               and node.func.id in _FUNCTIONS):
            raise ValueError(f"unsupported function in size expression {expr!r}")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            raise ValueError(f"non-integer constant in size expression {expr!r}")
    return compile(tree, "<size>", "eval")


def symbols_in(meta: InputMeta) -> list[str]:
    """The size symbols ``meta``'s shape names (``s0``, ``u1``), each once, in order."""
    found: list[str] = []
    for dim in meta.shape:
        if isinstance(dim, str):
            found += [s for s in SYMBOL.findall(dim) if s not in found]
    return found


def token_symbols(metas: Iterable[InputMeta]) -> set[str]:
    """The symbols that are a whole dim of a tensor among ``metas``: the dynamic dims,
    every one of them the call's token count (Dynamo may give equal dims symbols of their
    own)."""
    return {d for m in metas if m.kind == "tensor" for d in m.shape
            if isinstance(d, str) and d.isidentifier()}


def eval_dim(dim: int | str, values: dict[str, int]) -> int:
    """The value of a size or stride ``dim`` given the symbols' ``values``."""
    if isinstance(dim, int):
        return dim
    return int(eval(_compiled(dim), {"__builtins__": {}, **_FUNCTIONS}, values))  # noqa: S307


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def same_layout(shape: Sequence[int], stride: Sequence[int], wanted: Sequence[int]) -> bool:
    """True if ``stride`` addresses a tensor of ``shape`` as ``wanted`` does (dims of
    size 1 never move the pointer, so their strides do not matter)."""
    return all(s == w or n == 1 for n, s, w in zip(shape, stride, wanted, strict=True))


def check_weight(what: str, tensor: torch.Tensor, meta: InputMeta,
                 device: torch.device) -> None:
    """Raise UsageError unless ``tensor`` (named ``what``: ``param layers.0.w``) is what
    the compiled pieces were built for: device, dtype, shape and layout (they read it by
    pointer)."""
    want_dtype = getattr(torch, meta.dtype) if meta.dtype else tensor.dtype
    problem = None
    if tensor.device != device:
        problem = f"is on {tensor.device}, not {device}"
    elif tensor.dtype != want_dtype:
        problem = f"is {tensor.dtype}, not {want_dtype}"
    elif tuple(tensor.shape) != tuple(meta.shape):
        problem = f"has shape {tuple(tensor.shape)}, not {tuple(meta.shape)}"
    elif not same_layout(tensor.shape, tensor.stride(), meta.stride):
        problem = f"has strides {tuple(tensor.stride())}, not {tuple(meta.stride)}"
    if problem is not None:
        raise UsageError(f"{what} {problem}, which the compiled model was built for; "
                         "compile the model again after changing it")


def _symbol_values(metas: Sequence[InputMeta], shapes: Sequence[Sequence[int] | None]) -> dict[str, int]:
    """Each size symbol's value, read off the dims whose traced size is that bare symbol."""
    values: dict[str, int] = {}
    for m, shape in zip(metas, shapes, strict=True):
        if shape is None:
            continue
        for dim, size in zip(m.shape, shape, strict=False):
            if isinstance(dim, str) and dim.isidentifier():
                values.setdefault(dim, size)
    return values


def _traced_contiguous(m: InputMeta) -> bool:
    """True if the traced strides are the contiguous ones for every value of the symbols;
    False where a stride is a symbol of its own (a view's, that no size gives)."""
    probe = {s: 7 for s in symbols_in(m)}  # any value: strides are polynomials in the sizes
    probe2 = {s: 11 for s in symbols_in(m)}
    for values in (probe, probe2):
        try:
            shape = [eval_dim(d, values) for d in m.shape]
            if tuple(eval_dim(s, values) for s in m.stride) != contiguous_strides(shape):
                return False
        except (NameError, ValueError):
            return False
    return True


def _evaluated(dims: Sequence[int | str], values: dict[str, int]) -> tuple[int, ...]:
    """``dims`` (sizes or strides) at the symbols' ``values``; empty (unchecked) where one
    names a symbol no dynamic dim gives (a stride Dynamo made a symbol of its own: the
    compiled code reads it from the tensor)."""
    try:
        return tuple(eval_dim(d, values) for d in dims)
    except (NameError, ValueError):
        return ()


class CallCheck:
    """Checks the tensor arguments of a model call against their traced metadata.

    ``args``: (argument position, InputMeta) for each tensor argument the graph reads;
    ``device``: where the model lives (calls must be there too); ``written``: positions of
    arguments the model writes in place, which must not share memory with another
    argument (compiled code reads each input as if it were alone). The common case costs a
    few attribute reads and one tuple comparison per argument.
    """

    def __init__(self, args: Sequence[tuple[int, InputMeta]], device: torch.device,
                 size_of: Callable[[tuple[Any, ...]], int | None],
                 written: Sequence[int] = (),
                 written_weights: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        self.args = list(args)
        self.written = list(written)
        #: The memory of the model's own tensors it writes in place (a cache buffer),
        #: sorted, with their names: no argument may share it. They never overlap each
        #: other (``check_unshared_weights``), so one bisection per argument finds the
        #: only one an argument could overlap.
        self.written_weights = sorted((*memory, name) for name, t in written_weights
                                      if (memory := _memory(t)) is not None)
        self._written_starts = [lo for lo, _, _ in self.written_weights]
        self.device = device
        self.size_of = size_of
        self.count = 1 + max((i for i, _ in self.args), default=-1)
        self._dtypes = {i: getattr(torch, m.dtype) for i, m in self.args}
        self._contiguous = {i: _traced_contiguous(m) for i, m in self.args}
        self._symbols = sorted(token_symbols(m for _, m in self.args))
        self._expected: dict[int | None, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    def expected(self, size: int | None) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per argument, the (shape, strides) a call of dynamic size ``size`` must have."""
        found = self._expected.get(size)
        if found is None:
            values = dict.fromkeys(self._symbols, size) if size is not None else {}
            found = {}
            for i, m in self.args:
                found[i] = (_evaluated(m.shape, values), _evaluated(m.stride, values))
            self._expected[size] = found
        return found

    def __call__(self, args: tuple[Any, ...]) -> int | None:
        """Raise UsageError if ``args`` do not fit; return the call's dynamic size."""
        if len(args) < self.count:
            raise UsageError(f"expected at least {self.count} arguments, got {len(args)}")
        for i, _ in self.args:
            a = args[i]
            if not isinstance(a, torch.Tensor):
                raise UsageError(f"argument {i} must be a tensor, got {type(a).__name__}")
            refuse_subclass(i, a)
            if a.device != self.device:
                self._wrong_device(i, a)
        size = self.size_of(args)
        expected = self.expected(size)
        for i, _ in self.args:
            a = args[i]
            shape, stride = expected[i]
            if a.dtype != self._dtypes[i] or (shape and a.shape != shape):
                self._wrong_shape(i, a, size)
            if self._contiguous[i]:
                if not a.is_contiguous():
                    self._wrong_layout(i, a, "contiguous")
            elif stride and not same_layout(a.shape, a.stride(), stride):
                self._wrong_layout(i, a, f"strides {stride}")
        if self.written or self.written_weights:
            self._check_unshared(args)
        return size

    def _check_unshared(self, args: tuple[Any, ...]) -> None:
        memory = {i: _extent(args[i]) for i, _ in self.args}
        for i in self.written:
            lo, hi = memory[i]
            for j, (start, end) in memory.items():
                if j != i and start < hi and lo < end:
                    raise UsageError(
                        f"argument {i}, which the compiled model writes in place, shares "
                        f"memory with argument {j}; pass tensors that do not overlap "
                        "(clone one of them)")
        for j, (start, end) in memory.items():
            k = bisect.bisect_left(self._written_starts, end) - 1
            if start < end and k >= 0 and self.written_weights[k][1] > start:
                raise UsageError(
                    f"argument {j} shares memory with {self.written_weights[k][2]}, which the "
                    "compiled model writes in place (compiled code reads each input as if it "
                    "were alone); pass a tensor that does not overlap it (a clone)")

    def _wrong_device(self, i: int, a: torch.Tensor) -> None:
        if a.device.type == "meta":
            raise UsageError(f"argument {i} is a meta tensor, which holds no data: the compiled "
                             f"model runs on {self.device}; pass a tensor there")
        raise UsageError(f"argument {i} is on {a.device}, but the compiled model runs on "
                         f"{self.device}; move it there first")

    def _wrong_shape(self, i: int, a: torch.Tensor, size: int | None) -> None:
        meta = dict(self.args)[i]
        dtype = str(a.dtype).removeprefix("torch.")
        if dtype != meta.dtype or a.dim() != len(meta.shape):
            raise UsageError(f"argument {i} is {dtype} with {a.dim()} dims; the compiled model "
                             f"takes {meta.dtype} with {len(meta.shape)} dims")
        shape, _ = self.expected(size)[i]
        for d, (have, want) in enumerate(zip(a.shape, shape, strict=True)):
            if have != want:
                traced = meta.shape[d]
                if isinstance(traced, int):
                    raise UsageError(f"argument {i} has size {have} in dim {d}, which was "
                                     f"compiled static at {want}")
                raise UsageError(
                    f"argument {i} has size {have} in dim {d}, but the call's dynamic size is "
                    f"{size}: every dynamic dim must have the same size (traced as {traced})")

    def _wrong_layout(self, i: int, a: torch.Tensor, want: str) -> None:
        what = ("contiguous" if a.is_contiguous() else
                "another memory format: channels_last?" if _dense(a) and a.dim() == 4 else
                "another order of dims: a transposed or permuted tensor?" if _dense(a) else
                "an expanded or sliced view?")
        dynamic = any(not isinstance(d, int) for d in dict(self.args)[i].shape)
        if i in self.written and dynamic:  # traced contiguous whatever the first call gave
            raise UsageError(f"argument {i} has strides {tuple(a.stride())} ({what}), but an "
                             "argument with a dynamic dim is compiled contiguous, and the model "
                             "writes this one in place: pass a contiguous tensor that is itself "
                             "the one to write (a cache allocated as a tensor of its own, not a "
                             "view of a larger one)")
        if i in self.written:  # a copy would take the writes, not the caller's tensor
            raise UsageError(f"argument {i} has strides {tuple(a.stride())} ({what}), but the "
                             f"compiled model was traced with {want} and writes it in place: "
                             "pass it with the layout of the first call's (a contiguous copy "
                             "would take the writes instead of it)")
        if want == "contiguous":
            raise UsageError(f"argument {i} has strides {tuple(a.stride())} ({what}), but the "
                             f"compiled model reads it as contiguous; pass `.contiguous()` "
                             "of it")
        raise UsageError(f"argument {i} has strides {tuple(a.stride())} ({what}), but the "
                         f"compiled model was traced with the first call's {want}: pass it "
                         "with those strides, or compile again for this layout (a new "
                         "cachebuild.compile whose first call passes it so)")


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlap, in any order of
    dims (a permuted or channels_last tensor is; a slice or an expanded view is not)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True)
                               if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_unshared_weights(weights: Sequence[tuple[str, torch.Tensor]],
                           written: Collection[str]) -> None:
    """Raise UsageError where one of the model's tensors that it writes in place (named in
    ``written``) shares memory with another of its tensors (a buffer that is a view of
    it): compiled code reads each input as if it were alone, so the other would be read
    as it was before the write."""
    extents = [(name, memory) for name, t in weights if (memory := _memory(t)) is not None]
    for name, (lo, hi) in extents:
        if name not in written:
            continue
        for other, (start, end) in extents:
            if other != name and start < hi and lo < end:
                raise UsageError(
                    f"{other} shares memory with {name}, which the model writes in place: "
                    "compiled code reads each input as if it were alone, so it would read "
                    f"{other} as it was before the write; register {other} as a tensor of "
                    "its own (a clone), or compute it from the other in forward")


def _memory(t: Any) -> tuple[int, int] | None:
    """``_extent`` of a tensor that owns memory here; None for anything else (no data, a
    wrapper subclass whose pointer is 0, a tensor that refuses to give one)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        lo, hi = _extent(t)
    except RuntimeError:
        return None
    return (lo, hi) if lo and hi > lo else None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` can touch: [first, last + 1) (two views of one allocation that do
    not overlap there, a key and a value cache side by side, are separate)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()  # strides are never negative in torch
    return (start, start + elements_spanned(t) * t.element_size())


def elements_spanned(t: torch.Tensor) -> int:
    """How many elements of its storage a non-empty ``t`` spans, from its first to its
    last (gaps between them included: a column slice spans the rows' full width)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def copy_with_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides, whatever they are (``clone()`` gives a tensor
    that is not dense, a slice of a wider one or an expanded one, dense strides): the
    memory it spans from its first element, copied, then viewed as ``t`` is."""
    if t.numel() == 0:
        return t.clone()
    return t.as_strided((elements_spanned(t),), (1,)).clone().as_strided(t.shape, t.stride())


class LayoutGuard:
    """Gives the inputs of one compiled piece that come from inside the model the strides
    the piece was compiled for (``metas[i]`` for each ``i`` in ``checked``)."""

    def __init__(self, metas: Sequence[InputMeta], checked: Sequence[int]) -> None:
        self.metas = list(metas)
        self.checked = [i for i in checked if metas[i].kind == "tensor"]
        # The inputs whose sizes give the symbols' values: they key the strides' cache.
        self.symbolic = [i for i, m in enumerate(metas) if m.kind == "tensor" and symbols_in(m)]
        self._wanted: dict[tuple[Any, ...], list[tuple[int, ...] | None]] = {}

    def _strides(self, args: Sequence[Any]) -> list[tuple[int, ...] | None]:
        sizes = tuple(args[i].shape for i in self.symbolic)
        found = self._wanted.get(sizes)
        if found is None:
            shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args]
            values = _symbol_values(self.metas, shapes)
            found = []
            for i in self.checked:
                try:
                    found.append(tuple(eval_dim(s, values) for s in self.metas[i].stride))
                except (NameError, ValueError):
                    found.append(None)
            self._wanted[sizes] = found
        return found

    def __call__(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.checked:
            return args
        wanted = self._strides(args)
        out: list[Any] | None = None
        for i, stride in zip(self.checked, wanted, strict=True):
            a = args[i]
            if stride is None or a.stride() == stride or same_layout(a.shape, a.stride(), stride):
                continue
            fixed = torch.empty_strided(a.shape, stride, dtype=a.dtype, device=a.device)
            fixed.copy_(a)
            COUNTERS.layout_copies += 1
            if out is None:
                out = list(args)
            out[i] = fixed
        return args if out is None else tuple(out)


class PieceInputs(Protocol):
    """What ``layout_guards`` reads of a piece (``entry.PieceRecord`` has it)."""

    name: str
    compiled: bool
    input_metas: list[InputMeta]
    inner: list[int]


def layout_guards(pieces: Iterable[PieceInputs]) -> dict[str, LayoutGuard]:
    """A ``LayoutGuard`` for each compiled piece, by name: the inputs it reads that are
    made inside the model (``inner``) given the strides it was compiled for."""
    return {p.name: LayoutGuard(p.input_metas, p.inner) for p in pieces if p.compiled}
