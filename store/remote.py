"""The remote tier: framed blobs and their index records in a Redis server.

A fleet shares one warm cache through Redis. This module only moves bytes: it stores the
framed blob exactly as the local store frames it (header, payload, optional HMAC) and the
index record beside it, and never interprets either. Verifying a blob (checksum and
signature) is the tiered store's job, because only it knows the signing policy.

Layout in Redis (one blob ``K`` cut into ``n`` chunks)::

    cachebuild:v1:blob:K:0 … cachebuild:v1:blob:K:<n-1>   raw chunks of the framed blob
    cachebuild:v1:rec:K      JSON: the index record, chunk count, length, xxh3-128 of the blob
    cachebuild:v1:upload:K   short-lived claim held while one writer uploads K's chunks
    cachebuild:v1:lock:K     cross-machine build lock (token, expiry)

Chunks are written first and the record last, so a record that exists names a blob whose
chunks were all written. A reader still checks the chunk count, length and digest, so a
blob that Redis half evicted (LRU) reads as a miss, never as damaged bytes.

Anyone who can write to Redis can write anything there, so nothing read is trusted for its
size or shape, and what one call reads is bounded in total, not only per item: a record
is read only up to ``MAX_RECORD_BYTES`` and must parse into the expected types; a blob
longer than ``MAX_BLOB_BYTES`` is not read; every chunk's length is asked for (``STRLEN``)
before it is read, so a chunk longer than any writer makes (``MAX_CHUNK_BYTES``) or
chunks that do not add up to the length the record declares are refused before a byte
of them is downloaded; the caller may check each chunk as it arrives (the blob's header
is in the first) and stop the download; and ``records`` reads at most
``MAX_SHARED_RECORDS`` records and ``MAX_SHARED_RECORD_BYTES`` of them per call, asking
each one's length first.

Health: the first Redis error marks the remote down for the life of this object. That
emits one ``RemoteDownWarning``, and every later call is a fast miss or no-op. Nothing
here raises because Redis is slow, unreachable or dead; every socket has a timeout.

Build locks are held here for ``redis_lock.RemoteLock``, which decides whom to wait for;
this module only sets, renews and deletes their values (``take_lock`` and the rest).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from cachebuild.errors import UsageError, one_line, printable, warn_caller

from .interface import RemoteTier
from .layout import InvalidKey, check_key
from .record import loads_json
from .redis_lock import Attempt, LockServer, RemoteLock
from .timekeeping import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)

PREFIX = "cachebuild:v1:"
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
RECORD_FORMAT = 1
#: A stored record (index record, manifest included) is never longer than this.
MAX_RECORD_BYTES = 16 * 1024 * 1024
#: Nor is a blob cut into more chunks than this, or any chunk longer than this (the
#: largest chunk size a writer may use).
MAX_CHUNKS = 1 << 20
MAX_CHUNK_BYTES = 16 * 1024 * 1024
#: No blob read from Redis is longer than this (artifacts are megabytes).
MAX_BLOB_BYTES = 1 << 30
#: What one ``records`` call reads at most: how many records, and their bytes together.
MAX_SHARED_RECORDS = 100_000
MAX_SHARED_RECORD_BYTES = 32 * 1024 * 1024
#: The slowest transfer a Redis call waits for past its ``op_timeout``: a call moving ``n``
#: bytes ends after ``op_timeout + n / MIN_BYTES_PER_S`` seconds, however the bytes trickle.
MIN_BYTES_PER_S = 1 << 20
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
Mode = Literal["rw", "ro"]
T = TypeVar("T")

# Keys are content hashes; anything outside this alphabet would let a key collide with
# another key's chunk names or act as a SCAN glob.

# Errors that mean "the remote is not usable": connection refused or reset, timeouts,
# protocol errors, and plain socket errors that slip past redis-py's wrapping.
_REMOTE_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)

# Compare-and-delete / compare-and-extend: only the owner's token may release or renew a
# lock, so a holder that stalled past its expiry cannot remove a lock another machine took.
_RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""
_RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    redis.call('set', KEYS[1], ARGV[3], 'PX', ARGV[2])
    return 1
end
return 0
"""


