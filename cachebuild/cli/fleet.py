"""Remote tier commands: ``push`` (L1 → L2) and ``pull`` (L2 → L1).

``push MODEL.py`` uploads a model's entry and every target it refers to; ``push --all``
uploads everything L1 holds that the remote lacks. ``pull MODEL.py`` prefetches a model's
entry and all its targets into L1 before a server starts, verifying each blob (signature
included) on the way, so that the server loads everything locally. The model's entry key
is computed from its spec (class, config, parameter and input metadata, environment):
nothing is traced and nothing is built.

Both need a remote (``--remote``/``CACHEBUILD_REMOTE``); ``push`` needs it read-write.
Exit 0 when every key asked for is in the destination tier afterwards, 1 otherwise.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from cachebuild.cli.common import MAX_JOBS, MAX_LISTED, open_store, printable, state_of
from cachebuild.errors import CachebuildError, UsageError
from cachebuild.units import format_size, plural

if TYPE_CHECKING:
    from cachebuild.store import TransferCounts
    from cachebuild.store.interface import RemoteTier, Store

# torch, the model and the Redis client are imported inside the commands: `--help` and
# `push --all` should not pay for torch.


def _tiered(ctx: click.Context, command: str) -> tuple[Store, RemoteTier]:
    """The command line's store and its remote tier, which it must have (asked before the
    store is opened: a command refused makes no store)."""
    options = state_of(ctx).options
    if not options.uses_remote:
        why = ("the remote is off (--remote-mode off)" if options.remote else
               "no remote is configured")
        raise UsageError(f"{command} needs a remote tier, but {why}; use --remote URL "
                         "or CACHEBUILD_REMOTE")
    store = open_store(ctx)
    if store.remote is None:
        raise UsageError(f"{command} needs a remote tier, but this store has none")
    return store, store.remote


def _copied_in(store: Store) -> tuple[int, int]:
    """How many blobs this process copied into ``store``'s L1 from its remote, and their
    bytes."""
    tiers = getattr(store, "counters", None)
    return (tiers.l2_hits, tiers.l2_bytes) if tiers is not None else (0, 0)


def _entry_targets(store: Store, key: str) -> list[str]:
    """The keys the entry ``key`` held in L1 needs beside it: its targets and its seal."""
    from cachebuild.building.entry import Entry

    data = store.local.get(key)
    if data is None:
        raise CachebuildError(f"entry {key} vanished from the local store")
    try:
        return Entry.from_bytes(data).stored_keys()
    except (ValueError, KeyError, TypeError) as e:
        raise CachebuildError(f"entry {key} cannot be read: {e}") from e


def _summary(verb: str, counts: TransferCounts, seconds: float, *, rate: bool = False) -> str:
    parts = [f"{verb} {counts.transferred} ({format_size(counts.bytes)})",
             f"{counts.present} already there"]
    for name in ("missing", "rejected", "replaced", "failed"):
        if getattr(counts, name):
            parts.append(f"{getattr(counts, name)} {name}")
    if counts.unvouched:
        parts.append(f"{counts.unvouched} not pushed: they entered unsigned")
    if counts.signed:
        parts.append(f"{counts.signed} unsigned in the local store, signed with "
                     "CACHEBUILD_SIGNING_KEY to upload")
    line = ", ".join(parts) + f" in {seconds:.2f} s"
    if rate and counts.bytes:
        line += f" ({counts.bytes / max(seconds, 1e-9) / 1e6:.1f} MB/s)"
    return line


@click.command("push")
@click.argument("model", required=False, metavar="[MODEL.py]", type=click.Path(dir_okay=False))
@click.option("--all", "push_all", is_flag=True, help="Push every entry of the local store.")
@click.option("--vouch", "vouch", multiple=True, metavar="KEY",
              help="Also push KEY although it entered the local store without a verified "
                   "signature (pulled from a remote used without a key, imported unsigned), "
                   "signing it with the fleet key: you vouch for it (repeatable).")
@click.option("--replace", is_flag=True,
              help="Delete the remote's copies that fail verification here (damaged, or "
                   "signed with another key) and upload this store's instead.")
@click.pass_context
def push_command(ctx: click.Context, model: str | None, push_all: bool,
                 vouch: tuple[str, ...], replace: bool) -> None:
    """Upload MODEL.py's entry and targets (or, with --all, everything in L1) to the remote.

    Entries the remote already holds are left alone once they verify here, as a server
    with this store's settings would verify them (each is read whole to check it); one
    that does not is reported, and replaced only with --replace. With CACHEBUILD_SIGNING_KEY every
    blob uploaded is signed with it: one the local store holds unsigned because it was
    built here before the key was set is signed on the way, and the summary says how many
    were. One that entered the local store unsigned from elsewhere (`ls` and `verify` show
    where from) is not pushed unless named with --vouch. Exit 1 if any could not be
    pushed, or was not pushed for that reason.
    """
    from cachebuild.cli.common import resolve_key
    from cachebuild.modelfile import entry_key as entry_key_of
    from cachebuild.store import push

    if model and push_all:
        raise UsageError("push needs either MODEL.py or --all (not both)")
    if not model and not push_all and not vouch:
        raise UsageError("push needs MODEL.py, --all or --vouch KEY")
    store, remote = _tiered(ctx, "push")
    vouched = [resolve_key(ctx, k) for k in vouch]
    start = time.perf_counter()
    if not model and not push_all:
        keys: list[str] | None = []
        what = f"{len(vouched)} vouched for"
    elif push_all:
        keys = None
        what = "every local entry"
    else:
        assert model is not None
        entry_key = entry_key_of(model, store)
        if not store.local.contains(entry_key):
            raise UsageError(f"{model}: the model has no entry in the local store; run "
                             f"`cachebuild warm {model}` first")
        keys = [entry_key, *_entry_targets(store, entry_key)]
        what = f"entry {entry_key} and the {plural(len(keys) - 1, 'record')} it needs"
    counts = push(store, keys, vouch=vouched, replace=replace)
    click.echo(f"{what} → {remote.display_url}: "
               + _summary("pushed", counts, time.perf_counter() - start))
    for key in counts.unvouched_keys[:MAX_LISTED]:
        record = store.local.get_record(key)
        origin = record.unsigned_from if record is not None else "elsewhere"
        click.echo(f"not pushed {key}: it entered the local store unsigned from "
                   f"{printable(origin)}; name it with --vouch {key} to sign and push it",
                   err=True)
    if counts.unvouched > MAX_LISTED:
        click.echo(f"not pushed: and {counts.unvouched - MAX_LISTED} more", err=True)
    if counts.rejected:
        listed = ", ".join(counts.rejected_keys[:MAX_LISTED])
        more = f" and {counts.rejected - MAX_LISTED} more" if counts.rejected > MAX_LISTED else ""
        click.echo(f"error: the remote's {plural(counts.rejected, 'copy', 'copies')} of "
                   f"{listed}{more} failed verification here (damaged, unsigned, or signed "
                   "with another key: the log says which): where CACHEBUILD_SIGNING_KEY is "
                   "the fleet's key, run push again with --replace to upload this store's",
                   err=True)
    if counts.failed or counts.missing or counts.unvouched or counts.rejected:
        ctx.exit(1)


@click.command("pull")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--jobs", "-j", type=click.IntRange(min=1, max=MAX_JOBS), default=4,
              show_default=True,
              help="Blobs fetched and verified at once.")
@click.pass_context
def pull_command(ctx: click.Context, model: str, jobs: int) -> None:
    """Prefetch MODEL.py's entry and every target it uses from the remote into L1.

    Run it before a server starts so that the server loads everything locally. Every blob
    is verified (and its signature checked) before it is written to L1. Exit 1 if any
    target could not be fetched (missing, rejected, or the remote is down).
    """
    from cachebuild.modelfile import entry_key as entry_key_of
    from cachebuild.store import pull

    store, remote = _tiered(ctx, "pull")
    start = time.perf_counter()
    before = _copied_in(store)
    entry_key = entry_key_of(model, store)  # its lookup copies the entry in, and its seal
    first = pull(store, [entry_key], workers=1)
    if not store.local.contains(entry_key):
        if first.failed or not remote.available:
            raise CachebuildError(f"could not reach remote {remote.display_url} to "
                                  f"fetch the entry of {model}")
        if first.rejected:
            raise CachebuildError(f"the remote entry {entry_key} of {model} failed "
                                  "verification; it was not loaded")
        raise CachebuildError(f"{model}: the remote has no entry {entry_key}; warm the model "
                              "into it first (`cachebuild warm` with the remote read-write)")
    targets = pull(store, _entry_targets(store, entry_key), workers=jobs)
    seconds = time.perf_counter() - start
    for name in ("transferred", "present", "bytes"):
        setattr(targets, name, getattr(targets, name) + getattr(first, name))
    # What the lookup copied in was pulled too, not "already there".
    (blobs_after, bytes_after), (blobs_before, bytes_before) = _copied_in(store), before
    by_lookup = blobs_after - blobs_before - targets.transferred
    targets.transferred += by_lookup
    targets.present = max(0, targets.present - by_lookup)
    targets.bytes += bytes_after - bytes_before - targets.bytes
    click.echo(f"entry {entry_key} and its targets ← {remote.display_url}: "
               + _summary("pulled", targets, seconds, rate=True))
    if targets.missing:
        named = ", ".join(targets.missing_keys[:3]) + (
            ", ..." if len(targets.missing_keys) > 3 else "")
        click.echo(f"error: the remote lacks {plural(targets.missing, 'record')} of the "
                   f"entry, or holds them unreadable ({named}): `cachebuild warm {model}` "
                   "with the remote read-write builds them, and `cachebuild push --all "
                   "--replace` from a store that holds them sends them again", err=True)
    if targets.rejected:
        click.echo(f"error: {plural(targets.rejected, 'target')} of the remote failed "
                   "verification here: check that CACHEBUILD_SIGNING_KEY is the fleet's key "
                   "(the log names each one and why)", err=True)
    if targets.missing or targets.rejected or targets.failed:
        ctx.exit(1)


COMMANDS = (push_command, pull_command)
