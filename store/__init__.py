"""The artifact store: a locked, content-addressed store of compiled artifacts.

``LocalStore`` keeps blobs on local disk with a diskcache index, per-key build locks,
verification on every read, GC and bundles. The blob format (``encode_blob`` /
``decode_blob``) is shared with other tiers, which ship blobs as framed bytes
(``LocalStore.read_blob`` / ``write_blob``) and re-verify them on arrival.
"""

from cachebuild.errors import LockTimeout, StoreError

from .blob import CorruptBlob, decode_blob, encode_blob
from .layout import InvalidKey
from .local import LocalStore, UnknownKey
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
    "StoreError",
    "UnknownKey",
    "VerifyReport",
    "decode_blob",
    "encode_blob",
    "export_bundle",
    "import_bundle",
]


def __getattr__(name: str):
    # Bundles (tarfile) and the tiered store (the Redis client) are loaded only when asked
    # for: a server that loads its targets needs neither.
    if name in ("ExportReport", "ImportReport", "export_bundle", "import_bundle"):
        from . import bundle

        return getattr(bundle, name)
    if name in ("open_store", "TieredStore", "push", "pull"):
        from . import tiered

        return getattr(tiered, name)
    if name in ("RedisRemote", "RemoteDownWarning"):
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