class RemoteDownWarning(RuntimeWarning):
    """The remote tier stopped answering; the store carries on with local data only."""


def record_key(key: str) -> str:
    """Redis key of ``key``'s index record."""
    return f"{PREFIX}rec:{key}"


def chunk_key(key: str, index: int) -> str:
    """Redis key of chunk ``index`` of ``key``'s framed blob."""
    return f"{PREFIX}blob:{key}:{index}"


def lock_key(key: str) -> str:
    """Redis key of ``key``'s cross-machine build lock."""
    return f"{PREFIX}lock:{key}"


def upload_key(key: str) -> str:
    """Redis key of the claim a writer holds while it uploads ``key``'s chunks."""
    return f"{PREFIX}upload:{key}"


def redact_url(url: str) -> str:
    """``url`` with any password (``user:pw@host``, or a ``password=`` query parameter as
    redis-py also takes) replaced by ``***``, safe to print, log and keep in records."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "<unparsable remote URL>"
    base, sep, query = url.partition("?")
    if parts.password is not None:
        host = parts.hostname or ""
        if port is not None:
            host = f"{host}:{port}"
        base = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}",
                                         query="", fragment=""))
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(_secret(name) for name, _ in pairs):
        query = urlencode([(name, "***" if _secret(name) else value)
                           for name, value in pairs], safe="*")
    return base + sep + query


def _secret(parameter: str) -> bool:
    """Whether a URL's query parameter holds a secret (``password``, ``ssl_password``, a
    token): redis-py hands any of them to the connection."""
    name = parameter.lower()
    return any(word in name for word in ("password", "secret", "token"))


def _check_database(url: str, display_url: str) -> None:
    """UsageError unless the database ``url`` names (its path, or a ``db=`` parameter) is
    a number: redis-py takes any other for database 0, silently."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise UsageError(f"bad remote URL {display_url}: {exc}") from None
    named = [parts.path.strip("/")] if parts.scheme != "unix" else []
    named += [value for name, value in parse_qsl(parts.query, keep_blank_values=True)
              if name == "db"]
    for db in named:
        if db and not db.isdigit():
            raise UsageError(f"bad remote URL {display_url}: the database {db!r} is not a "
                             "number (redis://HOST:PORT/DB, e.g. redis://127.0.0.1:6379/0)")


