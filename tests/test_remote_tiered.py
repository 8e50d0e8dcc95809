"""TieredStore (local L1 + Redis L2) with a real redis-server and real processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import xxhash
from clock import ManualClock
from redis_server import (  # noqa: F401  (the `server` fixture; stores closed after each test)
    RedisServer,
    close_opened_stores,
    closed_after_test,
    free_port,
    redis_server_fixture,
    require_redis_server,
)

from cachebuild.errors import LockTimeout, UsageError
from cachebuild.store import StoreOptions, open_store
from cachebuild.store.blob import encode_blob
from cachebuild.store.local import LocalStore
from cachebuild.store.remote import RedisRemote, RemoteDownWarning, chunk_key, record_key
from cachebuild.store.tiered import TieredStore, UnsignedRemoteWarning
from cachebuild.store.timekeeping import SYSTEM_CLOCK, Clock
from cachebuild.store.transfer import pull, push

pytestmark = pytest.mark.redis

KEY_A = b"fleet-signing-key-A"
KEY_B = b"another-fleet-key-B"
MiB = 1024 * 1024


def new_key() -> str:
    return secrets.token_hex(16)


def tiered(
    root: Path,
    url: str | None,
    *,
    signing_key: bytes | None = KEY_A,
    mode: str = "rw",
    allow_unsigned: bool = False,
    lock_ttl: float = 60.0,
    chunk_size: int = 4 * MiB,
    clock: Clock = SYSTEM_CLOCK,
) -> TieredStore:
    """A tiered store (closed when the test ends); ``clock``: the remote lock's."""
    local = closed_after_test(LocalStore(root, signing_key=signing_key, clock=clock))
    remote = RedisRemote(url, mode=mode, chunk_size=chunk_size, clock=clock) if url else None
    return TieredStore(
        local, remote, signing_key=signing_key, allow_unsigned=allow_unsigned, lock_ttl=lock_ttl
    )


def down_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, RemoteDownWarning)]


def rewrite_remote_blob(server: RedisServer, key: str, blob: bytes) -> None:
    """Replace ``key``'s remote blob as someone with write access to Redis could:
    new chunk bytes and a record whose length and digest match them."""
    client = server.client()
    doc = json.loads(client.get(record_key(key)))
    for i in range(doc["chunks"]):
        client.delete(chunk_key(key, i))
    client.set(chunk_key(key, 0), blob)
    doc.update(chunks=1, length=len(blob), xxh3_128=xxhash.xxh3_128_hexdigest(blob))
    client.set(record_key(key), json.dumps(doc))


# -- sharing --------------------------------------------------------------------------


def test_put_in_one_get_in_another_lands_in_its_l1(tmp_path, server):
    first = tiered(tmp_path / "a", server.url)
    second = tiered(tmp_path / "b", server.url)
    key = new_key()
    payload = os.urandom(200_000)
    manifest = {"graph": "abc", "bucket": {"range": [1, 512]}}
    first.put(key, payload, kind="target", manifest=manifest)

    assert not second.local.contains(key)
    assert second.contains(key)
    assert second.get_record(key).manifest == manifest  # explain works on remote entries
    assert second.get(key) == payload
    assert second.local.contains(key)
    assert second.local.get(key) == payload
    assert second.local.get_record(key).manifest == manifest
    assert second.get(key) == payload
    tiers = second.stats().tiers
    # contains() fetched and verified it from L2 (into L1); both gets were L1 hits.
    assert (tiers.l1_hits, tiers.l2_hits, tiers.misses) == (2, 1, 0)


def test_large_blob_round_trips_through_chunks(tmp_path, server):
    first = tiered(tmp_path / "a", server.url)
    second = tiered(tmp_path / "b", server.url)
    key = new_key()
    payload = os.urandom(10 * MiB)
    first.put(key, payload, kind="target")
    assert len(server.client().keys(f"cachebuild:v1:blob:{key}:*")) == 3
    assert second.get(key) == payload
    path = second.materialize(key, ".so")
    assert path is not None and path.read_bytes() == payload


