"""This process's counters: what was planned, loaded, built, and where the time went.

``COUNTERS`` is the one explicit registry; ``cachebuild.stats()`` returns a copy.
(The module is not named ``stats``: a submodule of that name would shadow the function.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class Counters:
    planned: int = 0  # targets planned (pieces × buckets, before dedup)
    unique: int = 0   # distinct target keys among them
    hits: int = 0     # targets the store had (loaded, or shared with an earlier load)
    misses: int = 0   # targets the store lacked when this process needed them
    loaded: int = 0   # targets loaded from the store
    built: int = 0    # targets compiled (cache misses)
    failed: int = 0   # targets that failed to compile
    fallbacks: int = 0  # targets built in another flavour than asked (logged with why)
    layout_copies: int = 0  # piece inputs copied to the strides the piece was compiled for
    device_copies: int = 0  # targets used as a copy built for this GPU index (Builder)
    traced: int = 0   # models traced with Dynamo
    entries_loaded: int = 0  # model entries loaded (warm starts)
    vanished: int = 0  # targets removed from the store (gc) while being loaded: misses
    sizes_captured: int = 0  # sizes whose graphs were captured (every model, every policy)
    sizes_pending: int = 0   # sizes a background capture has yet to capture
    swaps: int = 0    # models that swapped from interim targets to theirs (while_building)
    #: calls that found a value the trace read changed since the last call (an adapter
    #: switched, a flag flipped): each ran on another forward, never the old one
    guard_misses: int = 0
    #: of those, calls served by a forward this process had made before for those values
    variant_switches: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # per phase

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


COUNTERS = Counters()


@contextmanager
def timed(name: str) -> Iterator[None]:
    """Time a block into ``COUNTERS.seconds[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        COUNTERS.add_time(name, time.perf_counter() - start)


def snapshot() -> dict:
    """The counters of this process as a plain dict."""
    data = asdict(COUNTERS)
    data["seconds"] = dict(COUNTERS.seconds)
    return data


def reset() -> None:
    global COUNTERS
    COUNTERS.__init__()  # type: ignore[misc]