@dataclass(frozen=True)
class RemoteBlobMeta:
    """What the record key holds besides the index record: how to reassemble the blob."""

    chunks: int
    length: int
    digest: str

    @classmethod
    def parse(cls, raw: bytes) -> tuple[dict[str, Any], RemoteBlobMeta]:
        """Decode a stored record; raises ``ValueError`` if it is not one we wrote, or not
        well formed (a field of the wrong type, a count that cannot be)."""
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"record longer than {MAX_RECORD_BYTES} bytes")
        try:
            doc = loads_json(raw)
        except RecursionError:
            raise ValueError("record nested too deeply") from None
        if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
            raise ValueError("unknown remote record format")
        record, chunks, length, digest = (doc.get(k) for k in
                                          ("record", "chunks", "length", "xxh3_128"))
        if not isinstance(record, dict):
            raise ValueError("malformed remote record: no record object")
        for name, value in (("chunks", chunks), ("length", length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"malformed remote record: {name} is not a count")
        if not 1 <= chunks <= min(MAX_CHUNKS, max(1, length)):
            raise ValueError(f"malformed remote record: {chunks} chunks for {length} bytes")
        if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
            raise ValueError("malformed remote record: bad digest")
        return record, cls(chunks=chunks, length=length, digest=digest)


@dataclass
class _Budget:
    """What is left of one ``records`` call's allowance."""

    max_records: int
    max_bytes: int
    records: int = 0
    bytes: int = 0
    left_out: bool = False

    def take(self, size: int) -> bool:
        """Count one more record of ``size`` bytes; False (and it is left out) if it does
        not fit."""
        if self.records >= self.max_records or self.bytes + size > self.max_bytes:
            self.left_out = True
            return False
        self.records += 1
        self.bytes += size
        return True

    @property
    def spent(self) -> bool:
        return self.left_out


def _said(exc: BaseException) -> str:
    """What Redis (or whatever answered in its place) said, as safe text: redis-py puts a
    refused command's arguments (a blob's bytes) in its error, and an answer may hold
    terminal escapes."""
    return printable(one_line(exc), 300)


class _TooSlow(redis.TimeoutError):
    """A Redis call outlasted its deadline (``_Deadlines``); never retried."""


class _Deadlines:
    """Ends every Redis command that outlasts its deadline: ``op_timeout`` seconds, plus
    ``n / MIN_BYTES_PER_S`` for a command said (``moving``) to carry ``n`` bytes.

    redis-py's socket timeout bounds each wait for the next bytes, not a whole reply, so a
    link that trickles a little at a time would hold one call for as long as it likes. A
    watchdog thread (one per remote, while a command waits) shuts the remote's sockets
    when a deadline passes: the blocked read ends, the call raises ``_TooSlow`` (no
    retry) and the remote is marked down as for any other error. redis-py copies each
    connection's retry policy, so this object is shared, never copied."""

    def __init__(self, op_timeout: float, on_expiry: Callable[[str], None]) -> None:
        self.op_timeout = op_timeout
        self._on_expiry = on_expiry
        self.expired: str | None = None   # why, once a deadline passed
        self._reset()
        _ALL_DEADLINES.add(self)

    def _reset(self) -> None:
        """A fresh state: at the start, and in a child forked from this process (where
        a lock a parent's thread held stays held, and the commands under way are the
        parent's: their deadlines are not the child's to keep)."""
        self._lock = threading.Lock()
        self._due: dict[int, float] = {}   # thread id -> when its command must be done
        self._wake = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._local = threading.local()   # per thread: bytes said, commands nested

    def __deepcopy__(self, memo: dict[int, Any]) -> _Deadlines:
        return self

    @contextmanager
    def moving(self, nbytes: int) -> Iterator[None]:
        """The commands sent in this block carry about ``nbytes`` bytes each way."""
        self._local.nbytes = nbytes
        try:
            yield
        finally:
            self._local.nbytes = 0

    @contextmanager
    def command(self) -> Iterator[None]:
        """One Redis command (or pipeline) of this thread, bounded; nested calls (a
        connect inside a command) count as the outer one."""
        depth = getattr(self._local, "depth", 0)
        if self.expired is not None:
            raise _TooSlow(self.expired)
        if depth == 0:
            seconds = self.op_timeout + getattr(self._local, "nbytes", 0) / MIN_BYTES_PER_S
            with self._lock:
                self._due[threading.get_ident()] = time.monotonic() + seconds
                if self._watchdog is None or not self._watchdog.is_alive():
                    self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                      name="cachebuild-remote-watchdog")
                    self._watchdog.start()
            self._wake.set()
        self._local.depth = depth + 1
        try:
            yield
        except BaseException as e:
            if self.expired is not None and not isinstance(e, _TooSlow):
                raise _TooSlow(self.expired) from e
            raise
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._lock:
                    self._due.pop(threading.get_ident(), None)

    def _watch(self) -> None:
        while True:
            with self._lock:
                if not self._due:
                    self._watchdog = None
                    return
                wait = min(self._due.values()) - time.monotonic()
                if wait <= 0:
                    self.expired = (f"no answer within {self.op_timeout:g} s (plus 1 s a "
                                    "MiB moved): the link is too slow")
                    self._due.clear()
            if wait <= 0:
                self._on_expiry(self.expired or "")
                continue
            self._wake.wait(wait)
            self._wake.clear()


