"""The blob format: one self-describing, self-verifying file per stored artifact.

A blob is ``header + payload [+ signature]``::

    offset  size  field
    0       8     magic  b"\\x89CBBLOB\\n"
    8       2     format version (1)
    10      2     flags (bit 0: an HMAC-SHA256 signature trails the payload)
    12      1     payload checksum algorithm (1: xxh3-64, 2: xxh3-128)
    13      1     key length K (bytes, ASCII)
    14      2     kind length N (bytes, UTF-8)
    16      8     payload length L
    24      16    payload checksum (xxh3-64 uses the first 8 bytes, the rest is zero)
    40      K     key
    40+K    N     kind
    40+K+N  8     header checksum: xxh3-64 of every header byte before it
    ...     L     payload
    ...     32    HMAC-SHA256 over header and payload (only when flag bit 0 is set)

All integers are little-endian. The header checksum catches damage to the key, kind or
length fields before the payload is even read; the payload checksum catches damage to
the payload; the HMAC, when a signing key is configured, catches deliberate tampering,
which a plain checksum cannot (anyone able to write the file can recompute it).

``decode_blob`` and ``read_blob_file`` never return a payload that fails any of these
checks: they raise :class:`CorruptBlob` with the reason instead.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import NamedTuple

import xxhash

from cachebuild.errors import StoreError

MAGIC = b"\x89CBBLOB\n"
FORMAT_VERSION = 1
FLAG_SIGNED = 0x1
ALGO_XXH3_64 = 1
ALGO_XXH3_128 = 2
SIGNATURE_SIZE = hashlib.sha256().digest_size

_FIXED = struct.Struct("<8sHHBBHQ16s")
_HEADER_CHECK = struct.Struct("<8s")
MAX_KEY_BYTES = 255
MAX_KIND_BYTES = 255
#: The largest header there can be; a reader that has this many bytes has the header.
MAX_HEADER_SIZE = _FIXED.size + MAX_KEY_BYTES + MAX_KIND_BYTES + _HEADER_CHECK.size
#: Blobs up to this size are read with one system call and sliced; larger ones are read
#: header first, then the payload straight into its final bytes object (no extra copy).
_SMALL_READ = 256 * 1024


#: Why a store that requires signatures refuses an unsigned blob: not damage, a refusal.
UNSIGNED_REFUSED = "unsigned, but this store requires signed blobs"


class CorruptBlob(StoreError):
    """A blob failed verification; ``reason`` says which check, ``key`` which blob."""

    def __init__(self, reason: str, key: str | None = None) -> None:
        self.reason = reason
        self.key = key
        where = f"blob {key}" if key else "blob"
        super().__init__(f"{where} failed verification: {reason}")


class BlobHeader(NamedTuple):
    """The parsed header of a blob (see the module docstring for the layout).

    A NamedTuple rather than a dataclass: it is built on every read, and this is cheaper.
    """

    key: str
    kind: str
    length: int
    checksum: str
    algorithm: int
    signed: bool
    header_size: int

    @property
    def total_size(self) -> int:
        """Size in bytes of the whole blob this header starts."""
        return self.header_size + self.length + (SIGNATURE_SIZE if self.signed else 0)


def payload_checksum(payload: bytes | memoryview, algorithm: int = ALGO_XXH3_128) -> str:
    """Hex checksum of ``payload`` as recorded in headers and index records."""
    if algorithm == ALGO_XXH3_128:
        return xxhash.xxh3_128_hexdigest(payload)
    if algorithm == ALGO_XXH3_64:
        return xxhash.xxh3_64_hexdigest(payload)
    raise ValueError(f"unknown checksum algorithm {algorithm}")


def _checksum_field(checksum_hex: str) -> bytes:
    return bytes.fromhex(checksum_hex).ljust(16, b"\0")


def encode_header(key: str, kind: str, payload: bytes | memoryview, *,
                  signed: bool = False, algorithm: int = ALGO_XXH3_128) -> tuple[bytes, str]:
    """The header bytes for ``payload`` and the payload's hex checksum."""
    key_b = key.encode("ascii")
    kind_b = kind.encode("utf-8")
    if not 0 < len(key_b) <= MAX_KEY_BYTES:
        raise ValueError(f"blob key must be 1..{MAX_KEY_BYTES} ASCII bytes, got {key!r}")
    if not 0 < len(kind_b) <= MAX_KIND_BYTES:
        raise ValueError(f"blob kind must be 1..{MAX_KIND_BYTES} UTF-8 bytes, got {kind!r}")
    checksum = payload_checksum(payload, algorithm)
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, FLAG_SIGNED if signed else 0, algorithm,
                        len(key_b), len(kind_b), len(payload), _checksum_field(checksum))
    body = fixed + key_b + kind_b
    return body + xxhash.xxh3_64_digest(body), checksum


