"""Store commands: ``ls``, ``stats``, ``gc``, ``verify``, ``pin``, ``unpin``, ``export``,
``import``. They import no torch (a model file given to ``pin`` or ``export`` does)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich import box
from rich.table import Table

from cachebuild.cli.common import (
    MAX_LISTED,
    DurationParam,
    SizeParam,
    ago,
    open_existing_store,
    open_store,
    printable,
    progress_bar,
    refuse_inside_store,
    resolve_key,
    safe_text,
    state_of,
    stdout,
)
from cachebuild.errors import UsageError, one_line
from cachebuild.store import QUARANTINE_KEEP_S, UNSIGNED_REFUSED
from cachebuild.units import format_size, plural

if TYPE_CHECKING:
    from cachebuild.store import StoreStats
    from cachebuild.store.interface import LocalTier, Store

#: How long quarantined blobs are kept, in days, as the messages say.
_QUARANTINE_DAYS = QUARANTINE_KEEP_S // 86400


#: Below this many columns a terminal gets ``ls``'s narrow table (it fits 80).
_LS_WIDE = 110
_LS_ONE_LINE = frozenset({"key", "kind", "size", "created", "last used", "hits", "pinned", "refs"})


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (records with manifests).")
@click.option("--kind", metavar="KIND", help="Only records of this kind (entry, aoti-cuda, ...).")
@click.pass_context
def ls_command(ctx: click.Context, as_json: bool, kind: str | None) -> None:
    """List the store's records (model entries and targets), most recently used first."""
    store = open_existing_store(ctx)
    records = sorted(store.records(kind=kind, manifests=as_json),
                     key=lambda r: r.last_used, reverse=True)
    if kind and not records:  # a typo, or a kind this store does not hold: say which it does
        held = sorted({r.kind for r in store.records(manifests=False)})
        click.echo(f"no records of kind {kind!r} in this store; it holds "
                   f"{', '.join(held) if held else 'none'}", err=True)
        if not as_json:
            return  # no empty table under the line that says why
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2))
        return
    now = time.time()
    out = stdout()
    # A terminal too narrow for every column gets the ones a glance needs, each on one
    # line: a wrapped key or size cannot be read, nor copied.
    narrow = out.is_terminal and out.width < _LS_WIDE
    table = Table(title=f"{plural(len(records), 'record')} in {store.root}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=not narrow,
                  caption=None if not narrow else
                  "(created, refs" + ("" if any(r.pinned for r in records) else ", pinned")
                  + ": a wider terminal, or --json)",
                  caption_justify="left")
    columns: list[tuple[str, str]] = [("key", "left"), ("kind", "left"), ("size", "right")]
    if not narrow:
        columns.append(("created", "left"))
    columns += [("last used", "left"), ("hits", "right")]
    pinned = not narrow or any(r.pinned for r in records)
    if pinned:
        columns.append(("pinned", "left"))
    if not narrow:
        columns.append(("refs", "right"))
    unsigned = any(r.unsigned_from for r in records)
    if unsigned:  # where each artifact that entered unsigned came from, and who trusted it
        columns += [("entered unsigned from", "left"), ("trusted by (else not served)", "left")]
    for name, justify in columns:
        table.add_column(name, justify=justify,  # type: ignore[arg-type]
                         no_wrap=name in _LS_ONE_LINE, min_width=32 if name == "key" else None)
    for r in records:
        row = [r.key, r.kind, format_size(r.size)]
        if not narrow:
            row.append(ago(r.created, now))
        row += [ago(r.last_used, now, units=1 if narrow else 2), str(r.hits)]
        if pinned:
            row.append("yes" if r.pinned else "")
        if not narrow:
            row.append(str(len(r.refs)) if r.refs else "")
        if unsigned:
            row.append(safe_text(r.unsigned_from or ""))
            row.append(safe_text(r.trusted or ("NOT TRUSTED" if r.unsigned_from else "")))
        table.add_row(*row)
    out.print(table)


