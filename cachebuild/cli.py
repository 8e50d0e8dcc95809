"""The ``cachebuild`` command line.

``cachebuild [--cache-dir DIR] [--remote URL] [--remote-mode rw|ro|off]
[--allow-unsigned] [-v] COMMAND``. This module holds the group, the options every command
shares, the store commands (``ls``, ``stats``, ``gc``, ``verify``, ``pin``, ``unpin``,
``export``, ``import``) and ``open_store`` for command modules elsewhere, which add their
commands with ``register``.

With a remote configured, a remote that is down or stops answering costs one warning
(``warning: ...`` on stderr, once per process) and the command carries on with the local
store.

Exit codes: 0 done; 1 the operation failed (e.g. ``verify`` found damage); 2 bad usage
or bad input. Errors raised on purpose (``CachebuildError``) print ``error: <message>``
on one line, without a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from cachebuild.errors import CachebuildError, UsageError
from cachebuild.units import format_duration, format_size, parse_duration, parse_size

#: Progress bars are shown only for operations on at least this many blobs.
PROGRESS_MIN_ITEMS = 16


@dataclass
class CliState:
    """What the global options decided, shared with every command through ``ctx.obj``."""

    cache_dir: Path | None = None
    remote: str | None = None
    remote_mode: str | None = None
    allow_unsigned: bool = False
    verbose: bool = False
    store: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class _Group(click.Group):
    """A click group that turns CachebuildError into ``error: <message>`` and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CachebuildError as e:
            state = ctx.obj if isinstance(ctx.obj, CliState) else None
            if state is not None and state.verbose:
                logging.getLogger("cachebuild").debug("error details", exc_info=True)
            click.echo(f"error: {_one_line(e)}", err=True)
            ctx.exit(e.exit_code)


class SizeParam(click.ParamType):
    """A size such as ``20G`` or ``512M`` (binary multiples), in bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class DurationParam(click.ParamType):
    """A duration such as ``7d``, ``12h`` or ``1h30m``, in seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _stdout() -> Console:
    # Piped output is read by people and scripts alike: never squeeze or cut keys.
    return Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def _entries(n: int) -> str:
    return "1 entry" if n == 1 else f"{n} entries"


def _stderr() -> Console:
    return Console(stderr=True)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              envvar="CACHEBUILD_DIR", show_envvar=True,
              help="Store directory [default: ~/.cache/cachebuild].")
@click.option("--remote", metavar="URL", envvar="CACHEBUILD_REMOTE", show_envvar=True,
              help="Remote store tier (L2) shared by a fleet, e.g. redis://host:6379/0.")
@click.option("--remote-mode", metavar="rw|ro|off", envvar="CACHEBUILD_REMOTE_MODE",
              show_envvar=True,
              help="rw: read and write the remote; ro: never write to it; off: ignore it "
                   "[default: rw].")
@click.option("--allow-unsigned", is_flag=True, envvar="CACHEBUILD_ALLOW_UNSIGNED",
              show_envvar=True,
              help="Use the remote without CACHEBUILD_SIGNING_KEY (anyone who can write to "
                   "it can run code here).")
@click.option("-v", "--verbose", is_flag=True, help="Say more about what happens.")
@click.version_option(package_name="cachebuild")
@click.pass_context
def main(ctx: click.Context, cache_dir: Path | None, remote: str | None,
         remote_mode: str | None, allow_unsigned: bool, verbose: bool) -> None:
    """cachebuild: build torch.compile'd models once, load them from a store after."""
    ctx.obj = CliState(cache_dir=cache_dir, remote=remote or None,
                       remote_mode=remote_mode.strip().lower() if remote_mode else None,
                       allow_unsigned=allow_unsigned, verbose=verbose)
    if ctx.obj.remote_mode is not None and ctx.obj.remote_mode not in REMOTE_MODES:
        raise UsageError(f"--remote-mode (CACHEBUILD_REMOTE_MODE) must be one of "
                         f"{', '.join(REMOTE_MODES)}, not {remote_mode!r}")
    _setup_logging(verbose)
    install_warning_display()
    ctx.call_on_close(lambda: _close_store(ctx.obj))


#: Modes of the remote tier (as ``cachebuild.store.tiered.MODES``, without importing it).
REMOTE_MODES = ("rw", "ro", "off")

#: Warning classes (by name) shown once per process on one line: the remote tier's.
_ONCE_WARNINGS = ("RemoteDownWarning", "UnsignedRemoteWarning")
_shown_once: set[str] = set()
_default_showwarning = warnings.showwarning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    name = category.__name__
    if name not in _ONCE_WARNINGS:
        _default_showwarning(message, category, filename, lineno, file, line)
        return
    if name in _shown_once:
        return
    _shown_once.add(name)
    click.echo(f"warning: {_one_line(message if isinstance(message, Warning) else Warning(message))}",
               err=True)