def sign(signing_key: bytes, header: bytes, payload: bytes | memoryview) -> bytes:
    """HMAC-SHA256 over header and payload."""
    mac = hmac.new(signing_key, header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def encode_parts(key: str, kind: str, payload: bytes | memoryview,
                 signing_key: bytes | None = None) -> tuple[bytes, bytes, str]:
    """``(header, trailer, checksum)`` such that header + payload + trailer is the blob.

    Lets a writer stream a large payload to disk without first concatenating it.
    """
    header, checksum = encode_header(key, kind, payload, signed=signing_key is not None)
    trailer = sign(signing_key, header, payload) if signing_key is not None else b""
    return header, trailer, checksum


def encode_blob(key: str, kind: str, payload: bytes | memoryview,
                signing_key: bytes | None = None) -> bytes:
    """The complete blob for ``payload``: header, payload, and an HMAC if a key is given."""
    header, trailer, _ = encode_parts(key, kind, payload, signing_key)
    return b"".join((header, payload, trailer))


def parse_header(buf: bytes | memoryview, *, expected_key: str | None = None) -> BlobHeader:
    """Parse and check a header at the start of ``buf``.

    Raises CorruptBlob if the magic, version, header checksum or key is wrong, or if
    ``buf`` is too short to hold the header.
    """
    mv = memoryview(buf)
    if len(mv) < _FIXED.size:
        raise CorruptBlob(f"truncated: {len(mv)} bytes is shorter than a blob header", expected_key)
    magic, version, flags, algorithm, klen, nlen, length, checksum = _FIXED.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptBlob("not a cachebuild blob (bad magic)", expected_key)
    if version != FORMAT_VERSION:
        raise CorruptBlob(f"unsupported blob format version {version}", expected_key)
    end = _FIXED.size + klen + nlen
    header_size = end + _HEADER_CHECK.size
    if len(mv) < header_size:
        raise CorruptBlob(f"truncated inside the header ({len(mv)} of {header_size} bytes)",
                          expected_key)
    if xxhash.xxh3_64_digest(mv[:end]) != mv[end:header_size]:
        raise CorruptBlob("header checksum mismatch", expected_key)
    if algorithm not in (ALGO_XXH3_64, ALGO_XXH3_128) or flags & ~FLAG_SIGNED:
        raise CorruptBlob(f"unknown checksum algorithm {algorithm} or flags {flags:#x}",
                          expected_key)
    try:
        key = bytes(mv[_FIXED.size:_FIXED.size + klen]).decode("ascii")
        kind = bytes(mv[_FIXED.size + klen:end]).decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptBlob("undecodable key or kind in header", expected_key) from None
    if expected_key is not None and key != expected_key:
        raise CorruptBlob(f"blob holds key {key}, not {expected_key}", expected_key)
    digest_len = 16 if algorithm == ALGO_XXH3_128 else 8
    return BlobHeader(key=key, kind=kind, length=length, checksum=checksum[:digest_len].hex(),
                      algorithm=algorithm, signed=bool(flags & FLAG_SIGNED),
                      header_size=header_size)


def _check_payload(header: BlobHeader, header_bytes: bytes | memoryview,
                   payload: bytes | memoryview, signature: bytes | memoryview | None,
                   signing_key: bytes | None, require_signature: bool) -> None:
    if payload_checksum(payload, header.algorithm) != header.checksum:
        raise CorruptBlob("payload checksum mismatch", header.key)
    if not header.signed:
        if require_signature:
            raise CorruptBlob(UNSIGNED_REFUSED, header.key)
        return
    if signing_key is None:
        if require_signature:
            raise CorruptBlob("signed, but no signing key is configured to check it", header.key)
        return
    assert signature is not None
    if not hmac.compare_digest(sign(signing_key, header_bytes, payload), bytes(signature)):
        raise CorruptBlob("bad signature (tampered, or signed with another key)", header.key)


def check_blob(data: bytes | bytearray | memoryview, *, expected_key: str,
               signing_key: bytes | None = None,
               require_signature: bool = False) -> BlobHeader:
    """Verify a complete blob held in memory without copying it; return its header.

    Checks the header, that the blob is exactly as long as the header says, the payload
    checksum and — with a signing key — the HMAC. ``require_signature`` rejects unsigned
    blobs. Raises CorruptBlob naming the first check that failed.
    """
    mv = memoryview(data)
    header = parse_header(mv, expected_key=expected_key)
    _check_size(header, len(mv))
    payload = mv[header.header_size:header.header_size + header.length]
    signature = mv[header.header_size + header.length:] if header.signed else None
    _check_payload(header, mv[:header.header_size], payload, signature,
                   signing_key, require_signature)
    return header


def decode_blob(data: bytes | bytearray | memoryview, *, expected_key: str,
                signing_key: bytes | None = None,
                require_signature: bool = False) -> tuple[str, bytes]:
    """Verify a complete blob held in memory and return ``(kind, payload)``.

    The checks are those of ``check_blob``; raises CorruptBlob naming the first that
    failed, so a caller can never use a payload that did not pass them all.
    """
    header = check_blob(data, expected_key=expected_key, signing_key=signing_key,
                        require_signature=require_signature)
    start = header.header_size
    return header.kind, bytes(memoryview(data)[start:start + header.length])


def _check_size(header: BlobHeader, actual: int) -> None:
    expected = header.total_size
    if actual < expected:
        raise CorruptBlob(f"truncated: {actual} of {expected} bytes", header.key)
    if actual > expected:
        raise CorruptBlob(f"{actual - expected} unexpected trailing bytes", header.key)


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    # One pread fills a fresh bytes object directly; only a short read (over 2 GiB, or
    # the file shrank) takes the slow path.
    data = os.pread(fd, n, offset)
    if len(data) == n:
        return data
    buf = bytearray(data)
    while len(buf) < n:
        chunk = os.pread(fd, n - len(buf), offset + len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def read_blob_fd(fd: int, *, expected_key: str, signing_key: bytes | None = None,
                 require_signature: bool = False) -> tuple[BlobHeader, bytes]:
    """Read and verify the blob in the open file ``fd``; return its header and payload.

    The file is read once: small blobs with one call, large ones header first and then
    the payload straight into the bytes object that is returned (no further copy).
    Raises CorruptBlob naming the check that failed.
    """
    size = os.fstat(fd).st_size
    if size <= _SMALL_READ:
        data = _pread_exact(fd, size, 0)
        header = check_blob(data, expected_key=expected_key, signing_key=signing_key,
                            require_signature=require_signature)
        start = header.header_size
        return header, data[start:start + header.length]
    head = _pread_exact(fd, MAX_HEADER_SIZE, 0)
    header = parse_header(head, expected_key=expected_key)
    _check_size(header, size)
    payload = _pread_exact(fd, header.length, header.header_size)
    if len(payload) != header.length:
        raise CorruptBlob(f"truncated while reading: {len(payload)} of {header.length} "
                          "payload bytes", header.key)
    signature = (_pread_exact(fd, SIGNATURE_SIZE, header.header_size + header.length)
                 if header.signed else None)
    _check_payload(header, head[:header.header_size], payload, signature,
                   signing_key, require_signature)
    return header, payload


class StreamCheck:
    """Verifies a blob that arrives in pieces (a bundle member, a download) without ever
    holding it whole: the same checks as ``check_blob``, and a blob that runs past the
    length its header declares is refused at once, before the excess is read.

    ``feed`` each piece in order, then ``finish`` for the header (CorruptBlob if any
    check failed).
    """

    def __init__(self, *, expected_key: str, signing_key: bytes | None = None,
                 require_signature: bool = False) -> None:
        self.expected_key = expected_key
        self.signing_key = signing_key
        self.require_signature = require_signature
        self.header: BlobHeader | None = None
        self._head = bytearray()  # bytes before the header is complete, then the header
        self._seen = 0
        self._hash: object | None = None
        self._mac: hmac.HMAC | None = None
        self._signature = bytearray()

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        view = memoryview(piece).cast("B")
        if self.header is None:
            take = view[:MAX_HEADER_SIZE - len(self._head)]
            self._head += take
            view = view[len(take):]
            if len(self._head) < _FIXED.size:
                return
            size = (_FIXED.size + self._head[13] + int.from_bytes(self._head[14:16], "little")
                    + _HEADER_CHECK.size)
            if len(self._head) < size:
                return  # the rest of the header is still to come
            self._start(size)
            rest = bytes(self._head[size:])
            del self._head[size:]
            self._seen = size
            self._take(memoryview(rest))
        self._take(view)

    def _start(self, size: int) -> None:
        header = parse_header(self._head[:size], expected_key=self.expected_key)
        self.header = header
        self._hash = (xxhash.xxh3_128() if header.algorithm == ALGO_XXH3_128
                      else xxhash.xxh3_64())
        if header.signed and self.signing_key is not None:
            self._mac = hmac.new(self.signing_key, bytes(self._head[:size]), hashlib.sha256)

    def _take(self, view: memoryview) -> None:
        if not view:
            return
        header = self.header
        assert header is not None
        end = header.header_size + header.length
        if self._seen + len(view) > header.total_size:
            raise CorruptBlob(f"longer than the {header.total_size} bytes its header declares",
                              header.key)
        payload = view[:max(0, end - self._seen)]
        if payload:
            self._hash.update(payload)  # type: ignore[attr-defined]
            if self._mac is not None:
                self._mac.update(payload)
        self._signature += view[len(payload):]
        self._seen += len(view)

    def finish(self) -> BlobHeader:
        header = self.header
        if header is None:
            if len(self._head) >= _FIXED.size:  # a header shorter than it says it is
                parse_header(bytes(self._head), expected_key=self.expected_key)
            raise CorruptBlob(f"truncated: {len(self._head)} bytes is shorter than a blob "
                              "header", self.expected_key)
        _check_size(header, self._seen)
        if self._hash.hexdigest() != header.checksum:  # type: ignore[attr-defined]
            raise CorruptBlob("payload checksum mismatch", header.key)
        if not header.signed:
            if self.require_signature:
                raise CorruptBlob(UNSIGNED_REFUSED, header.key)
            return header
        if self.signing_key is None:
            if self.require_signature:
                raise CorruptBlob("signed, but no signing key is configured to check it",
                                  header.key)
            return header
        assert self._mac is not None
        if not hmac.compare_digest(self._mac.digest(), bytes(self._signature)):
            raise CorruptBlob("bad signature (tampered, or signed with another key)", header.key)
        return header
