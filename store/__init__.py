"""The artifact store: a locked, content-addressed store of compiled artifacts.

``Store`` is the protocol every store implements (``base.py`` has it, with the smaller
``ArtifactSource`` backends load from and the local tier's ``LocalTier``);
``open_store(StoreOptions.from_env())`` opens the one a process is configured for: a
``LocalStore`` (blobs on local disk with a diskcache index, per-key build locks,
verification on every read, GC and bundles), or a ``TieredStore`` that adds a shared
Redis tier. The blob format (``encode_blob`` /
``decode_blob``) is shared by the tiers, which ship blobs as framed bytes and re-verify
them on arrival.
"""

from cachebuild.errors import LockTimeout, StoreError

from .blob import CorruptBlob, decode_blob, encode_blob
from .interface import Store
from .layout import InvalidKey
from .local import LocalStore, UnknownKey
from .options import StoreOptions, open_store
from .record import GCReport, Record, VerifyReport

__all__ = [
    "CorruptBlob",
    "ExportReport",
    "GCReport",
    "ImportReport",
    "InvalidKey",
    "LocalStore",
    "LockTimeout",
    "Record",
    "Store",
    "StoreError",
    "StoreOptions",
    "UnknownKey",
    "VerifyReport",
    "decode_blob",
    "encode_blob",
    "export_bundle",
    "import_bundle",
    "open_store",
]


def __getattr__(name: str):
    # Bundles (tarfile) and the tiered store (the Redis client) are loaded only when asked
    # for: a server that loads its targets needs neither.
    if name in ("ExportReport", "ImportReport", "export_bundle", "import_bundle"):
        from . import bundle

        return getattr(bundle, name)
    if name == "TieredStore":
        from . import tiered

        return tiered.TieredStore
    if name in ("push", "pull", "TransferCounts"):
        from . import transfer

        return getattr(transfer, name)
    if name in ("RedisRemote", "RemoteDownWarning"):
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