def install_warning_display() -> None:
    """Print the remote tier's warnings as one ``warning: ...`` line, once per process
    for each kind (a remote that is down is said once, however many calls notice)."""
    warnings.showwarning = _show_warning


def _setup_logging(verbose: bool) -> None:
    logger = logging.getLogger("cachebuild")
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(console=_stderr(), show_time=False, show_path=False))
    logger.propagate = False


def _close_store(state: CliState) -> None:
    if state.store is not None:
        state.store.close()
        state.store = None


def state_of(ctx: click.Context) -> CliState:
    """The CliState of the running command line."""
    obj = ctx.find_object(CliState)
    if obj is None:
        raise UsageError("cachebuild commands must run under the cachebuild group")
    return obj


def store_options(ctx: click.Context) -> dict[str, Any]:
    """What decides the store: ``cache_dir``, ``remote``, ``mode`` and ``allow_unsigned``
    (picklable, so that worker processes open the same store)."""
    state = state_of(ctx)
    return {"cache_dir": str(state.cache_dir) if state.cache_dir else None,
            "remote": state.remote, "mode": state.remote_mode,
            "allow_unsigned": state.allow_unsigned}


def open_store_from(options: dict[str, Any]) -> Any:
    """The store ``store_options`` describes: a ``TieredStore`` (L1 + Redis) when a remote
    is configured, else the ``LocalStore``."""
    from cachebuild.store import LocalStore  # the store is not needed for --help

    cache_dir = Path(options["cache_dir"]) if options.get("cache_dir") else None
    if not options.get("remote"):
        return LocalStore.from_env(cache_dir)
    from cachebuild.store.tiered import open_store as open_tiered

    return open_tiered(cache_dir, options["remote"], allow_unsigned=options["allow_unsigned"],
                       mode=options.get("mode"))


def open_store(ctx: click.Context) -> Any:
    """The store that the global options and environment select (opened once).

    ``--cache-dir``/``CACHEBUILD_DIR`` pick the directory; ``CACHEBUILD_SIGNING_KEY`` and
    ``CACHEBUILD_REQUIRE_SIGNATURE`` configure signing. With ``--remote``/
    ``CACHEBUILD_REMOTE`` it is a ``TieredStore`` (``--remote-mode``, ``--allow-unsigned``).
    Raises StoreError (exit 1) if the directory is unsafe or unusable, UsageError (exit 2)
    for a bad remote URL or mode, or a remote without a signing key.
    """
    state = state_of(ctx)
    if state.store is None:
        state.store = open_store_from(store_options(ctx))
    return state.store


def register(command: click.Command) -> click.Command:
    """Add ``command`` (a click command or group) to ``cachebuild``; returns it unchanged,
    so it can be used as a decorator."""
    main.add_command(command)
    return command


def no_model_commands(path: str, ctx: click.Context) -> str:
    """The default ``resolve_model_entry_key``: refuses, naming what is missing."""
    raise UsageError(f"{path}: pinning a model file needs the model commands")


#: ``resolve_model_entry_key(path, ctx) -> key``: the entry key of the model defined in
#: ``path`` (a MODEL.py file). The model commands provide it by rebinding this name;
#: ``pin``, ``unpin`` and ``export`` look it up at call time.
resolve_model_entry_key: Callable[[str, click.Context], str] = no_model_commands


def _resolve_target(ctx: click.Context, target: str) -> str:
    from cachebuild.store.layout import check_key

    if target.endswith(".py"):
        return sys.modules[__name__].resolve_model_entry_key(target, ctx)
    try:
        return check_key(target)
    except ValueError:
        raise UsageError(f"{target!r} is neither a store key (hex, e.g. 32 chars) nor a "
                         "MODEL.py file") from None


