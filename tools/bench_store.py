"""Benchmark the local store against raw diskcache and plain files, side by side.

For each blob size: ``get`` hit latency (p50/p99, and the bandwidth that p50 implies)
and ``put`` throughput of

- ``LocalStore``: verified reads (header, length, xxh3 checksum), durable writes (fsync);
- raw ``diskcache.Cache`` ``set``/``get`` (no verification, no fsync);
- plain files: ``write``/``read`` of a file per key (no verification, no fsync).

Reads of the three are interleaved (one get of each per round), so a busy machine slows
all of them alike. Reads are served from the page cache, as they are for a warm fleet
process. Goals checked at the end: LocalStore hit p50 under 100 µs for the smallest
size, and verified reads at no less than half of plain-file bandwidth for the largest.

    python tools/bench_store.py [--sizes 4K,1M,50M] [--dir DIR] [--markdown] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import diskcache
from benchlib import cpu_model

from cachebuild.keys import make_key
from cachebuild.store import LocalStore
from cachebuild.units import format_size, parse_size

SMALL_GOAL_US = 100.0
BANDWIDTH_GOAL = 0.5


@dataclass
class Result:
    size: int
    backend: str
    put_mb_s: float
    get_p50_us: float
    get_p99_us: float
    get_mb_s: float
    puts: int
    gets: int


class PlainFiles:
    """One file per key, written and read with no verification and no fsync."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, data: bytes) -> None:
        with open(self.root / key, "wb") as f:
            f.write(data)

    def get(self, key: str) -> bytes | None:
        try:
            with open(self.root / key, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


def _plan(size: int) -> tuple[int, int, int]:
    """(distinct keys, puts, gets) for a blob size: fewer of the big ones."""
    if size <= 64 << 10:
        return 200, 400, 5000
    if size <= 4 << 20:
        return 30, 60, 600
    return 3, 6, 40


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bench_size(size: int, base: Path) -> list[Result]:
    n_keys, n_puts, n_gets = _plan(size)
    payloads = [os.urandom(size) for _ in range(min(n_keys, 3))]
    keys = [make_key({"bench": size, "i": i}) for i in range(n_puts)]
    store = LocalStore(base / f"local-{size}")
    cache = diskcache.Cache(str(base / f"diskcache-{size}"), eviction_policy="none",
                            size_limit=2**62, statistics=0)
    files = PlainFiles(base / f"files-{size}")
    puts: dict[str, Callable[[str, bytes], object]] = {
        "LocalStore": lambda k, d: store.put(k, d, kind="bench"),
        "diskcache": cache.set,
        "plain files": files.put,
    }
    gets: dict[str, Callable[[str], bytes | None]] = {
        "LocalStore": store.get, "diskcache": cache.get, "plain files": files.get,
    }
    put_rate = {}
    for name, put in puts.items():
        start = time.perf_counter()
        for i, k in enumerate(keys):
            put(k, payloads[i % len(payloads)])
        put_rate[name] = size * len(keys) / (time.perf_counter() - start) / 1e6
    lat: dict[str, list[float]] = {name: [] for name in gets}
    hot = keys[:n_keys]
    for get in gets.values():  # warm-up: page cache, connections
        for k in hot[:10]:
            assert get(k) is not None
    for i in range(n_gets):
        k = hot[i % len(hot)]
        for name, get in gets.items():
            t0 = time.perf_counter_ns()
            data = get(k)
            lat[name].append((time.perf_counter_ns() - t0) / 1e3)
            assert data is not None and len(data) == size, name
    store.close()
    cache.close()
    results = []
    for name in gets:
        p50 = statistics.median(lat[name])
        results.append(Result(size=size, backend=name, put_mb_s=put_rate[name],
                              get_p50_us=p50, get_p99_us=_percentile(lat[name], 0.99),
                              get_mb_s=size / p50, puts=len(keys), gets=n_gets))
    return results


def machine() -> dict[str, str]:
    """Where the figures were measured."""
    cpu = cpu_model()
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    return {"date": date, "nproc": str(os.cpu_count()), "arch": platform.machine(),
            "cpu": cpu, "torch": torch_version, "python": platform.python_version(),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def _fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


def _rows(results: list[Result]) -> list[list[str]]:
    return [[format_size(r.size), r.backend, f"{r.put_mb_s:,.0f}", _fmt_us(r.get_p50_us),
             _fmt_us(r.get_p99_us), f"{r.get_mb_s:,.0f}"] for r in results]


HEADERS = ["size", "backend", "put MB/s", "get p50", "get p99", "get MB/s (p50)"]


def goals(results: list[Result]) -> list[tuple[str, bool, str]]:
    """(goal, met, measured) for the two goals of the store."""
    sizes = sorted({r.size for r in results})
    by = {(r.size, r.backend): r for r in results}
    out = []
    small = by[(sizes[0], "LocalStore")]
    out.append((f"LocalStore hit p50 < {SMALL_GOAL_US:.0f} µs at {format_size(sizes[0])}",
                small.get_p50_us < SMALL_GOAL_US, _fmt_us(small.get_p50_us)))
    big, plain = by[(sizes[-1], "LocalStore")], by[(sizes[-1], "plain files")]
    ratio = big.get_mb_s / plain.get_mb_s
    out.append((f"verified reads ≥ {BANDWIDTH_GOAL:.0%} of plain-file bandwidth at "
                f"{format_size(sizes[-1])}", ratio >= BANDWIDTH_GOAL,
                f"{ratio:.0%} ({big.get_mb_s:,.0f} vs {plain.get_mb_s:,.0f} MB/s)"))
    return out


def markdown(results: list[Result], info: dict[str, str], command: str) -> str:
    lines = [f"Measured {info['date']} on {info['nproc']} × {info['cpu']} ({info['arch']}), "
             f"torch {info['torch']}, Python {info['python']}, stores in "
             f"{info['filesystem']}, load average at start {info['load']}.", "",
             f"Command: `{command}`", "",
             "| " + " | ".join(HEADERS) + " |",
             "| " + " | ".join("---" for _ in HEADERS) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(results)]
    lines += ["", "| goal | met | measured |", "| --- | --- | --- |"]
    lines += [f"| {g} | {'yes' if ok else 'no'} | {m} |" for g, ok, m in goals(results)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,1M,50M", help="blob sizes (default 4K,1M,50M)")
    parser.add_argument("--dir", type=Path, help="where to put the stores (default: a temp dir)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    info = machine()
    base = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(base)], capture_output=True, text=True)
    info["filesystem"] = f"{base.parent} ({fs.stdout.strip() or 'unknown'})"
    try:
        results = [r for size in sizes for r in bench_size(size, base / "s")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    command = "python tools/bench_store.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json:
        print(json.dumps({"machine": info, "results": [asdict(r) for r in results],
                          "goals": goals(results)}, indent=2))
    elif args.markdown:
        print(markdown(results, info, command.strip()))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"store benchmark — {info['date']}, {info['nproc']} × {info['cpu']}, "
                            f"torch {info['torch']}, load {info['load']}")
        for h in HEADERS:
            table.add_column(h, justify="left" if h in ("size", "backend") else "right")
        for row in _rows(results):
            table.add_row(*row)
        console = Console()
        console.print(table)
        for goal, ok, measured in goals(results):
            console.print(f"{'met ' if ok else 'MISSED'} {goal}: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