#: Every remote's deadlines, made anew in a forked child (``_Deadlines._reset``).
_ALL_DEADLINES: weakref.WeakSet[_Deadlines] = weakref.WeakSet()


def _forked() -> None:
    for deadlines in list(_ALL_DEADLINES):
        deadlines._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class _BoundedRetry(Retry):
    """redis-py's retry policy (one immediate retry on a dropped connection, none on
    timeouts), with every command bounded by ``_Deadlines``."""

    def __init__(self, deadlines: _Deadlines) -> None:
        super().__init__(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self.deadlines = deadlines

    def call_with_retry(self, do: Callable[[], T], fail: Any, *args: Any, **kwargs: Any) -> T:
        def bounded() -> T:
            with self.deadlines.command():
                return do()

        return super().call_with_retry(bounded, fail, *args, **kwargs)


def _shut_sockets(remote_ref: weakref.ref[RedisRemote], why: str) -> None:
    """End every read a remote's connections wait in (a deadline passed): shutting a
    socket wakes a thread blocked on it, which then sees the connection closed, raises
    ``_TooSlow`` and marks the remote down (each caller says ``why`` as its error)."""
    remote = remote_ref()
    if remote is None:
        return
    pool = remote._client.connection_pool
    # redis-py keeps no public list of the connections in use; its pools have kept these
    # two for years (a pool without them only loses this early end: the socket timeout
    # still ends each wait for bytes).
    for conn in [*getattr(pool, "_in_use_connections", ()),
                 *getattr(pool, "_available_connections", ())]:
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RedisRemote(RemoteTier, LockServer):
    """A Redis server used as the shared L2 tier.

    ``mode="ro"`` makes this object write nothing at all to Redis: no blobs, no records,
    no locks, no clean-up of broken entries. Timeouts bound every call: connecting takes
    at most ``connect_timeout`` seconds, a command ``op_timeout`` seconds and, for one
    that moves ``n`` bytes, ``n / MIN_BYTES_PER_S`` more (``_Deadlines``).
    """

    def __init__(
        self,
        url: str,
        *,
        mode: Mode = "rw",
        connect_timeout: float = 1.0,
        op_timeout: float = 5.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if mode not in ("rw", "ro"):
            raise UsageError(f"remote mode must be 'rw' or 'ro', not {mode!r}")
        if not 1 <= chunk_size <= MAX_CHUNK_BYTES:
            raise UsageError(f"chunk size must be from 1 to {MAX_CHUNK_BYTES} bytes, "
                             f"not {chunk_size}")
        self.url = url
        self.display_url = redact_url(url)
        _check_database(url, self.display_url)
        self.mode: Mode = mode
        self.chunk_size = chunk_size
        self.op_timeout = op_timeout
        self.clock = clock
        ref = weakref.ref(self)
        self._deadlines = _Deadlines(op_timeout, lambda why: _shut_sockets(ref, why))
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_connect_timeout=connect_timeout,
                socket_timeout=op_timeout,
                # One immediate retry on a dropped connection (an idle socket the server
                # closed) and none on timeouts, so a dead server costs one timeout, not many.
                retry=_BoundedRetry(self._deadlines),
            )
        except ValueError as exc:
            raise UsageError(f"bad remote URL {self.display_url}: {exc}") from exc
        self._release_script = self._client.register_script(_RELEASE_LUA)
        self._renew_script = self._client.register_script(_RENEW_LUA)
        self._state = threading.Lock()
        self._down = False
        self._writes_refused = False
        self.errors = 0
        self.incomplete = 0

    def __repr__(self) -> str:
        return f"RedisRemote({self.display_url!r}, mode={self.mode!r})"

    # -- health -----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False once any Redis error has marked the remote down."""
        return not self._down

    @property
    def writable(self) -> bool:
        """True while puts and locks reach Redis: read-write mode, up, writes accepted."""
        return self.mode == "rw" and not self._down and not self._writes_refused

    def _fail(self, op: str, exc: BaseException) -> None:
        """Mark the remote down; warn once for this object."""
        with self._state:
            self.errors += 1
            first = not self._down
            self._down = True
        log.debug("remote %s failed during %s", self.display_url, op, exc_info=exc)
        if first:
            warn_caller(f"cachebuild remote {self.display_url} is unavailable "
                        f"({op}: {_said(exc)}); continuing with the local store only",
                        RemoteDownWarning)

    def _refuse_writes(self, op: str, exc: BaseException) -> None:
        """Redis answered but refused a write (OOM, replica, ACL): keep reading, stop writing."""
        with self._state:
            self.errors += 1
            first = not self._writes_refused
            self._writes_refused = True
        if first:
            warn_caller(f"cachebuild remote {self.display_url} refused a write "
                        f"({op}: {_said(exc)}); reading from it continues, nothing more is "
                        "written to it", RemoteDownWarning)

    def _guard(self, op: str, fn: Callable[[], T], default: T) -> T:
        """Run ``fn`` against Redis; on any remote error mark it down and return ``default``."""
        if self._down:
            return default
        try:
            return fn()
        except _REMOTE_ERRORS as exc:
            self._fail(op, exc)
            return default

    def ping(self) -> bool:
        """True if Redis answers now; a failure marks the remote down like any other."""
        return self._guard("ping", lambda: bool(self._client.ping()), False)

    def close(self) -> None:
        """Drop pooled connections; the object stays usable (it reconnects on demand)."""
        try:
            self._client.close()
        except _REMOTE_ERRORS:
            pass

    # -- reads ------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """True if a complete record for ``key`` is stored (chunks are checked on ``get``)."""
        check_key(key)
        return self._guard("contains", lambda: bool(self._client.exists(record_key(key))), False)

    def get_record(self, key: str) -> dict[str, Any] | None:
        """The index record stored with ``key``'s blob, or None."""
        check_key(key)

        def read() -> dict[str, Any] | None:
            raw = self._get_record_bytes(key)
            if raw is None:
                return None
            try:
                record, _ = RemoteBlobMeta.parse(raw)
            except ValueError:
                return None
            return record

        return self._guard("get_record", read, None)

    def get(self, key: str, check: Callable[[memoryview, int], None] | None = None
            ) -> tuple[dict[str, Any], bytes] | None:
        """``(record, framed_blob)`` for ``key``, or None if absent, incomplete or unreachable.

        The bytes are exactly what was put (length and xxh3-128 checked); whether they are
        a valid, correctly signed blob is for the caller to decide. ``check(chunk,
        length)`` is called with each chunk as it arrives, in order, and the blob's
        declared length; whatever it raises stops the download and leaves this call.
        """
        check_key(key)
        return self._guard("get", lambda: self._read(key, check), None)

    def _get_record_bytes(self, key: str) -> bytes | None:
        """The stored record of ``key``, or None; one longer than MAX_RECORD_BYTES is
        cut there (and then fails to parse), never downloaded whole."""
        try:
            raw = self._client.getrange(record_key(key), 0, MAX_RECORD_BYTES)
        except redis.ResponseError:  # not a string (WRONGTYPE): not a record of ours
            return None
        if not raw:
            # GETRANGE cannot tell a missing key from an empty value; an empty record is
            # no record either way.
            return None
        return raw

    def _read(self, key: str, check: Callable[[memoryview, int], None] | None = None
              ) -> tuple[dict[str, Any], bytearray] | None:
        raw = self._get_record_bytes(key)
        if raw is None:
            return None
        try:
            record, meta = RemoteBlobMeta.parse(raw)
        except ValueError as exc:
            self._incomplete(key, f"unreadable record ({exc})")
            return None
        if meta.length > MAX_BLOB_BYTES:
            self._incomplete(key, f"the record declares {meta.length} bytes, more than any "
                             f"blob read from the remote ({MAX_BLOB_BYTES})")
            return None
        # Every chunk's length first: chunks that are missing or do not add up to the
        # declared length are refused before anything is downloaded.
        sizes: list[int] = []
        batch = 1000
        for start in range(0, meta.chunks, batch):
            pipe = self._client.pipeline(transaction=False)
            for i in range(start, min(start + batch, meta.chunks)):
                pipe.exists(chunk_key(key, i))
                pipe.strlen(chunk_key(key, i))
            replies = pipe.execute(raise_on_error=False)
            for offset in range(0, len(replies), 2):
                exists, size = replies[offset], replies[offset + 1]
                if not exists or not isinstance(size, int):  # missing, or not a string
                    self._incomplete(key, f"chunk {start + offset // 2} of {meta.chunks} "
                                     "missing or not a string")
                    return None
                if size > MAX_CHUNK_BYTES:
                    self._incomplete(key, f"chunk {start + offset // 2} is {size} bytes, "
                                     f"longer than any writer makes ({MAX_CHUNK_BYTES})")
                    return None
                sizes.append(size)
                if sum(sizes) > meta.length:
                    self._incomplete(key, "chunks are longer than the record declares")
                    return None
        if sum(sizes) != meta.length:
            self._incomplete(key, "chunks are shorter than the record declares")
            return None
        blob = bytearray()
        filled = 0
        # Fetch in batches so a huge blob does not ask Redis for one giant reply (the
        # first chunk alone: it holds the header the caller checks first); each chunk no
        # longer than its length said (it may have changed since).
        starts = [0, *range(1, meta.chunks, 16)]
        for start, stop in zip(starts, [*starts[1:], meta.chunks], strict=True):
            pipe = self._client.pipeline(transaction=False)
            for i in range(start, stop):
                if sizes[i]:
                    pipe.getrange(chunk_key(key, i), 0, sizes[i] - 1)
            with self._deadlines.moving(sum(sizes[start:stop])):
                parts = pipe.execute(raise_on_error=False)
            for part in parts:
                if not isinstance(part, bytes) or filled + len(part) > meta.length:
                    self._incomplete(key, "chunks changed while they were read")
                    return None
                if check is not None:
                    check(memoryview(part), meta.length)
                blob += part
                filled += len(part)
        if filled != meta.length or xxhash.xxh3_128_hexdigest(blob) != meta.digest:
            self._incomplete(key, "chunks do not match the record's length and digest")
            return None
        return record, blob

    def _incomplete(self, key: str, why: str) -> None:
        """A record whose chunks are gone (evicted) or wrong: a miss, cleaned up when allowed.

        Dropping only the record lets the next writer upload the blob again; leftover
        chunks are overwritten by that upload or evicted by Redis.
        """
        with self._state:
            self.incomplete += 1
        log.info("remote blob %s is incomplete (%s); treating it as a miss", key, why)
        if self.writable:
            try:
                self._client.delete(record_key(key))
            except _REMOTE_ERRORS as exc:
                self._fail("delete incomplete record", exc)

    def keys(self) -> Iterator[str]:
        """Every key with a record in Redis (SCAN: no server stall, may repeat under churn).

        Names that are not store keys (written by something else) are skipped."""
        prefix = record_key("")
        if self._down:
            return
        try:
            for raw in self._client.scan_iter(match=prefix + "*", count=1000):
                name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                try:
                    yield check_key(name[len(prefix) :])
                except InvalidKey:
                    log.info("ignoring %r in the remote: not a store key", name[:100])
        except _REMOTE_ERRORS as exc:
            self._fail("scan", exc)

    def records(self, max_records: int = MAX_SHARED_RECORDS,
                max_bytes: int = MAX_SHARED_RECORD_BYTES) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(key, record)`` for the stored index records (for ``explain`` on remote
        entries); the records are parsed but not checked further. At most ``max_records``
        records of ``max_bytes`` together are read (each one's length is asked first);
        the rest are left out, with one log line saying how many."""
        budget = _Budget(max_records, max_bytes)
        batch: list[str] = []
        for key in self.keys():
            batch.append(key)
            if len(batch) >= 500:
                yield from self._records_of(batch, budget)
                batch = []
            if budget.spent:
                break
        if batch and not budget.spent:
            yield from self._records_of(batch, budget)
        if budget.left_out:
            log.warning("cachebuild: read %d records of the remote %s and left the rest out: one command "
                        "reads at most %d records and %d MiB of them", budget.records,
                        self.display_url, max_records, max_bytes >> 20)

    def _records_of(self, keys: list[str], budget: _Budget) -> list[tuple[str, dict[str, Any]]]:
        sizes = self._guard("read record sizes", lambda: self._strlens(keys), [])
        wanted: list[tuple[str, int]] = []
        for key, size in zip(keys, sizes, strict=False):
            if not isinstance(size, int) or not 0 < size <= MAX_RECORD_BYTES:
                continue  # absent, not a string, or longer than a record can be
            if not budget.take(size):
                break
            wanted.append((key, size))
        out = []
        # In slices of at most 16 MiB: never more than that in flight at once.
        start = 0
        while start < len(wanted):
            end, flight = start, 0
            while end < len(wanted) and (end == start or flight < 16 << 20):
                flight += wanted[end][1]
                end += 1
            part = [key for key, _ in wanted[start:end]]

            def read(part: list[str] = part, flight: int = flight) -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for k in part:
                    pipe.getrange(record_key(k), 0, MAX_RECORD_BYTES - 1)
                with self._deadlines.moving(flight):
                    return pipe.execute(raise_on_error=False)

            for key, raw in zip(part, self._guard("read records", read, []), strict=False):
                if not isinstance(raw, bytes) or not raw:
                    continue
                try:
                    record, _ = RemoteBlobMeta.parse(raw)
                except ValueError:
                    continue
                out.append((key, record))
            start = end
        return out

    def _strlens(self, keys: list[str]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(record_key(k))
        return pipe.execute(raise_on_error=False)

    # -- writes -----------------------------------------------------------------------

    def put(self, key: str, record: dict[str, Any], blob: bytes) -> bool:
        """Store ``blob`` and its ``record`` under ``key``; True if this call uploaded it.

        Immutable like the local store: an existing key is left alone. Read-only mode, a
        down remote or a refused write make this a no-op that returns False. Concurrent
        writers of one key are serialised by a short-lived upload claim, so chunks of two
        uploads never interleave; a writer that dies mid-upload leaves no record, and its
        claim expires.
        """
        check_key(key)
        if not self.writable:
            return False
        try:
            return self._write(key, record, blob)
        except (redis.ResponseError, redis.DataError) as exc:
            self._refuse_writes("put", exc)
        except _REMOTE_ERRORS as exc:
            self._fail("put", exc)
        return False

    def _write(self, key: str, record: dict[str, Any], blob: bytes) -> bool:
        client = self._client
        if client.exists(record_key(key)):
            return False
        n = max(1, math.ceil(len(blob) / self.chunk_size))
        token = secrets.token_hex(16)
        # Long enough for a slow link to move every chunk; a dead writer's claim still ends.
        claim_ms = int(1000 * (30 + n * self.op_timeout))
        if not client.set(upload_key(key), token, nx=True, px=claim_ms):
            return False  # another writer is uploading this key right now
        try:
            # The previous claimant may have finished between our check and our claim;
            # rewriting its chunks now would break its completed record.
            if client.exists(record_key(key)):
                return False
            view = memoryview(blob)
            batch = 8
            for start in range(0, n, batch):
                pipe = client.pipeline(transaction=False)
                for i in range(start, min(start + batch, n)):
                    lo = i * self.chunk_size
                    pipe.set(chunk_key(key, i), view[lo : lo + self.chunk_size].tobytes())
                with self._deadlines.moving(min(len(blob), (start + batch) * self.chunk_size)
                                            - start * self.chunk_size):
                    pipe.execute()
            doc = {
                "format": RECORD_FORMAT,
                "record": record,
                "chunks": n,
                "length": len(blob),
                "xxh3_128": xxhash.xxh3_128_hexdigest(blob),
            }
            written = client.set(record_key(key), json.dumps(doc, sort_keys=True), nx=True)
        finally:
            self._release_script(keys=[upload_key(key)], args=[token])
        return bool(written)

    def delete(self, key: str) -> bool:
        """Remove ``key``'s record and chunks; True if a record was removed. No-op unless writable."""
        check_key(key)
        if not self.writable:
            return False

        def drop() -> bool:
            raw = self._get_record_bytes(key)
            if raw is None and not self._client.exists(record_key(key)):
                return False
            try:
                chunks = RemoteBlobMeta.parse(raw or b"")[1].chunks
            except ValueError:
                chunks = 0
            # Record first: from then on readers see a miss, never a record without chunks.
            removed = self._client.delete(record_key(key))
            names = [chunk_key(key, i) for i in range(chunks)]
            for start in range(0, len(names), 512):
                self._client.delete(*names[start : start + 512])
            return bool(removed)

        return self._guard("delete", drop, False)

    # -- cross-machine lock -------------------------------------------------------------

    @contextmanager
    def lock(self, key: str, ttl: float = 60.0, timeout: float | None = 600.0,
             signing_key: bytes | None = None) -> Iterator[bool]:
        """Hold ``key``'s build lock across machines; yields True if Redis holds it for us.

        Yields False (no lock taken, nothing written) when read-only, when the remote is
        down, or when the holder cannot prove to be a builder of this fleet and was waited
        on long enough (``redis_lock``): the caller's local lock still gives single-flight
        on this machine. While held, a background thread extends the expiry every
        ``ttl/3`` seconds; if this process dies the lock expires ``ttl`` seconds later and
        another machine takes over. Raises ``LockTimeout`` if a proven holder keeps it for
        more than ``timeout`` seconds.
        """
        check_key(key)
        held = RemoteLock(self, key, lock_key(key), ttl, signing_key, self.clock)
        acquired = held.acquire(timeout)
        try:
            yield acquired
        finally:
            if acquired:
                held.release()

    def take_lock(self, name: str, token: str, ttl_ms: int) -> Attempt | None:
        """Set lock ``name`` to ``token`` for ``ttl_ms`` if nobody holds it; else who does
        (value and expiry). None if Redis failed or refused (marked so)."""
        try:
            if self._client.set(name, token, nx=True, px=ttl_ms):
                return Attempt(taken=True)
            pipe = self._client.pipeline(transaction=False)
            pipe.get(name)
            pipe.pttl(name)
            value, pttl = pipe.execute()
        except (redis.ResponseError, redis.DataError) as exc:
            self._refuse_writes("lock", exc)
            return None
        except _REMOTE_ERRORS as exc:
            self._fail("lock", exc)
            return None
        return Attempt(taken=False, value=value, pttl=pttl)

    def renew_lock(self, name: str, token: str, ttl_ms: int, fresh: str) -> bool | None:
        """If lock ``name`` holds ``token``, set it to ``fresh`` for ``ttl_ms`` (True);
        False if it holds something else; None if Redis failed (marked down)."""
        try:
            return bool(self._renew_script(keys=[name], args=[token, ttl_ms, fresh]))
        except _REMOTE_ERRORS as exc:
            self._fail("lock renewal", exc)
            return None

    def release_lock(self, name: str, token: str) -> None:
        """Delete lock ``name`` if it still holds ``token``."""
        try:
            self._release_script(keys=[name], args=[token])
        except _REMOTE_ERRORS as exc:
            self._fail("lock release", exc)
