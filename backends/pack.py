"""Several named files as one payload: how a ``standalone`` artifact on CPU carries the
kernels it was built with (its libraries and objects) beside Inductor's own artifact.

Format: magic (``CBPACK\\x01``), the length of a JSON table (8 bytes, little endian), the
table (``[[name, size], ...]``), then the files' bytes in table order.
"""

from __future__ import annotations

import json
import os

PACK_MAGIC = b"CBPACK\x01"


def pack(parts: dict[str, bytes]) -> bytes:
    """Several named files as one payload: magic, a JSON table of names and sizes, bytes."""
    table = json.dumps([[name, len(data)] for name, data in parts.items()]).encode()
    return PACK_MAGIC + len(table).to_bytes(8, "little") + table + b"".join(parts.values())


def unpack(data: bytes) -> dict[str, bytes] | None:
    """The files ``pack`` joined, or None if ``data`` is a single plain file."""
    if not data.startswith(PACK_MAGIC):
        return None
    start = len(PACK_MAGIC) + 8
    end = start + int.from_bytes(data[len(PACK_MAGIC):start], "little")
    parts, offset = {}, end
    for name, size in json.loads(data[start:end]):
        parts[name] = data[offset: offset + size]
        offset += size
    return parts


def read_packed(path: str | os.PathLike[str]) -> dict[str, bytes] | None:
    """The files packed in ``path``, or None (without reading it whole) for a plain file."""
    with open(path, "rb") as f:
        if f.read(len(PACK_MAGIC)) != PACK_MAGIC:
            return None
        f.seek(0)
        return unpack(f.read())
