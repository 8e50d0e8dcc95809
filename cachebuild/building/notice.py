"""A server start that must trace or build says so, before the minutes it takes.

A warm start is silent: it loads. When a start must trace (no entry, a stale one) or build
(targets missing), one warning line says what is missing, why (not warmed, the traced
source changed, a value the trace read differs, evicted or damaged), and the command that
would have avoided it. The builds then show progress: a bar on a terminal, else a line
per target, so a log shows what the start is doing; a wait that says nothing for
``QUIET_S`` seconds says that it still runs (``Heartbeat``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachebuild.store.interface import Store

log = logging.getLogger("cachebuild")

#: Seconds a long wait may go without a line on a log that is not a terminal.
QUIET_S = 15.0

#: How a lookup's ``why`` begins where the stored entry was traced for other values.
VALUES_DIFFER = "a value the trace read differs"

#: What to run instead, said with every notice where the model file is not known.
HINT = ("`cachebuild warm MODEL.py` (a file whose build() returns this model's ModelSpec) "
        "before the server starts avoids this")


def _model_file(model: Any) -> str:
    from cachebuild.trust.codehash import code_file

    return code_file(type(model)) or "its file"


def hint(model: Any, why: str = "") -> str:
    """The command that would have avoided a cold start: ``cachebuild warm`` with the
    model file where it is known (the file defining the model's class, or the script
    running, if it has a ``build()``), else the generic form. Where the stored entry was
    traced for other values (``why``), warming avoids it only for the values its
    ``build()`` gives the model: said so."""
    other_values = why.startswith(VALUES_DIFFER)
    for module in (sys.modules.get(type(model).__module__), sys.modules.get("__main__")):
        path = getattr(module, "__file__", None)
        if callable(getattr(module, "build", None)) and isinstance(path, str) and \
                os.path.isfile(path):
            if other_values:
                return (f"`cachebuild warm {path}` with its build() leaving the model as "
                        "this call finds it (the values above) avoids this")
            return f"`cachebuild warm {path}` before the server starts avoids this"
    if other_values:
        return ("`cachebuild warm MODEL.py` whose build() leaves the model as this call finds "
                "it (the values above) avoids this")
    return HINT


def reason(why: str, store: Store | None = None,
           factors: dict[str, Any] | None = None) -> str:
    """Why a model must be traced, in words, from a lookup's ``why``. Where no entry is
    stored under the model's key, ``store`` and the key's ``factors`` find the nearest
    stored entry of the same class, to say what changed since it was warmed (the model's
    source, a config value) instead of "not warmed"."""
    if why == "no entry":
        if _refused(store, factors):
            return ("its stored entry is not served here (it came unsigned from a source "
                    "no one trusted, or it is damaged: see the message above)")
        changes = _changes(store, factors)
        remote = getattr(store, "remote", None)
        if not changes and remote is not None and not remote.available:
            return (f"no stored entry was found here, and the remote {remote.display_url} "
                    "that may hold one is unavailable (see the warning above)")
        if not changes:
            return ("it was not warmed (no stored entry for this model, config and input "
                    "shapes)")
        if any(c.startswith("the file defining") for c in changes):
            # The nearest entry is found by the class's name: the same file edited since,
            # or another file defining a class of that name.
            return ("its source differs from the one warmed (its file was edited since, or "
                    f"the warmed class of that name is another file's): {'; '.join(changes)}")
        # Stored by `cachebuild warm` or by an earlier call (of this process or another):
        # either way an entry of this model's class, made with other settings.
        return f"its stored entry was made with other settings: {'; '.join(changes)}"
    from cachebuild.building.entry import STALE

    if why.startswith(STALE):
        return f"its stored entry is stale: {why}"
    if why.startswith(VALUES_DIFFER):
        return f"its stored entry was traced for other values: {why.split(': ', 1)[-1]}"
    return why


def must_trace(model: Any, why: str, store: Store | None = None,
               factors: dict[str, Any] | None = None) -> None:
    """The start will trace ``model`` with Dynamo and build what is missing: say why
    (``reason``), and what avoids it."""
    log.warning("cachebuild: compiling %s (defined in %s) from scratch because %s; tracing "
                "and building what is missing can take minutes; %s",
                type(model).__name__, _model_file(model), reason(why, store, factors),
                hint(model, why))


@contextmanager
def tracing(model: Any) -> Iterator[None]:
    """While a start traces ``model`` (seconds to minutes, no target done yet to say), a
    line every ``QUIET_S`` seconds says that it still does, as ``warm``'s log does."""
    with Heartbeat(lambda line: log.warning("cachebuild: %s", line)) as heartbeat:
        heartbeat.said(f"tracing {type(model).__name__}")
        yield


