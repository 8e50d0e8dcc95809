"""The backend protocol and what a build request carries.

A backend has a ``name``, ``factors(config)`` and ``toolchain(config, device, probe_dir)``
(what enters every target key besides the graph), ``compile(request) -> Artifact``,
``load(kind, key, source, device) -> callable`` and ``load_needs(kind)`` (what loading an
artifact of its kind takes: the caller never reads a backend's kinds itself). The
callable takes the piece's inputs positionally and returns a sequence of tensors. A
backend whose artifact cannot run on ``device``'s index raises ``DeviceBound`` from
``load`` (the builder then makes a copy for that index). A backend declares ``Backend``
(subclasses it), which gives it the default ``load_needs``: nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from cachebuild.graph.facts import InputMeta, holds_at

if TYPE_CHECKING:
    from pathlib import Path

    import torch.fx as fx

    from cachebuild.config import CompileConfig
    from cachebuild.passes import PassManager
    from cachebuild.store.interface import ArtifactSource


@dataclass
class Artifact:
    """A compiled piece: ``kind`` says how ``payload`` loads (``aoti-cuda``, ``standalone``...).

    ``fallback``: why the piece was built in another flavour than the one asked for
    (logged and counted by the builder), or None.
    """

    kind: str
    payload: bytes
    fallback: str | None = None


@dataclass(frozen=True)
class LoadNeeds:
    """What loading an artifact takes besides its bytes."""

    #: Loading initialises Inductor in this process (seconds, once): a warm start imports
    #: it early (``cachebuild.preload``) and loads such artifacts on threads.
    inductor: bool = False


class DeviceBound(Exception):
    """An artifact whose code names the GPU it was built on (``built_for``, e.g.
    ``cuda:0``) asked to load on another one: it cannot run there as it is."""

    def __init__(self, key: str, built_for: str, wanted: str) -> None:
        super().__init__(f"artifact {key} was built for {built_for} and cannot run on {wanted}")
        self.built_for = built_for


@dataclass
class BuildRequest:
    """Everything a backend needs to compile one target."""

    gm: fx.GraphModule
    input_metas: list[InputMeta]
    bucket: dict[str, Any]
    config: CompileConfig
    key: str
    passes: PassManager
    toolchain: dict[str, Any] = field(default_factory=dict)  # Backend.toolchain's answer


class Backend(Protocol):
    """``factors``: what enters the entry key and every target key (cheap, no probing).
    ``toolchain``: what else enters target keys on ``device`` (may probe once per
    environment, keeping its verdict in ``probe_dir``). ``load`` returns a callable on
    ``device`` from what ``source`` holds under ``key`` (a store, or the scratch store of
    an artifact being proven), or None if it no longer holds it; a plain callable, not an
    ``nn.Module`` (whose ``__call__`` would run torch's global module hooks on a piece).
    ``load_needs``: what loading an artifact of ``kind`` takes. ``start_toolchain``:
    begin finding ``toolchain``'s answer in the background (called before a trace, so
    that a probe overlaps it). ``toolchain`` may answer before that is done with what it presumes;
    ``confirm_toolchain`` then waits for the answer and raises ToolchainRefuted if it
    differs (to every caller, until ``forget_refuted``, called before planning again):
    called before anything built with it is built in or loaded into this process.
    ``toolchain_proven``: a worker process built an artifact of ``kind`` with
    ``toolchain`` for ``device`` and proved it (loaded, run, matched its piece), which
    may answer what ``start_toolchain`` began finding.
    ``generates_code``: its ``compile`` runs compilers that write files (Inductor's,
    Triton's, the C++ compiler's), which a build points at the store's work folder; a
    backend that only rewrites graphs says False, and its builds touch nothing of the
    process (its environment included)."""

    name: str
    generates_code: bool = True

    def factors(self, config: CompileConfig) -> dict[str, Any]: ...

    def toolchain(self, config: CompileConfig, device: str,
                  probe_dir: Path | None) -> dict[str, Any]: ...

    def start_toolchain(self, config: CompileConfig, device: str) -> None:
        return None

    def confirm_toolchain(self, device: str) -> None:
        return None

    def forget_refuted(self, device: str) -> None:
        return None

    def toolchain_proven(self, device: str, toolchain: dict[str, Any], kind: str) -> None:
        return None

    def compile(self, request: BuildRequest) -> Artifact: ...

    def load(self, kind: str, key: str, source: ArtifactSource, device: str) -> Any: ...

    def load_needs(self, kind: str) -> LoadNeeds:
        return LoadNeeds()


def bucket_bounds(bucket: dict[str, Any]) -> tuple[int, int] | None:
    """(lo, hi) of a range bucket with more than one size, else None (static)."""
    if "range" in bucket:
        lo, hi = bucket["range"]
        if lo < hi:
            return lo, hi
    return None


def size_hint(bucket: dict[str, Any]) -> int | None:
    """The size example inputs get for a bucket: the exact size, or a size in the range
    that torch does not specialise (never 0 or 1)."""
    if "size" in bucket:
        return bucket["size"]
    if "range" in bucket:
        lo, hi = bucket["range"]
        return lo if lo == hi else max(2, min(hi, max(lo, 16)))
    return None


def _eval_dim(dim: int | str, size: int | None, known: dict[str, int] | None = None) -> int:
    """``dim`` (an int, or a symbolic expression of the token count) at ``size``; symbols
    in ``known`` take their values from it."""
    if isinstance(dim, int):
        return dim
    import sympy

    expr = sympy.sympify(dim)
    values = {s: (known or {}).get(str(s), size) for s in expr.free_symbols}
    if any(v is None for v in values.values()):
        raise ValueError(f"{dim} has no value in a bucket of static shapes")
    return int(expr.subs(values))


def _static_symbols(metas: list[InputMeta]) -> dict[str, int]:
    """Values for the symbols a bucket of static shapes leaves in strides (a view of a
    wider input, at sizes Dynamo saw once): each the stride a dense layout has there, so
    that the inputs and the sizes the piece takes agree. The piece is built for any."""
    known: dict[str, int] = {}
    for m in metas:
        if m.kind == "tensor" and all(isinstance(d, int) for d in m.shape):
            dense = torch.empty([int(d) for d in m.shape], device="meta").stride()
            for st, value in zip(m.stride, dense, strict=True):
                if isinstance(st, str) and st.isidentifier():
                    known.setdefault(st, value)
    return known


def example_inputs(metas: list[InputMeta], bucket: dict[str, Any],
                   size: int | None = None, distinct: Collection[int] = ()) -> list[Any]:
    """Real random inputs matching ``metas`` with the dynamic dim at ``size`` (default: the
    bucket's hint). Integer tensors hold 0s and 1s (valid indices into any dim), or, for
    the inputs whose positions are in ``distinct``, a shuffle of 0..n-1 (indices that never
    repeat: a write through them is the same whatever order it runs in)."""
    size = size_hint(bucket) if size is None else size
    known = _static_symbols(metas) if size is None else {}
    out: list[Any] = []
    for position, m in enumerate(metas):
        if m.kind != "tensor":
            out.append(_eval_dim(m.shape[0], size, known))
            continue
        shape = [_eval_dim(d, size, known) for d in m.shape]
        stride = [_eval_dim(st, size, known) for st in m.stride]
        dtype = getattr(torch, m.dtype)
        # The values fill the memory the layout spans, then the layout views it: a layout
        # whose elements share memory (an expanded input, stride 0) cannot be written
        # element by element.
        span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) \
            if all(shape) else 0
        if dtype.is_floating_point:
            memory = torch.randn(span, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            memory = torch.zeros(span, dtype=torch.bool)
        elif position in distinct:
            memory = torch.randperm(max(span, 1))[:span].to(dtype)
        else:
            memory = torch.randint(0, 2, (span,), dtype=dtype)
        out.append(memory.to(m.device).as_strided(shape, stride))
    return out


def dynamic_dims_of(metas: list[InputMeta]) -> list[dict[int, str]]:
    """Per input, the dims whose size is a plain symbol (dim → symbol)."""
    return [
        {d: s for d, s in enumerate(m.shape) if isinstance(s, str) and s.isidentifier()}
        if m.kind == "tensor" else {}
        for m in metas
    ]


def symbolic_fake_inputs(metas: list[InputMeta], bucket: dict[str, Any]) -> tuple[Any, list[Any]]:
    """Fake inputs whose dynamic dims are symbols (static for an exact-size bucket).

    Returns ``(fake_mode, inputs)``; dims that share a symbol in ``metas`` share one here.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    real = example_inputs(metas, bucket)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = bucket_bounds(bucket) is not None
    out: list[Any] = []
    for m, r, dyn in zip(metas, real, dynamic_dims_of(metas), strict=True):
        if m.kind != "tensor":
            out.append(r)
            continue
        sizes = [DimDynamic.DYNAMIC if (dynamic and d in dyn) else DimDynamic.STATIC
                 for d in range(r.dim())]
        ctx = StatelessSymbolicContext(dynamic_sizes=sizes)
        out.append(fake_mode.from_tensor(r, symbolic_context=ctx))
    return fake_mode, out


def range_symbols(fake_args: list[Any], metas: list[InputMeta]) -> set[Any]:
    """The symbols standing for a range's dynamic dim in symbolic fake inputs."""
    found: set[Any] = set()
    for fake, dyn in zip(fake_args, dynamic_dims_of(metas), strict=True):
        for d in dyn:
            size = fake.shape[d]
            if isinstance(size, torch.SymInt):
                found |= size.node.expr.free_symbols
    return found


def check_kept_symbolic(shape_env: Any, symbols: set[Any], bucket: dict[str, Any]) -> None:
    """Raise ValueError if tracing a range target specialised its size.

    A guard that pins a range's symbol (``Eq(s0, 16)``), or any guard that fails at the
    range's ends, means the traced graph holds at the size hint only.
    """
    bounds = bucket_bounds(bucket)
    if bounds is None or not symbols:
        return
    # Symbols Dynamo found equal to a range symbol stand for the same size.
    symbols = set(symbols) | {s for s, r in shape_env.replacements.items()
                              if r.free_symbols & symbols}
    for symbol in symbols:
        fixed = shape_env.replacements.get(symbol)
        if fixed is not None and not (fixed.free_symbols & symbols):
            raise ValueError(f"the trace specialised the range's size to {fixed} "
                             f"(range {bounds[0]}-{bounds[1]})")
    for guard in shape_env.guards:
        expr = guard.expr
        if not expr.free_symbols & symbols:
            continue
        for size in bounds:
            if not holds_at(expr, symbols, size):
                other = [b for b in bounds if b != size]
                cut = (f"compile_ranges=(({size}, {size}), ({size + 1}, {other[0]}))"
                       if size == bounds[0] and other else
                       f"compile_ranges=(({other[0]}, {size - 1}), ({size}, {size}))"
                       if other else "another range")
                raise ValueError(f"the trace specialised the range's size: guard {expr} "
                                 f"fails at size {size} of range {bounds[0]}-{bounds[1]} "
                                 f"(the forward branches on the token count there): give "
                                 f"that size a range of its own, e.g. {cut}")
