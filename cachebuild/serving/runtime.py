"""A stitched forward bound to a live model: what a compiled model runs at each call.

``ModelRuntime`` is made in one pass over what it needs: the live model's weights checked
against what the pieces were built for and the checks of each call's arguments
(``inputs``), the stitched forward (``stitch``), the output's structure (``outputs``),
the model's weights watched for replacement (``weights``) and, with a graph mode, when
each size is captured (``capture``). A call then checks its arguments, dispatches by size
and runs graphs where a size has them, the compiled pieces directly where not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from cachebuild import compat, keep
from cachebuild.building.entry import Entry
from cachebuild.building.entry_key import shared_tensors
from cachebuild.config import CompileConfig
from cachebuild.counters import timed
from cachebuild.errors import UsageError, warn_caller
from cachebuild.graph import weights
from cachebuild.graph.facts import device_of, on_device, without_autograd
from cachebuild.graph.inputs import CallCheck, check_unshared_weights, check_weight, layout_guards
from cachebuild.graph.outputs import TREE, output_builder
from cachebuild.serving.capture import CallShape, Capturer, CaptureState
from cachebuild.serving.cudagraphs import (
    capture_for,
    next_capture_size,
    pad_args,
    pad_plan,
    unpad_outputs,
)
from cachebuild.serving.graphmodes import sizes_for
from cachebuild.serving.stitch import forward_over, stitch
from cachebuild.tracing.guard_watch import CallGuards
from cachebuild.tracing.guards import Mismatch

log = logging.getLogger("cachebuild")


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
        self.model = model
        self.config = config
        self.dynamic_dims = dict(dynamic_dims)
        self.bindings = list(entry.bindings)
        self.metas = list(entry.input_metas)
        self.device = live_device(model, entry)
        self._on_device = on_device(self.device)
        mode = config.cudagraph_mode
        n_args = 1 + max((b.arg for b in entry.bindings if b.kind in ("arg", "size")
                          and b.arg is not None), default=-1)
        #: call arguments the forward writes in place (a KV cache passed in): never copied
        self.written_args = sorted({entry.bindings[i].arg for i in entry.written_inputs
                                    if entry.bindings[i].kind == "arg"})
        #: How a padded call's outputs come back to its size, or why calls are not padded
        #: (``_padding``: worked out at the first call that could be padded).
        self._pad: list[Any] | str | None = None
        if config.pad_to_capture_size and entry.written_inputs:
            raise UsageError(
                "pad_to_capture_size pads calls with rows of zeros, and this model writes in "
                "place: the padding rows would write too (into a cache, at index 0). Pad in "
                "the caller with rows that write nowhere, as examples/generate.py's Engine does")
        self._from_call = [(i, b) for i, b in enumerate(self.bindings)
                           if b.kind in ("arg", "size")]
        self._arg_metas = [(b, m) for b, m in zip(self.bindings, self.metas, strict=True)
                           if b.kind == "arg"]
        #: The call's arguments traced as tensors (no guard reads them: the call check
        #: does, and a value there instead is another forward's call, not an error).
        self._tensor_args = sorted({b.arg for b, m in self._arg_metas if m.kind == "tensor"})
        not_beside = _not_beside(entry)
        self._warned_eager = False
        self._warned_pad = False
        #: The weights' versions when a padded call was last compared with one at its own
        #: size (None: never): weights written since (load_state_dict) are compared again.
        self._pad_proven: int | None = None
        self._first_call = True
        # Compiled pieces answer without autograd: said once if a call could expect it.
        self._no_autograd_unsaid = any(p.requires_grad for p in model.parameters())
        #: Which weights were one tensor at the trace (``entry.shared_tensors``): each is
        #: bound once, so a tying undone (or made) since needs another forward.
        self._shared: list[list[str]] = entry.factors.get("shared", [])
        # The inputs: weights and call arguments checked, then the layouts pieces expect.
        self.rebind()
        layouts = layout_guards(entry.pieces)
        self.make_output = output_builder(entry.out_spec)
        self.stitched = stitch(entry, loaded, layouts)
        self._exact = forward_over(self.stitched, self.stitched.calls, self._weights,
                                   self._from_call, self.make_output)
        #: What the trace read besides tensors, checked by the front door before each call.
        self.guards = CallGuards(entry.guard_set(), entry.sources)
        self._shared_at = -1
        compat.custom_ops_without_dynamo()  # splitting ops run eagerly at every call
        self.capturer: Capturer | None = None
        if mode != "none":
            shape = CallShape(n_args, frozenset(self.written_args),
                              frozenset(self.dynamic_dims))
            capture_sizes = [s for s in config.capture_sizes if self.in_buckets(s)]
            self.capturer = Capturer(
                capture_for(str(self.device)), self.device, config.capture, mode,
                sizes_for(mode, capture_sizes, config.full_decode_sizes()), shape,
                self._dynamic_size, self.forward_over, self.stitched.calls,
                self.stitched.compiled, not_beside=not_beside)

    def rebind(self) -> None:
        """Look up the model's parameters and buffers again (after they were replaced).

        Each is checked against what the compiled pieces were built for (device, dtype,
        shape, layout): they read it by pointer. One that is gone (set to None, deleted)
        or does not fit is a UsageError, and is looked at again at the next call.
        """
        # Watched, read and armed before the lookups: a change made while they run is seen
        # next call. Watched again each time: a replaced submodule's own weights are new.
        paths = self._watched_paths()
        weights.watch(self.model, paths)
        generation = weights.generation()
        held = compat.dict_watcher().watch(weights.holders(self.model, paths))
        template: list[Any] = []
        for b, m in zip(self.bindings, self.metas, strict=True):
            if b.kind in ("param", "buffer"):
                tensor = weights.lookup(self.model, b.kind, b.path)
                check_weight(f"{b.kind} {b.path}", tensor, m, self.device)
                template.append(tensor)
            elif b.kind == "const":
                template.append(b.dim)
            else:
                template.append(None)
        named = [(f"{b.kind} {b.path}", t) for b, t in zip(self.bindings, template, strict=True)
                 if b.kind in ("param", "buffer")]
        written = {f"{self.bindings[i].kind} {self.bindings[i].path}"
                   for i in self.entry.written_inputs
                   if self.bindings[i].kind in ("param", "buffer")}
        check_unshared_weights(named, written)
        self._template = template
        self.check = CallCheck([(b.arg, m) for b, m in self._arg_metas], self.device,
                               self._dynamic_size, self.written_args,
                               [(n, t) for n, t in named if n in written])
        #: The weights the forward writes in place (``_call`` moves their version counters).
        self._written_weights = [template[i] for i in self.entry.written_inputs
                                 if self.bindings[i].kind in ("param", "buffer")]
        # Kept once every weight passed: one refused above is looked up again next call.
        self._generation, self._held = generation, held
        # A weight whose memory moved under the same tensor object (``model.half()``, a
        # submodule's ``.float()``, ``w.data = ...``: ``.data`` set, which no hook or
        # watched dict sees): every weight's pointer is compared at every call, as the
        # pieces read it with the dtype and layout they were built for.
        self._bound = [t for t in template if isinstance(t, torch.Tensor)]
        self._bound_at = weights.addresses(self._bound)
        self._addresses = weights.addresses(template)

    def _watched_paths(self) -> list[str]:
        """The bound weights' paths, and every other name of a weight that was one tensor
        with another at the trace (a tied head's): setting any of them is seen."""
        paths = [b.path for b in self.bindings if b.kind in ("param", "buffer")]
        bound = set(paths)
        return paths + [n for group in self._shared for n in group if n not in bound]

    def mismatches(self, model: torch.nn.Module, args: tuple[Any, ...]) -> list[Mismatch]:
        """What differs now from the trace this forward was made from (none: it may run):
        the values its guards read, which weights are one tensor, and each weight's shape
        (an adapter of another rank swapped in). Weights are looked at again
        only after one, or a submodule, was set on a watched path: its registration moves
        ``weights.generation``, and a write into a module's dicts that skips registration
        (``module._parameters[name] = p``, set to None) changes a watched dict (``rebind``'s
        watch over the same paths)."""
        wrong = self.guards.mismatches(model, args)
        if not wrong:  # a value where a tensor was traced: another forward, as in eager
            other = next((i for i in self._tensor_args
                          if i < len(args) and not isinstance(args[i], torch.Tensor)), None)
            if other is not None:
                wrong = [Mismatch(f"argument {other}", "a tensor", type(args[other]).__name__)]
        at = weights.generation()
        if wrong or (self._shared_at == at and self._held()):
            return wrong
        # Modules set on the paths since the last rebind are watched from now on, even if
        # this call never reaches one (refused, or run eagerly out of range).
        weights.watch(model, self._watched_paths())
        at = weights.generation()
        now = shared_tensors(model)
        if now != self._shared:
            return [Mismatch("the weights that are one tensor (tied, or a layer used twice)",
                             self._shared, now)]
        for b, m in zip(self.bindings, self.metas, strict=True):
            if b.kind not in ("param", "buffer"):
                continue
            try:
                t = weights.lookup(model, b.kind, b.path)
            except UsageError:
                continue  # gone: the call says so (``rebind``)
            # Another shape is another model (an adapter of another rank); another dtype is
            # a conversion (``model.half()``), which ``rebind`` refuses until it is undone.
            if tuple(t.shape) != tuple(m.shape):
                return [Mismatch(f"{b.kind} {b.path}", f"shape {list(m.shape)}",
                                 f"shape {list(t.shape)}")]
        self._shared_at = at
        return []

    def _weights(self) -> list[Any]:
        """The graph inputs that come from the model (weights, constants) as bound now;
        None where a call gives them."""
        return self._template

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

    def capture_if_eager(self, like: Sequence[Any]) -> CaptureReport | None:
        """With the ``eager`` capture policy, every size captured now, shaped ``like`` a
        call (``capture``), and what it captured; None with any other policy."""
        if self.capturer is None or self.capturer.policy != "eager":
            return None
        with timed("capture"):
            report = self.capture(like=like)
        log.info("captured %d sizes in %.2f s (%d bytes of graph memory)", len(report.sizes),
                 report.seconds, report.pool_bytes)
        return report

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
        wanted = sorted({s for s in (sizes or self.config.capture_sizes)
                         if self.in_buckets(s) and s in capturer.sizes}, reverse=True)
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
        return self.config.in_buckets(size)

    def __call__(self, *args: Any) -> Any:
        if self._no_autograd_unsaid and torch.is_grad_enabled():
            self._no_autograd_unsaid = False
            log.warning("cachebuild: %s is called with autograd on, and its compiled pieces "
                        "run without it: the outputs carry no gradient history (as under "
                        "torch.no_grad()); serve it under torch.inference_mode() or "
                        "torch.no_grad()", type(self.model).__name__)
        size = self._check(args)
        said = self.config.outside(size) if size is not None else None
        if said is not None:
            if self.config.out_of_range != "eager":
                raise UsageError(said)
            if not self._warned_eager:
                warn_caller(said)
                self._warned_eager = True
            return self.model(*args)
        if (size is not None and self.config.pad_to_capture_size and self.captured_sizes
                and size not in self.captured_sizes):
            padded = next_capture_size(size, self.captured_sizes)
            if padded is not None and self._padding():
                return self._padded(args, size, padded)
        if self._first_call and self.capturer is not None:
            return self._first(args)
        return self._call(*args)

    def _padded(self, args: tuple[Any, ...], size: int, padded: int) -> Any:
        """The call of ``size`` tokens run at ``padded``, its outputs cut back. The first
        such call also runs at its own size and compares (a model that writes nothing in
        place, as padding requires, can run twice): where the padding rows changed what
        the others get (tokens that mix outside attention: a mean over them), calls are
        not padded from then on, said once, and this one answers at its own size. The
        comparison is made again at the first padded call after the weights are written in
        place (a gate loaded after a warm-up on zeros); a write through ``.data`` leaves
        no trace to see."""
        out = unpad_outputs(self._call(*pad_args(args, self.dynamic_dims, padded)),
                            self._pad, size)
        versions = sum(t._version for t in self._bound)
        if self._pad_proven == versions:
            return out
        self._pad_proven = versions
        out = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, out)
        exact = self._call(*args)
        if _close(out, exact):
            return out
        self._pad = (f"a call of {size} tokens padded to {padded} answered otherwise than at "
                     "its own size: its tokens mix outside attention (a mean or a sum over "
                     "them?)")
        self._padding()  # says it, once
        return exact

    def _padding(self) -> bool:
        """Whether calls are padded to a captured size; where they cannot be (``pad_plan``
        says why), said once, and every call runs at its own size."""
        if self._pad is None:
            self._pad = (pad_plan(self.entry.output_metas, self.entry.input_metas)
                         if self.entry.out_spec.startswith(TREE) else
                         "its output is not a plain structure of tensors and sizes")
        if isinstance(self._pad, list):
            return True
        if not self._warned_pad:
            self._warned_pad = True
            log.warning("cachebuild: %s runs each call at its own size, not padded to a "
                        "captured one (pad_to_capture_size): %s", type(self.model).__name__,
                        self._pad)
        return False

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
        graphs hold the old tensors' memory: with any captured, a replaced weight (or one
        whose ``.data`` was replaced) is an error."""
        before, at = self._template, self._addresses
        self.rebind()
        moved = weights.replaced(before, self._template, at)
        if moved and self.captured_sizes:
            self._template, self._addresses = before, at
            self._generation = -1  # refuse again at the next call
            names = [self.bindings[i].path for i in moved[:3]]
            raise UsageError(
                f"{', '.join(map(str, names))} were replaced by new tensors (or new memory under "
                "their .data) after graph capture, "
                "which still reads the old ones: copy new weights in place "
                "(load_state_dict, param.data.copy_) or compile the model again")

    def _call(self, *args: Any) -> Any:
        if self._generation != weights.GENERATION[0] or not self._held() or \
                not weights.unmoved(self._bound, self._bound_at):
            self._rebind_if_replaced()
        with self._on_device:  # graphs name the GPU by type: run on the model's
            if self.capturer is None:
                out = without_autograd(self._forward, *args)
            else:
                out = without_autograd(self.capturer, args)
        self._wrote(args)
        return out

    def _wrote(self, args: tuple[Any, ...]) -> None:
        """Move the version counters of what the call wrote in place, as eager's in-place
        ops do: compiled pieces and graph replays write memory behind autograd's back, and
        a tensor saved for backward, or a check made on ``_version``, must see the write."""
        written = [args[i] for i in self.written_args if i < len(args)]
        if written or self._written_weights:
            torch.autograd.graph.increment_version([*written, *self._written_weights])

    def _forward(self, *args: Any) -> Any:
        return self._exact(args)

    def forward_over(self, calls: dict[str, Callable[..., Any]]
                     ) -> Callable[[tuple[Any, ...]], Any]:
        """The forward over call arguments, with the stitched graph calling ``calls`` (the
        pieces as they are, a capture pass's wrapped ones, a size's replayers)."""
        return forward_over(self.stitched, calls, self._weights, self._from_call,
                            self.make_output)


def _not_beside(entry: Entry) -> str | None:
    """Why capture passes on dummy inputs may not run beside the caller's calls, if so."""
    if entry.written_inputs:
        return ("the forward writes state (a cache, a buffer) that a pass on dummy inputs "
                "would change")
    if any(m.get("distributed") is not None for m in entry.manifests.values()):
        return ("the forward runs collectives, which every rank must issue in one order: "
                "a thread of its own would interleave them differently on each rank")
    return None


def _rng_state(device: torch.device) -> tuple[Any, ...]:
    """torch's generator states that a forward on ``device`` could draw from, comparable."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return (bytes(cpu.numpy()), None if cuda is None else bytes(cuda.numpy()))


def live_device(model: torch.nn.Module, entry: Entry) -> torch.device:
    """Where the model runs now: its first parameter's or buffer's device, else the
    traced one (a model without weights)."""
    return torch.device(device_of([*model.parameters(), *model.buffers()], entry.device))


def _close(a: Any, b: Any) -> bool:
    """Whether two results of one call are the same values: the same structure, and each
    leaf as a build's proof compares an artifact with its piece (``verify.compare``: a
    floating tensor within its dtype's rounding, as another size runs other kernels)."""
    from cachebuild.building.verify import Mismatch, compare  # the first padded call only

    left, spec = pytree.tree_flatten(a)
    right, other = pytree.tree_flatten(b)
    if spec != other:
        return False
    try:
        for x, y in zip(left, right, strict=True):
            compare(x, y, "output")
    except Mismatch:
        return False
    return True
