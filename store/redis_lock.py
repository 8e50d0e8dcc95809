"""The cross-machine build lock: one holder of a key's build at a time across a fleet.

A lock is a value set with "only if absent" and an expiry on a ``LockServer`` (Redis,
through ``RedisRemote``): a holder renews the expiry every third of it while it builds,
so a holder that dies frees the lock one expiry later. What ``RemoteLock`` promises:

- **Only the holder releases or renews.** Release and renewal compare the value first,
  so a holder that stalled past its expiry never removes a lock someone else took since.
- **No one outside the fleet can stop a build.** With the fleet's signing key a token
  carries an HMAC of the lock's name and the time it was set (made afresh at every
  renewal, so a copied token soon stops proving anything); a holder whose token does not
  prove the key within the last three lock lifetimes is waited on ``FOREIGN_WAIT`` seconds
  at most, and without a key (nobody can prove anything) any holder is waited on one lock
  lifetime at most. A lock that never expires was set by no cachebuild process. Then the
  build goes ahead under the local lock (a duplicate build is better than none).
- **Waiting is bounded**: a proven holder is waited on ``timeout`` seconds, then
  ``LockTimeout``; a server that is down or refuses writes means no lock is taken (the
  local lock still holds the build single-flight on this machine), never an exception.

Time (the waiting, the token's age) comes from the lock's ``Clock``; the expiry itself
is the server's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from cachebuild.errors import LockTimeout

from .timekeeping import SYSTEM_CLOCK, Clock

log = logging.getLogger("cachebuild.store.remote")

_LOCK_DOMAIN = b"cachebuild-lock-v1\0"
#: How long a lock held by someone who cannot prove to be a builder of the fleet (its
#: token carries no valid HMAC) is waited on before building anyway.
FOREIGN_WAIT = 2.0
#: Slack for clocks that differ between machines, when a lock token's time is checked.
CLOCK_SLACK_S = 30.0


@dataclass(frozen=True)
class Attempt:
    """One try to take a lock: taken, or the value and the expiry (ms; -1: none) of the
    lock someone else holds."""

    taken: bool
    value: Any = None
    pttl: Any = None


class LockServer(Protocol):
    """Where locks are held (``RedisRemote``). Each call that fails marks the server down
    (or refusing writes) and answers None."""

    display_url: str

    @property
    def writable(self) -> bool:
        """True while locks can be taken: read-write, up, writes accepted."""
        ...

    @property
    def available(self) -> bool:
        """False once the server stopped answering."""
        ...

    def take_lock(self, name: str, token: str, ttl_ms: int) -> Attempt | None:
        """Set ``name`` to ``token`` for ``ttl_ms`` if it is absent."""
        ...

    def renew_lock(self, name: str, token: str, ttl_ms: int, fresh: str) -> bool | None:
        """If ``name`` holds ``token``: set it to ``fresh`` for ``ttl_ms`` more (True);
        False if someone else holds it."""
        ...

    def release_lock(self, name: str, token: str) -> None:
        """Delete ``name`` if it still holds ``token``."""
        ...


def lock_token(name: str, nonce: str, signing_key: bytes | None, now_ms: int) -> str:
    """The value a builder sets under lock ``name``: ``nonce``, and with a signing key the
    time (ms) and an HMAC of both with the lock's name, proving that the holder has the
    fleet's key now (renewals set a fresh one, so a copied value soon stops proving)."""
    if signing_key is None:
        return nonce
    body = f"{nonce}.{now_ms}"
    mac = hmac.new(signing_key, _LOCK_DOMAIN + name.encode() + b"\0" + body.encode(),
                   hashlib.sha256).hexdigest()[:32]
    return f"{body}.{mac}"


