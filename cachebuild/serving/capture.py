"""When a model's sizes are captured into device graphs, and how a call is served from them.

A size is captured by a **capture pass**: a real call of the forward at that size, exact
(its result is that call's answer, its writes are that call's writes), during which every
graph is recorded right after the code it records has run, in the same thread, at the same
size. The run is the capture's warm-up (kernels loaded, library handles made, per-shape
heuristics done); the capture itself runs nothing (``cudagraphs``). So a pass can ride along
a user's call (``lazy``), or run in a thread beside a live server on dummy inputs
(``background``, for models whose forward writes no state and draws no random numbers),
and no size ever waits for another to be captured: a size without graphs runs the
compiled pieces directly, exactly, only slower. Once a pass ends, its size's graphs are
published in one step.

Policies (``CompileConfig.capture``):

- ``eager``: every capture size before ``prepare`` returns (dummy inputs; whatever the
  passes write is put back);
- ``lazy``: a size is captured by its first call;
- ``background``: a thread captures every size after the first output, largest first (the
  pool then holds what every later size reuses), then smallest to largest; a model that
  writes state or draws random numbers is captured ``lazy`` instead (said once in the log);
- ``auto`` (default): ``background`` on CUDA, ``lazy`` elsewhere.

``piecewise``: every compiled piece is recorded at each size; splitting ops run eagerly
between replays. ``full``: the whole forward is one graph per size. ``full_and_piecewise``:
both, full graphs at the decode sizes for calls the caller marks as decode batches
(``calls.decoding``), piecewise graphs at every capture size for the rest;
``full_decode_only``: the full decode graphs alone. Which kind serves a call is
``graphmodes.route``'s decision; a size whose full graph cannot be captured (a splitting
op that refuses capture there) is served piecewise, said once in the log. Either way a
size's graphs of one kind are served by one ``Replayer`` at the call level, whose static
argument buffers the pieces read in place; both kinds share the pool and the buffers.

Memory: outputs of one piece that only later pieces read are held by the graphs without
owning their memory (``cudagraphs.weak``), so the pool reuses it for the next size; the
forward's own outputs stay owned (they are returned to the caller). Static input buffers
come from one ``Arena`` per model.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild import keep, process_state
from cachebuild.calls import is_decode
from cachebuild.counters import COUNTERS
from cachebuild.serving.cudagraphs import (
    Arena,
    ArgumentViews,
    GraphCapture,
    ReplayCapture,
    Replayer,
    flat_tensors,
    weak,
)
from cachebuild.serving.graphmodes import CAPTURE, FULL, PIECEWISE, REPLAY, Sizes, kinds, route

log = logging.getLogger("cachebuild")

def resolve_policy(policy: str, device: torch.device) -> str:
    """``auto`` → ``background`` on CUDA, ``lazy`` elsewhere; any other policy as it is."""
    if policy == "auto":
        return "background" if device.type == "cuda" else "lazy"
    return policy


def capture_order(sizes: Sequence[int]) -> list[int]:
    """Largest first (the pool grows once to what every other size reuses), then the rest
    from the smallest up (the sizes a server sees first)."""
    ordered = sorted(set(sizes))
    return ordered[-1:] + ordered[:-1]


@dataclass(frozen=True)
class CallShape:
    """How the call's arguments meet the graphs: ``written``: positions the forward writes
    in place; ``dynamic``: positions with a dynamic dim. A written argument without one is
    a cache the caller keeps: graphs read and write it at its own address."""

    n_args: int
    written: frozenset[int]
    dynamic: frozenset[int]

    def keeps(self, i: int) -> bool:
        return i in self.written and i not in self.dynamic


@dataclass(frozen=True)
class PieceSpec:
    """A compiled piece as a pass wraps it: ``stable[i]``: input ``i`` is the same tensor
    at every call (a weight); ``written[i]``: the piece writes input ``i`` in place."""

    stable: list[bool]
    written: list[bool]


class CapturePass:
    """One size, recorded beside a real call.

    ``statics`` maps each real tensor the call has produced so far, by identity, to the
    static tensor a replay has in its place (a graph's output, a static argument buffer):
    a later piece that reads it reads that address in place. Real tensors are kept until
    the pass ends, so identities stay unique.
    """

    def __init__(self, api: GraphCapture, arena: Arena, size: int) -> None:
        self.api = api
        self.arena = arena
        self.size = size
        self.statics: dict[int, torch.Tensor] = {}
        self._reals: list[Any] = []
        self.replayers: dict[str, Replayer] = {}
        #: why recording stopped, if it did: the call goes on exactly, the size is not
        #: published (a failed capture never changes what the call computes or writes)
        self.error: BaseException | None = None

    def link(self, real: Any, static: Any) -> None:
        """Remember that ``static`` stands for ``real`` at replay (tensor by tensor)."""
        for r, s in zip(flat_tensors(real), flat_tensors(static), strict=True):
            self.statics[id(r)] = s
            self._reals.append(r)

    def bind_call(self, args: Sequence[Any], shape: CallShape
                  ) -> tuple[list[Any], list[tuple[int, torch.Tensor]], list[tuple[int, int]],
                             list[tuple[int, torch.Tensor]]]:
        """Static stand-ins for the call's arguments: (inputs, copies, pinned, written back).

        A cache the caller keeps is read in place (pinned to its address); every other
        tensor gets a static buffer that a replay copies the call's value into.
        """
        inputs: list[Any] = []
        copies: list[tuple[int, torch.Tensor]] = []
        pinned: list[tuple[int, int]] = []
        back: list[tuple[int, torch.Tensor]] = []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                inputs.append(a)
                continue
            if shape.keeps(i):
                pinned.append((i, a.data_ptr()))
                static = a
            else:
                static = self.arena.buffer(("arg", i), a)
                copies.append((i, static))
                if i in shape.written:
                    back.append((i, static))
            self.link(a, static)
            inputs.append(static)
        return inputs, copies, pinned, back

    def wrap(self, name: str, fn: Callable[..., Any], spec: PieceSpec) -> Callable[..., Any]:
        """``fn`` as the pass calls it: run for real, then recorded at the same size."""

        def run(*args: Any) -> Any:
            return self.piece(name, fn, args, spec)

        return run

    def piece(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
              spec: PieceSpec) -> Any:
        result = fn(*args)  # the call's own work, and the capture's warm-up
        if self.error is None:
            try:
                self._record(name, fn, args, spec, result)
            except Exception as e:
                self.error = e
        return result

    def _record(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                spec: PieceSpec, result: Any) -> None:
        inputs: list[Any] = []
        replayer = Replayer(self.api, None, None, fn)
        for i, a in enumerate(args):
            static = self.statics.get(id(a)) if isinstance(a, torch.Tensor) else None
            if not isinstance(a, torch.Tensor) or spec.stable[i]:
                inputs.append(a)
            elif static is not None:
                replayer.pinned.append((i, static.data_ptr()))
                inputs.append(static)
            else:
                buf = self.arena.buffer(("in", i), a)
                replayer.copies.append((i, buf))
                if spec.written[i]:
                    replayer.written_back.append((i, buf))
                inputs.append(buf)
        replayer.graph, outputs = self.api.capture(fn, inputs)
        if outputs is not None:
            _check_no_overlap(name, outputs, [b for _, b in replayer.copies])
            self.link(result, outputs)
            replayer.outputs = weak(outputs)
        self.replayers[name] = replayer

    def owned(self, result: Any) -> dict[tuple[Any, ...], torch.Tensor]:
        """The static tensors whose memory the call's result uses, by ``_view_key``: their
        replayers hand out these owning tensors instead of unowned ones."""
        wanted = {t.untyped_storage().data_ptr() for t in flat_tensors(result)}
        out = {}
        for r in self._reals:
            static = self.statics[id(r)]
            if r.untyped_storage().data_ptr() in wanted and static is not r:
                out[_view_key(static)] = static
        return out


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same view of memory."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _check_no_overlap(name: str, outputs: Any, buffers: list[torch.Tensor]) -> None:
    """A graph whose output lies in one of its static input buffers would see it
    overwritten by the next piece's copy: refuse the capture (the size then runs without
    graphs). Pieces never return their inputs (``split.py``), so this holds."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
    for t in flat_tensors(outputs):
        if any(lo <= t.data_ptr() < hi for lo, hi in spans):
            raise RuntimeError(f"{name}: an output of its graph lies in a static input buffer")


