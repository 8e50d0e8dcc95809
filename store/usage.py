"""Usage of a store by this process, buffered: hits, last-used times and counters.

A hit would cost an index write if it were recorded at once; ``Usage`` keeps them in
memory and writes them to the index together (``flush``), at most about once a second
(``FLUSH_INTERVAL``, by the store's clock) or when many keys are pending, and whenever
the store flushes or closes. What it promises:

- nothing is written twice: a forked child starts with nothing pending, so it never
  writes its parent's usage again;
- a process that is killed loses at most its last interval of statistics, never a record;
- a failed write (a read-only or full disk) only warns, once: statistics never stop a
  load.
"""

from __future__ import annotations

import logging
import os
import threading

from .index import INDEX_ERRORS, Index
from .timekeeping import SYSTEM_CLOCK, Clock

log = logging.getLogger("cachebuild.store")


class Usage:
    """Hits, last-used times and counters waiting to be written to the index."""

    FLUSH_INTERVAL = 1.0
    MAX_PENDING = 1024

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.uses: dict[str, list[float]] = {}
        self.counts: dict[str, int] = {}
        self.pid = os.getpid()
        self.last_flush = clock.monotonic()
        self.warned = False

    def _fork_check(self) -> None:
        # A forked child must not write its parent's pending usage a second time.
        if self.pid != os.getpid():
            self.uses, self.counts, self.pid = {}, {}, os.getpid()

    def _due(self) -> bool:
        return self.clock.monotonic() - self.last_flush > self.FLUSH_INTERVAL

    def note(self, key: str | None, counter: str) -> bool:
        """Record one event (a use of ``key``, if given); True when it is time to flush."""
        with self.lock:
            self._fork_check()
            if key is not None:
                now = self.clock.time()
                use = self.uses.get(key)
                if use is None:
                    self.uses[key] = [now, 1]
                else:
                    use[0] = now
                    use[1] += 1
            self.counts[counter] = self.counts.get(counter, 0) + 1
            return self._due() or len(self.uses) > self.MAX_PENDING

    def add(self, counter: str, amount: int) -> bool:
        """Add ``amount`` to a counter; True when it is time to flush."""
        with self.lock:
            self._fork_check()
            self.counts[counter] = self.counts.get(counter, 0) + amount
            return self._due()

    def pending(self, key: str) -> tuple[float, int] | None:
        """``(last used, hits)`` of ``key`` not yet written, or None."""
        with self.lock:
            use = self.uses.get(key)
            return None if use is None else (use[0], int(use[1]))

    def flush(self, index: Index) -> None:
        """Write pending usage to the index. Failures (read-only or full disk) only warn."""
        with self.lock:
            self._fork_check()
            uses, counts = self.uses, self.counts
            self.uses, self.counts = {}, {}
            self.last_flush = self.clock.monotonic()
        if not uses and not counts:
            return
        try:
            with index.transact():
                for key, (when, hits) in uses.items():
                    small = index.get_small(key)
                    if small is None:
                        continue
                    small["last_used"] = max(small["last_used"], when)
                    small["hits"] += int(hits)
                    index.set_small(key, small)
                for name, n in counts.items():
                    index.incr(name, n)
        except INDEX_ERRORS as e:
            if not self.warned:
                log.warning("cachebuild: could not record store usage statistics: %s", e)
                self.warned = True
