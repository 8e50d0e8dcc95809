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
reported.

With ``--model MODEL.py`` it also measures a model's warm start, each run in a fresh
process: one process builds the model into an empty L1 and Redis; then the time from
``cachebuild.compile`` to the first output is measured for a process with an empty L1
pulling from Redis, and for a process with a warm L1 and no remote. Usage::

    python tools/bench_remote.py [--blobs 10] [--total-mb 30] [--repeat 5] [--json]
    python tools/bench_remote.py --model examples/llama.py [--model-repeat 3]
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
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from benchlib import cpu_model

from cachebuild.store import LocalStore, RedisRemote, TieredStore, pull

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
    cpu = cpu_model()
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


def model_child(model_path: str, cache_dir: str, url: str) -> None:
    """Run in a fresh process: compile-and-first-call ``model_path``; print a JSON line."""
    import torch

    import cachebuild
    from cachebuild.modelfile import load_spec
    from cachebuild.store import StoreOptions, open_store

    spec = load_spec(model_path)
    store = open_store(StoreOptions(cache_dir, remote=url or None, signing_key=SIGNING_KEY,
                                    remote_mode="rw" if url else "off"))
    imported = time.perf_counter()
    compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims, store=store)
    with torch.no_grad():
        out = compiled(*spec.example_inputs)
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize()
    done = time.perf_counter()
    stats = cachebuild.stats()
    print(json.dumps({
        "first_output_s": done - imported,
        "built": stats.get("built"),
        "loaded": stats.get("loaded"),
        "l1_bytes": store.local.stats().bytes,
        "tiers": store.stats().to_json()["tiers"],
    }))  # fmt: skip


def run_child(model_path: str, cache_dir: Path, url: str) -> dict:
    """One fresh process of ``model_child``; its JSON report plus ``wall_s``, the whole
    process from exec to exit (interpreter, imports, model construction included)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", model_path, str(cache_dir), url],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"model process failed:\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["wall_s"] = time.perf_counter() - start
    return report


def bench_model(model_path: str, url: str, work: Path, repeat: int) -> dict:
    """Warm start of a model: empty L1 pulling from Redis vs warm L1, fresh processes."""
    builder = run_child(model_path, work / "model-builder", url)
    cold: list[dict] = []
    warm: list[dict] = []
    # Alternate the two cases so that load from other work on the machine hits both alike.
    # The warm L1 is the one the first cold process filled from Redis.
    for i in range(repeat):
        cold.append(run_child(model_path, work / f"model-cold-{i}", url))
        warm.append(run_child(model_path, work / "model-cold-0", ""))
    if any(r["built"] for r in cold + warm):
        raise SystemExit(f"a warm start built targets: cold {cold}, warm {warm}")

    def summary(runs: list[dict]) -> dict:
        return {
            "first_output_s": round(statistics.median(r["first_output_s"] for r in runs), 3),
            "process_s": round(statistics.median(r["wall_s"] for r in runs), 3),
            "l2_hits": runs[0]["tiers"]["l2_hits"],
            "l1_bytes": runs[0]["l1_bytes"],
        }

    result = {
        "model": model_path,
        "repeat": repeat,
        "build": {"first_output_s": round(builder["first_output_s"], 2), "built": builder["built"]},
        "cold L1 <- Redis": summary(cold),
        "warm L1": summary(warm),
    }
    result["cold_over_warm"] = round(
        result["cold L1 <- Redis"]["first_output_s"] / result["warm L1"]["first_output_s"], 2
    )
    return result


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        model_child(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blobs", type=int, default=10)
    parser.add_argument("--total-mb", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4, help="threads for pull()")
    parser.add_argument("--model", help="also time a MODEL.py's warm start (fresh processes)")
    parser.add_argument("--model-repeat", type=int, default=3)
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
        model = bench_model(args.model, url, work, args.model_repeat) if args.model else None
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
        "model": model,
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
    if model is None:
        return
    print(
        f"\nmodel {model['model']}: built {model['build']['built']} targets in "
        f"{model['build']['first_output_s']:.1f} s; median of {model['repeat']} fresh processes"
    )
    print(f"artifacts in L1 after a warm start: {model['warm L1']['l1_bytes'] / 1e6:.2f} MB")
    print(f"{'warm start':<22}{'first output s':>16}{'process s':>12}{'L2 hits':>10}")
    for name in ("warm L1", "cold L1 <- Redis"):
        r = model[name]
        print(f"{name:<22}{r['first_output_s']:>16.3f}{r['process_s']:>12.3f}{r['l2_hits']:>10}")
    print(f"\ncold L1 from Redis / warm L1 (first output): {model['cold_over_warm']:.2f}x")


if __name__ == "__main__":
    main()
