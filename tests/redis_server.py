"""A throw-away redis-server for tests: free loopback port, temporary directory, no disk.

``RedisServer`` starts a real ``redis-server`` bound to 127.0.0.1 with persistence off,
waits until it answers, and stops it (SIGTERM, then SIGKILL) on exit. The ``server``
fixture skips the test with a clear reason when no ``redis-server`` binary is installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

if TYPE_CHECKING:
    from cachebuild.store.local import LocalStore


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` (``$REDIS_SERVER`` wins), or None if there is none."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on 127.0.0.1; ``url`` is set once it answers."""

    def __init__(self, *, maxmemory: str | None = None, policy: str | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.binary = binary
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="cachebuild-redis-"))

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING; raises RuntimeError otherwise."""
        for _ in range(5):
            self.port = free_port()
            args = [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self._dir),
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "yes",
                "--daemonize", "no",
                "--loglevel", "warning",
            ]  # fmt: skip
            if self.maxmemory:
                args += ["--maxmemory", self.maxmemory]
            if self.policy:
                # Redis's LRU is approximate (5 keys sampled per eviction by default);
                # 64 samples keep it near true LRU. Its clock ticks once a second, so keys
                # written within one second still go in no particular order.
                args += ["--maxmemory-policy", self.policy, "--maxmemory-samples", "64"]
            log = open(self._dir / "redis.log", "ab")
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            self.url = f"redis://127.0.0.1:{self.port}/0"
            if self._wait_ready(timeout):
                return self
            self.stop()  # the port was taken between probe and bind: try another
        raise RuntimeError(f"redis-server did not start; log in {self._dir / 'redis.log'}")

    def _wait_ready(self, timeout: float) -> bool:
        client = self.client()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def client(self) -> redis.Redis:
        """A plain client to inspect or tamper with the server's contents."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server if it runs (SIGTERM, SIGKILL after 5 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_redis_server() -> None:
    """Skip the calling test if redis-server is missing."""
    if redis_server_binary() is None:
        pytest.skip(
            "redis-server is not installed (apt-get install redis-server, or set REDIS_SERVER)"
        )


@pytest.fixture(name="server")
def redis_server_fixture() -> Iterator[RedisServer]:
    """``server``: a fresh, empty redis-server for one test, stopped afterwards.

    Use it by importing ``redis_server_fixture`` into a test module and asking for ``server``.
    """
    require_redis_server()
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


_OPENED: list[LocalStore] = []


def closed_after_test(store: LocalStore) -> LocalStore:
    """``store``, closed when the test that opened it ends (a module that opens stores so
    imports ``close_opened_stores``)."""
    _OPENED.append(store)
    return store


@pytest.fixture(autouse=True)
def close_opened_stores() -> Iterator[None]:
    """Closes every store ``closed_after_test`` was given during the test."""
    yield
    while _OPENED:
        _OPENED.pop().close()