def test_materialize_pulls_from_remote(tmp_path, server):
    first = tiered(tmp_path / "a", server.url)
    second = tiered(tmp_path / "b", server.url)
    key = new_key()
    first.put(key, b"\x7fELF shared object bytes", kind="aoti")
    path = second.materialize(key, ".so")
    assert path is not None and path.read_bytes() == b"\x7fELF shared object bytes"
    assert second.materialize(new_key(), ".so") is None


def test_miss_everywhere(tmp_path, server):
    store = tiered(tmp_path / "a", server.url)
    assert store.get(new_key()) is None
    assert store.stats().tiers.misses == 1


def test_delete_then_put_replaces_the_shared_copy(tmp_path, server):
    """How a stale entry is replaced: under the lock, delete then put, in both tiers."""
    first = tiered(tmp_path / "a", server.url)
    key = new_key()
    first.put(key, b"stale entry", kind="entry")
    with first.lock(key):
        assert first.contains(key)
        first.delete(key)
        first.put(key, b"fresh entry", kind="entry")
    assert tiered(tmp_path / "b", server.url).get(key) == b"fresh entry"

    ro = tiered(tmp_path / "c", server.url, mode="ro")
    assert ro.get(key) == b"fresh entry"
    ro.delete(key)
    assert not ro.local.contains(key)
    assert ro.remote.contains(key)  # read-only never deletes from Redis


# -- signing ------------------------------------------------------------------------------


def test_remote_without_signing_key_needs_allow_unsigned(tmp_path, server):
    with pytest.raises(UsageError, match="signing key"):
        tiered(tmp_path / "a", server.url, signing_key=None)
    with pytest.warns(UnsignedRemoteWarning):
        store = tiered(tmp_path / "a", server.url, signing_key=None, allow_unsigned=True)
    key = new_key()
    store.put(key, b"unsigned payload", kind="target")
    with pytest.warns(UnsignedRemoteWarning):
        other = tiered(tmp_path / "b", server.url, signing_key=None, allow_unsigned=True)
    assert other.get(key) == b"unsigned payload"
    # The copy in L1 came unsigned from the remote that --allow-unsigned named: trusted by
    # that option, so it is served from L1 from then on.
    copy = other.local.get_record(key)
    assert copy.unsigned_from.startswith("remote ") and copy.trusted.startswith(
        "--allow-unsigned with remote ")
    assert other.local.get(key) == b"unsigned payload"
    # No remote, no key: nothing to authenticate, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiered(tmp_path / "c", None, signing_key=None)


def test_tampered_remote_blob_is_rejected(tmp_path, server):
    writer = tiered(tmp_path / "a", server.url)
    key = new_key()
    payload = os.urandom(50_000)
    writer.put(key, payload, kind="target")
    blob = bytearray(encode_blob(key, "target", payload, KEY_A))
    blob[-1000] ^= 0x01  # one payload byte
    # Written with a matching record digest, so the blob's own checks must catch it.
    rewrite_remote_blob(server, key, bytes(blob))

    reader = tiered(tmp_path / "b", server.url)
    assert reader.get(key) is None
    assert not reader.local.contains(key)
    tiers = reader.stats().tiers
    assert tiers.remote_rejected == 1 and tiers.misses == 1 and tiers.l2_hits == 0


def test_tampered_blob_with_recomputed_checksum_is_rejected(tmp_path, server):
    """Only the HMAC stops an attacker who rewrites the blob consistently."""
    key = new_key()
    tiered(tmp_path / "a", server.url).put(key, b"genuine artifact", kind="target")
    forged = encode_blob(key, "target", b"malicious artifact", None)  # valid framing, unsigned
    rewrite_remote_blob(server, key, forged)
    reader = tiered(tmp_path / "b", server.url)
    assert reader.get(key) is None
    assert reader.stats().tiers.remote_rejected == 1


