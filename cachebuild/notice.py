"""A server start that must trace or build says so, before the minutes it takes.

A warm start is silent: it loads. When a start must trace (no entry, a stale one) or build
(targets missing), one warning line says what is missing, why (not warmed, the traced
source changed, a value the trace read differs, evicted or damaged), and the command that
would have avoided it. The builds then show progress: a bar on a terminal, else a line
per target, so a log shows what the start is doing.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("cachebuild")

#: What to run instead, said with every notice.
HINT = ("`cachebuild warm MODEL.py` (a file whose build() returns this model's ModelSpec) "
        "before the server starts avoids this")


def _model_file(model: Any) -> str:
    try:
        return inspect.getsourcefile(type(model)) or "its file"
    except (OSError, TypeError):
        return "its file"


def must_trace(model: Any, why: str) -> None:
    """The start will trace ``model`` with Dynamo and build what is missing: say why."""
    if why == "no entry":
        reason = "it was not warmed (no stored entry for this model, config and input shapes)"
    elif why.startswith("traced source changed"):
        reason = f"its stored entry is stale: {why}"
    elif why.startswith("a value the trace read differs"):
        reason = f"its stored entry was traced for other values: {why.split(': ', 1)[-1]}"
    else:
        reason = why
    log.warning("cachebuild: compiling %s (defined in %s) from scratch because %s; tracing "
                "and building what is missing can take minutes; %s",
                type(model).__name__, _model_file(model), reason, HINT)


def must_build(model: Any, missing: int, total: int, warm: bool) -> None:
    """``missing`` of the entry's ``total`` targets will be built: say so (a warm start
    whose targets went missing was evicted or damaged; a trace's were never built)."""
    if warm:
        log.warning("cachebuild: %d of %d targets of %s's stored entry are missing (evicted "
                    "by gc, or damaged and quarantined); building them; %s",
                    missing, total, type(model).__name__, HINT)


@contextmanager
def build_progress(total: int) -> Iterator[Any]:
    """A callback ``done(label, seconds)`` per target built: a bar on a terminal, else one
    log line per target."""
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

            def advance(label: str, seconds: float) -> None:
                progress.update(task, advance=1, description=f"{label} ({seconds:.1f} s)")

            yield advance
        return
    count = [0]
    start = time.perf_counter()

    def line(label: str, seconds: float) -> None:
        count[0] += 1
        log.warning("cachebuild: built %s in %.1f s (%d of %d, %.0f s so far)", label, seconds,
                    count[0], total, time.perf_counter() - start)

    yield line