def _own(outputs: Any, owned: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    import torch.utils._pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: owned.get(_view_key(t), t), outputs)


@dataclass
class CaptureState:
    """Where capture stands: the policy in force, sizes captured, waiting and failed (with
    why), seconds spent in capture passes, graphs recorded, and the memory they hold:
    ``pool_bytes`` in the graphs' pool, ``buffer_bytes`` in static input buffers."""

    policy: str
    captured: list[int]
    pending: list[int]
    failed: dict[int, str]
    seconds: float
    graphs: int
    pool_bytes: int
    buffer_bytes: int
    split: dict[str, float] = field(default_factory=dict)
    per_size: dict[int, float] = field(default_factory=dict)  # seconds of each size's pass
    #: sizes with graphs of each kind, and (full_and_piecewise) sizes whose full graph
    #: failed and that are served piecewise instead
    kinds: dict[str, list[int]] = field(default_factory=dict)
    full_failed: dict[int, str] = field(default_factory=dict)
    #: calls served by full graphs, by piecewise graphs, and without graphs
    served: dict[str, int] = field(default_factory=dict)


@atexit.register
def _stop_all() -> None:
    """Stop every capturer whose background thread may be running
    (``ProcessState.capturers``), so that no thread is in the middle of a capture while the
    interpreter tears CUDA down."""
    for capturer in list(process_state.current().capturers):
        capturer.stop()