def store_metrics(stats: StoreStats) -> str:
    """A store's ``stats()`` in the Prometheus exposition format (counters since the store was made,
    gauges for what it holds now)."""
    from cachebuild.metrics import Metric, render

    counters = {
        "hits": "Lookups the store answered.", "misses": "Lookups that found nothing.",
        "puts": "Blobs stored.", "quarantined": "Blobs that failed verification.",
        "builds": "Targets built into the store.", "loads": "Targets loaded from the store.",
        "traces": "Models traced with Dynamo.", "warm_starts": "Starts from a stored entry.",
        "l2_hits": "Blobs copied in from the remote tier.",
        "remote_rejected": "Remote copies refused: they failed verification.",
    }
    metrics = [Metric(f"store_{name}_total", float(getattr(stats, name)), text)
               for name, text in counters.items()]
    metrics += [
        Metric("store_build_seconds_total", float(stats.build_seconds),
               "Seconds spent building targets."),
        Metric("store_load_seconds_total", float(stats.load_seconds),
               "Seconds spent loading targets."),
        Metric("store_records", float(stats.records), "Records in the store.",
               kind="gauge"),
        Metric("store_bytes", float(stats.bytes), "Payload bytes stored.",
               kind="gauge"),
        Metric("store_disk_bytes", float(stats.disk_bytes),
               "Bytes the store takes on disk.", kind="gauge"),
        Metric("store_work_bytes", float(stats.work.bytes if stats.work else 0),
               "Bytes compilers wrote while building targets (gc removes them).",
               kind="gauge"),
    ]
    return render(metrics)


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--prometheus", metavar="FILE",
              help="Also write the counters in the Prometheus text format to FILE "
                   "(atomically; '-' prints them instead of the table).")
@click.pass_context
def stats_command(ctx: click.Context, as_json: bool, prometheus: str | None) -> None:
    """Records, sizes, hits and misses of the store, and what processes did with it
    (targets built and loaded and the time it took, traces, warm starts); with a remote,
    its health now and the blobs copied in from it (L2 hits) or refused. --prometheus writes the same counters in the Prometheus text
    format, for a collector that reads files (node_exporter's textfile collector)."""
    from cachebuild.backends import environment
    from cachebuild.backends.probe import listed_toolchains, unusable
    from cachebuild.metrics import check_target, write

    if prometheus is not None:  # before the store is read: a bad path is bad usage
        if check_target(prometheus) is not None:
            refuse_inside_store(Path(prometheus), Path(state_of(ctx).options.cache_dir),
                                "--prometheus")
    store = open_existing_store(ctx)
    stats = store.stats()
    if prometheus is not None:
        write(store_metrics(stats), prometheus)
        if prometheus == "-":
            return
    folders = environment.listed()  # every environment folder of this user's
    toolchains = listed_toolchains([Path(f.path) for f in folders])
    # Counted with the store closed: an open index holds files (SQLite's shared memory)
    # that are gone when the command ends, and du counts what stays.
    state_of(ctx).close()
    disk = environment.disk_paid(Path(stats.path), folders,
                                 stats.work.path if stats.work is not None else None)
    if as_json:
        report = stats.to_json()
        report["toolchains"] = toolchains.to_json()
        if toolchains.problem is not None:
            report["toolchain_problem"] = toolchains.problem
        report["disk"] = disk.to_json()
        click.echo(json.dumps(report, indent=2))
        return
    table = Table(show_header=False, box=box.SIMPLE)
    table.add_column("what")
    table.add_column("value")
    rate = "–" if stats.hit_rate is None else f"{stats.hit_rate:.1%}"
    rows = [("store", stats.path + (" (read-only here)" if stats.read_only else "")),
            ("records", str(stats.records)),
            ("payload", format_size(stats.bytes)),
            ("blobs on disk", format_size(stats.disk_bytes)),
            ("pinned", str(stats.pinned)),
            ("hits", str(stats.hits)),
            ("misses", str(stats.misses)),
            ("hit rate", rate),
            ("quarantined", str(stats.quarantined)),
            ("builds", f"{stats.builds} ({stats.build_seconds:.1f} s)"),
            ("loads", f"{stats.loads} ({stats.load_seconds:.2f} s)"),
            ("traces", str(stats.traces)),
            ("warm starts", str(stats.warm_starts))]
    for kind, k in stats.by_kind.items():
        rows.append((f"  kind {kind}", f"{k.records} ({format_size(k.bytes)})"))
    tiers = stats.tiers
    if tiers is not None and tiers.remote is not None:
        health = "up" if tiers.remote_available else "down"
        rows += [("remote", f"{tiers.remote} ({tiers.remote_mode}, {health}, "
                            f"{'signed' if tiers.signed else 'unsigned'})"),
                 # Since the store was made, as the hits and misses above (the L1's):
                 ("L2 hits", f"{stats.l2_hits} (blobs copied in from the remote)"),
                 ("remote rejected", f"{stats.remote_rejected} (copies that failed "
                                     "verification)")]
    work = stats.work
    if work is not None:  # what compilers wrote during builds: gc empties it
        rows.append(("build work files", f"{format_size(work.bytes)} in "
                                         f"{plural(work.files, 'file')} ({work.path})"))
    for part in disk.parts:  # every byte this store's user pays for, where it is
        rows.append((part.what, f"{format_size(part.bytes)} ({part.path}"
                                + (f": {part.about}" if part.about else "") + ")"))
    rows.append(("disk in all", format_size(disk.total)))
    overlay = stats.overlay
    if overlay is not None:  # a read-only store: where this user's builds go
        rows.append(("overlay", f"{overlay.path} ({overlay.records} records)"))
    for v in toolchains.verdicts:  # which flavour and compiler this machine builds with
        line = v.describe().split(": ", 1)[1]
        why = unusable(v)
        if why is not None:
            line += f" (not used: {why}; the next build probes again)"
        rows.append((f"toolchain ({v.device})", safe_text(line, 2000)))
    if toolchains.problem is not None:
        rows.append(("toolchain", safe_text(toolchains.problem, 500)))
    for what, value in rows:
        table.add_row(what, value)
    stdout().print(table)


