"""The blob format: every kind of damage and tampering is caught, with its reason."""

from __future__ import annotations

import os

import pytest

from cachebuild.keys import make_key
from cachebuild.store import CorruptBlob, decode_blob, encode_blob
from cachebuild.store.blob import (
    ALGO_XXH3_64,
    SIGNATURE_SIZE,
    encode_header,
    parse_header,
    read_blob_fd,
)

KEY = make_key({"blob": 1})
OTHER = make_key({"blob": 2})


def _fd_of(data: bytes, tmp_path) -> int:
    path = tmp_path / "blob"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize("size", [0, 1, 4096, 300_000, 3_000_000])
@pytest.mark.parametrize("signing_key", [None, b"secret"])
def test_round_trip_in_memory_and_from_file(size, signing_key, tmp_path):
    payload = os.urandom(size)
    blob = encode_blob(KEY, "target", payload, signing_key)
    assert decode_blob(blob, expected_key=KEY, signing_key=signing_key) == ("target", payload)
    fd = _fd_of(blob, tmp_path)
    try:
        header, got = read_blob_fd(fd, expected_key=KEY, signing_key=signing_key,
                                   require_signature=signing_key is not None)
    finally:
        os.close(fd)
    assert got == payload
    assert (header.key, header.kind, header.length, header.signed) == (
        KEY, "target", size, signing_key is not None)
    assert header.total_size == len(blob)


def _corrupt(reason_match: str, blob: bytes, tmp_path, **kw):
    with pytest.raises(CorruptBlob, match=reason_match) as info:
        decode_blob(blob, expected_key=KEY, **kw)
    fd = _fd_of(blob, tmp_path)
    try:
        with pytest.raises(CorruptBlob, match=reason_match):
            read_blob_fd(fd, expected_key=KEY, **kw)
    finally:
        os.close(fd)
    return info.value


@pytest.mark.parametrize("size", [1000, 400_000])
def test_flipped_payload_byte(size, tmp_path):
    blob = bytearray(encode_blob(KEY, "target", os.urandom(size)))
    blob[-10] ^= 0x01
    err = _corrupt("payload checksum mismatch", bytes(blob), tmp_path)
    assert err.key == KEY and err.reason == "payload checksum mismatch"


@pytest.mark.parametrize("offset", [9, 12, 20, 30, 45, 60])
def test_flipped_header_byte(offset, tmp_path):
    blob = bytearray(encode_blob(KEY, "target", b"x" * 100))
    blob[offset] ^= 0x40
    _corrupt("header checksum mismatch|unsupported blob format", bytes(blob), tmp_path)


@pytest.mark.parametrize("cut", [-1, -500, -1000, 10, 50])
def test_truncated(cut, tmp_path):
    blob = encode_blob(KEY, "target", b"y" * 1000)
    _corrupt("truncated", blob[:cut], tmp_path)


def test_trailing_bytes(tmp_path):
    _corrupt("trailing", encode_blob(KEY, "k", b"z" * 10) + b"!", tmp_path)


def test_wrong_key_and_bad_magic(tmp_path):
    _corrupt(f"holds key {OTHER}", encode_blob(OTHER, "k", b"data"), tmp_path)
    _corrupt("bad magic", b"\0" * 200, tmp_path)


def test_signature_checks(tmp_path):
    payload = os.urandom(5000)
    signed = encode_blob(KEY, "k", payload, b"key-A")
    unsigned = encode_blob(KEY, "k", payload)
    # a blob signed with another key
    _corrupt("bad signature", signed, tmp_path, signing_key=b"key-B")
    # an unsigned blob where signatures are required
    _corrupt("unsigned", unsigned, tmp_path, signing_key=b"key-A", require_signature=True)
    # tampering that also fixes up the checksum: only the HMAC can catch it
    forged_payload = bytearray(payload)
    forged_payload[0] ^= 0xFF
    header, _ = encode_header(KEY, "k", bytes(forged_payload), signed=True)
    forged = header + bytes(forged_payload) + signed[-SIGNATURE_SIZE:]
    _corrupt("bad signature", forged, tmp_path, signing_key=b"key-A")
    # without a key, a signed blob still passes its checksum (it cannot be checked further)
    assert decode_blob(signed, expected_key=KEY)[1] == payload


def test_xxh3_64_blobs_decode():
    header, checksum = encode_header(KEY, "k", b"abc", algorithm=ALGO_XXH3_64)
    assert len(checksum) == 16
    assert decode_blob(header + b"abc", expected_key=KEY) == ("k", b"abc")
    assert parse_header(header).checksum == checksum


def test_header_rejects_bad_fields():
    with pytest.raises(ValueError):
        encode_blob(KEY, "", b"")
    with pytest.raises(ValueError):
        encode_blob("k" * 300, "kind", b"")
