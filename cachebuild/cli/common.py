"""What every command module shares: the command line's state and store, its output and
its argument types. Command modules import this, never ``main``.

Errors raised on purpose (``CachebuildError``) print ``error: <message>`` on one line and
exit with the error's code (2 bad usage or input, 1 an operation that failed); the group in
``main`` does that.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cachebuild import process_state
from cachebuild.errors import UsageError, one_line, printable
from cachebuild.store import StoreOptions, UnknownKey
from cachebuild.store.interface import Store
from cachebuild.units import format_duration, parse_duration, parse_size

#: Progress bars are shown only for operations on at least this many blobs.
PROGRESS_MIN_ITEMS = 16
#: A command lists at most this many items of one kind (refused bundle members, damaged
#: blobs) one per line, then says how many more there are.
MAX_LISTED = 50
#: The most worker processes or threads a command starts, and the largest world size
#: `--world-size` plans (one trace per distinct rank, in this process).
MAX_JOBS = 256
MAX_WORLD_SIZE = 1024


@dataclass
class CliState:
    """What the global options decided, shared with every command through ``ctx.obj``."""

    options: StoreOptions
    verbose: bool = False
    store: Store | None = None
    #: Where a command that only looks opened an empty store instead of making one.
    scratch: tempfile.TemporaryDirectory[str] | None = None

    def open_store(self) -> Store:
        """The store the options select (opened once, closed when the command ends)."""
        if self.store is None:
            from cachebuild.store import open_store

            self.store = open_store(self.options)
        return self.store

    def open_store_to_look(self) -> tuple[Store, bool]:
        """The store for a command that only looks (``plan``, ``explain``, ``warm
        --dry-run``), and whether it is there (``store.open_to_look``: where none is, an
        empty one in a temporary folder, removed when the command ends)."""
        if self.store is None:
            from cachebuild.store import open_to_look

            self.store, self.scratch = open_to_look(self.options)
        return self.store, self.scratch is None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None


def state_of(ctx: click.Context) -> CliState:
    """The CliState of the running command line."""
    obj = ctx.find_object(CliState)
    if obj is None:
        raise UsageError("cachebuild commands must run under the cachebuild group")
    return obj


def open_store(ctx: click.Context) -> Store:
    """The command line's store (see ``CliState.open_store``)."""
    return state_of(ctx).open_store()


def open_existing_store(ctx: click.Context) -> Store:
    """The command line's store, which must exist: a command that reads or maintains a
    store never makes an empty one where a path was mistyped (UsageError, exit 2, naming
    the path)."""
    import os

    from cachebuild.store import FORMAT_DIR, holds_store

    path = Path(state_of(ctx).options.cache_dir)
    if not holds_store(path):
        why = "no such directory" if not os.path.lexists(path) else \
            f"the directory holds no store (no {FORMAT_DIR}/ folder)"
        raise UsageError(f"no store at {path}: {why}; check --cache-dir or CACHEBUILD_DIR, "
                         "or make one with `cachebuild warm MODEL.py` or `cachebuild import "
                         "FILE`")
    return open_store(ctx)


def refuse_inside_store(file: Path, store_path: Path, what: str) -> None:
    """UsageError where ``file``, which a command is about to write, lies inside the store
    at ``store_path``: it would replace the store's own files (its index, a blob)."""
    inside, root = file.parent.resolve(), store_path.resolve()
    if inside == root or root in inside.parents:
        raise UsageError(f"cannot write {what} {file} inside the store {store_path}: give a "
                         "path outside it")


def safe_text(value: object, limit: int = 200) -> str:
    """``value`` as text that is safe to print through rich: control characters (terminal
    escape sequences among them) written as ``\\xNN``, rich markup escaped, and cut
    at ``limit`` characters. For anything that came from outside (a shared tier, a
    bundle), which must never move the cursor, recolour or hide what is printed."""
    from rich.markup import escape

    return escape(printable(value, limit))


# -- output ----------------------------------------------------------------------------

class _TrimmedLines:
    """A text stream that writes each line without trailing blanks: a table piped is as
    wide as its longest cell, and rich pads every other row to it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._line = ""

    def write(self, text: str) -> int:
        *done, self._line = (self._line + text).split("\n")
        for line in done:
            self._stream.write(line.rstrip(" ") + "\n")
        return len(text)

    def flush(self) -> None:
        if self._line:  # a line without its end yet: written as it is, blanks and all
            self._stream.write(self._line)
            self._line = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # rich draws with what the stream can encode
        return getattr(self._stream, "encoding", None) or "utf-8"


class _Console(Console):
    """rich's console, but a reader that goes away (`cachebuild ls | head`) is left to the
    command line's one handler of it (silent, the exit code of SIGPIPE), not rich's exit 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def _console(stderr: bool) -> Console:
    # On a terminal, rich fits lines to its width. Piped output is read by scripts and
    # people alike: never wrap a line or cut a key there.
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return _Console(stderr=stderr)
    return _Console(file=_TrimmedLines(stream), width=100_000, soft_wrap=True)  # type: ignore[arg-type]


