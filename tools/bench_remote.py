"""Benchmark the Redis remote tier against a warm local store, side by side in one run.

Starts its own redis-server on a free loopback port (persistence off), fills it with
synthetic signed blobs of realistic artifact sizes through a TieredStore, then measures:

- ``warm L1``: ``get`` of every blob from a warm local store (what a restarted server does);
- ``cold L1 <- Redis``: ``get`` of every blob from an empty local store pulling from Redis
  (fetch, verify the HMAC, write into L1 with fsync) — what a fresh machine does;
- ``pull``: ``pull()`` of every key into an empty local store, as throughput;
- ``Redis fetch only``: ``RedisRemote.get`` without verification or L1 write, to show
  where the time goes.

Each measurement runs ``--repeat`` times on fresh objects; the median and the best are
reported. Usage::

    python tools/bench_remote.py [--blobs 10] [--total-mb 30] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from cachebuild.store.local import LocalStore
from cachebuild.store.remote import RedisRemote
from cachebuild.store.tiered import TieredStore, pull

SIGNING_KEY = b"bench-signing-key"


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on a free 127.0.0.1 port; returns the process and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
         "--save", "", "--appendonly", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0"


def make_blobs(count: int, total_mb: float, seed: int = 0) -> dict[str, bytes]:
    """``count`` random payloads of uneven sizes (0.5x–1.5x the mean) adding up to ~total_mb."""
    rng = random.Random(seed)
    mean = total_mb * 1024 * 1024 / count
    return {
        rng.randbytes(16).hex(): os.urandom(int(mean * rng.uniform(0.5, 1.5))) for _ in range(count)
    }


def timed(runs: int, setup: Callable[[], object], body: Callable[[object], None]) -> list[float]:
    """Seconds for ``body(setup())``, ``runs`` times; setup is not timed."""
    out = []
    for _ in range(runs):
        state = setup()
        start = time.perf_counter()
        body(state)
        out.append(time.perf_counter() - start)
    return out


def machine() -> dict[str, str]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.split()
    redis_version = next((v.split("=", 1)[1] for v in version if v.startswith("v=")), "?")
    return {
        "nproc": str(os.cpu_count()),
        "arch": platform.machine(),
        "cpu": cpu,
        "redis_server": redis_version,
        "redis_py": redis.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blobs", type=int, default=10)
    parser.add_argument("--total-mb", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4, help="threads for pull()")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cachebuild-bench-remote-"))
    proc, url = start_redis(work)
    try:
        blobs = make_blobs(args.blobs, args.total_mb)
        total = sum(map(len, blobs.values()))
        keys = list(blobs)
        warm_dir = work / "warm"
        writer = TieredStore(LocalStore(warm_dir, signing_key=SIGNING_KEY), RedisRemote(url))
        for key, payload in blobs.items():
            writer.put(key, payload, kind="target")
        writer.local.close()

        counter = iter(range(10**6))

        def fresh_dir() -> Path:
            return work / f"cold-{next(counter)}"

        def warm_store() -> TieredStore:
            return TieredStore(LocalStore(warm_dir, signing_key=SIGNING_KEY), RedisRemote(url))

        def cold_store() -> TieredStore:
            return TieredStore(LocalStore(fresh_dir(), signing_key=SIGNING_KEY), RedisRemote(url))

        def get_all(store: TieredStore) -> None:
            for key in keys:
                assert store.get(key) is not None
            assert store.counters.misses == 0

        def pull_all(store: TieredStore) -> None:
            counts = pull(store, keys, workers=args.workers)
            assert counts.transferred == len(keys)

        def fetch_only(remote: RedisRemote) -> None:
            for key in keys:
                assert remote.get(key) is not None

        results = {
            "warm L1": timed(args.repeat, warm_store, get_all),
            "cold L1 <- Redis": timed(args.repeat, cold_store, get_all),
            f"pull, {args.workers} threads": timed(args.repeat, cold_store, pull_all),
            "Redis fetch only": timed(args.repeat, lambda: RedisRemote(url), fetch_only),
        }
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)

    mb = total / 1e6
    rows = []
    for name, secs in results.items():
        med = statistics.median(secs)
        rows.append({
            "case": name,
            "median_s": round(med, 4),
            "best_s": round(min(secs), 4),
            "MB_per_s": round(mb / med, 1),
        })  # fmt: skip
    warm = statistics.median(results["warm L1"])
    cold = statistics.median(results["cold L1 <- Redis"])
    report = {
        "machine": machine(),
        "blobs": len(blobs),
        "total_MB": round(mb, 1),
        "repeat": args.repeat,
        "results": rows,
        "cold_over_warm": round(cold / warm, 2),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    m = report["machine"]
    print(f"{m['cpu']} ({m['nproc']} CPUs, {m['arch']}), redis-server {m['redis_server']}")
    print(f"{len(blobs)} signed blobs, {mb:.1f} MB in all, median of {args.repeat} runs\n")
    print(f"{'case':<22}{'median s':>10}{'best s':>10}{'MB/s':>10}")
    for r in rows:
        print(f"{r['case']:<22}{r['median_s']:>10.3f}{r['best_s']:>10.3f}{r['MB_per_s']:>10.1f}")
    print(f"\ncold L1 from Redis / warm L1: {report['cold_over_warm']:.2f}x")


if __name__ == "__main__":
    main()