@click.command("gc")
@click.option("--max-size", type=SizeParam(unit=True), metavar="SIZE",
              help="Evict least recently used records until the store fits, e.g. 20G "
                   "(a unit is needed: K, M, G, T, or B for bytes; 0 evicts every unpinned "
                   "record).")
@click.option("--older-than", type=DurationParam(unit=True), metavar="AGE",
              help="Evict records unused for this long, e.g. 7d, 12h or 1h30m (a unit is "
                   "needed: s, m, h, d or w).")
@click.option("--dry-run", is_flag=True, help="Show what would go; remove nothing.")
@click.option("--environments", is_flag=True,
              help="Also remove your environment folders of other environments (another "
                   "torch, Python or CPU: toolchain verdicts and precompiled headers no "
                   "build here uses) and a probe/ folder an earlier version kept in the "
                   "store.")
@click.pass_context
def gc_command(ctx: click.Context, max_size: int | None, older_than: float | None,
               dry_run: bool, environments: bool) -> None:
    """Evict records, least recently used first; pinned records and what they refer to stay.

    Records go only as --max-size or --older-than says (with neither, none do). A model
    entry goes together with the targets no other entry refers to (the entry first), so
    GC never leaves an entry whose targets are gone. Every run empties the build work
    folder and removes the C++ objects builds keep for reuse (in your environment folders,
    shared by your stores) that no build used for 7 days, where no build is running. With
    --environments, also the environment folders this environment does not use (the
    current one stays: every build here needs it).
    """
    store = open_existing_store(ctx)
    report = store.gc(max_size=max_size, older_than=older_than, dry_run=dry_run)
    out = stdout()
    verb = "would remove" if dry_run else "removed"
    if dry_run and report.removed:
        table = Table(title="would remove", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("key", "kind", "size", "last used"):
            table.add_column(col, no_wrap=col == "key", min_width=32 if col == "key" else None)
        now = time.time()
        for unit in report.units:
            for i, key in enumerate(unit):
                r = store.get_record(key)
                if r is not None:  # a model entry's targets follow it, indented
                    table.add_row(key if i == 0 else f"  {key}", r.kind, format_size(r.size),
                                  ago(r.last_used, now))
        out.print(table)
    out.print(f"{verb} {plural(len(report.removed), 'record')} ({format_size(report.freed_bytes)}); "
              f"store {'would be' if dry_run else 'is now'} {format_size(report.bytes_after)} "
              f"in {plural(report.records_after, 'record')}, {report.kept_pinned} kept by pins")
    if report.work_bytes:
        out.print(f"{verb} {format_size(report.work_bytes)} of build work files "
                  "(the compilers' caches and temp files)")
    elif report.work_busy:
        out.print("build work files kept: a build is running")
    _gc_objects(dry_run, verb)
    if dry_run and report.orphans_removed:
        out.print(f"would move {plural(report.orphans_removed, 'blob')} no record points to "
                  f"into quarantine/ (kept {_QUARANTINE_DAYS} days)")
    elif report.tmp_removed or report.orphans_removed:
        out.print(f"cleaned {plural(report.tmp_removed, 'abandoned temp file')}; moved "
                  f"{plural(report.orphans_removed, 'blob')} no record points to into quarantine/ "
                  f"(kept {_QUARANTINE_DAYS} days)")
    if environments:
        _gc_environments(store, dry_run, verb)
    if report.over_cap:
        click.echo(f"warning: pinned records alone take {format_size(report.bytes_after)}, "
                   f"more than --max-size {format_size(max_size or 0)}", err=True)


def _gc_objects(dry_run: bool, verb: str) -> None:
    """Remove the C++ objects builds keep for reuse in this user's environment folders that
    no build has used for a week, where no build holds the folder, saying how much went."""
    from cachebuild.backends import environment
    from cachebuild.store import UnsafeStore

    out = stdout()
    freed, busy = 0, False
    for folder in environment.paths():
        try:
            size, removed = environment.clean_objects(folder, dry_run)
        except (UnsafeStore, OSError) as e:  # not ours alone, or not writable: left as it is
            out.print(f"kept C++ objects of {safe_text(folder, 500)} stay: {one_line(e)}")
            continue
        freed += size
        busy |= not removed
    if freed:
        out.print(f"{verb} {format_size(freed)} of C++ objects no build used for "
                  f"{environment.OBJECT_AGE / 86400:.0f} days")
    elif busy:
        out.print("C++ objects kept for reuse stay: a build is running")


def _gc_environments(store: Store, dry_run: bool, verb: str) -> None:
    """Remove the environment folders of other environments, and the store's old
    ``probe/`` folder, saying what went and what was kept (a folder in use)."""
    import os

    from cachebuild.backends import environment
    from cachebuild.store import FORMAT_DIR, UnsafeStore

    out = stdout()
    # This environment's folders: the one in use, and the default one of this torch,
    # Python and CPU, which other shells of this user use without $CACHEBUILD_PROBE_DIR.
    # Both paths import torch (its fingerprint).
    ours = {os.path.realpath(environment.current()),
            os.path.realpath(environment.root() / environment.fingerprint())}
    candidates = []
    for f in environment.listed():
        if os.path.realpath(f.path) in ours:
            continue
        if not environment.is_environment_folder(f):  # put there by someone, for something
            out.print(f"kept {safe_text(f.path, 500)}: not an environment folder (no "
                      f"{environment.DESCRIPTION}, and its name is no environment's)")
            continue
        candidates.append((Path(f.path), f.summary()))
    legacy = Path(store.local.root) / "probe"
    if not getattr(store.local, "read_only", False) and legacy.is_dir() and \
            legacy.parent.name == FORMAT_DIR:
        candidates.append((legacy, "kept in the store by an earlier version"))
    if not candidates:
        out.print("no environment folders of other environments")
    for path, about in candidates:
        try:
            size, removed = environment.remove(path, dry_run)
        except (UnsafeStore, OSError) as e:  # not ours alone, or not writable
            out.print(f"kept environment folder {safe_text(path, 500)}: {one_line(e)}")
            continue
        if removed:
            out.print(f"{verb} environment folder {safe_text(path, 500)} ({safe_text(about)}; "
                      f"{format_size(size)})")
        else:
            out.print(f"kept environment folder {safe_text(path, 500)}: a probe or build is "
                      "using it")


@click.command("verify")
@click.option("--repair", is_flag=True, help="Quarantine damaged blobs and drop their records; "
                                             "remove records holding graphs a load refuses.")
@click.pass_context
def verify_command(ctx: click.Context, repair: bool) -> None:
    """Check every blob, and every stored graph as a load checks it; exit 1 if any is
    damaged or holds a graph a load refuses, and was not repaired."""
    store = open_existing_store(ctx)
    with progress_bar("verifying") as on_progress:
        report = store.verify(repair=repair, progress=on_progress)
    # Blobs that verify can still hold a graph a load refuses (one that names what stored
    # graphs may not call): a server would never load it, so it is not "ok". Checking
    # graphs takes torch, imported only for a store that holds some.
    refused: list[tuple[str, str]] = []
    if any(next(iter(store.records(kind=kind, manifests=False)), None) is not None
           for kind in ("entry", "fx-graph")):
        from cachebuild.building.entry import refused_graphs

        refused = refused_graphs(store, skip={key for key, _ in report.damaged + report.untrusted})
    for key, why in refused[:MAX_LISTED]:
        if repair:
            store.delete(key)
        click.echo(f"refused {key}: {printable(why)}" + (" (removed)" if repair else ""),
                   err=True)
    if len(refused) > MAX_LISTED:
        click.echo(f"refused: and {len(refused) - MAX_LISTED} more", err=True)
    if repair:
        for key, _ in refused[MAX_LISTED:]:
            store.delete(key)
    # Unsigned blobs a store requiring signatures refuses are not damage; they are never
    # served either way.
    unsigned_refused = [key for key, reason in report.damaged if reason == UNSIGNED_REFUSED]
    damaged = [(key, reason) for key, reason in report.damaged if reason != UNSIGNED_REFUSED]
    for key, reason in damaged[:MAX_LISTED]:
        click.echo(f"damaged {key}: {reason}" + (" (quarantined)" if repair else ""), err=True)
    if len(damaged) > MAX_LISTED:
        click.echo(f"damaged: and {len(damaged) - MAX_LISTED} more", err=True)
    for key in unsigned_refused[:MAX_LISTED]:
        click.echo(f"refused {key}: unsigned, and CACHEBUILD_REQUIRE_SIGNATURE is set, so it "
                   "is never served" + (" (quarantined: the next warm builds it signed)"
                                        if repair else ""), err=True)
    if len(unsigned_refused) > MAX_LISTED:
        click.echo(f"refused: and {len(unsigned_refused) - MAX_LISTED} more unsigned", err=True)
    for key, origin in report.unsigned[:MAX_LISTED]:
        click.echo(f"unsigned {key}: entered this store without a verified signature from "
                   f"{printable(origin)}; push signs it only if named with --vouch", err=True)
    if len(report.unsigned) > MAX_LISTED:
        click.echo(f"unsigned: and {len(report.unsigned) - MAX_LISTED} more (ls shows them)",
                   err=True)
    untrusted: dict[str, int] = {}
    for _, origin in report.untrusted:
        untrusted[origin] = untrusted.get(origin, 0) + 1
    for origin, count in list(untrusted.items())[:MAX_LISTED]:
        click.echo(f"not trusted: {plural(count, 'record')} from {printable(origin)}, not "
                   f"served until you trust the source: `cachebuild trust "
                   f"'{printable(origin)}'`", err=True)
    # Untrusted records are not served, and their graphs were not read: not "ok".
    summary = (f"checked {report.checked} blobs: "
               f"{report.ok - len(refused) - len(report.untrusted)} ok, "
               f"{len(damaged)} damaged")
    if unsigned_refused:
        summary += f", {len(unsigned_refused)} unsigned (refused)"
    if refused:
        summary += f", {len(refused)} holding graphs a load refuses"
    if report.untrusted:
        summary += f", {len(report.untrusted)} not trusted"
    if report.unsigned:
        summary += f" ({len(report.unsigned)} of them entered unsigned)"
    if report.tmp_removed or report.orphans_removed:
        summary += (f"; cleaned {plural(report.tmp_removed, 'abandoned temp file')}; moved "
                    f"{plural(report.orphans_removed, 'blob')} no record points to into quarantine/ "
                    f"(kept {_QUARANTINE_DAYS} days)")
    incomplete = _incomplete_entries(store, {key for key, _ in report.damaged + refused})
    for line in incomplete[:MAX_LISTED]:
        click.echo(line, err=True)
    if len(incomplete) > MAX_LISTED:
        click.echo(f"incomplete: and {len(incomplete) - MAX_LISTED} more", err=True)
    if incomplete:
        n = len(incomplete)
        summary += f"; {n} entr{'y' if n == 1 else 'ies'} incomplete"
    click.echo(summary)
    if report.unrecorded:
        click.echo(f"{plural(report.unrecorded, 'blob')} no record points to (left by an "
                   "interrupted write, or a lost index): `cachebuild verify --repair` or "
                   f"`cachebuild gc` moves them into quarantine/, kept {_QUARANTINE_DAYS} days",
                   err=True)
    if (report.damaged or refused) and not repair:
        click.echo("run `cachebuild verify --repair` to quarantine or remove them", err=True)
        ctx.exit(1)


def _incomplete_entries(store: Store, unusable: set[str]) -> list[str]:
    """A line for every stored entry some of whose parts are not stored here (or are
    among ``unusable``): not damage (``gc`` evicts unpinned targets), but a start that
    uses the entry builds before it serves, or traces again without its guards' seal.
    Only what is here is asked about: a remote tier's ``contains`` would copy what it has."""
    from cachebuild.building.entry import payload_parts

    recorded = {r.key for r in store.records(manifests=False)}
    held = recorded - unusable
    lines = []
    for record in store.records(kind="entry", manifests=False):
        # Held here, so no tier copies it: a look, not a use.
        payload = store.get(record.key, touch=False) if record.key in held else None
        if payload is None:
            continue
        try:
            targets, seal = payload_parts(payload)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue  # a graph check above says what is wrong with it
        missing = [k for k in targets if k not in held]
        if seal is not None and seal not in held:
            lines.append(f"incomplete entry {record.key}: the seal of its guards is not "
                         "stored here (a start traces the model again)")
        elif missing:
            damaged = sum(k in recorded for k in missing)
            how = (f"{len(missing)} of its {len(targets)} targets not stored here" if not damaged
                   else f"{len(missing)} of its {len(targets)} targets damaged or not stored "
                   f"here ({damaged} damaged)")
            lines.append(f"incomplete entry {record.key}: {how} (a start that uses it builds "
                         "them first; `cachebuild warm MODEL.py` builds them ahead)")
    return lines


@click.command("pin")
@click.argument("target", metavar="KEY|MODEL.py")
@click.pass_context
def pin_command(ctx: click.Context, target: str) -> None:
    """Keep a record (a model entry keeps everything it refers to) from GC."""
    store = open_existing_store(ctx)
    key = resolve_key(ctx, target)
    was = store.get_record(key)
    store.pin(key)
    click.echo(f"{key} was already pinned" if was is not None and was.pinned else f"pinned {key}")


@click.command("unpin")
@click.argument("target", metavar="KEY|MODEL.py")
@click.pass_context
def unpin_command(ctx: click.Context, target: str) -> None:
    """Let GC remove a record again."""
    store = open_existing_store(ctx)
    key = resolve_key(ctx, target)
    was = store.get_record(key)
    store.unpin(key)
    click.echo(f"unpinned {key}" if was is None or was.pinned else f"{key} was not pinned")


#: Suffixes of archive formats a bundle is not (it is a tar, gzip-compressed or not).
_OTHER_ARCHIVES = (".zip", ".7z", ".rar", ".xz", ".bz2", ".zst", ".lz4", ".tbz2", ".txz")


def _is_tar(path: Path) -> bool:
    """Whether ``path`` holds a tar archive (compressed or not): an earlier bundle, which
    an export may replace."""
    import tarfile

    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


@click.command("export")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model", required=False, metavar="[MODEL.py|KEY]")
@click.option("--kind", "kinds", multiple=True, metavar="KIND",
              help="Only records of this kind (repeatable).")
@click.pass_context
def export_command(ctx: click.Context, file: Path, model: str | None,
                   kinds: tuple[str, ...]) -> None:
    """Write records to a bundle FILE (.tar, or .tar.gz to compress): all of them, or a
    model's entry and everything it refers to."""
    from cachebuild.store import export_bundle

    if not file.name or file.name in (".", ".."):
        raise UsageError("give the bundle a file name (FILE.tar, or FILE.tar.gz to compress)")
    if str(file) == "-":  # not a file named "-" where standard output was meant
        raise UsageError("export writes a bundle file, not standard output: give it a path "
                         "(FILE.tar; a file named - needs its full path)")
    if file.suffix.lower() in _OTHER_ARCHIVES:  # a tar under a .zip name fools unzip
        raise UsageError(f"a bundle is a tar archive; {file.suffix} names another format: "
                         f"use {file.stem}.tar, or {file.stem}.tar.gz to compress")
    if file.exists() and not file.is_file():  # a device, a folder: never replaced
        raise UsageError(f"cannot write the bundle {file}: it exists and is not a regular file")
    if not file.parent.is_dir():
        raise UsageError(f"cannot write the bundle {file}: directory {file.parent} does not "
                         "exist")
    store = open_existing_store(ctx).local
    refuse_inside_store(file, store.path, "the bundle")
    if file.is_file() and file.stat().st_size and not _is_tar(file):  # a typo: notes.txt
        raise UsageError(f"cannot write the bundle {file}: it exists and is not a bundle; "
                         "give another name, or remove it first")
    keys = [resolve_key(ctx, model)] if model else None
    held = {r.kind for r in store.records(manifests=False)}
    unheld = [k for k in kinds if k not in held]
    if unheld:  # a typo, or a kind this store does not hold: say which it does
        raise UsageError(f"no records of kind {', '.join(map(repr, unheld))} in this store; "
                         f"it holds {', '.join(sorted(held)) if held else 'none'}")
    with progress_bar("exporting") as on_progress:
        report = export_bundle(store, file, keys=keys, kinds=kinds or None, progress=on_progress)
    click.echo(f"exported {plural(len(report.exported), 'record')} ({format_size(report.bytes)}) "
               f"to {file}")
    for key, reason in report.skipped:
        click.echo(f"skipped {key}: {reason}", err=True)
    if report.skipped:
        ctx.exit(1)


@click.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--allow-unsigned", "allow_unsigned", is_flag=True,
              help="Import unsigned blobs into a store that has a signing key (they are "
                   "refused otherwise); they are served only once trusted.")
