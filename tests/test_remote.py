"""RedisRemote against a real redis-server: chunking, read-only, eviction, health, locks."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
import warnings

import pytest
from clock import ManualClock
from redis_server import (  # noqa: F401  (redis_server_fixture provides `server`)
    RedisServer,
    free_port,
    redis_server_fixture,
    require_redis_server,
)

from cachebuild.errors import LockTimeout, UsageError
from cachebuild.store.redis_lock import RemoteLock
from cachebuild.store.remote import (
    PREFIX,
    RedisRemote,
    RemoteDownWarning,
    chunk_key,
    lock_key,
    record_key,
    redact_url,
)

pytestmark = pytest.mark.redis

MiB = 1024 * 1024


def new_key() -> str:
    return secrets.token_hex(16)


def record_for(key: str, size: int) -> dict:
    return {
        "key": key,
        "kind": "test",
        "size": size,
        "checksum": "0" * 32,
        "created": 1_700_000_000.0,
        "manifest": {"graph": "g", "bucket": {"size": 4}},
        "refs": [],
    }


def down_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, RemoteDownWarning)]


def test_large_blob_is_chunked_and_round_trips(server):
    remote = RedisRemote(server.url)
    key = new_key()
    blob = os.urandom(10 * MiB + 123)
    assert remote.put(key, record_for(key, len(blob)), blob) is True

    client = server.client()
    chunks = sorted(k.decode() for k in client.keys(f"{PREFIX}blob:{key}:*"))
    assert chunks == sorted(chunk_key(key, i) for i in range(3))  # 4 MiB chunks
    doc = json.loads(client.get(record_key(key)))
    assert doc["chunks"] == 3 and doc["length"] == len(blob)
    assert doc["record"]["manifest"] == {"graph": "g", "bucket": {"size": 4}}

    record, data = remote.get(key)
    assert data == blob
    assert record["key"] == key and record["manifest"]["bucket"] == {"size": 4}
    assert remote.get_record(key) == record
    assert remote.contains(key) and list(remote.keys()) == [key]
    assert [k for k, r in remote.records()] == [key] and remote.get_record(key) == record


def test_put_is_immutable(server):
    remote = RedisRemote(server.url, chunk_size=1000)
    key = new_key()
    assert remote.put(key, record_for(key, 5), b"first")
    assert remote.put(key, record_for(key, 6), b"second") is False
    assert remote.get(key)[1] == b"first"


def test_missing_key_is_a_miss(server):
    remote = RedisRemote(server.url)
    assert remote.get(new_key()) is None
    assert remote.get_record(new_key()) is None
    assert not remote.contains(new_key())
    assert remote.available


def test_delete_removes_record_and_chunks(server):
    remote = RedisRemote(server.url, chunk_size=1000)
    key, other = new_key(), new_key()
    remote.put(key, record_for(key, 5000), os.urandom(5000))
    remote.put(other, record_for(other, 10), os.urandom(10))
    assert remote.delete(key) is True
    assert remote.get(key) is None and remote.delete(key) is False
    assert [k.decode() for k in server.client().keys("*")] != []
    assert server.client().keys(f"{PREFIX}*{key}*") == []
    assert remote.get(other) is not None


def test_read_only_writes_nothing(server):
    client = server.client()
    rw = RedisRemote(server.url, chunk_size=100)
    present = new_key()
    rw.put(present, record_for(present, 1000), os.urandom(1000))
    # A record whose chunk is gone: read-write would drop it; read-only must not.
    broken = new_key()
    rw.put(broken, record_for(broken, 1000), os.urandom(1000))
    client.delete(chunk_key(broken, 3))
    before = sorted(client.keys("*"))

    ro = RedisRemote(server.url, mode="ro", chunk_size=100)
    fresh = new_key()
    assert ro.put(fresh, record_for(fresh, 10), b"0123456789") is False
    assert ro.delete(present) is False
    with ro.lock(fresh, ttl=5) as held:
        assert held is False
        assert client.dbsize() == len(before)
    assert ro.get(broken) is None
    assert ro.get(present) is not None

    assert sorted(client.keys("*")) == before
    assert ro.available


def test_half_evicted_blob_is_a_miss_and_is_dropped(server):
    client = server.client()
    remote = RedisRemote(server.url, chunk_size=1000)
    key = new_key()
    blob = os.urandom(5000)
    remote.put(key, record_for(key, len(blob)), blob)
    client.delete(chunk_key(key, 2))

    assert remote.get(key) is None
    assert remote.incomplete == 1
    assert not client.exists(record_key(key))  # dropped, so the next put can repair it
    assert remote.put(key, record_for(key, len(blob)), blob)
    assert remote.get(key)[1] == blob


def test_chunk_of_wrong_length_is_a_miss(server):
    client = server.client()
    remote = RedisRemote(server.url, chunk_size=1000)
    key = new_key()
    remote.put(key, record_for(key, 3000), os.urandom(3000))
    client.set(chunk_key(key, 1), b"short")
    assert remote.get(key) is None


def test_eviction_under_memory_pressure_never_returns_wrong_bytes():
    """With allkeys-lru and more data than fits, every get is the exact blob or a miss."""
    require_redis_server()
    with RedisServer(maxmemory="6mb", policy="allkeys-lru") as server:
        remote = RedisRemote(server.url, chunk_size=64 * 1024)
        flood = {new_key(): os.urandom(512 * 1024) for _ in range(40)}  # 20 MiB into 6 MiB
        for key, blob in flood.items():
            remote.put(key, record_for(key, len(blob)), blob)
        # Redis's LRU clock ticks once a second, so keys written within one second are
        # evicted in no particular order: any flood blob may have lost a chunk. A blob
        # written two ticks later is younger than all of them, and must survive whole.
        time.sleep(2.1)
        fresh, fresh_blob = new_key(), os.urandom(512 * 1024)
        assert remote.put(fresh, record_for(fresh, len(fresh_blob)), fresh_blob)
        got = remote.get(fresh)
        assert got is not None and got[1] == fresh_blob
        hits = 0
        for key, blob in flood.items():
            got = remote.get(key)
            if got is not None:
                assert got[1] == blob
                hits += 1
        assert remote.available, "a slow answer marked the remote down"
        assert hits < len(flood)  # 20 MiB cannot all be there


def test_down_at_start_is_one_warning_and_fast():
    url = f"redis://127.0.0.1:{free_port()}/0"
    remote = RedisRemote(url)
    key = new_key()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert remote.get(key) is None
        assert remote.put(key, record_for(key, 3), b"abc") is False
        assert not remote.contains(key)
        assert list(remote.keys()) == []
        with remote.lock(key) as held:
            assert held is False
        for _ in range(100):
            remote.get(key)
    # Only the first call went to the network: every later one was answered at once.
    assert remote.errors == 1
    assert len(down_warnings(caught)) == 1
    assert not remote.available


def test_unresponsive_server_is_bounded_by_the_op_timeout():
    """A server that accepts connections but never answers costs one op timeout, once."""
    require_redis_server()
    with RedisServer() as server:
        remote = RedisRemote(server.url, op_timeout=0.5)
        key = new_key()
        remote.put(key, record_for(key, 3), b"abc")
        os.kill(server.proc.pid, 19)  # SIGSTOP: the socket stays open, nothing answers
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(20):
                    assert remote.get(key) is None
            # One call waited out the op timeout and marked the remote down; the other 19
            # never went to the socket.
            assert remote.errors == 1
            assert len(down_warnings(caught)) == 1
        finally:
            os.kill(server.proc.pid, 18)  # SIGCONT, so it can be stopped cleanly


class _Trickle:
    """A TCP proxy in front of a Redis server that passes requests on at once and
    answers a few bytes a second (a congested or throttled link)."""

    def __init__(self, port: int, bytes_per_s: int = 2000) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._target, self._rate = port, bytes_per_s
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, slow: bool) -> None:
        try:
            while data := source.recv(65536):
                step = self._rate // 10 if slow else len(data)
                for i in range(0, len(data), step):
                    sink.sendall(data[i:i + step])
                    if slow:
                        time.sleep(0.1)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def test_a_link_that_trickles_is_cut_at_the_deadline_not_at_the_end(server):
    """The socket timeout bounds each wait for the next bytes, not a whole answer: a link
    that sends a little at a time held one read of a 94 KiB entry for 50 s. Every call
    now ends at its deadline (op timeout, plus a second a MiB it moves), marking the
    remote down with one warning that says why, at the caller's line."""
    key = new_key()
    assert RedisRemote(server.url).put(key, record_for(key, 200_000), os.urandom(200_000))
    trickle = _Trickle(int(server.url.rsplit(":", 1)[1].split("/")[0]))
    try:
        remote = RedisRemote(f"redis://127.0.0.1:{trickle.port}/0", mode="ro", op_timeout=1.0)
        began = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert remote.get(key) is None  # 200 KB at 2 KB/s would take 100 s
            assert remote.get(key) is None  # and the next call does not try again
        assert time.monotonic() - began < 30
        assert not remote.available and remote.errors == 1
        [said] = down_warnings(caught)
        assert "the link is too slow" in str(said.message)
        assert said.filename == __file__
    finally:
        trickle.close()