def test_naively_flipped_byte_is_a_miss(tmp_path, server):
    key = new_key()
    tiered(tmp_path / "a", server.url, chunk_size=1000).put(key, os.urandom(5000), kind="t")
    client = server.client()
    chunk = bytearray(client.get(chunk_key(key, 2)))
    chunk[10] ^= 0xFF
    client.set(chunk_key(key, 2), bytes(chunk))
    reader = tiered(tmp_path / "b", server.url, chunk_size=1000)
    assert reader.get(key) is None
    assert not reader.local.contains(key)


def test_blob_signed_with_another_key_is_rejected(tmp_path, server):
    key = new_key()
    tiered(tmp_path / "a", server.url, signing_key=KEY_B).put(key, b"other fleet", kind="t")
    reader = tiered(tmp_path / "b", server.url, signing_key=KEY_A)
    assert reader.get(key) is None
    assert not reader.local.contains(key)
    assert reader.stats().tiers.remote_rejected == 1
    counts = pull(reader, [key])
    assert counts.rejected == 1 and counts.transferred == 0


def test_unsigned_remote_blob_is_rejected_when_a_key_is_set(tmp_path, server):
    key = new_key()
    with pytest.warns(UnsignedRemoteWarning):
        unsigned = tiered(tmp_path / "a", server.url, signing_key=None, allow_unsigned=True)
    unsigned.put(key, b"no signature", kind="t")
    reader = tiered(tmp_path / "b", server.url, signing_key=KEY_A)
    assert reader.get(key) is None
    assert reader.stats().tiers.remote_rejected == 1


# -- read-only ----------------------------------------------------------------------------


def test_read_only_store_writes_nothing_to_redis(tmp_path, server):
    client = server.client()
    writer = tiered(tmp_path / "w", server.url)
    shared = new_key()
    writer.put(shared, b"warm artifact", kind="target")
    before = sorted(client.keys("*"))
    assert client.dbsize() == len(before) > 0

    ro = tiered(tmp_path / "ro", server.url, mode="ro")
    for _ in range(5):
        ro.put(new_key(), os.urandom(10_000), kind="target")
    fresh = new_key()
    with ro.lock(fresh):
        ro.put(fresh, b"built under lock", kind="target")
    assert ro.get(shared) == b"warm artifact"  # reads still work
    with pytest.raises(UsageError):
        push(ro)
    pull(ro)

    assert sorted(client.keys("*")) == before
    assert ro.local.contains(fresh) and ro.local.contains(shared)


# -- failure modes ------------------------------------------------------------------------


