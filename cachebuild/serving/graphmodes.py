"""Which kind of device graph serves a call: a pure decision, the same on every device.

A graph mode (``CompileConfig.cudagraph_mode``) captures graphs of one or two kinds per
size: ``FULL`` (the whole forward, splitting ops included) and ``PIECEWISE`` (each compiled
piece; splitting ops run eagerly between replays). ``route`` decides, from the mode, the
call's size, whether the caller marked it a decode batch (``calls.decoding``) and which
graphs exist or failed, what a call does: replay a kind, capture a kind on the way
(``lazy``), or run without graphs. Nothing here touches a device, so every case is tested
on a CPU; ``capture.Capturer`` acts on the answer.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

FULL = "full"
PIECEWISE = "piecewise"
#: What a call does: replay existing graphs, capture graphs riding along, or neither.
REPLAY, CAPTURE, EXACT = "replay", "capture", "exact"


def kinds(mode: str) -> tuple[str, ...]:
    """The graph kinds a mode captures."""
    return {"none": (), "piecewise": (PIECEWISE,), "full": (FULL,),
            "full_and_piecewise": (PIECEWISE, FULL), "full_decode_only": (FULL,)}[mode]


@dataclass(frozen=True)
class Sizes:
    """The sizes each kind is captured at: ``piecewise`` (the capture sizes, in modes with
    piecewise graphs), ``full`` (every capture size in ``full`` mode; the decode sizes in
    the modes where full graphs serve decode calls only)."""

    piecewise: frozenset[int]
    full: frozenset[int]

    def wanted(self) -> list[tuple[str, int]]:
        """Every (kind, size) to capture: piecewise first, then full (as vLLM captures
        mixed batches before uniform decode ones)."""
        return ([(PIECEWISE, s) for s in sorted(self.piecewise)]
                + [(FULL, s) for s in sorted(self.full)])


def sizes_for(mode: str, capture_sizes: Container[int] | list[int],
              decode_sizes: list[int] | tuple[int, ...]) -> Sizes:
    """The sizes of each kind for ``mode``, given the capture sizes (those within the
    compile ranges) and the sizes whose decode calls get full graphs."""
    capture = frozenset(capture_sizes)  # type: ignore[arg-type]
    decode = frozenset(decode_sizes) & capture
    if mode == "piecewise":
        return Sizes(capture, frozenset())
    if mode == "full":
        return Sizes(frozenset(), capture)
    if mode == "full_and_piecewise":
        return Sizes(capture, decode)
    if mode == "full_decode_only":
        return Sizes(frozenset(), decode)
    return Sizes(frozenset(), frozenset())


def wanted_kind(mode: str, size: int | None, decode: bool, sizes: Sizes) -> str | None:
    """The kind of graph meant to serve a call, before asking which exist: full graphs
    for every call of a captured size in ``full`` mode, for marked decode calls at a decode
    size in the two modes with decode graphs; piecewise graphs for the other calls of a
    capture size where the mode has them; None: no graphs."""
    if size is None:
        return None
    if size in sizes.full and (decode or mode == "full"):
        return FULL
    if size in sizes.piecewise:
        return PIECEWISE
    return None


@dataclass(frozen=True)
class Route:
    """What a call does (``REPLAY``, ``CAPTURE`` or ``EXACT``) with which kind of graph."""

    action: str
    kind: str | None = None


RUN_EXACT = Route(EXACT)


def route(mode: str, size: int | None, decode: bool, sizes: Sizes,
          ready: Container[tuple[str, int]], failed: Container[tuple[str, int]],
          lazy: bool) -> Route:
    """What a call of ``size`` does. ``ready``: the (kind, size) pairs with published
    graphs; ``failed``: those whose capture failed; ``lazy``: whether this call may capture
    the graphs it lacks (the lazy policy, with no other pass running).

    A size whose full graph failed (a splitting op that cannot be captured there) is
    served piecewise where the mode has piecewise graphs, else without graphs. A decode
    call whose full graph is not captured yet (and that may not capture it now) replays
    the size's piecewise graphs where they exist: graphs of either kind give the exact
    answer, and piecewise ones cost less than none.
    """
    kind = wanted_kind(mode, size, decode, sizes)
    if kind == FULL and (FULL, size) in failed:
        kind = PIECEWISE if size in sizes.piecewise else None
    if kind is None or (kind, size) in failed:
        return RUN_EXACT
    if (kind, size) in ready:
        return Route(REPLAY, kind)
    if lazy:
        return Route(CAPTURE, kind)
    if kind == FULL and (PIECEWISE, size) in ready:
        return Route(REPLAY, PIECEWISE)
    return RUN_EXACT