@contextmanager
def _progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback ``(done, total)`` drawing a rich bar once total is large enough."""
    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "progress" not in bar:
            if total < PROGRESS_MIN_ITEMS:
                return
            progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=_stderr(), transient=True)
            progress.start()
            bar["progress"], bar["task"] = progress, progress.add_task(description, total=total)
        bar["progress"].update(bar["task"], completed=done, total=total)

    try:
        yield update
    finally:
        if "progress" in bar:
            bar["progress"].stop()


def _ago(when: float, now: float) -> str:
    return format_duration(max(0.0, now - when)) + " ago"


# -- commands -------------------------------------------------------------------------


@main.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (records with manifests).")
@click.option("--kind", metavar="KIND", help="Only entries of this kind.")
@click.pass_context
def ls_command(ctx: click.Context, as_json: bool, kind: str | None) -> None:
    """List stored entries, most recently used first."""
    store = open_store(ctx)
    records = sorted(store.entries(kind=kind, manifests=as_json),
                     key=lambda r: r.last_used, reverse=True)
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2))
        return
    now = time.time()
    table = Table(title=f"{_entries(len(records))} in {store.root}", title_justify="left",
                  box=box.SIMPLE_HEAD)
    table.add_column("key", no_wrap=True, min_width=32)
    table.add_column("kind")
    table.add_column("size", justify="right")
    table.add_column("created")
    table.add_column("last used")
    table.add_column("hits", justify="right")
    table.add_column("pinned")
    table.add_column("refs", justify="right")
    for r in records:
        table.add_row(r.key, r.kind, format_size(r.size), _ago(r.created, now),
                      _ago(r.last_used, now), str(r.hits), "yes" if r.pinned else "",
                      str(len(r.refs)) if r.refs else "")
    _stdout().print(table)


@main.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def stats_command(ctx: click.Context, as_json: bool) -> None:
    """Entries, sizes, hits and misses of the store; with a remote, also by tier (L1/L2)."""
    from cachebuild.backends.probe import cached_verdicts

    store = open_store(ctx)
    remote = getattr(store, "remote", None)
    if remote is not None:
        remote.ping()  # so that the health shown is now's (a remote that is down warns once)
    stats = store.stats()
    verdicts = cached_verdicts(getattr(store, "probe_dir", None))
    stats["toolchains"] = [v.to_json() | {"summary": v.describe()} for v in verdicts]
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    table = Table(show_header=False, box=box.SIMPLE)
    table.add_column("what")
    table.add_column("value")
    rate = "–" if stats["hit_rate"] is None else f"{stats['hit_rate']:.1%}"
    rows = [("store", stats["path"]),
            ("entries", str(stats["entries"])),
            ("payload", format_size(stats["bytes"])),
            ("on disk", format_size(stats["disk_bytes"])),
            ("pinned", str(stats["pinned"])),
            ("hits", str(stats["hits"])),
            ("misses", str(stats["misses"])),
            ("hit rate", rate),
            ("quarantined", str(stats["quarantined"]))]
    for kind, k in stats["by_kind"].items():
        rows.append((f"  kind {kind}", f"{k['entries']} ({format_size(k['bytes'])})"))
    tiers = stats.get("tiers")
    if tiers is not None and tiers.get("remote") is not None:
        health = "up" if tiers["remote_available"] else "down"
        rows += [("remote", f"{tiers['remote']} ({tiers['remote_mode']}, {health}, "
                            f"{'signed' if tiers['signed'] else 'unsigned'})"),
                 ("L1 hits", str(tiers["l1_hits"])),
                 ("L2 hits", str(tiers["l2_hits"])),
                 ("tier misses", str(tiers["misses"])),
                 ("remote rejected", str(tiers["remote_rejected"])),
                 ("remote incomplete", str(tiers["remote_incomplete"])),
                 ("remote errors", str(tiers["remote_errors"]))]
    for v in verdicts:  # which flavour and compiler this machine builds with, and why
        rows.append((f"toolchain ({v.device})", v.describe().split(": ", 1)[1]))
    for what, value in rows:
        table.add_row(what, value)
    _stdout().print(table)


@main.command("gc")
@click.option("--max-size", type=SizeParam(), metavar="SIZE",
              help="Evict least recently used entries until the store fits, e.g. 20G.")
@click.option("--older-than", type=DurationParam(), metavar="AGE",
              help="Evict entries unused for this long, e.g. 7d.")
@click.option("--dry-run", is_flag=True, help="Show what would go; remove nothing.")
@click.pass_context
def gc_command(ctx: click.Context, max_size: int | None, older_than: float | None,
               dry_run: bool) -> None:
    """Evict entries, least recently used first; pinned entries and what they refer to stay."""
    store = open_store(ctx)
    report = store.gc(max_size=max_size, older_than=older_than, dry_run=dry_run)
    out = _stdout()
    verb = "would remove" if dry_run else "removed"
    if dry_run and report.removed:
        table = Table(title="would remove", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("key", "kind", "size", "last used"):
            table.add_column(col, no_wrap=col == "key", min_width=32 if col == "key" else None)
        now = time.time()
        for key in report.removed:
            r = store.get_record(key)
            if r is not None:
                table.add_row(key, r.kind, format_size(r.size), _ago(r.last_used, now))
        out.print(table)
    out.print(f"{verb} {_entries(len(report.removed))} ({format_size(report.freed_bytes)}); "
              f"store {'would be' if dry_run else 'is now'} {format_size(report.bytes_after)} "
              f"in {_entries(report.entries_after)}, {report.kept_pinned} kept by pins")
    if report.tmp_removed or report.orphans_removed:
        out.print(f"cleaned {report.tmp_removed} abandoned temp files and "
                  f"{report.orphans_removed} unrecorded blobs")
    if report.over_cap:
        click.echo(f"warning: pinned entries alone take {format_size(report.bytes_after)}, "
                   f"more than --max-size {format_size(max_size or 0)}", err=True)


@main.command("verify")
@click.option("--repair", is_flag=True, help="Quarantine damaged blobs and drop their records.")
@click.pass_context
def verify_command(ctx: click.Context, repair: bool) -> None:
    """Check every blob; exit 1 if any is damaged and was not repaired."""
    store = open_store(ctx)
    with _progress("verifying") as progress:
        report = store.verify(repair=repair, progress=progress)
    for key, reason in report.damaged:
        click.echo(f"damaged {key}: {reason}" + (" (quarantined)" if repair else ""), err=True)
    summary = f"checked {report.checked} blobs: {report.ok} ok, {len(report.damaged)} damaged"
    if report.tmp_removed or report.orphans_removed:
        summary += (f"; cleaned {report.tmp_removed} abandoned temp files and "
                    f"{report.orphans_removed} unrecorded blobs")
    click.echo(summary)
    if report.damaged and not repair:
        click.echo("run `cachebuild verify --repair` to quarantine them", err=True)
        ctx.exit(1)


@main.command("pin")
@click.argument("target", metavar="KEY|MODEL.py")
@click.pass_context
def pin_command(ctx: click.Context, target: str) -> None:
    """Keep an entry (and everything it refers to) from GC."""
    key = _resolve_target(ctx, target)
    open_store(ctx).pin(key)
    click.echo(f"pinned {key}")


@main.command("unpin")
@click.argument("target", metavar="KEY|MODEL.py")
@click.pass_context
def unpin_command(ctx: click.Context, target: str) -> None:
    """Let GC remove an entry again."""
    key = _resolve_target(ctx, target)
    open_store(ctx).unpin(key)
    click.echo(f"unpinned {key}")


@main.command("export")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model", required=False, metavar="[MODEL.py|KEY]")
@click.option("--kind", "kinds", multiple=True, metavar="KIND",
              help="Only entries of this kind (repeatable).")
@click.pass_context
def export_command(ctx: click.Context, file: Path, model: str | None,
                   kinds: tuple[str, ...]) -> None:
    """Write entries to a bundle FILE (.tar, or .tar.gz to compress): all of them, or a
    model's entry and everything it refers to."""
    from cachebuild.store import export_bundle

    store = open_store(ctx)
    keys = [_resolve_target(ctx, model)] if model else None
    with _progress("exporting") as progress:
        report = export_bundle(store, file, keys=keys, kinds=kinds or None, progress=progress)
    click.echo(f"exported {_entries(len(report.exported))} ({format_size(report.bytes)}) "
               f"to {file}")
    for key, reason in report.skipped:
        click.echo(f"skipped {key}: {reason}", err=True)
    if report.skipped:
        ctx.exit(1)


@main.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.pass_context
def import_command(ctx: click.Context, file: Path) -> None:
    """Import a bundle, re-verifying every blob; damaged entries are refused (exit 1)."""
    from cachebuild.store import import_bundle

    store = open_store(ctx)
    with _progress("importing") as progress:
        report = import_bundle(store, file, progress=progress)
    click.echo(f"imported {_entries(len(report.imported))} from {file}"
               + (f", {len(report.existing)} already present" if report.existing else ""))
    for name, reason in report.refused:
        click.echo(f"refused {name}: {reason}", err=True)
    if report.refused:
        click.echo(f"error: refused {len(report.refused)} damaged or incomplete entries",
                   err=True)
        ctx.exit(1)


# -- more commands ----------------------------------------------------------------------
# Command modules elsewhere in cachebuild import this module and add their commands with
# ``register(command)``; ``main`` stays the entry point.

# Model commands (warm, plan, explain) and remote tier commands (push, pull).
from cachebuild import cli_model, cli_remote  # noqa: E402,F401

if __name__ == "__main__":
    # Under ``python -m`` this file runs as __main__, a second copy of the module;
    # command modules registered with the importable one, so run that one's group.
    from cachebuild.cli import main as _main

    _main(prog_name="cachebuild")