class Capturer:
    """A model's graphs: which kind serves each call, and the passes that make them.

    ``mode`` is the graph mode and ``sizes`` the sizes of each kind (``graphmodes``);
    ``make_forward(calls)`` is the runtime's forward over call arguments with the stitched
    graph calling ``calls``; ``calls`` the exact callables by piece name; ``pieces`` the
    compiled ones with their specs (what a piecewise pass records). ``not_beside``: why
    passes on dummy inputs may not run beside the caller, if they may not (the
    ``background`` policy then captures ``lazy``).
    """

    def __init__(self, api: GraphCapture, device: torch.device, policy: str, mode: str,
                 sizes: Sizes, shape: CallShape, size_of: Callable[[tuple[Any, ...]], int | None],
                 make_forward: Callable[[dict[str, Callable[..., Any]]],
                                        Callable[[tuple[Any, ...]], Any]],
                 calls: dict[str, Callable[..., Any]], pieces: dict[str, PieceSpec],
                 not_beside: str | None = None) -> None:
        self.api = api
        self.device = device
        self.policy = resolve_policy(policy, device)
        self.mode = mode
        self.kinds = kinds(mode)
        self.size_sets = sizes
        self.sizes = sorted(sizes.piecewise | sizes.full)
        self.shape = shape
        self.size_of = size_of
        self._make_forward = make_forward
        self.calls = calls
        self.exact = make_forward(calls)
        self.pieces = pieces
        self.arena = Arena()
        #: published graphs by kind, then size: read by serving threads
        self.graphs: dict[str, dict[int, Replayer]] = {FULL: {}, PIECEWISE: {}}
        #: the graphs of the mode's main kind (piecewise where it has them)
        self.primary = self.kinds[0]
        self.ready = self.graphs[self.primary]
        self.pieces_at: dict[int, list[Replayer]] = {}  # piecewise: each size's pieces
        self.failures: dict[tuple[str, int], str] = {}
        self.pending: list[tuple[str, int]] = []
        self.seconds = 0.0
        self.per_size: dict[int, float] = {}
        self.exact_calls = 0  # calls that ran without graphs (capture passes included)
        self._published: set[tuple[str, int]] = set()
        #: (decode mark, size) → the replayer that serves such calls: filled as calls come,
        #: emptied whenever graphs are published or fail (the answer may change then)
        self._routes: dict[tuple[bool, int | None], Replayer] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one pass at a time: they share the arena and pool
        self._warned_miss = False
        self._stream: Any = None
        if self.policy == "background" and not_beside is not None:
            self.not_in_background(not_beside)

    # -- serving ---------------------------------------------------------------------------

    def __call__(self, args: tuple[Any, ...]) -> Any:
        """``args`` served from the graphs ``graphmodes.route`` picks, else run exactly (a
        lazy policy captures them on the way)."""
        size = self.size_of(args)
        decode = is_decode()
        routes = self._routes  # the answers as of now: a publish replaces the dict
        graphs = routes.get((decode, size))
        if graphs is not None:
            return graphs(*args)
        step = route(self.mode, size, decode, self.size_sets, self._published, self.failures,
                     self.policy == "lazy")
        if step.action == REPLAY:
            graphs = self.graphs[step.kind][size]  # type: ignore[index]
            routes[(decode, size)] = graphs
            return graphs(*args)
        if step.action == CAPTURE:
            assert size is not None and step.kind is not None
            if self._lock.acquire(blocking=False):
                self.exact_calls += 1  # the call runs exactly; its graphs are recorded beside
                try:
                    return self._capture(step.kind, size, args)
                finally:
                    self._lock.release()
            # another pass is running: serve as well as the graphs there are now allow
            step = route(self.mode, size, decode, self.size_sets, self._published,
                         self.failures, False)
            if step.action == REPLAY:
                return self.graphs[step.kind][size](*args)  # type: ignore[index]
        self.exact_calls += 1
        return self.exact(args)

    def _miss(self, *args: Any) -> Any:
        if not self._warned_miss:
            self._warned_miss = True
            log.warning("a call passed another tensor where the graphs read a cache in place "
                        "(an argument the model writes, read at the address of the call its "
                        "size was captured with): such calls run without graphs")
        return self.exact(args)

    # -- capture ---------------------------------------------------------------------------

    def wanted(self, sizes: Sequence[int] | None = None) -> list[tuple[str, int]]:
        """The (kind, size) pairs to capture, among ``sizes`` (default: all), in capture
        order: each kind largest first, then from the smallest up; piecewise first."""
        out = []
        for kind in (PIECEWISE, FULL):
            of_kind = self.size_sets.piecewise if kind == PIECEWISE else self.size_sets.full
            chosen = [s for s in of_kind if sizes is None or s in sizes]
            out += [(kind, s) for s in capture_order(chosen)]
        return out

    def capture_now(self, sizes: Sequence[int], args_for: Callable[[int], tuple[Any, ...]],
                    kept: keep.Tensors) -> list[int]:
        """Capture ``sizes`` in this thread on dummy inputs (``eager``), every kind the mode
        has there, largest first; ``kept`` puts back what the passes write. The sizes
        captured (of any kind)."""
        done = set()
        with self._lock, torch.no_grad(), keep.rng():
            for kind, size in self.wanted(sizes):
                if (kind, size) in self._published:
                    done.add(size)
                    continue
                try:
                    args = args_for(size)
                    kept.add(args[i] for i in range(len(args)) if self.shape.keeps(i))
                    self._capture(kind, size, args)
                    if (kind, size) in self._published:
                        done.add(size)
                except Exception as e:
                    self._failed(kind, size, e)
        return sorted(done)

    def start_background(self, args_for: Callable[[int], tuple[Any, ...]],
                         draws_random: bool = False) -> None:
        """Capture every size not yet captured in a thread (``background``); idempotent.
        ``draws_random``: the forward was seen to draw random numbers, which passes beside
        the caller would take from its generators: such a model is captured ``lazy``."""
        if self.policy != "background" or self.in_background:
            return
        if draws_random:
            self.not_in_background("the forward draws random numbers, which a pass beside "
                                    "the caller would take from its generators")
            return
        self.pending = [p for p in self.wanted() if p not in self._published]
        COUNTERS.sizes_pending += len(self.pending)
        if not self.pending:
            return
        if self.device.type == "cuda":  # the passes' real runs: a stream of the thread's own
            self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights
        self._thread = threading.Thread(target=self._background, args=(args_for,),
                                        name="cachebuild-capture", daemon=True)
        self._thread.start()

    def _background(self, args_for: Callable[[int], tuple[Any, ...]]) -> None:
        process_state.current().capturers.add(self)
        from cachebuild.graph.facts import on_device

        streams = (torch.cuda.stream(self._stream) if self._stream is not None
                   else contextlib.nullcontext())
        with on_device(str(self.device)), torch.no_grad(), streams:
            while self.pending and not self._stop.is_set():
                kind, size = self.pending[0]
                try:
                    with self._lock:
                        self._capture(kind, size, args_for(size))
                except Exception as e:
                    # A pass on dummy inputs that fails once fails for every size: the rest
                    # ride along their first real calls instead.
                    self.not_in_background(f"a pass on dummy inputs failed at size {size} "
                                            f"({type(e).__name__}: {e})")
                    COUNTERS.sizes_pending -= len(self.pending)
                    self.pending.clear()
                    return
                self.pending.pop(0)
                COUNTERS.sizes_pending -= 1

    def not_in_background(self, why: str) -> None:
        """Capture ``lazy`` from now on, saying why in the log."""
        log.info("graphs are captured at each size's first call, not in the background: %s",
                 why)
        self.policy = "lazy"
        self._routes = {}

    @property
    def in_background(self) -> bool:
        """Whether background capture has started (it may have finished)."""
        return self._thread is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background capture to finish; True when nothing is pending."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.pending

    def stop(self) -> None:
        """Stop background capture after the pass in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _capture(self, kind: str, size: int, args: tuple[Any, ...]) -> Any:
        """One capture pass of ``kind`` at ``size``: the call's result. The graphs are
        published when the pass recorded every one; otherwise the pair is marked failed
        (its calls then go as ``graphmodes.route`` says)."""
        start = time.perf_counter()
        p = CapturePass(self.api, self.arena, size)
        statics, copies, pinned, back = p.bind_call(args, self.shape)
        if kind == PIECEWISE:  # the pieces are recorded as the call reaches them
            calls = dict(self.calls)
            for name, spec in self.pieces.items():
                calls[name] = p.wrap(name, self.calls[name], spec)
            result = self._make_forward(calls)(args)
            whole = self._replay_pieces(p, result, statics)
        else:  # full: the forward runs, then it is recorded whole
            result = self.exact(args)
            exact = self.exact
            try:
                graph, outputs = self.api.capture(lambda *a: exact(a), statics)
                whole = Replayer(self.api, graph, outputs, self._miss)
            except Exception as e:
                p.error = e
        if p.error is not None:
            self._failed(kind, size, p.error)
            return result
        whole.copies, whole.pinned, whole.written_back = copies, pinned, back
        whole.argument_views = ArgumentViews(copies)
        if kind == PIECEWISE:
            self.pieces_at[size] = list(p.replayers.values())
        self.graphs[kind][size] = whole  # published: one assignment, then the index
        self._published.add((kind, size))
        self._routes = {}
        seconds = time.perf_counter() - start
        self.per_size[size] = self.per_size.get(size, 0.0) + seconds
        self.seconds += seconds
        COUNTERS.sizes_captured += 1
        COUNTERS.add_time("capture", seconds)
        return result

    def _replay_pieces(self, p: CapturePass, result: Any, statics: list[Any]) -> Replayer:
        """The call-level replayer of a piecewise size: the forward over the static
        arguments, with each compiled piece replayed (its outputs owned where the call's
        result holds them)."""
        owned = p.owned(result)
        calls = dict(self.calls)
        for name, r in p.replayers.items():
            r.outputs = _own(r.outputs, owned)
            calls[name] = r.fast()
        forward = self._make_forward(calls)
        return Replayer(ReplayCapture(), (lambda *a: forward(a), statics), None, self._miss)

    def _failed(self, kind: str, size: int, error: BaseException) -> None:
        why = f"{type(error).__name__}: {error}"
        self.failures[(kind, size)] = why
        self._routes = {}
        if kind == FULL and size in self.size_sets.piecewise:
            log.warning("size %d: no full graph (%s); its decode calls are served by its "
                        "piecewise graphs", size, why)
        else:
            log.warning("size %d cannot be captured (%s); it runs without graphs", size, why)

    # -- state -----------------------------------------------------------------------------

    @property
    def failed(self) -> dict[int, str]:
        """Sizes whose graphs of the mode's main kind failed, with why."""
        return {s: why for (k, s), why in self.failures.items() if k == self.primary}

    @property
    def captured_sizes(self) -> list[int]:
        """Sizes with graphs of any kind."""
        return sorted({s for _, s in self._published})

    def replayers(self) -> list[Replayer]:
        """Every replayer: each size's call-level one of each kind, then its pieces'
        (piecewise)."""
        out = []
        for kind in (PIECEWISE, FULL):
            for size, whole in sorted(self.graphs[kind].items()):
                out.append(whole)
                if kind == PIECEWISE:
                    out += self.pieces_at.get(size, [])
        return out

    def served(self) -> dict[str, int]:
        """Calls served by full graphs, by piecewise graphs, and without graphs (the calls
        that captured a size's graphs included)."""
        return {FULL: sum(r.replays for r in self.graphs[FULL].values()),
                PIECEWISE: sum(r.replays for r in self.graphs[PIECEWISE].values()),
                "none": self.exact_calls}

    def state(self) -> CaptureState:
        full_failed = ({s: why for (k, s), why in self.failures.items() if k == FULL}
                       if self.primary != FULL else {})
        return CaptureState(self.policy, self.captured_sizes, sorted({s for _, s in self.pending}),
                            self.failed, self.seconds, self.api.graphs,
                            self.api.pool_bytes(), self.arena.nbytes, dict(self.api.seconds),
                            dict(self.per_size),
                            {k: sorted(self.graphs[k]) for k in self.kinds}, full_failed,
                            self.served())
