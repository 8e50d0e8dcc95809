"""Several named files as one payload: how a ``standalone`` artifact on CPU carries the
kernels it was built with (its libraries and objects) beside Inductor's own artifact.

Format: magic (``CBPACK\\x01``), the length of a JSON table (8 bytes, little endian), the
table (``[[name, size], ...]``), then the files' bytes in table order.

Names become paths under a directory the loader writes to, so every name is checked
before any file is written: a relative path of plain components (letters, digits,
``_.+-``), none of them ``.`` or ``..``, each at most 255 bytes. A table that names a
file twice, or whose sizes do not add up to the bytes that follow it, is refused.
"""

from __future__ import annotations

import json
import os
import re

from cachebuild.errors import CachebuildError

PACK_MAGIC = b"CBPACK\x01"
_COMPONENT = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]{0,254}")
_MAX_PARTS = 100_000


class PackError(CachebuildError, ValueError):
    """A pack that is not well formed, or names a file outside its directory."""


def check_name(name: object) -> str:
    """``name`` if it is a safe relative path (see the module doc), else PackError."""
    if not isinstance(name, str) or not 0 < len(name) <= 4096:
        raise PackError(f"packed file name {name!r} is not a relative path")
    parts = name.split("/")
    if any(not _COMPONENT.fullmatch(p) or p in (".", "..") for p in parts):
        raise PackError(f"packed file name {name[:100]!r} is not a plain relative path "
                        "(no '..', no absolute paths, plain characters only)")
    return name


def pack(parts: dict[str, bytes]) -> bytes:
    """Several named files as one payload: magic, a JSON table of names and sizes, bytes."""
    for name in parts:
        check_name(name)
    table = json.dumps([[name, len(data)] for name, data in parts.items()]).encode()
    return PACK_MAGIC + len(table).to_bytes(8, "little") + table + b"".join(parts.values())


def unpack(data: bytes) -> dict[str, bytes] | None:
    """The files ``pack`` joined, or None if ``data`` is a single plain file.

    Every name and size is checked before anything is returned (PackError if one fails),
    so a caller never starts writing files from a pack that turns out to be bad.
    """
    if not data.startswith(PACK_MAGIC):
        return None
    start = len(PACK_MAGIC) + 8
    if len(data) < start:
        raise PackError("pack is truncated inside its header")
    end = start + int.from_bytes(data[len(PACK_MAGIC):start], "little")
    if end > len(data):
        raise PackError("pack's table is longer than the pack")
    try:
        table = json.loads(data[start:end])
    except (ValueError, RecursionError):
        raise PackError("pack's table is not JSON") from None
    if not isinstance(table, list) or len(table) > _MAX_PARTS:
        raise PackError("pack's table is not a list of files")
    sizes: dict[str, int] = {}
    for row in table:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[1], int)
                and not isinstance(row[1], bool) and row[1] >= 0):
            raise PackError(f"pack's table has a malformed row: {str(row)[:100]}")
        name = check_name(row[0])
        if name in sizes:
            raise PackError(f"pack names {name!r} twice")
        sizes[name] = row[1]
    if end + sum(sizes.values()) != len(data):
        raise PackError("pack's sizes do not add up to its length")
    parts, offset = {}, end
    for name, size in sizes.items():
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