def _refused(store: Store | None, factors: dict[str, Any] | None) -> bool:
    """Whether the store holds a record under the entry key of ``factors`` that a lookup
    could not read (a blob not served: untrusted, or damaged)."""
    if store is None or not isinstance(factors, dict):
        return False
    from cachebuild.keys import make_key

    try:
        return store.get_record(make_key(factors)) is not None
    except Exception as e:  # a damaged index explains nothing; the start goes on
        log.debug("no record: %s", e)
        return False


def _changes(store: Store | None, factors: dict[str, Any] | None) -> list[str]:
    """What differs from the nearest stored entry of the model's class, in words (none:
    nothing of that class is stored)."""
    if store is None or not isinstance(factors, dict):
        return []
    from cachebuild.building.nearest import entries_of, nearest_entry

    try:
        nearest = nearest_entry(factors, entries_of(store, factors["model"]["class"]))
    except Exception as e:  # a damaged record explains nothing; the start goes on
        log.debug("no nearest entry: %s", e)
        return []
    return nearest[1][:3] if nearest else []


def must_build(model: Any, missing: int, total: int, warm: bool) -> None:
    """``missing`` of the entry's ``total`` targets will be built: say so (a warm start's
    may have failed to build when it was warmed, been evicted or been damaged; a trace's
    were never built)."""
    if warm:
        log.warning("cachebuild: %d of %d targets of %s's stored entry are missing (their "
                    "build failed when it was warmed, or gc evicted them, or they were "
                    "damaged and quarantined); building them; %s",
                    missing, total, type(model).__name__, hint(model))


class Heartbeat:
    """While a long wait runs, says ``still <what it does> (N s)`` through ``say`` each time
    ``quiet`` seconds pass with nothing said: on a log that is not a terminal (which has a
    live line instead), a phase that runs for minutes is never silent.

    ``said(what)`` tells it a line was just said and, with ``what``, what the wait does
    now (timed from then). Used as a context manager: the beats stop when the block ends,
    or for good when ``say`` fails (a closed pipe). ``due(now)`` is the line a beat would
    say at ``now``, if any, and how long to wait before the next look.
    """

    def __init__(self, say: Callable[[str], None], quiet: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._say = say
        self._quiet = QUIET_S if quiet is None else quiet
        self._clock = clock
        self._lock = threading.Lock()
        self._what: str | None = None
        self._since = self._last = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="cachebuild-heartbeat",
                                        daemon=True)

    def said(self, what: str | None = None) -> None:
        with self._lock:
            self._last = self._clock()
            if what is not None and what != self._what:
                self._what, self._since = what, self._last

    def due(self, now: float) -> tuple[str | None, float]:
        with self._lock:
            wait = self._last + self._quiet - now
            if self._what is None or wait > 0:
                # Looked at again when the beat falls due (a little after, never before).
                return None, max(wait, 0.05) if self._what else self._quiet
            self._last = now
            return f"still {self._what} ({now - self._since:.0f} s)", self._quiet

    def _beat(self) -> None:
        wait = self._quiet
        while not self._stop.wait(wait):
            line, wait = self.due(self._clock())
            if line is not None:
                try:
                    self._say(line)
                except Exception:  # nowhere to say it (a closed pipe): stop beating
                    return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def build_progress(total: int) -> Iterator[Any]:
    """A callback ``done(label, seconds)`` per target built: a bar on a terminal, else one
    log line per target, and one every ``QUIET_S`` seconds that no target finished."""
    if total <= 0:
        yield lambda label, seconds: None
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(TextColumn("building {task.description}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("", total=total)

            seen: set[str] = set()

            def advance(label: str, seconds: float) -> None:
                # A target built again (removed from the store meanwhile) is not one more.
                progress.update(task, advance=0 if label in seen else 1,
                                description=f"{label} ({seconds:.1f} s)")
                seen.add(label)

            yield advance
        return
    built: set[str] = set()
    start = time.perf_counter()
    with Heartbeat(lambda line: log.warning("cachebuild: %s", line)) as heartbeat:
        heartbeat.said(f"building {total} target{'s' if total != 1 else ''}")

        def line(label: str, seconds: float) -> None:
            if label in built:  # removed from the store meanwhile (a gc), built again
                log.warning("cachebuild: built %s again in %.1f s (%.0f s so far)", label,
                            seconds, time.perf_counter() - start)
            else:
                built.add(label)
                log.warning("cachebuild: built %s in %.1f s (%d of %d, %.0f s so far)", label,
                            seconds, len(built), total, time.perf_counter() - start)
            heartbeat.said(f"building, {len(built)} of {total} targets done"
                           if len(built) < total else None)

        yield line
