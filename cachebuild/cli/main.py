"""The ``cachebuild`` command: the group, the options every command shares, and the table
of commands. Command modules (``store``, ``model``, ``remote``) never import this one.

``cachebuild [--cache-dir DIR] [--remote URL] [--remote-mode rw|ro|off]
[--allow-unsigned] [-v] COMMAND``. The store's environment variables (``CACHEBUILD_DIR``,
``CACHEBUILD_REMOTE``, ``CACHEBUILD_REMOTE_MODE``, ``CACHEBUILD_SIGNING_KEY``,
``CACHEBUILD_REQUIRE_SIGNATURE``, ``CACHEBUILD_ALLOW_UNSIGNED``) are read by
``cachebuild.store.options`` alone; an option given here wins over its variable.

Exit codes: 0 done; 1 the operation failed (e.g. ``verify`` found damage); 2 bad usage
or bad input; 130 interrupted by Ctrl-C (SIGINT), 143 ended by SIGTERM (the command's
cleanup runs for both). Errors
raised on purpose print ``error: <message>`` on one line.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from typing import Any

import click
from rich.logging import RichHandler

from cachebuild.cli import fleet, model, store
from cachebuild.cli.common import CliState, install_warning_display, stderr
from cachebuild.errors import CachebuildError, one_line
from cachebuild.store import StoreOptions, UnknownKey

#: Every command, by module: what ``cachebuild --help`` lists.
COMMANDS = (*store.COMMANDS, *model.COMMANDS, *fleet.COMMANDS)


#: What click 8.2+ raises for a group called with no command (8.1 prints its help itself).
_NO_ARGS: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _Terminated(KeyboardInterrupt):
    """SIGTERM, met as Ctrl-C is: what the command holds is let go on the way out (its
    build workers, its locks, a temporary store), where the default would end the process
    on the spot."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated()


def _end_on_sigterm() -> None:
    """SIGTERM raises ``_Terminated`` in this process, unless someone else handles it."""
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


class _Group(click.Group):
    """A click group that says every error the same way: one ``error: <message>`` line,
    exit 2 for bad usage or input, 1 for an operation that failed (``CachebuildError``
    carries its own code; click's usage errors are 2)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        _end_on_sigterm()
        try:
            # Not standalone, click hands back the code a command exited with (ctx.exit).
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            sys.exit(code if isinstance(code, int) else 0)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except _NO_ARGS as e:  # `cachebuild` alone: its help, as it reads
            click.echo(e.format_message())
            sys.exit(0)
        except click.ClickException as e:
            hint = ""
            ctx = getattr(e, "ctx", None)
            if isinstance(e, click.UsageError) and ctx is not None:
                hint = f" (see `{ctx.command_path} --help`)"
            message = one_line(e.format_message()).rstrip(".")
            message = message[:1].lower() + message[1:]  # as cachebuild's own messages read
            click.echo(f"error: {message}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.Abort as e:
            if isinstance(e.__context__, _Terminated):
                click.echo("error: terminated (SIGTERM)", err=True)
                sys.exit(128 + signal.SIGTERM)
            if isinstance(e.__context__, KeyboardInterrupt):  # as shells count Ctrl-C
                click.echo("error: interrupted (Ctrl-C)", err=True)
                sys.exit(128 + signal.SIGINT)
            click.echo("error: aborted", err=True)
            sys.exit(1)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CachebuildError as e:
            _details(ctx)
            hint = "; `cachebuild ls` lists the store's keys" if isinstance(e, UnknownKey) else ""
            click.echo(f"error: {one_line(e)}{hint}", err=True)
            ctx.exit(e.exit_code)
        except BrokenPipeError:
            # The reader of our output went away (`cachebuild ls | head`): nothing to say,
            # and nothing more to write; the exit code a shell gives a process SIGPIPE ends.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(128 + signal.SIGPIPE)
        except OSError as e:
            # A path that cannot be used as given (a file where a folder must be, a name
            # too long, a loop of links) or a disk that is full, met where no message was
            # made for it: one line naming the path, as every other error.
            _details(ctx)
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            where = f"{e.filename}: " if e.filename else ""
            advice = ("free some space and try again" if full else
                      "check the paths given (--cache-dir, CACHEBUILD_DIR, the files named)")
            click.echo(f"error: {where}{e.strerror or e}; {advice}", err=True)
            ctx.exit(1 if full or e.errno in (errno.EIO, errno.EROFS) else 2)


def _details(ctx: click.Context) -> None:
    """With ``-v``, the traceback of the error being handled, in the log."""
    state = ctx.obj if isinstance(ctx.obj, CliState) else None
    if state is not None and state.verbose:
        logging.getLogger("cachebuild").debug("error details", exc_info=True)


#: The handler the command line logs through (one per process, however often it runs).
_HANDLER: list[logging.Handler] = []


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Plain lines to whatever ``sys.stderr`` is when a record comes (a test runner swaps
    it between commands)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _setup_logging(verbose: bool) -> None:
    """Log lines on stderr: rich's on a terminal; plain, one line each, when stderr is a
    pipe or a file (rich would pad every line to the width piped output is given)."""
    logger = logging.getLogger("cachebuild")
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if not _HANDLER:
        if sys.stderr.isatty():
            handler: logging.Handler = RichHandler(console=stderr(), show_time=False,
                                                   show_path=False)
        else:
            handler = _Stderr()
            handler.setFormatter(logging.Formatter("%(message)s"))
        _HANDLER.append(handler)
        logger.addHandler(handler)
    logger.propagate = False


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--cache-dir", metavar="DIR",
              help="Store directory [env CACHEBUILD_DIR; default: $XDG_CACHE_HOME/cachebuild, else ~/.cache/cachebuild].")
@click.option("--remote", metavar="URL",
              help="Remote store tier (L2) shared by a fleet, e.g. redis://host:6379/0 "
                   "[env CACHEBUILD_REMOTE].")
@click.option("--remote-mode", metavar="rw|ro|off",
              help="rw: read and write the remote; ro: never write to it; off: ignore it "
                   "[env CACHEBUILD_REMOTE_MODE; default: rw].")
@click.option("--allow-unsigned", is_flag=True, default=None,
              help="Use the remote without CACHEBUILD_SIGNING_KEY (anyone who can write to "
                   "it can run code here) [env CACHEBUILD_ALLOW_UNSIGNED].")
@click.option("-v", "--verbose", is_flag=True, help="Say more about what happens.")
@click.version_option(package_name="cachebuild")
@click.pass_context
def main(ctx: click.Context, cache_dir: str | None, remote: str | None,
         remote_mode: str | None, allow_unsigned: bool | None, verbose: bool) -> None:
    """cachebuild: build torch.compile'd models once, load them from a store after."""
    _setup_logging(verbose)
    install_warning_display()
    options = StoreOptions.from_env(cache_dir=cache_dir, remote=remote, remote_mode=remote_mode,
                                    allow_unsigned=allow_unsigned or None)
    ctx.obj = CliState(options=options, verbose=verbose)
    ctx.call_on_close(ctx.obj.close)


for _command in COMMANDS:
    main.add_command(_command)
