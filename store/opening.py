"""Opening the store a process is configured for: ``open_store(options)``."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from cachebuild.errors import UsageError

from .interface import Store
from .layout import FORMAT_DIR, writable_here
from .local import LocalStore
from .options import StoreOptions


def open_store(options: StoreOptions | None = None) -> Store:
    """The store ``options`` describe (default: the environment's): a ``LocalStore``, or
    a ``TieredStore`` (L1 + Redis) when a remote is configured and not off, or, where the
    directory is read-only here, an ``OverlayStore`` (that store read-only, this user's
    builds in ``overlay_dir`` or in memory).

    Raises StoreError (exit 1) for an unsafe or unusable directory, UsageError (exit 2)
    for a bad remote URL, or a remote without a signing key unless ``allow_unsigned``.
    """
    options = options or StoreOptions.from_env()
    if not writable_here(options.cache_dir):
        check_can_make(Path(options.cache_dir))
        if options.uses_remote:
            raise UsageError(f"the store at {options.cache_dir} is read-only here, and a "
                             "remote tier needs a local store it can write: give one "
                             "(--cache-dir, CACHEBUILD_DIR) or turn the remote off "
                             "(CACHEBUILD_REMOTE_MODE=off)")
        return _overlay_over(LocalStore(options.cache_dir, signing_key=options.signing_key,
                                        require_signature=options.require_signature,
                                        read_only=True), options)
    local = LocalStore(options.cache_dir, signing_key=options.signing_key,
                       require_signature=options.require_signature, work_dir=options.work_dir)
    if not options.uses_remote:
        return local
    from .remote import RedisRemote
    from .tiered import TieredStore

    assert options.remote is not None
    try:
        remote = RedisRemote(options.remote, mode=options.remote_mode)  # type: ignore[arg-type]
    except BaseException:
        local.close()
        raise
    return TieredStore(local, remote, allow_unsigned=options.allow_unsigned, opened_with=options)


def open_to_serve(options: StoreOptions | None = None) -> Store:
    """``open_store``'s store, for a compiled model's start: where the disk holding it is
    too full to open it to write (``LocalStore.read_only``), an ``OverlayStore`` over it,
    as over a read-only mount, so that a model it does not hold builds (in memory, or in
    ``overlay_dir``) and serves rather than failing; a build command keeps refusing."""
    options = options or StoreOptions.from_env()
    store = open_store(options)
    if isinstance(store, LocalStore) and store.read_only:
        return _overlay_over(store, options)
    return store


def _overlay_over(base: LocalStore, options: StoreOptions) -> Store:
    """An ``OverlayStore`` over ``base``, which this process only reads, as ``options``
    place the overlay and the builds' work folder."""
    from .overlay import OverlayStore

    if options.overlay_dir:  # refused now, not after a trace, at the first build
        try:
            check_overlay_dir(Path(options.overlay_dir), base.path)
        except UsageError:
            base.close()
            raise
    return OverlayStore(base, options.overlay_dir, work_dir=options.work_dir,
                        opened_with=options)


def check_overlay_dir(path: Path, base: Path) -> None:
    """UsageError (exit 2) where the overlay folder ``path`` (``CACHEBUILD_OVERLAY_DIR``)
    cannot take what a process over the read-only store at ``base`` builds: it is a file,
    it lies inside that store, or no store can be made there (``check_can_make``)."""
    named = f"CACHEBUILD_OVERLAY_DIR={path}"
    path = path.expanduser().absolute()
    real, below = Path(os.path.realpath(path)), Path(os.path.realpath(base))
    if real == below or below in real.parents:
        raise UsageError(f"{named} lies inside the store it is to lie over ({base}), which "
                         "this process only reads: give a folder outside it")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{named} is not a folder: give a folder (or leave it unset: "
                         "what is built then stays in memory)")
    check_can_make(path, f"{named} holds no overlay", "give another folder, or leave it unset (what is built "
                                "then stays in memory)")


def check_can_make(path: Path, named: str | None = None,
                   instead: str = "give another --cache-dir or CACHEBUILD_DIR") -> None:
    """UsageError (exit 2) where ``path`` holds no store and none can be made there: it
    is a folder this process may not write (a read-only mount, another user's, no write
    permission), or the nearest folder above it that is there is one it cannot write in.
    A store that is there is left to the checks of opening it. ``named``: how a message
    names the path (``no store at PATH``); ``instead``: what it says to do."""
    named = named or f"no store at {path}"
    path = path.expanduser().absolute()
    if os.path.isdir(path / FORMAT_DIR):
        return
    if os.path.lexists(path):
        if writable_here(path):
            return
        where = f"{path} is not writable here"
    else:
        above = path.parent
        while not os.path.lexists(above) and above != above.parent:
            above = above.parent
        if not os.path.isdir(above):
            raise UsageError(f"{named}, and none can be made there: {above} is a file, not a "
                             f"folder; {instead}")
        try:
            read_only = bool(os.statvfs(above).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = True
        if not read_only and os.access(above, os.W_OK | os.X_OK):
            return
        where = f"{above} is not writable here"
    raise UsageError(f"{named}, and none can be made there: {where} (a read-only mount, "
                     f"another user's folder, or no write permission); {instead}")


def holds_store(path: Path) -> bool:
    """Whether ``path`` holds a store. Before it looks, an unsafe or unusable place is
    refused as opening a store there would refuse it (StoreError, UsageError): a folder
    that is there (another user's, open to others, unreadable), or the folders above one
    that is not (another user may have moved it away)."""
    from .layout import check_private_dir, check_readable_dir, check_where_made

    if os.path.lexists(path):
        real = Path(os.path.realpath(path))
        (check_private_dir if writable_here(real) else check_readable_dir)(real)
    else:
        check_where_made(path.absolute())
    return os.path.isdir(path / FORMAT_DIR)


def holds_store_or_may_make(path: Path) -> bool:
    """``holds_store``, where one that is not there could be made (``check_can_make``)."""
    if holds_store(path):
        return True
    check_can_make(path)
    return False


#: How the temporary folder of a look at a place with no store begins.
LOOK_PREFIX = "cachebuild-look-"


def open_to_look(options: StoreOptions) -> tuple[Store, tempfile.TemporaryDirectory[str] | None]:
    """The store ``options`` name, for a command that only looks (``plan``, ``explain``,
    ``warm --dry-run``): where they name a place a store could be made but none is, an
    empty one in a temporary folder (its remote tier, if any, still asked), returned with
    it for the caller to remove, so that looking makes no store where a path may be
    mistyped."""
    if holds_store_or_may_make(Path(options.cache_dir)):
        return open_store(options), None
    from .layout import UnsafeStore

    scratch = tempfile.TemporaryDirectory(prefix=LOOK_PREFIX)
    try:
        return open_store(dataclasses.replace(options, cache_dir=scratch.name)), scratch
    except UnsafeStore as e:  # a path the user never gave: say where it came from
        scratch.cleanup()
        raise UnsafeStore(
            f"the empty store this command looks in, in the temporary folder "
            f"{tempfile.gettempdir()} (TMPDIR), cannot be used: {e}; set TMPDIR to "
            "a folder only you can write") from None
    except BaseException:
        scratch.cleanup()
        raise