def proven(name: str, value: Any, signing_key: bytes, max_age_s: float, now: float) -> bool:
    """True if ``value`` under lock ``name`` was set by a holder of ``signing_key`` within
    ``max_age_s`` seconds (plus ``CLOCK_SLACK_S``) before ``now``."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return False
    if not isinstance(value, str) or not value.isascii() or value.count(".") != 2 \
            or len(value) > 100:
        return False
    nonce, when, _ = value.split(".")
    if not when.isdigit() or len(when) > 16:
        return False
    age = now - int(when) / 1000
    if not -CLOCK_SLACK_S <= age <= max_age_s + CLOCK_SLACK_S:
        return False
    return hmac.compare_digest(lock_token(name, nonce, signing_key, int(when)), value)


class RemoteLock:
    """One acquisition of the build lock of ``key``, held under ``name`` on ``server``
    (see the module doc): ``acquire``, then ``release``; renewed in a thread meanwhile."""

    def __init__(self, server: LockServer, key: str, name: str, ttl: float,
                 signing_key: bytes | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        if ttl <= 0:
            raise ValueError(f"lock ttl must be positive, not {ttl}")
        self.server = server
        self.name = name
        self.key = key
        self.ttl_ms = max(1, int(ttl * 1000))
        self.signing_key = signing_key
        self.clock = clock
        self.nonce = secrets.token_hex(16)
        self.token = self._token()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False

    def _token(self) -> str:
        return lock_token(self.name, self.nonce, self.signing_key,
                          int(self.clock.time() * 1000))

    def _unproven_wait(self, value: Any, pttl: Any) -> float | None:
        """How long a holder with lock ``value`` (and expiry ``pttl``) may keep us waiting
        at most, when it cannot prove to be a builder of this fleet; None if it can."""
        if pttl == -1 or (isinstance(pttl, int) and pttl > max(10 * self.ttl_ms, 600_000)):
            return self.ttl_ms / 1000  # no cachebuild process sets such an expiry
        if self.signing_key is None:
            return self.ttl_ms / 1000  # nobody can prove anything: one lock lifetime
        if proven(self.name, value, self.signing_key, 3 * self.ttl_ms / 1000,
                  self.clock.time()):
            return None
        return min(FOREIGN_WAIT, self.ttl_ms / 1000)

    def acquire(self, timeout: float | None) -> bool:
        """True once held; False if the server cannot hold locks, or if the holder cannot
        prove to be a builder of this fleet and has been waited on long enough (with a
        warning); LockTimeout after ``timeout`` seconds (None: no limit)."""
        clock = self.clock
        deadline = None if timeout is None else clock.monotonic() + timeout
        unproven_since: float | None = None
        delay = 0.02
        while True:
            if not self.server.writable:
                return False
            attempt = self.server.take_lock(self.name, self.token, self.ttl_ms)
            if attempt is None:
                return False
            if attempt.taken:
                break
            now = clock.monotonic()
            limit = self._unproven_wait(attempt.value, attempt.pttl)
            if limit is None:
                unproven_since = None
            else:
                unproven_since = now if unproven_since is None else unproven_since
                if now - unproven_since >= limit:
                    self._give_up(attempt.pttl, limit)
                    return False
            if deadline is not None and now >= deadline:
                raise LockTimeout(
                    f"build lock for {self.key} is held on another machine "
                    f"({self.server.display_url}) for more than {timeout:g}s"
                )
            # Exponential backoff with jitter so waiters on many machines do not poll in step.
            pause = delay * (0.5 + random.random())
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - now))
            clock.sleep(pause)
            delay = min(delay * 2, 0.5)
        self._renewer = threading.Thread(
            target=self._renew_loop, name=f"cachebuild-lock-{self.key[:8]}", daemon=True
        )
        self._renewer.start()
        return True

    def _give_up(self, pttl: Any, waited: float) -> None:
        who = ("its holder cannot prove to be a builder of this fleet (no "
               "CACHEBUILD_SIGNING_KEY here, so none can)" if self.signing_key is None
               else "its holder cannot prove to be a builder of this fleet "
               "(its token carries no HMAC made with CACHEBUILD_SIGNING_KEY)")
        if pttl == -1:
            who = "it never expires, so no cachebuild process set it"
        log.warning("cachebuild: the build lock of %s in %s is taken, but %s; building under "
                    "the local lock alone after %.1f s (delete the key %s if it "
                    "is stale)", self.key, self.server.display_url, who, waited, self.name)

    def renew(self) -> bool:
        """Extend the expiry by a lock lifetime, with a fresh token (with a key: a fresh
        time and HMAC); False once the lock is lost or the server is gone."""
        if not self.server.available:
            return False
        fresh = self._token()
        ok = self.server.renew_lock(self.name, self.token, self.ttl_ms, fresh)
        if ok is None:
            return False
        if not ok:
            # We stalled past the expiry and someone else may hold it now. The build
            # carries on (puts are idempotent); at worst the target is built twice.
            self.lost = True
            log.warning("cachebuild: remote build lock for %s expired while held", self.key)
            return False
        self.token = fresh  # release compares with what is there now
        return True

    def _renew_loop(self) -> None:
        """``renew`` every third of the ttl until released, lost, or the server dies."""
        interval = self.ttl_ms / 3000.0
        while not self._stop.wait(interval):
            if not self.renew():
                return

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still ours."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if not self.server.available or self.lost:
            return
        self.server.release_lock(self.name, self.token)
