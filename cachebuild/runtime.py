"""The stitched forward: compiled pieces dispatched by size, splitting ops run eagerly.

Built from an Entry alone (no Dynamo): the stitching graph becomes a GraphModule whose
submodules are ``PieceRunner``s (compiled pieces) or small eager graphs (splitting ops).
A PieceRunner picks its target by the runtime size of the dynamic dim: an exact compile
size first, else the range that holds it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild import compat, keep, weights
from cachebuild.capture import CallShape, Capturer, CaptureState, PieceSpec
from cachebuild.config import CompileConfig
from cachebuild.cudagraphs import capture_for, next_capture_size, pad_args, unpad_outputs
from cachebuild.entry import Entry
from cachebuild.errors import UsageError
from cachebuild.facts import InputMeta, device_of, on_device
from cachebuild.fxjson import GraphFormatError, data_to_module
from cachebuild.inputs import CallCheck, LayoutGuard, same_layout
from cachebuild.keys import canonical_json
from cachebuild.outputs import output_builder
from cachebuild.targets import canonical_graph
from cachebuild.trace import Binding


def _size_reader(size_input: tuple[int, int] | None) -> Callable[[tuple[Any, ...]], int | None]:
    """Reads a call's dynamic size from input ``i``'s dim ``d`` (None: no dynamic size)."""
    if size_input is None:
        return lambda args: None
    i, d = size_input
    return lambda args: args[i].shape[d]


class PieceRunner:
    """One compiled piece over all its buckets.

    ``layout`` gives the inputs that come from inside the model the strides the piece was
    compiled for before it reads them (``inputs.LayoutGuard``); an input in ``written``
    (written in place by the piece) that had to be copied for that is copied back after.
    """

    def __init__(self, name: str, size_input: tuple[int, int] | None, single_output: bool,
                 table: list[tuple[dict[str, Any], Callable[..., Any]]],
                 layout: LayoutGuard | None = None, written: Sequence[int] = ()) -> None:
        self.name = name
        self.written = list(written)
        self.size_of = _size_reader(size_input)
        self.single_output = single_output
        self.layout = layout if layout is not None and layout.checked else None
        self.exact = {b["size"]: fn for b, fn in table if "size" in b}
        self.ranges = [(b["range"][0], b["range"][1], fn) for b, fn in table if "range" in b]
        self.static = next((fn for b, fn in table if "static" in b), None)

    def select(self, size: int | None) -> Callable[..., Any]:
        if size is None:
            assert self.static is not None
            return self.static
        fn = self.exact.get(size)
        if fn is not None:
            return fn
        for lo, hi, fn in self.ranges:
            if lo <= size <= hi:
                return fn
        raise UsageError(f"size {size} lies outside every compile range of {self.name}")

    def __call__(self, *args: Any) -> Any:
        given = args
        if self.layout is not None:
            args = self.layout(args)
        out = self.select(self.size_of(args))(*args)
        if args is not given:
            for i in self.written:
                if args[i] is not given[i]:
                    given[i].copy_(args[i])
        return out[0] if self.single_output else tuple(out)


@dataclass
class Stitched:
    """The stitched forward of an entry: a GraphModule over the pieces, each piece's
    callable by name (a PieceRunner or an eager splitting-op graph's forward), and how a
    capture pass wraps the compiled ones."""

    gm: torch.fx.GraphModule
    calls: dict[str, Callable[..., Any]]
    compiled: dict[str, PieceSpec] = field(default_factory=dict)


def stitch(entry: Entry, loaded: dict[str, Any]) -> Stitched:
    """The stitched forward of ``entry`` over loaded targets; takes the graph's inputs."""
    calls: dict[str, Any] = {}
    compiled: dict[str, PieceSpec] = {}
    # Splitting-op pieces are small stateless graphs, most of them alike (one attention
    # call per layer): each distinct one becomes a module once, shared by its copies.
    eager: dict[str, torch.fx.GraphModule] = {}
    for piece in entry.pieces:
        if piece.compiled:
            table = [(t.bucket, loaded[t.key]) for t in piece.targets]
            layout = LayoutGuard(piece.input_metas, piece.inner)
            calls[piece.name] = PieceRunner(piece.name, piece.size_input, piece.single_output,
                                            table, layout, piece.written)
            compiled[piece.name] = PieceSpec(list(piece.weights),
                                             _flags(piece.written, len(piece.input_metas)))
        else:
            try:
                shape = canonical_json(canonical_graph(piece.nodes, [])["nodes"])
            except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
                data_to_module(piece.nodes)  # raises GraphFormatError saying what is wrong
                raise GraphFormatError(f"stored piece {piece.name} is not a graph") from None
            if shape not in eager:
                eager[shape] = data_to_module(piece.nodes)
            calls[piece.name] = eager[shape].forward
    return Stitched(data_to_module(entry.stitch, calls), calls, compiled)


class _Direct:
    """Stands for a stitched GraphModule as ``self`` in its generated forward, handing out
    the raw piece callables: a call then skips ``nn.Module.__call__`` twice per piece,
    microseconds that a piecewise replay pays on the CPU at every layer."""

    def __init__(self, gm: torch.fx.GraphModule, calls: dict[str, Callable[..., Any]]) -> None:
        self._gm = gm
        self.__dict__.update(calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gm, name)


def direct_forward(stitched: Stitched,
                   calls: dict[str, Callable[..., Any]] | None = None) -> Callable[..., Any]:
    """The stitched forward, calling each piece's callable (``calls``, default the
    stitched ones) directly."""
    return type(stitched.gm).forward.__get__(_Direct(stitched.gm, calls or stitched.calls))


def on_device_forward(forward: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``forward`` run with ``device`` current (``facts.on_device``), where it has an index:
    graphs name the model's GPU by type alone, so they run on whichever GPU is current."""
    if torch.device(device).index is None:
        return forward
    scope = on_device(device)

    def run(*args: Any) -> Any:
        with scope:
            return forward(*args)

    return run


@dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    pool_bytes: int  # device memory held by the captured graphs (0 where not measurable)
    graphs: int = 0  # device graphs captured
    #: where ``seconds`` went on a device with graphs: warm-up runs, stream capture, graph
    #: instantiation (the rest is the eager work between pieces and Python)
    split: dict[str, float] = field(default_factory=dict)


class ModelRuntime:
    """A stitched forward bound to a live model: ``runtime(*args)`` is ``model(*args)``.

    With a graph mode, sizes are captured as the config's ``capture`` policy says
    (``capture.py``); a call of a size without graphs runs the compiled pieces directly,
    exactly. The outputs of a call are then valid until the next call.
    """

    def __init__(self, entry: Entry, loaded: dict[str, Any], model: torch.nn.Module,
                 config: CompileConfig, dynamic_dims: dict[int, int]) -> None:
        self.entry = entry
        self.device = live_device(model, entry)
        self._on_device = on_device(self.device)
        mode = config.cudagraph_mode
        self.stitched = stitch(entry, loaded)
        n_args = 1 + max((b.arg for b in entry.bindings if b.kind in ("arg", "size")
                          and b.arg is not None), default=-1)
        #: call arguments the forward writes in place (a KV cache passed in): never copied
        self.written_args = sorted({entry.bindings[i].arg for i in entry.written_inputs
                                    if entry.bindings[i].kind == "arg"})
        if config.pad_to_capture_size and entry.written_inputs:
            raise UsageError(
                "pad_to_capture_size pads calls with rows of zeros, and this model writes in "
                "place: the padding rows would write too (into a cache, at index 0). Pad in "
                "the caller with rows that write nowhere, as examples/generate.py's Engine does")
        self.model = model
        self.config = config
        self.dynamic_dims = dict(dynamic_dims)
        self.bindings = list(entry.bindings)
        self.metas = list(entry.input_metas)
        self.make_output = output_builder(entry.out_spec)
        self._warned_eager = False
        self._first_call = True
        weights.watch(model, [b.path for b in self.bindings if b.kind in ("param", "buffer")])
        self.rebind()
        self._exact = self.forward_over(self.stitched.calls)
        compat.custom_ops_without_dynamo()  # splitting ops run eagerly at every call
        self.capturer: Capturer | None = None
        if mode != "none":
            shape = CallShape(n_args, frozenset(self.written_args),
                              frozenset(self.dynamic_dims))
            self.capturer = Capturer(
                capture_for(str(self.device)), self.device, config.capture,
                [s for s in config.capture_sizes if self.in_buckets(s)], shape,
                self._dynamic_size, self.forward_over, self.stitched.calls,
                self.stitched.compiled if mode == "piecewise" else {},
                not_beside=_not_beside(entry))

    def rebind(self) -> None:
        """Look up the model's parameters and buffers again (after they were replaced).

        Each is checked against what the compiled pieces were built for (device, dtype,
        shape, layout): they read it by pointer.
        """
        self._generation = weights.generation()
        self._template: list[Any] = []
        for b, m in zip(self.bindings, self.metas, strict=True):
            if b.kind in ("param", "buffer"):
                tensor = (self.model.get_parameter(b.path) if b.kind == "param"
                          else self.model.get_buffer(b.path))
                _check_weight(b, tensor, m, self.device)
                self._template.append(tensor)
            elif b.kind == "const":
                self._template.append(b.dim)
            else:
                self._template.append(None)
        self._from_call = [(i, b) for i, b in enumerate(self.bindings) if b.kind in ("arg", "size")]
        self._arg_metas = [(b, m) for b, m in zip(self.bindings, self.metas, strict=True)
                           if b.kind == "arg"]
        self.check = CallCheck([(b.arg, m) for b, m in self._arg_metas], self.device,
                               self._dynamic_size, self.written_args)

    def _check(self, args: tuple[Any, ...]) -> int | None:
        return self.check(args)

    def _dynamic_size(self, args: tuple[Any, ...]) -> int | None:
        if not self.dynamic_dims:
            return None
        i, d = min(self.dynamic_dims.items())
        return args[i].shape[d]

    def dummy_args(self, size: int, like: Sequence[Any] | None = None) -> tuple[Any, ...]:
        """Call arguments of dynamic size ``size`` (zeros), from the entry's input metadata.

        ``like``: a real call, whose arguments the forward writes in place and whose shape
        has no dynamic dim (its KV cache) are used as they are: graphs read those at the
        address they are captured with.
        """
        by_arg = {b.arg: m for b, m in self._arg_metas}
        n_args = 1 + max(by_arg, default=-1)
        if not self._args_from_metas():
            raise UsageError("some call arguments are not graph inputs; pass make_args= to capture()")
        args = []
        for i in range(n_args):
            m = by_arg[i]
            if like is not None and i in self.written_args and i not in self.dynamic_dims:
                args.append(like[i])
                continue
            shape = [size if isinstance(s, str) else s for s in m.shape]
            args.append(torch.zeros(shape, dtype=getattr(torch, m.dtype), device=self.device))
        return tuple(args)

    def _args_from_metas(self) -> bool:
        """Whether every call argument is a graph input (so a dummy call can be made)."""
        by_arg = {b.arg for b, _ in self._arg_metas}
        return by_arg == set(range(1 + max(by_arg, default=-1)))

    def _capturer(self) -> Capturer:
        if self.capturer is None:
            raise UsageError("cudagraph_mode is 'none': nothing to capture")
        return self.capturer

    def capture(self, sizes: Sequence[int] | None = None,
                make_args: Callable[[int], tuple[Any, ...]] | None = None,
                like: Sequence[Any] | None = None) -> CaptureReport:
        """Capture graphs for ``sizes`` (default: the config's) now, in this thread, largest
        first, whatever the policy.

        Arguments come from ``make_args(size)``, else ``dummy_args(size, like)``. Each size
        is a real run of the forward on them, and whatever it writes in place that outlives
        the call (the model's written buffers, caches passed in) is put back as it was
        afterwards: capturing changes no state of the model or the caller.
        """
        capturer = self._capturer()
        wanted = sorted({s for s in (sizes or self.config.capture_sizes) if self.in_buckets(s)},
                        reverse=True)
        args_for = make_args or (lambda size: self.dummy_args(size, like))
        kept = keep.Tensors(self._template[i] for i in self.entry.written_inputs
                            if self.bindings[i].kind in ("param", "buffer"))
        split_before = dict(capturer.api.seconds)
        graphs_before = capturer.api.graphs
        start = time.perf_counter()
        try:
            with self._on_device:
                capturer.capture_now(wanted, args_for, kept)
        finally:
            kept.restore()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        split = {k: v - split_before.get(k, 0.0) for k, v in capturer.api.seconds.items()}
        return CaptureReport(wanted, time.perf_counter() - start, capturer.api.pool_bytes(),
                             capturer.api.graphs - graphs_before, split)

    def start_capture(self, like: Sequence[Any] | None = None, draws_random: bool = False) -> None:
        """Begin capturing as the policy says: ``eager`` captures every size now,
        ``background`` starts its thread, ``lazy`` waits for calls."""
        capturer = self._capturer()
        if capturer.policy == "eager":
            self.capture(like=like)
        elif capturer.policy == "background":
            if self._args_from_metas():
                capturer.start_background(lambda size: self.dummy_args(size, like), draws_random)
            else:
                capturer.not_in_background("some call arguments are not graph inputs, so no "
                                            "dummy call can be made")

    def capture_state(self) -> CaptureState | None:
        """Sizes captured and pending, time spent and graph memory (None without a graph
        mode)."""
        return self.capturer.state() if self.capturer is not None else None

    @property
    def captured_sizes(self) -> list[int]:
        return self.capturer.captured_sizes if self.capturer is not None else []

    def replayers(self) -> list[Any]:
        """Every size's replayers (``cudagraphs.Replayer``: ``replays``, ``misses``), none
        without a graph mode."""
        return self.capturer.replayers() if self.capturer is not None else []

    def in_buckets(self, size: int) -> bool:
        return size in self.config.compile_sizes or any(
            lo <= size <= hi for lo, hi in self.config.compile_ranges)

    def __call__(self, *args: Any) -> Any:
        size = self._check(args)
        if size is not None and not self.in_buckets(size):
            if self.config.out_of_range == "eager":
                if not self._warned_eager:
                    warnings.warn(f"size {size} is outside every compile range; running eagerly",
                                  stacklevel=2)
                    self._warned_eager = True
                return self.model(*args)
            raise UsageError(
                f"size {size} of the dynamic dim is outside every compile range "
                f"{list(self.config.compile_ranges)}; add a range or set out_of_range='eager'"
            )
        if (size is not None and self.config.pad_to_capture_size and self.captured_sizes
                and size not in self.captured_sizes):
            padded = next_capture_size(size, self.captured_sizes)
            if padded is not None:
                out = self._call(*pad_args(args, self.dynamic_dims, padded))
                return unpad_outputs(out, padded, size)
        if self._first_call and self.capturer is not None:
            return self._first(args)
        return self._call(*args)

    def _first(self, args: tuple[Any, ...]) -> Any:
        """The first call: served first, then background capture starts (a first output
        never waits for graphs). Whether the forward draws random numbers is seen here."""
        self._first_call = False
        before = _rng_state(self.device)
        out = self._call(*args)
        capturer = self._capturer()
        if capturer.policy == "background" and not capturer.in_background:
            self.start_capture(draws_random=_rng_state(self.device) != before)
        return out

    def _rebind_if_replaced(self) -> None:
        """Use weights that replaced the model's tensors since the last call. Captured
        graphs hold the old tensors: with any captured, a replaced weight is an error."""
        before = self._template
        self.rebind()
        moved = weights.replaced(before, self._template)
        if moved and self.captured_sizes:
            self._template = before
            self._generation = -1  # refuse again at the next call
            names = [self.bindings[i].path for i in moved[:3]]
            raise UsageError(
                f"{', '.join(map(str, names))} were replaced by new tensors after graph capture, "
                "which still reads the old ones: copy new weights in place "
                "(load_state_dict, param.data.copy_) or compile the model again")

    def _call(self, *args: Any) -> Any:
        if self._generation != weights.GENERATION[0]:
            self._rebind_if_replaced()
        with self._on_device:  # graphs name the GPU by type: run on the model's
            if self.capturer is not None:
                return self.capturer(args)
            return self._forward(*args)

    def _forward(self, *args: Any) -> Any:
        return self._exact(args)

    def forward_over(self, calls: dict[str, Callable[..., Any]]
                     ) -> Callable[[tuple[Any, ...]], Any]:
        """The forward over call arguments, with the stitched graph calling ``calls`` (the
        pieces as they are, a capture pass's wrapped ones, a size's replayers)."""
        run = direct_forward(self.stitched, calls)
        from_call = self._from_call
        make_output = self.make_output

        def forward(args: tuple[Any, ...]) -> Any:
            flat = list(self._template)  # weights and constants in place; fill in the call
            for position, b in from_call:
                flat[position] = args[b.arg] if b.kind == "arg" else args[b.arg].shape[b.dim]
            return make_output(run(*flat))

        return forward


def _not_beside(entry: Entry) -> str | None:
    """Why capture passes on dummy inputs may not run beside the caller's calls, if so."""
    if entry.written_inputs:
        return ("the forward writes state (a cache, a buffer) that a pass on dummy inputs "
                "would change")
    if entry.layouts():
        return ("the forward runs collectives, which every rank must issue in one order: "
                "a thread of its own would interleave them differently on each rank")
    return None


def _rng_state(device: torch.device) -> tuple[Any, ...]:
    """torch's generator states that a forward on ``device`` could draw from, comparable."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return (bytes(cpu.numpy()), None if cuda is None else bytes(cuda.numpy()))


def _flags(positions: Sequence[int], count: int) -> list[bool]:
    """``count`` flags, True at ``positions``."""
    chosen = set(positions)
    return [i in chosen for i in range(count)]


def _check_weight(binding: Binding, tensor: torch.Tensor, meta: InputMeta,
                  device: torch.device) -> None:
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
        raise UsageError(f"{binding.kind} {binding.path} {problem}, which the compiled model "
                         "was built for; compile the model again after changing it")


def live_device(model: torch.nn.Module, entry: Entry) -> torch.device:
    """Where the model runs now: its first parameter's or buffer's device, else the
    traced one (a model without weights)."""
    return torch.device(device_of([*model.parameters(), *model.buffers()], entry.device))