@click.option("--trust", is_flag=True,
              help="Trust this bundle: serve what comes in unsigned from it (kept in each "
                   "record). Implies --allow-unsigned.")
@click.pass_context
def import_command(ctx: click.Context, file: Path, allow_unsigned: bool, trust: bool) -> None:
    """Import a bundle, re-verifying every blob; damaged records are refused (exit 1).

    Into a store with a signing key (CACHEBUILD_SIGNING_KEY), unsigned blobs are refused
    unless --allow-unsigned or --trust is given. What comes in without a signature the
    store's key verifies is not served until its source is trusted: --trust, or
    `cachebuild trust SOURCE` later."""
    from cachebuild.store import check_bundle, import_bundle

    # A file that is no bundle is refused before the store is opened, which makes one.
    check_bundle(file)
    store = open_store(ctx).local
    store.check_writable("import a bundle")  # said before anything is read, as gc says it
    with progress_bar("importing") as on_progress:
        report = import_bundle(store, file, progress=on_progress, allow_unsigned=allow_unsigned,
                               trust=trust)
    click.echo(f"imported {plural(len(report.imported), 'record')} from {file}"
               + (f", {len(report.existing)} already present" if report.existing else "")
               + (f", {len(report.kept)} kept as built here (the bundle's copies differ, as "
                  "two builds of one target do)" if report.kept else ""))
    for key in report.kept[:MAX_LISTED]:
        click.echo(f"kept {key}: built here; the bundle's copy differs", err=True)
    untrusted: dict[str, int] = {}
    for key in report.imported:
        record = store.get_record(key)
        if record is not None and record.is_untrusted:
            origin = record.unsigned_from or ""
            untrusted[origin] = untrusted.get(origin, 0) + 1
    for origin, count in list(untrusted.items())[:MAX_LISTED]:
        click.echo(f"not trusted: {plural(count, 'record')} from {printable(origin)} will not "
                   f"be served until you trust the source: `cachebuild trust "
                   f"'{printable(origin)}'` (or import with --trust)", err=True)
    for name, reason in report.refused[:MAX_LISTED]:
        click.echo(f"refused {printable(name)}: {printable(reason, 300)}", err=True)
    named = len(report.refused) + report.more_refused
    if named > MAX_LISTED:
        click.echo(f"refused: and {named - MAX_LISTED} more", err=True)
    if report.stopped is not None:
        click.echo(f"error: {one_line(report.stopped)}; the import stopped there: the "
                   f"{plural(len(report.imported), 'record')} named imported above are "
                   "stored, the rest of the bundle was not read (import it again once "
                   "there is room: what is stored is already present)", err=True)
        ctx.exit(1)
    if report.refused_count or report.rest_refused:
        said = [f"{plural(report.refused_count, 'record')} (damaged, incomplete, or other "
                "bytes than the store holds under their key; each is named above)"
                ] if report.refused_count else []
        if report.rest_refused:
            said.append("the rest of the bundle (damaged or truncated: not read)")
        click.echo(f"error: refused {' and '.join(said)}", err=True)
        ctx.exit(1)


