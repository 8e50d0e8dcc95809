"""Model commands: ``warm``, ``plan``, ``explain``.

They parse their arguments and print the library's reports: ``warm`` and ``plan`` those
of ``cachebuild.warming.warm`` and ``plan`` (trace once, build every missing target in
worker processes under the key's lock, record the entry), ``explain`` that of
``cachebuild.explain.explain`` (why a model's entry or targets are not stored, in
words). ``plan`` and ``explain`` change nothing in the store.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from cachebuild.building.notice import Heartbeat
from cachebuild.cli.common import (
    MAX_JOBS,
    MAX_WORLD_SIZE,
    model_file,
    printable,
    safe_text,
    state_of,
    stderr,
    stdout,
)
from cachebuild.errors import one_line
from cachebuild.units import plural

if TYPE_CHECKING:
    from cachebuild.explain import EntryExplanation
    from cachebuild.store.interface import Store
    from cachebuild.warming import PlanReport, TargetReport

# torch and the build graph are imported inside the commands: `cachebuild ls` and
# `--help` should not pay for them.


def _console() -> Console:
    return stderr()


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``ranks 0-2, 5``; ``[3]`` → ``rank 3``."""
    parts: list[str] = []
    for r in sorted(set(ranks)):
        if parts and parts[-1].split("-")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + ", ".join(parts)


def _phases_line(target: TargetReport) -> str | None:
    """``  export 0.3 s, lowering 3.0 s, ...``: where a built target's time went."""
    from cachebuild.clock import detail

    if target.state != "built" or not target.phases:
        return None
    return "  " + detail(target.phases, target.reused)


