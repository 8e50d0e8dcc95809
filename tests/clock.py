"""A clock for tests that moves only when told (``cachebuild.store.clock.Clock``)."""

from __future__ import annotations

import threading
import time

from cachebuild.store.clock import Clock


class ManualClock(Clock):
    """Starts at the real time (so that records it stamps look recent to a process on the
    system clock) and then moves only by ``advance``; ``sleep`` moves it at once."""

    def __init__(self) -> None:
        self._now = time.time()
        self._mono = 0.0
        self._lock = threading.Lock()

    def time(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        with self._lock:
            self._now += seconds
            self._mono += seconds
