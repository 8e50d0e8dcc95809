"""The store's sense of time, in one object that a caller (a test) can replace.

Every time the store keeps or acts on comes from a ``Clock``: when a record was created
and last used, how old a record is for ``gc --older-than``, when pending usage is due to
be written, how long a build lock is waited on and when a lock token was made. The
system clock is the default; a test passes a clock it moves itself, so that nothing it
checks depends on how fast the machine runs.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Wall time (for what is recorded), a monotonic time (for intervals) and a pause."""

    def time(self) -> float:
        """Seconds since the epoch, as records keep them."""
        ...

    def monotonic(self) -> float:
        """Seconds that only go forward, for measuring an interval."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass (waiting for a lock)."""
        ...


class SystemClock(Clock):
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


#: The clock every store uses unless it is given another.
SYSTEM_CLOCK: Clock = SystemClock()