@click.command("trust")
@click.argument("source")
@click.pass_context
def trust_command(ctx: click.Context, source: str) -> None:
    """Serve what came unsigned from SOURCE (a bundle or a remote, as `ls` and `verify`
    name it); the decision is kept in each record it marks."""
    store = open_existing_store(ctx).local
    source = _named_source(store, source)
    marked = store.trust(source, f"cachebuild trust ({source})"[:600])
    if not marked:
        already = sum(1 for r in store.records(manifests=False)
                      if r.unsigned_from == source and not r.is_untrusted)
        if already:  # trusted before: the same command again (a script) is done
            click.echo(f"{plural(already, 'record')} from {printable(source)} already trusted")
            return
        sources = sorted({r.unsigned_from for r in store.records(manifests=False)
                          if r.is_untrusted and r.unsigned_from})
        known = (": untrusted sources are " + ", ".join(
            f"'{printable(s)}'" for s in sources[:5]) + (" ..." if len(sources) > 5 else "")
            if sources else ": nothing stored is untrusted")
        raise UsageError(f"no untrusted record came from '{printable(source)}'{known}")
    click.echo(f"trusted {plural(len(marked), 'record')} from {printable(source)}")


def _named_source(store: LocalTier, given: str) -> str:
    """The source ``given`` names: itself where a record names it, else the one source of
    that name with a digest after it (``bundle cache.tar`` for ``bundle cache.tar
    (3f2a9c1d4e5f)``), the one not trusted yet where several are; two such untrusted
    sources are a UsageError naming both (two bundles of one name)."""
    sources: dict[str, bool] = {}  # source -> whether any of its records is untrusted
    for r in store.records(manifests=False):
        if r.unsigned_from:
            sources[r.unsigned_from] = sources.get(r.unsigned_from, False) or r.is_untrusted
    if given in sources:
        return given
    named = [s for s in sources if s.startswith(given + " (") and s.endswith(")")]
    untrusted = [s for s in named if sources[s]]
    if len(untrusted) > 1:
        raise UsageError(f"{len(untrusted)} untrusted sources are named '{printable(given)}': "
                         + ", ".join(f"'{printable(s)}'" for s in untrusted[:5])
                         + "; trust one by its whole name, as `cachebuild import` said it")
    return (untrusted or named or [given])[0]


COMMANDS = (ls_command, stats_command, gc_command, verify_command, pin_command, unpin_command,
            export_command, import_command, trust_command)
