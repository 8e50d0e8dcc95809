"""Where one target's build time goes: phases timed exclusively, per build.

A build runs inside ``measuring(clock)``; code anywhere below it (the backend, hooks
around the compilers) marks what it does with ``phase(name)``. Phases nest, and time is
counted exclusively: while a nested phase runs, the one around it does not count, so the
phases of a build add up to its wall time and none is counted twice. Outside
``measuring`` (or on another thread) ``phase`` costs a dictionary lookup and records
nothing.

The phase names a build reports (``PHASES``, in the order a build goes through them):
``export`` (the piece traced into the program a compiler takes), ``lowering`` (the
compiler's own work in Python: passes, scheduling, code generation), ``triton`` (Triton
kernels compiled, or waited for), ``cxx_isa`` (Inductor's checks of the CPU's vector
instructions), ``cxx_headers`` (precompiled headers), ``cxx_wrapper`` (an AOTInductor
package's C++ wrapper), ``cxx_kernels`` (C++ kernels), ``cxx_link`` (linking),
``packaging`` (the artifact written and read back), ``proof`` (run against the piece
run eagerly) and ``store`` (written to the store).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("export", "lowering", "triton", "cxx_isa", "cxx_headers", "cxx_wrapper",
          "cxx_kernels", "cxx_link", "packaging", "proof", "store")

#: The C++ phases, shown together as ``cxx`` where one figure is enough.
CXX = tuple(p for p in PHASES if p.startswith("cxx_"))


class BuildClock:
    """Seconds per phase of one build, each second counted in exactly one phase, and
    counts of events (``cxx_reused``: C++ objects taken from the work folder's cache)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._stack: list[list[object]] = []  # [name, start] of the phases running

    @property
    def current(self) -> str | None:
        """The innermost phase running, if any."""
        return str(self._stack[-1][0]) if self._stack else None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._stack:  # the enclosing phase pauses
            outer = self._stack[-1]
            self._add(str(outer[0]), now - float(outer[1]))  # type: ignore[arg-type]
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            _, start = self._stack.pop()
            self._add(name, now - float(start))  # type: ignore[arg-type]
            if self._stack:
                self._stack[-1][1] = now  # and resumes

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def report(self) -> dict[str, float]:
        """Seconds per phase, in ``PHASES`` order (other names after), rounded to ms."""
        order = {p: i for i, p in enumerate(PHASES)}
        names = sorted(self.seconds, key=lambda p: (order.get(p, len(order)), p))
        return {p: round(self.seconds[p], 3) for p in names}


_local = threading.local()


def current() -> BuildClock | None:
    """The clock of the build running on this thread, if one is measured."""
    return getattr(_local, "clock", None)


@contextmanager
def measuring(clock: BuildClock) -> Iterator[BuildClock]:
    """Count this thread's ``phase`` marks into ``clock`` while the block runs."""
    saved = current()
    _local.clock = clock
    try:
        yield clock
    finally:
        _local.clock = saved


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the block as phase ``name`` of the build this thread measures (if any)."""
    clock = current()
    if clock is None:
        yield
        return
    with clock.phase(name):
        yield


def summary(seconds: dict[str, float]) -> str:
    """``lowering 3.1 s, cxx 5.2 s (wrapper 4.6), proof 0.3 s``: a build's phases in
    words, C++ phases together with their largest named."""
    parts: list[str] = []
    cxx = {p[4:]: s for p, s in seconds.items() if p in CXX}
    for name in PHASES:
        if name in CXX:
            if name == CXX[0] and cxx:
                top = max(cxx, key=lambda k: cxx[k])
                parts.append(f"cxx {sum(cxx.values()):.1f} s ({top} {cxx[top]:.1f})")
            continue
        if seconds.get(name, 0.0) >= 0.05:
            parts.append(f"{name} {seconds[name]:.1f} s")
    return ", ".join(parts)


def detail(seconds: dict[str, float], reused: int = 0) -> str:
    """Every phase of a build that took time, in order: ``export 0.3 s, lowering 3.0 s,
    cxx_headers 12.0 s, cxx_wrapper 5.6 s, ...``, and the C++ objects it reused."""
    order = {p: i for i, p in enumerate(PHASES)}
    names = sorted((p for p, s in seconds.items() if s >= 0.05),
                   key=lambda p: (order.get(p, len(order)), p))
    text = ", ".join(f"{p} {seconds[p]:.1f} s" for p in names)
    return text + (f"; {reused} C++ objects reused" if reused else "")
