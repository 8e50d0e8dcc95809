"""What this process remembers between starts, in one object.

A process remembers the targets it loaded (every layer and every later start with the
same key shares one), the targets it proved against their pieces, the models that failed
to compile (not traced again), the warnings it says once (a source of unsigned artifacts
named in a refusal, a work folder emptied, a remote that is down, a graph that builds a
variant per number), and the capturers whose background threads may be running (stopped
at exit). All of it lives in one ``ProcessState``; ``current()`` is the one the process
uses, and ``fresh()`` runs a block as a new process would start, then puts the old one
back (what tests use instead of clearing module globals).

Kept out of it on purpose, as a fresh state must not drop them: memos of what a given
content or environment computes to (source and code hashes, file digests, the compiler
probe's verdicts and the CPU's vector ISAs, pass uuids, files already written from
verified bytes), registries filled at import or kept for the interpreter (backends, refs
readers, bounded stand-ins, dict watchers, weight hooks), ``counters.COUNTERS`` (its own
explicit registry with its own reset), Inductor's one-time import (``build.preload``: an
import cannot be undone), and what follows the process's environment while a build or a
load runs (``backends.kernel_dir``, ``backends.compilers``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol


class Stoppable(Protocol):
    """What the state needs of a capturer: a way to stop its background thread."""

    def stop(self) -> None: ...


@dataclass
class Failure:
    """A model that failed to compile: the error, and ``changed(key, model, args)``:
    whether a start for entry key ``key`` of ``model`` called with ``args`` differs from
    the one that failed (by what its trace read, where it got that far). None: a start
    for the same entry key is the same."""

    error: BaseException
    key: str = ""
    changed: Any = None  # Callable[[str, model, args], bool] | None

    def meets(self, key: str, model: Any, args: Any) -> bool:
        """Whether a start for ``key`` of ``model`` called with ``args`` is this failure."""
        if self.changed is None:
            return key == self.key
        return not self.changed(key, model, args)


@dataclass
class ProcessState:
    """What one process remembers.

    ``loaded``: loaded targets by (key, device); ``verified``: keys of targets proven
    against their piece (built here, by a worker for this process, or checked on load);
    ``failed``: the models that failed to compile (``Failure``), by the entry key of
    their code, config and shapes (a model's values lead to variants of it); ``said``:
    what was said once already (``first_saying``); ``capturers``: capturers whose
    background thread may be running; ``building``: builds in the background.
    """

    loaded: dict[tuple[str, str], Any] = field(default_factory=dict)
    verified: set[str] = field(default_factory=set)
    failed: dict[str, list[Failure]] = field(default_factory=dict)
    said: set[str] = field(default_factory=set)
    capturers: weakref.WeakSet[Stoppable] = field(default_factory=weakref.WeakSet)
    #: builds running in the background (``background.BackgroundBuild``): their entries
    #: count as stored for a lookup, as they will be (``start.pending_entries``)
    building: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def first_saying(self, what: str) -> bool:
        """True the first time this state is asked about ``what`` (a line, or what names
        it; then it is remembered as said), False after: said once per process."""
        with self._lock:
            said = what in self.said
            self.said.add(what)
        return not said


_current = ProcessState()
_swap = threading.Lock()


def current() -> ProcessState:
    """The state this process uses now."""
    return _current


def reset() -> ProcessState:
    """Forget everything the process remembers, as a new process would start, and return
    the new state. Running capture threads are not memory but work under way: the new
    state keeps them, so that they are still stopped at exit."""
    global _current
    with _swap:
        _current = ProcessState(capturers=_current.capturers)
        return _current


@contextmanager
def fresh() -> Iterator[ProcessState]:
    """Run the block on a fresh state (``reset``), then put back the one before: what the
    block's starts loaded, proved or failed is forgotten after it; capture threads started
    in it are still stopped at exit."""
    global _current
    with _swap:
        before = _current
        state = _current = ProcessState(capturers=before.capturers)
    try:
        yield state
    finally:
        with _swap:
            _current = before