class _Phases(logging.Handler):
    """What a long wait is doing (the ``cachebuild.progress`` log: the probe, the trace,
    the builds), shown as it starts: ``show(line)`` for each record."""

    def __init__(self, show: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.show(record.getMessage())


@contextmanager
def _phases(show: Callable[[str], None]) -> Iterator[None]:
    """Route the ``cachebuild.progress`` log to ``show`` while the block runs (and to
    nothing else: the command shows it its own way)."""
    logger = logging.getLogger("cachebuild.progress")
    handler = _Phases(show)
    saved = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextmanager
def _progress(console: Console, verbose: bool = False
              ) -> Iterator[tuple[Callable[[TargetReport, int, int], None],
                                  Callable[[str], None]]]:
    """``(on_target, on_phase)``: a callback per target finished, and one per phase of the
    work as it starts (importing the model, the toolchain probe, the trace, the builds).
    On a terminal, one live line shows the phase (a bar once targets finish) and the time
    since the command started; elsewhere, each phase and each target is a line, at once,
    so that a log shows what the command is doing, and a phase that says nothing for a
    while says that it still runs (``Heartbeat``). ``verbose``: each built target's
    phases on a line of their own."""
    started = time.perf_counter()
    if not console.is_terminal:
        def say(text: str) -> None:
            console.print(f"[{time.perf_counter() - started:5.1f} s] {text}", markup=False,
                          highlight=False)

        with Heartbeat(say) as heartbeat:
            def line(target: TargetReport, done: int, total: int) -> None:
                what = {"built": "built", "failed": "failed",
                        "stored": "found stored"}[target.state]
                failed = target.state == "failed" and target.error
                why = f": {printable(one_line(target.error), 300)}" if failed else ""
                console.print(f"{what} {target.label} in {target.seconds:.1f} s ({done} of "
                              f"{total}){why}", markup=False, highlight=False)
                phases = _phases_line(target) if verbose else None
                if phases:
                    console.print(phases, markup=False, highlight=False)
                heartbeat.said(f"building, {done} of {total} targets done" if done < total
                               else "finishing, every target done")

            def phase(text: str) -> None:
                say(text)
                heartbeat.said(text)

            with _phases(phase):
                yield line, phase
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting", total=None)

        def advance(target: TargetReport, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total,
                            description=f"{target.label} {target.seconds:.1f} s")
            phases = _phases_line(target) if verbose else None
            if phases:
                progress.console.print(f"{target.label}:{phases}", markup=False,
                                       highlight=False)

        def phase(text: str) -> None:
            progress.update(task, description=escape(text))

        with _phases(phase):
            yield advance, phase


@click.command("warm")
@click.argument("model", type=click.Path(dir_okay=False), callback=model_file)
@click.option("--jobs", "-j", type=click.IntRange(min=1, max=MAX_JOBS), default=None,
              help="Worker processes building targets (default: CACHEBUILD_BUILD_JOBS "
                   "where set, else one per target to build, at most one per CPU this "
                   "process may use and per CACHEBUILD_BUILD_MEMORY of available memory).")
@click.option("--device", metavar="D", help="Move the model and inputs to D (e.g. cuda:0).")
@click.option("--dry-run", is_flag=True, help="Show what would be built; build nothing.")
@click.option("--world-size", type=click.IntRange(min=1, max=MAX_WORLD_SIZE), default=None,
              metavar="N",
              help="MODEL.py is tensor-parallel: plan each of N ranks in this process under "
                   "torch's fake process group (no GPUs, no other processes) and build "
                   "each unique target once for the whole group.")
@click.option("--watch", is_flag=True,
              help="Keep running: warm again each time MODEL.py, a file its model was "
                   "traced from or a module of yours it loaded changes, in a process that "
                   "imported torch and set up Inductor while you edited. Ctrl-C ends.")
@click.option("--round", "round_", is_flag=True, hidden=True,
              help="One round of --watch: prepare, wait for a line on stdin, then warm.")
@click.pass_context
def warm_command(ctx: click.Context, model: str, jobs: int | None, device: str | None,
                 dry_run: bool, world_size: int | None, watch: bool, round_: bool) -> None:
    """Build every missing target of MODEL.py ahead of deploy and record its entry.

    MODEL.py defines build() -> cachebuild.ModelSpec. A target that fails is reported with
    its piece, bucket, key and the compiler's message; the others still build (exit 1).
    With --world-size N, build() is called once per rank, with torch.distributed's rank
    and world size set as torchrun would (a fake process group), and every rank's entry
    is recorded. With --watch, it warms again after each edit until Ctrl-C.
    """
    from cachebuild.warming import warm

    if watch:
        if dry_run:
            raise click.UsageError("--watch builds after each edit: leave out --dry-run")
        _watch(ctx, model, jobs, device, world_size)
        return
    console = _console()
    say = _say(console)
    verbose = bool(getattr(ctx.obj, "verbose", False))
    here, read = 0, None
    if round_:
        from cachebuild import watching

        here = _round_ready(device)
        if not here:
            return
        read = watching.ReadStamps()
    try:
        with _progress(console, verbose) as (on_target, _):
            report = warm(model, store=_store_for(ctx, look=dry_run), jobs=jobs,
                          device=device, world_size=world_size, dry_run=dry_run, say=say,
                          on_target=on_target, here=here)
    except KeyboardInterrupt:
        if not round_:
            raise
        # A round is stopped by its watching command (Ctrl-C there), which says so: no
        # error line of its own, its builds ended and the store whole all the same.
        ctx.exit(128 + signal.SIGINT)
    except Exception as e:
        if round_:
            # A failed round still says what to watch: the modules it loaded and the files
            # its error names (a helper with a syntax error never ran; a module not found
            # may be made next to the model file), so that the fix warms again.
            from cachebuild import watching

            watching.tell_files([*watching.watched_files(None, []),
                                 *watching.error_files(e, model)],
                                False, read.stop() if read is not None else None, error=True)
        raise
    if dry_run:
        _plan_table(report, console, state_of(ctx).open_store())
        would = len(report.targets) - len(report.with_state("stored"))
        console.print(f"dry run: {would} of {len(report.targets)} targets would be built")
        return
    for entry in report.entries:
        if entry.recorded is False:
            console.print(f"[yellow]no entry recorded[/yellow] (no warm start without Dynamo): "
                          f"{escape(entry.unrecordable or '')}")
    for target in report.failed:
        console.print(f"[red]failed[/red] {target.label} key {target.key}: "
                      f"{escape(target.error or '')}")
    total = len(report.targets)
    if verbose and report.phases:
        console.print("model: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.phases.items()),
                      markup=False, highlight=False)
    console.print(
        f"{plural(total, 'target')}: {len(report.stored)} already stored, "
        f"{len(report.built)} built, {len(report.failed)} failed, in {report.seconds:.1f} s; "
        f"{_entries_said(report)}")
    if round_:
        from cachebuild import watching

        store = state_of(ctx).open_store()
        watching.tell_files(watching.watched_files(store, [e.key for e in report.entries]),
                            report.ok, read.stop() if read is not None else None)
    if not report.ok:
        ctx.exit(1)


def _round_ready(device: str | None) -> int:
    """A round of ``--watch``: make the imports and set-up every round needs, then wait
    for the watching process to say go. How many missing targets to build in this
    process (set up for them), or 0 where the watching process has gone."""
    from cachebuild import watching

    # The watching process ends a round that waits by closing its stdin, and one under
    # way with SIGINT: this one waits for neither.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        watching.prepare(device)
        if not watching.wait_for_go():
            return 0
    finally:
        signal.signal(signal.SIGINT, previous)
    return 1


def _watch(ctx: click.Context, model: str, jobs: int | None, device: str | None,
           world_size: int | None) -> None:
    """``warm --watch``: rounds of ``warm --round`` with this command's options, until
    Ctrl-C."""
    from cachebuild import watching

    top = ctx.find_root().params
    args: list[str] = []
    for name in ("cache_dir", "remote", "remote_mode"):
        if top.get(name) is not None:
            args += ["--" + name.replace("_", "-"), str(top[name])]
    args += ["--allow-unsigned"] if top.get("allow_unsigned") else []
    args += ["-v"] if top.get("verbose") else []
    args += ["warm", model, "--round"]
    for flag, value in (("--jobs", jobs), ("--device", device), ("--world-size", world_size)):
        if value is not None:
            args += [flag, str(value)]
    console = _console()
    verbose = bool(getattr(ctx.obj, "verbose", False))

    def ready(seconds: float) -> None:
        console.print(f"ready for the next edit (set up in {seconds:.1f} s)", highlight=False)

    try:
        watching.watch(args, model, _say(console), ready if verbose else None)
    except KeyboardInterrupt as e:
        if type(e) is not KeyboardInterrupt:  # SIGTERM: ended as every command is
            raise
        console.print("stopped watching")  # Ctrl-C is how a watch ends: exit 0


def _store_for(ctx: click.Context, look: bool = False) -> Store:
    """The command line's store (its worker processes ask it how to open it again), once
    the building variables of the environment hold (``settings.check_settings``). A
    command that only looks (``look``) makes no store where there is none: it says so
    and looks in an empty one (``CliState.open_store_to_look``)."""
    from cachebuild.building.settings import check_settings

    check_settings()
    state = state_of(ctx)
    if not look:
        return state.open_store()
    where = state.options.cache_dir
    store, there = state.open_store_to_look()
    if not there:
        shown = ("only what the remote tier holds is shown as stored" if
                 state.options.uses_remote else "every target is shown as missing")
        _console().print(f"no store at {safe_text(where)} yet: {shown} (nothing is made "
                         "there; `cachebuild warm MODEL.py` builds one)", highlight=False)
    return store


def _say(console: Console) -> Callable[[str], None]:
    return lambda text: console.print(text, markup=False, highlight=False)


def _entries_said(report: PlanReport) -> str:
    """``entry KEY``, or for a world size each distinct entry with the ranks it serves."""
    if report.world_size is None:
        if report.entries and report.entries[0].recorded is False:
            # Its targets are stored; a start traces the model (Dynamo) to find them.
            return "no entry recorded: every start traces the model, then loads these targets"
        return f"entry {report.entry_key}"
    return "entries " + ", ".join(f"{e.key} ({rank_ranges(e.ranks)})" for e in report.entries)


def _plan_table(report: PlanReport, console: Console, store: Store) -> None:
    """Each unique target once, with the pieces using it (and, for a world size, the
    ranks), and its state."""
    if report.world_size is None:
        entry = report.entries[0]
        untrusted = _not_trusted(store, entry.key) if entry.why != "fresh" else None
        state = ("stored" if entry.why == "fresh" else untrusted if untrusted is not None
                 else "none yet" if entry.why == "no entry" else f"not used: {entry.why}")
        title = f"entry {entry.key} ({state})"
    else:
        n = len(report.entries)
        title = (f"{report.world_size} ranks: {n} entr{'y' if n == 1 else 'ies'}, "
                 f"{len(report.targets)} unique targets")
    # As ``ls`` draws its table: a rule under the header, and whole keys (to paste).
    table = Table(title=escape(title), title_justify="left", box=box.SIMPLE_HEAD)
    columns = ["piece", "bucket", "key"] + (["used by"] if report.world_size else []) + ["state"]
    for column in columns:
        table.add_column(column, no_wrap=column == "key")
    for t in report.targets:
        row = [", ".join(map(str, t.pieces)), t.bucket, t.key]
        if report.world_size:
            row.append(rank_ranges(t.ranks))
        table.add_row(*row, t.state)
    console.print(table)


def _not_trusted(store: Store, key: str) -> str | None:
    """Why a stored record is not served where no one trusted where it came from (None:
    it is not stored, or is trusted)."""
    record = store.local.get_record(key)  # a look: no tier copies anything here
    if record is None or not record.is_untrusted:
        return None
    origin = printable(record.unsigned_from or "")
    return f"stored but not trusted: `cachebuild trust '{origin}'` serves it"


_WORLD_SIZE = click.option(
    "--world-size", type=click.IntRange(min=1, max=MAX_WORLD_SIZE), default=None, metavar="N",
    help="MODEL.py is tensor-parallel: plan each of N ranks under torch's fake process group.")


@click.command("plan")
@click.argument("model", type=click.Path(dir_okay=False), callback=model_file)
@click.option("--device", metavar="D", help="Move the model and inputs to D first.")
@_WORLD_SIZE
@click.pass_context
def plan_command(ctx: click.Context, model: str, device: str | None,
                 world_size: int | None) -> None:
    """Show MODEL.py's targets and their state (stored / missing / stale); build nothing.
    With --world-size, each unique target of the group once, with the ranks using it."""
    from cachebuild.warming import plan

    console = _console()
    with _progress(console) as (_, on_phase):
        report = plan(model, store=_store_for(ctx, look=True), device=device,
                      world_size=world_size, say=_say(console))
    _plan_table(report, stdout(), state_of(ctx).open_store())


@click.command("explain")
@click.argument("model", type=click.Path(dir_okay=False), callback=model_file)
@click.option("--device", metavar="D", help="Move the model and inputs to D first.")
@_WORLD_SIZE
@click.pass_context
def explain_command(ctx: click.Context, model: str, device: str | None,
                    world_size: int | None) -> None:
    """For every missing target of MODEL.py, the nearest stored one and what differs
    (with --world-size: of every rank, naming the ranks a target serves)."""
    from cachebuild.explain import explain

    with _progress(_console()):  # importing the model, tracing it: said as they start
        report = explain(model, store=_store_for(ctx, look=True), device=device,
                         world_size=world_size)
    console = stdout()
    # Manifests may come from a shared tier: everything is printed as plain, escaped text.
    for entry in report.entries:
        console.print(_entry_said(entry, model), markup=False, emoji=False, highlight=False)
    for t in report.targets:
        nearest = f"nearest {t.nearest[:16]}" if t.nearest else "no stored target"
        who = f" for {rank_ranges(t.ranks)}" if report.world_size is not None else ""
        line = f"{t.label} ({t.key[:16]}) {t.state}{who}; {nearest}: " + "; ".join(
            printable(r, 300) for r in t.reasons)
        console.print(line, markup=False, emoji=False, highlight=False)
    if not report.targets:
        console.print("every target is stored")


def _entry_said(entry: EntryExplanation, model: str) -> str:
    """Why the model's entry was not used, in one line."""
    head = f"entry {entry.key[:16]}"
    if entry.mismatches:
        return f"{head} was traced for other values: " + "; ".join(
            printable(m, 300) for m in entry.mismatches)
    from cachebuild.building.entry import STALE

    if entry.why.startswith(STALE):
        return f"{head} is stale: {entry.why}"
    if entry.why != "no entry":
        return f"{head} not used: {entry.why}"
    said = f"{head}: none is stored for this model, config and input shapes"
    if entry.nearest is None:
        return said + f" (not warmed: run `cachebuild warm {model}`)"
    return said + f"; the nearest entry {entry.nearest[:16]} differs: " + "; ".join(
        [printable(d, 300) for d in entry.differences] or ["in nothing explain can name"])


COMMANDS = (warm_command, plan_command, explain_command)