def stdout() -> Console:
    return _console(stderr=False)


def stderr() -> Console:
    return _console(stderr=True)


def ago(when: float, now: float, units: int = 2) -> str:
    """How long before ``now`` ``when`` was, in at most ``units`` units: ``3m 20s ago``."""
    return format_duration(max(0.0, now - when), units=units) + " ago"


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback ``(done, total)`` drawing a rich bar once total is large enough."""
    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "progress" not in bar:
            if total < PROGRESS_MIN_ITEMS:
                return
            shown = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                             TimeRemainingColumn(), console=stderr(), transient=True)
            shown.start()
            bar["progress"], bar["task"] = shown, shown.add_task(description, total=total)
        bar["progress"].update(bar["task"], completed=done, total=total)

    try:
        yield update
    finally:
        if "progress" in bar:
            bar["progress"].stop()


#: Warning classes (by name) shown once per process on one line: the remote tier's.
ONCE_WARNINGS = ("RemoteDownWarning", "UnsignedRemoteWarning")
_default_showwarning = warnings.showwarning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    name = category.__name__
    if name not in ONCE_WARNINGS:
        _default_showwarning(message, category, filename, lineno, file, line)
        return
    if not process_state.current().first_saying(f"warning: {name}"):
        return
    click.echo(f"warning: {printable(one_line(message), 1000)}", err=True)


def install_warning_display() -> None:
    """Print the remote tier's warnings as one ``warning: ...`` line, once per process
    for each kind (a remote that is down is said once, however many calls notice)."""
    warnings.showwarning = _show_warning


# -- argument types ----------------------------------------------------------------------

def _unit_missing(value: str, examples: str) -> str | None:
    """Why ``value`` needs a unit, where it is a number without one other than 0 (0 is 0
    in every unit); ``examples`` says what to write, ``{0}`` standing for the number."""
    text = value.strip()
    try:
        if float(text) == 0:
            return None
    except ValueError:
        return None
    return f"{text!r} has no unit: give one, e.g. {examples.format(text)}"


class SizeParam(click.ParamType):
    """A size such as ``20G`` or ``512M`` (binary multiples), in bytes. ``unit``: a bare
    number other than 0 is refused (where a slip, 20 for 20G, would remove everything)."""

    name = "size"

    def __init__(self, *, unit: bool = False) -> None:
        self.unit = unit

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        why = _unit_missing(value, "{0}G or {0}M ({0}B for bytes)") if self.unit else None
        if why is not None:
            self.fail(why, param, ctx)
        return size


class DurationParam(click.ParamType):
    """A duration such as ``7d``, ``12h`` or ``1h30m``, in seconds. ``unit``: a bare number
    other than 0 is refused (where a slip, 7 for 7d, would remove everything)."""

    name = "duration"

    def __init__(self, *, unit: bool = False) -> None:
        self.unit = unit

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            seconds = parse_duration(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        why = _unit_missing(value, "{0}d or {0}h ({0}s for seconds)") if self.unit else None
        if why is not None:
            self.fail(why, param, ctx)
        return seconds


def model_file(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A MODEL.py argument, checked as it is parsed: before the command opens a store or
    says a phase, a path that names no model file is a one-line usage error."""
    from cachebuild.modelfile import check_model_file

    return str(check_model_file(value))


#: The shortest key prefix a command accepts, as git accepts abbreviated hashes.
MIN_PREFIX = 8


def resolve_key(ctx: click.Context, target: str) -> str:
    """The store key a command argument names: a key, a unique prefix of one (at least
    ``MIN_PREFIX`` hex characters, as ``plan`` and ``ls`` print them), or MODEL.py for its
    entry's key. An ambiguous prefix names the keys it matches."""
    if target.endswith(".py"):
        from cachebuild.modelfile import stored_entry_key

        return stored_entry_key(target, open_store(ctx))
    text = target.strip().lower()
    if not (len(text) >= MIN_PREFIX and all(c in "0123456789abcdef" for c in text)):
        raise UsageError(f"{target!r} is neither a store key (hex; a unique prefix of at least "
                         f"{MIN_PREFIX} characters will do) nor a MODEL.py file")
    matches = [r.key for r in open_store(ctx).records(manifests=False) if r.key.startswith(text)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UnknownKey(text)
    shown = ", ".join(sorted(matches)[:5]) + (f" and {len(matches) - 5} more"
                                              if len(matches) > 5 else "")
    raise UsageError(f"key prefix {text} is ambiguous: it matches {shown}; give more characters")