def test_redis_down_at_start_works_locally_with_one_warning(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    store = tiered(tmp_path / "a", url)
    keys = [new_key() for _ in range(20)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for key in keys:
            assert store.get(key) is None
            with store.lock(key):
                store.put(key, key.encode() * 100, kind="target")
        for key in keys:
            assert store.get(key) == key.encode() * 100
        assert push(store).failed == len(keys)
    assert len(down_warnings(caught)) == 1
    tiers = store.stats().tiers
    assert tiers.remote_available is False and tiers.remote_errors == 1
    assert tiers.l1_hits == 20
    # Workers this process starts now are not sent to wait out the same timeout again,
    # and a start that finds no entry says the remote was unavailable, not "not warmed".
    options = StoreOptions(cache_dir=tmp_path / "a", remote=url + "\n")  # as a file gives it
    assert options.remote == url
    reopened = TieredStore(store.local, store.remote, signing_key=KEY_A, opened_with=options)
    assert reopened.reopen_options() == options.with_remote_off()
    from cachebuild.building.notice import reason

    said = reason("no entry", store, {})
    assert "the remote redis://127.0.0.1" in said and "unavailable" in said, said


def test_redis_killed_mid_puts_completes_locally_with_one_warning(tmp_path):
    require_redis_server()
    with RedisServer() as server:
        store = tiered(tmp_path / "a", server.url)
        items = {new_key(): os.urandom(300_000) for _ in range(30)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n, (key, payload) in enumerate(items.items()):
                if n == 10:
                    server.kill()
                with store.lock(key):
                    if store.get(key) is None:
                        store.put(key, payload, kind="target")
        assert len(down_warnings(caught)) == 1
        # The first call after the kill marked the remote down; no later one waited on it.
        assert store.stats().tiers.remote_errors == 1
        for key, payload in items.items():
            assert store.local.get(key) == payload


def test_two_stores_with_separate_l1_build_once(tmp_path, server):
    """Check-then-build under the tiered lock, as Builder does, from two machines' worth of
    stores: while the first builds, the second waits on the lock in Redis, then finds the
    artifact and builds nothing."""
    key = new_key()
    built: list[str] = []
    waiting, done = threading.Event(), threading.Event()

    def build(name: str, store: TieredStore) -> None:
        with store.lock(key):
            if store.get(key) is None:
                built.append(name)
                store.put(key, b"the one artifact", kind="target")
        assert store.get(key) == b"the one artifact"

    def meanwhile(seconds: float) -> None:  # the second waits until the first is done
        waiting.set()
        done.wait(30)

    first = tiered(tmp_path / "l1-first", server.url)
    second = tiered(tmp_path / "l1-second", server.url, clock=ManualClock(on_sleep=meanwhile))
    with first.lock(key):  # the first is building when the second asks
        other = threading.Thread(target=build, args=("second", second))
        other.start()
        assert waiting.wait(30)
        assert first.get(key) is None
        built.append("first")
        first.put(key, b"the one artifact", kind="target")
    done.set()
    other.join(30)
    assert built == ["first"]


def _hold_forever(root: str, url: str, key: str, ready, ttl: float) -> None:
    store = tiered(Path(root), url, lock_ttl=ttl)
    with store.lock(key):
        ready.set()
        time.sleep(600)  # until it is killed


def test_killed_lock_holder_expires_and_another_takes_over(tmp_path, server):
    key = new_key()
    ttl = 1.5
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(
        target=_hold_forever, args=(str(tmp_path / "l1-holder"), server.url, key, ready, ttl)
    )
    holder.start()
    try:
        assert ready.wait(60) and holder.is_alive()
        waiter = tiered(tmp_path / "l1-waiter", server.url, lock_ttl=ttl)
        # Alive and renewing: held well past its ttl.
        with pytest.raises(LockTimeout):
            with waiter.lock(key, timeout=2 * ttl):
                pass
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        # Nobody renews it now: it expires one lifetime later, and the waiter takes it.
        with waiter.lock(key, timeout=30):
            pass
    finally:
        if holder.is_alive():
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(10)


# -- push / pull / open_store -------------------------------------------------------------


def test_push_all_then_pull(tmp_path, server):
    local_only = tiered(tmp_path / "a", None)
    items = {new_key(): os.urandom(100_000) for _ in range(5)}
    for key, payload in items.items():
        local_only.put(key, payload, kind="target", manifest={"n": key[:4]})

    pusher = tiered(tmp_path / "a", server.url)
    counts = push(pusher)
    assert counts.transferred == 5 and counts.bytes == 500_000
    assert push(pusher).present == 5
    assert push(pusher, [new_key()]).missing == 1

    puller = tiered(tmp_path / "b", server.url)
    keys = list(items)
    counts = pull(puller, keys[:2])
    assert counts.transferred == 2
    counts = pull(puller)
    assert (counts.transferred, counts.present) == (3, 2)
    for key, payload in items.items():
        assert puller.local.get(key) == payload
        assert puller.local.get_record(key).manifest == {"n": key[:4]}
    assert sorted(r.key for r in puller.records(shared=True)) == sorted(items)


def test_a_record_of_another_redis_type_is_not_already_there(tmp_path, server):
    """A value of another Redis type under a record's name (no reader can read it) is
    counted rejected by push, not "already there", and replaced when asked; then readers
    get the blob again."""
    pusher = tiered(tmp_path / "a", server.url)
    key = new_key()
    pusher.put(key, os.urandom(5000), kind="target")
    client = server.client()
    client.delete(record_key(key))
    client.lpush(record_key(key), b"a")
    counts = push(pusher, [key])
    assert (counts.rejected, counts.present, counts.rejected_keys) == (1, 0, [key])
    counts = pull(tiered(tmp_path / "p", server.url), [key])  # says which it could not read
    assert (counts.missing, counts.missing_keys) == (1, [key])
    counts = push(pusher, [key], replace=True)
    assert (counts.replaced, counts.present) == (1, 0)
    assert tiered(tmp_path / "r", server.url).get(key) == pusher.local.get(key)


def test_push_counts_a_bad_remote_copy_as_rejected_and_replaces_it_only_when_asked(
        tmp_path, server):
    """A damaged remote copy is not "already there"; a pusher with another key (which
    rejects the fleet's good copies) replaces nothing unless asked."""
    pusher = tiered(tmp_path / "a", server.url)
    damaged, good = new_key(), new_key()
    pusher.put(damaged, os.urandom(20_000), kind="target")
    pusher.put(good, os.urandom(20_000), kind="target")
    blob = bytearray(encode_blob(damaged, "target", pusher.local.get(damaged), KEY_A))
    blob[-100] ^= 0x01
    rewrite_remote_blob(server, damaged, bytes(blob))

    counts = push(pusher, [damaged, good])
    assert (counts.rejected, counts.present, counts.transferred) == (1, 1, 0)
    assert counts.rejected_keys == [damaged]
    assert tiered(tmp_path / "r1", server.url).get(damaged) is None  # left as it was

    counts = push(pusher, [damaged, good], replace=True)
    assert (counts.replaced, counts.transferred, counts.present) == (1, 1, 1)
    reader = tiered(tmp_path / "r2", server.url)
    assert reader.get(damaged) == pusher.local.get(damaged)

    # Another key sees every fleet copy as bad: reported, never replaced unasked.
    other = tiered(tmp_path / "b", server.url, signing_key=KEY_B)
    other.local.put(good, pusher.local.get(good), kind="target")
    counts = push(other, [good])
    assert counts.rejected == 1 and counts.replaced == 0
    assert tiered(tmp_path / "r3", server.url).get(good) == pusher.local.get(good)


def test_open_store_reads_the_environment(tmp_path, server, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_DIR", str(tmp_path / "env-l1"))
    monkeypatch.setenv("CACHEBUILD_REMOTE", server.url)
    monkeypatch.setenv("CACHEBUILD_SIGNING_KEY", "k" * 32)
    monkeypatch.setenv("CACHEBUILD_REMOTE_MODE", "ro")
    store = open_store()
    assert store.remote is not None and store.remote.mode == "ro"
    assert store.signing_key == b"k" * 32
    key = new_key()
    store.put(key, b"x", kind="target")
    assert server.client().dbsize() == 0
    assert (tmp_path / "env-l1").exists()
    # A worker opens the same two tiers from what the store says.
    assert store.reopen_options() == StoreOptions.from_env()

    assert isinstance(open_store(StoreOptions.from_env(remote_mode="off")), LocalStore)
    assert open_store(StoreOptions.from_env(remote_mode="rw")).remote.mode == "rw"
    monkeypatch.delenv("CACHEBUILD_SIGNING_KEY")
    with pytest.raises(UsageError):
        open_store()
    with pytest.raises(UsageError):
        open_store(StoreOptions.from_env(remote_mode="sideways"))


def test_a_store_without_remote_does_not_import_redis(tmp_path):
    """`import redis` costs start-up time; only a process with a remote pays it."""
    code = (
        "import sys\n"
        "from cachebuild.store import open_store\n"
        "from cachebuild.store import StoreOptions\n"
        f"store = open_store(StoreOptions({str(tmp_path / 'l1')!r}, signing_key=b'k' * 32))\n"
        "store.put('ab' * 16, b'x', kind='target')\n"
        "assert store.get('ab' * 16) == b'x'\n"
        "assert 'redis' not in sys.modules, 'redis imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEBUILD_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
