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
between replays. ``full``: the whole forward is one graph per size. Either way a size is
served by one ``Replayer`` at the call level, whose static argument buffers the pieces
read in place.

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
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachebuild import keep
from cachebuild.counters import COUNTERS
from cachebuild.cudagraphs import (
    Arena,
    GraphCapture,
    ReplayCapture,
    Replayer,
    flat_tensors,
    weak,
)

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


#: Capturers whose background thread may be running: stopped at exit, so that no thread is
#: in the middle of a capture while the interpreter tears CUDA down.
_RUNNING: weakref.WeakSet[Capturer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for capturer in list(_RUNNING):
        capturer.stop()


class Capturer:
    """A model's graphs: which sizes are served from them, and the passes that make them.

    ``make_forward(calls)`` is the runtime's forward over call arguments with the stitched
    graph calling ``calls``; ``calls`` the exact callables by piece name; ``pieces`` the
    compiled ones with their specs (piecewise mode; empty: full mode). ``not_beside``: why
    passes on dummy inputs may not run beside the caller, if they may not (the
    ``background`` policy then captures ``lazy``).
    """

    def __init__(self, api: GraphCapture, device: torch.device, policy: str, sizes: Sequence[int],
                 shape: CallShape, size_of: Callable[[tuple[Any, ...]], int | None],
                 make_forward: Callable[[dict[str, Callable[..., Any]]],
                                        Callable[[tuple[Any, ...]], Any]],
                 calls: dict[str, Callable[..., Any]], pieces: dict[str, PieceSpec],
                 not_beside: str | None = None) -> None:
        self.api = api
        self.device = device
        self.policy = resolve_policy(policy, device)
        self.sizes = sorted(set(sizes))
        self._wanted = frozenset(self.sizes)
        self.shape = shape
        self.size_of = size_of
        self._make_forward = make_forward
        self.calls = calls
        self.exact = make_forward(calls)
        self.pieces = pieces
        self.arena = Arena()
        self.ready: dict[int, Replayer] = {}  # published sizes: read by serving threads
        self.pieces_at: dict[int, list[Replayer]] = {}  # piecewise: each size's pieces
        self.failed: dict[int, str] = {}
        self.pending: list[int] = []
        self.seconds = 0.0
        self.per_size: dict[int, float] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one pass at a time: they share the arena and pool
        self._warned_miss = False
        self._stream: Any = None
        if self.policy == "background" and not_beside is not None:
            self._not_in_background(not_beside)

    # -- serving ---------------------------------------------------------------------------

    def __call__(self, args: tuple[Any, ...]) -> Any:
        """``args`` served from graphs where its size has them, else run exactly (a lazy
        policy captures the size on the way)."""
        size = self.size_of(args)
        graphs = self.ready.get(size) if size is not None else None
        if graphs is not None:
            return graphs(*args)
        if (self.policy == "lazy" and size in self._wanted and size not in self.failed
                and self._lock.acquire(blocking=False)):
            try:
                return self._capture_size(size, args)
            finally:
                self._lock.release()
        return self.exact(args)

    def _miss(self, *args: Any) -> Any:
        if not self._warned_miss:
            self._warned_miss = True
            log.warning("a call passed another tensor where the graphs read a cache in place "
                        "(an argument the model writes, read at the address of the call its "
                        "size was captured with): such calls run without graphs")
        return self.exact(args)

    # -- capture ---------------------------------------------------------------------------

    def capture_now(self, sizes: Sequence[int], args_for: Callable[[int], tuple[Any, ...]],
                    kept: keep.Tensors) -> list[int]:
        """Capture ``sizes`` in this thread on dummy inputs (``eager``), largest first;
        ``kept`` puts back what the passes write. The sizes captured."""
        done = []
        with self._lock, torch.no_grad(), keep.rng():
            for size in capture_order(sizes):
                if size in self.ready:
                    done.append(size)
                    continue
                try:
                    args = args_for(size)
                    kept.add(args[i] for i in range(len(args)) if self.shape.keeps(i))
                    self._capture_size(size, args)
                    done.append(size)
                except Exception as e:
                    self._failed(size, e)
        return done

    def start_background(self, args_for: Callable[[int], tuple[Any, ...]],
                         draws_random: bool = False) -> None:
        """Capture every size not yet captured in a thread (``background``); idempotent.
        ``draws_random``: the forward was seen to draw random numbers, which passes beside
        the caller would take from its generators: such a model is captured ``lazy``."""
        if self.policy != "background" or self.in_background:
            return
        if draws_random:
            self._not_in_background("the forward draws random numbers, which a pass beside "
                                    "the caller would take from its generators")
            return
        self.pending = [s for s in capture_order(self.sizes) if s not in self.ready]
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
        _RUNNING.add(self)
        from cachebuild.facts import on_device

        streams = (torch.cuda.stream(self._stream) if self._stream is not None
                   else contextlib.nullcontext())
        with on_device(str(self.device)), torch.no_grad(), streams:
            while self.pending and not self._stop.is_set():
                size = self.pending[0]
                try:
                    with self._lock:
                        self._capture_size(size, args_for(size))
                except Exception as e:
                    self._failed(size, e)
                finally:
                    self.pending.pop(0)
                    COUNTERS.sizes_pending -= 1

    def _not_in_background(self, why: str) -> None:
        log.info("graphs are captured at each size's first call, not in the background: %s",
                 why)
        self.policy = "lazy"

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

    def _capture_size(self, size: int, args: tuple[Any, ...]) -> Any:
        """One capture pass: the call's result. ``size`` is published when the pass
        recorded every graph; otherwise it is marked failed (and runs without graphs)."""
        start = time.perf_counter()
        p = CapturePass(self.api, self.arena, size)
        statics, copies, pinned, back = p.bind_call(args, self.shape)
        if self.pieces:  # piecewise: the pieces are recorded as the call reaches them
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
            self._failed(size, p.error)
            return result
        whole.copies, whole.pinned, whole.written_back = copies, pinned, back
        self.pieces_at[size] = list(p.replayers.values())
        self.ready[size] = whole  # published: one assignment
        seconds = time.perf_counter() - start
        self.per_size[size] = seconds
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
            calls[name] = r
        forward = self._make_forward(calls)
        return Replayer(ReplayCapture(), (lambda *a: forward(a), statics), None, self._miss)

    def _failed(self, size: int, error: BaseException) -> None:
        self.failed[size] = f"{type(error).__name__}: {error}"
        log.warning("size %d cannot be captured (%s); it runs without graphs", size,
                    self.failed[size])

    # -- state -----------------------------------------------------------------------------

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self.ready)

    def replayers(self) -> list[Replayer]:
        """Every replayer: each size's call-level one, then its pieces' (piecewise)."""
        out = []
        for size, whole in sorted(self.ready.items()):
            out += [whole, *self.pieces_at.get(size, [])]
        return out

    def state(self) -> CaptureState:
        return CaptureState(self.policy, self.captured_sizes, list(self.pending),
                            dict(self.failed), self.seconds, self.api.graphs,
                            self.api.pool_bytes(), self.arena.nbytes, dict(self.api.seconds),
                            dict(self.per_size))