def test_a_forked_child_keeps_none_of_its_parents_deadlines():
    """A fork while a parent's thread was in a Redis call: the child got that thread's
    lock held (its first call hung) and its deadline (which, never taken off there,
    marked the remote down in the child)."""
    remote = RedisRemote(f"redis://127.0.0.1:{free_port()}/0")
    deadlines = remote._deadlines
    with deadlines._lock:  # as a parent's thread in a call holds it
        deadlines._due[12345] = time.monotonic() - 1
        child = os.fork()
        if child == 0:
            fresh = remote._deadlines._lock.acquire(timeout=2) and not remote._deadlines._due
            os._exit(0 if fresh else 1)
    deadlines._due.clear()
    assert os.waitpid(child, 0)[1] == 0


def test_bad_url_and_mode_are_usage_errors():
    with pytest.raises(UsageError):
        RedisRemote("http://127.0.0.1:6379")
    with pytest.raises(UsageError):
        RedisRemote("redis://127.0.0.1:6379", mode="wo")  # type: ignore[arg-type]
    # A database that is not a number was taken for database 0, silently.
    for url in ("redis://127.0.0.1:6379/abc", "redis://127.0.0.1:6379/0?db=x"):
        with pytest.raises(UsageError, match="is not a number"):
            RedisRemote(url)
    with pytest.raises(UsageError, match="bad remote URL"):
        RedisRemote("redis://[::1/0")  # a ValueError escaped, with its traceback
    for url in ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://h:1/15",
                "redis://h:1?db=3", "unix:///run/redis.sock?db=2"):
        RedisRemote(url)


