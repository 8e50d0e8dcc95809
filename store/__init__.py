"""The artifact store: a locked, content-addressed store of compiled artifacts.

This package is the store's front door: code outside ``store/`` imports from it, or the
protocols from ``cachebuild.store.interface``, and from no other module of the store
(``tests/test_layering.py`` checks). ``Store`` is the protocol every store implements
(``interface.py`` has it, with the smaller
``ArtifactSource`` backends load from and the local tier's ``LocalTier``);
``open_store(StoreOptions.from_env())`` opens the one a process is configured for: a
``LocalStore`` (blobs on local disk with a diskcache index, per-key build locks,
verification on every read, GC and bundles), or a ``TieredStore`` that adds a shared
Redis tier. The blob format (``encode_blob`` /
``decode_blob``) is shared by the tiers, which ship blobs as framed bytes and re-verify
them on arrival.
"""

from cachebuild.errors import LockTimeout, StoreError

from .blob import UNSIGNED_REFUSED, CorruptBlob, decode_blob, encode_blob
from .files import write_whole
from .interface import ArtifactSource, RemoteTier, Store
from .layout import (
    FORMAT_DIR,
    InvalidKey,
    UnsafeStore,
    check_links,
    check_parents,
    check_private_dir,
    check_readable_dir,
    check_where_made,
    checked_real_dir,
    make_private_dir,
    others_can_write,
    prepare_work_dir,
    writable_here,
)
from .local import LocalStore, UnknownKey
from .locking import flocked_shared, try_flock
from .maintenance import (
    QUARANTINE_KEEP_S,
    WORK_FOLDERS,
    WORK_LOCK,
    WORK_MARK,
    build_folders,
    made_by_builds,
    mark_work_folder,
)
from .opening import check_can_make, holds_store, open_store, open_to_look, open_to_serve
from .options import StoreOptions, cache_home
from .overlay import OverlayStore
from .record import (
    GCReport,
    KindTotals,
    OverlaySummary,
    Record,
    StoreStats,
    TierStats,
    VerifyReport,
    WorkUsage,
)
from .refs import register_refs
from .work import ObjectRecords, open_work_dir, say_once

__all__ = [
    "QUARANTINE_KEEP_S",
    "UNSIGNED_REFUSED",
    "FORMAT_DIR",
    "check_bundle",
    "check_can_make",
    "holds_store",
    "open_to_look",
    "WORK_FOLDERS",
    "WORK_LOCK",
    "WORK_MARK",
    "made_by_builds",
    "mark_work_folder",
    "ArtifactSource",
    "CorruptBlob",
    "ExportReport",
    "GCReport",
    "ImportReport",
    "InvalidKey",
    "KindTotals",
    "LocalStore",
    "LockTimeout",
    "ObjectRecords",
    "OverlayStore",
    "OverlaySummary",
    "Record",
    "RedisRemote",
    "RemoteDownWarning",
    "RemoteTier",
    "Store",
    "StoreError",
    "StoreOptions",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "TransferCounts",
    "UnknownKey",
    "UnsafeStore",
    "UnsignedRemoteWarning",
    "VerifyReport",
    "WorkUsage",
    "build_folders",
    "bundle_source",
    "cache_home",
    "check_links",
    "check_parents",
    "check_private_dir",
    "check_readable_dir",
    "checked_real_dir",
    "others_can_write",
    "check_where_made",
    "decode_blob",
    "encode_blob",
    "export_bundle",
    "flocked_shared",
    "import_bundle",
    "make_private_dir",
    "open_store",
    "open_to_serve",
    "open_work_dir",
    "say_once",
    "prepare_work_dir",
    "pull",
    "push",
    "register_refs",
    "try_flock",
    "writable_here",
    "write_whole",
]


def __getattr__(name: str):
    # Bundles (tarfile) and the tiered store (the Redis client) are loaded only when asked
    # for: a server that loads its targets needs neither.
    if name in ("ExportReport", "ImportReport", "bundle_source", "check_bundle", "export_bundle",
                "import_bundle"):
        from . import bundle

        return getattr(bundle, name)
    if name in ("TieredStore", "UnsignedRemoteWarning"):
        from . import tiered

        return getattr(tiered, name)
    if name in ("push", "pull", "TransferCounts"):
        from . import transfer

        return getattr(transfer, name)
    if name in ("RedisRemote", "RemoteDownWarning"):
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
