"""A clock for tests that moves only when told (``cachebuild.store.timekeeping.Clock``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cachebuild.store.timekeeping import Clock


class ManualClock(Clock):
    """Starts at the real time (so that records it stamps look recent to a process on the
    system clock) and then moves only by ``advance``; ``sleep`` moves it at once, after
    calling ``on_sleep(seconds)`` if set: what happens meanwhile (a holder lets go of a
    lock, a lock expires), for the code that waits."""

    def __init__(self, on_sleep: Callable[[float], None] | None = None) -> None:
        self._now = time.time()
        self._mono = 0.0
        self._lock = threading.Lock()
        self.on_sleep = on_sleep
        self.slept = 0  # how many times code waited

    def time(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        if self.on_sleep is not None:
            self.on_sleep(seconds)
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        with self._lock:
            self._now += seconds
            self._mono += seconds