def test_password_is_redacted():
    assert redact_url("redis://user:s3cret@10.0.0.1:6379/2") == "redis://user:***@10.0.0.1:6379/2"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert "s3cret" not in repr(RedisRemote("redis://:s3cret@127.0.0.1:1/0"))
    # redis-py takes a password as a query parameter too, and so in a unix socket's URL.
    assert redact_url("redis://127.0.0.1:6379/4?password=s3cret") == \
        "redis://127.0.0.1:6379/4?password=***"
    assert redact_url("unix:///run/redis.sock?db=2&password=s3cret") == \
        "unix:///run/redis.sock?db=2&password=***"
    assert "s3cret" not in RedisRemote("redis://h:1/0?Password=s3cret").display_url
    assert redact_url("rediss://h/0?ssl_password=s3cret&db=1") == \
        "rediss://h/0?ssl_password=***&db=1"


def test_what_the_server_says_is_shown_as_plain_text():
    """A refusal's text (a blob's bytes, as redis-py quotes the command) or an answer
    holding terminal escapes reaches the warning as plain text."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):  # an error for each command (RESP array)
                commands = data.startswith(b"*") + data.count(b"\r\n*")
                conn.sendall(b"-ERR \x1b]0;title\x07 \x00\x01 refused\r\n" * commands)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=answer, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    remote = RedisRemote(f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remote.get_record(new_key())
        remote.put(new_key(), record_for("x", 3), b"abc")
    listener.close()
    said = " ".join(str(w.message) for w in down_warnings(caught))
    assert said and "refused" in said
    assert all(c.isprintable() for c in said), said


# -- lock ---------------------------------------------------------------------------------


def test_lock_is_released_only_by_its_owner(server):
    client = server.client()
    remote = RedisRemote(server.url)
    key = new_key()
    with remote.lock(key, ttl=10) as held:
        assert held is True
        token = client.get(lock_key(key))
        assert token and 0 < client.pttl(lock_key(key)) <= 10_000
        # Someone else's lock now sits under the name (ours expired and was retaken).
        client.set(lock_key(key), b"someone-else", px=10_000)
    assert client.get(lock_key(key)) == b"someone-else"
    client.delete(lock_key(key))
    with remote.lock(key, ttl=10):
        pass
    assert not client.exists(lock_key(key))


def test_lock_is_renewed_while_held(server):
    """A renewal puts the expiry back to a full lock lifetime; a holder that renews keeps
    everyone else waiting."""
    client = server.client()
    remote = RedisRemote(server.url)
    key = new_key()
    held = RemoteLock(remote, key, lock_key(key), ttl=60)
    assert held.acquire(timeout=None)
    try:
        client.pexpire(lock_key(key), 500)  # most of its lifetime gone
        assert held.renew()
        assert client.pttl(lock_key(key)) > 50_000
        other = RedisRemote(server.url, clock=ManualClock())
        with pytest.raises(LockTimeout):
            with other.lock(key, ttl=60, timeout=5):
                pass
    finally:
        held.release()
    assert not client.exists(lock_key(key))


def test_a_lock_taken_by_someone_else_is_lost_not_renewed(server):
    client = server.client()
    remote = RedisRemote(server.url)
    key = new_key()
    held = RemoteLock(remote, key, lock_key(key), ttl=60)
    assert held.acquire(timeout=None)
    client.set(lock_key(key), b"someone-else", px=10_000)  # ours expired and was retaken
    assert held.renew() is False and held.lost
    held.release()
    assert client.get(lock_key(key)) == b"someone-else"


def test_lock_waits_for_the_holder(server):
    first = RedisRemote(server.url)
    key = new_key()
    order: list[str] = []
    entered, release, released = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with first.lock(key, ttl=5):
            order.append("first in")
            entered.set()
            release.wait(30)
            order.append("first out")
        released.set()

    def meanwhile(seconds: float) -> None:  # while the second waits, the first finishes
        release.set()
        released.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    assert entered.wait(30)
    second = RedisRemote(server.url, clock=ManualClock(on_sleep=meanwhile))
    with second.lock(key, ttl=5, timeout=10) as held:
        assert held
        order.append("second in")
    t.join()
    assert order == ["first in", "first out", "second in"]


def test_abandoned_lock_expires_and_is_taken_over(server):
    client = server.client()
    key = new_key()
    # A holder that died without releasing: its token stays until the expiry.
    client.set(lock_key(key), b"dead-owner", px=60_000)
    clock = ManualClock(on_sleep=lambda seconds: client.delete(lock_key(key)))  # it expires
    remote = RedisRemote(server.url, clock=clock)
    with remote.lock(key, ttl=5, timeout=10) as held:
        assert held
    assert clock.slept >= 1  # waited for it, then took it over
