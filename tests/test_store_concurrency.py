"""LocalStore across real processes: concurrent puts and gets, writers killed with SIGKILL,
single-flight builds under the build lock, and GC under a reading process.

Workers run in fresh processes forked from a multiprocessing *forkserver*: a clean server
process that imported the store once (importing ``cachebuild`` imports torch, seconds per
process), so each worker starts in milliseconds yet shares no state with the test process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
import traceback
from multiprocessing import forkserver

import pytest

from cachebuild.keys import make_key
from cachebuild.store import LocalStore, LockTimeout


def _ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["cachebuild.store", __name__])
    # Python 3.11's forkserver ignores the parent's sys.path when it preloads, so this
    # module would fail to preload (silently) and every worker would import it afresh;
    # start the server with the tests folder on PYTHONPATH instead.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), old]))
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def key(name: str) -> str:
    return make_key({"concurrency": name})


def payload_for(k: str, max_size: int = 400_000) -> bytes:
    """The one payload ever stored under ``k``: any other bytes returned are a bug."""
    rng = random.Random(k)
    return rng.randbytes(rng.randint(1, max_size))


def _run(fn, *args) -> None:
    # A worker's assertion or exception becomes exit code 1 with the traceback on stderr.
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _join_all(procs, timeout: float = 120) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


# -- 8 processes putting and getting ----------------------------------------------------


def _put_get(store_dir: str, worker: int, shared: list[str], barrier) -> None:
    store = LocalStore(store_dir)
    own = [key(f"own-{worker}-{i}") for i in range(15)]
    rng = random.Random(worker)
    barrier.wait()
    for _ in range(3):
        keys = shared + own
        rng.shuffle(keys)
        for k in keys:
            data = store.get(k)
            if data is None:
                record = store.put(k, payload_for(k), kind="target", manifest={"k": k})
                assert record.key == k and record.size == len(payload_for(k))
                data = store.get(k)
            assert data == payload_for(k), f"wrong bytes for {k}"
    store.close()


def worker_put_get(*args) -> None:
    _run(_put_get, *args)


def test_eight_processes_put_and_get_same_and_different_keys(open_local, store_dir):
    open_local(store_dir)
    ctx = _ctx()
    shared = [key(f"shared-{i}") for i in range(15)]
    barrier = ctx.Barrier(8)
    procs = [ctx.Process(target=worker_put_get, args=(str(store_dir), w, shared, barrier))
             for w in range(8)]
    for p in procs:
        p.start()
    assert _join_all(procs) == [0] * 8
    store = open_local(store_dir)
    keys = shared + [key(f"own-{w}-{i}") for w in range(8) for i in range(15)]
    assert {r.key for r in store.records()} == set(keys)
    for k in keys:
        assert store.get(k) == payload_for(k)
    assert store.verify().clean
    stats = store.stats()
    assert stats.puts == len(keys)  # each key written once: later puts were no-ops
    assert list((store.root / "tmp").iterdir()) == []


# -- writers killed with SIGKILL ----------------------------------------------------------


KILL_KEYS = [key(f"kill-{i}") for i in range(30)]


def _kill_payload(k: str) -> bytes:
    return payload_for(k, max_size=3_000_000)  # large, so kills often land mid-write


def _killable_writer(store_dir: str, seed: int, ready) -> None:
    store = LocalStore(store_dir)
    rng = random.Random(seed)
    ready.send("ready")
    while True:
        k = rng.choice(KILL_KEYS)
        action = rng.random()
        if action < 0.65:
            store.put(k, _kill_payload(k), kind="target", refs=[rng.choice(KILL_KEYS)])
        elif action < 0.75:
            store.delete(k)
        elif action < 0.85:
            store.materialize(k, ".so")
        elif action < 0.95:
            store.get(k)
        else:
            store.gc(max_size=20_000_000)


def worker_killable_writer(*args) -> None:
    _run(_killable_writer, *args)


def _checking_reader(store_dir: str, stop, results) -> None:
    store = LocalStore(store_dir)
    expected = {k: _kill_payload(k) for k in KILL_KEYS}
    hits = misses = 0
    while not stop.is_set():
        for k in KILL_KEYS:
            data = store.get(k)
            if data is None:
                misses += 1
            else:
                assert data == expected[k], f"torn or wrong bytes for {k}"
                hits += 1
    results.put((hits, misses))


def worker_checking_reader(*args) -> None:
    _run(_checking_reader, *args)


@pytest.mark.slow
def test_writers_killed_at_random_points(open_local, store_dir):
    open_local(store_dir)
    ctx = _ctx()
    stop, results = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=worker_checking_reader, args=(str(store_dir), stop, results))
    reader.start()
    rng = random.Random(2)
    for i in range(50):
        parent_end, child_end = ctx.Pipe()
        writer = ctx.Process(target=worker_killable_writer, args=(str(store_dir), i, child_end))
        writer.start()
        assert parent_end.poll(30), "writer did not start"
        parent_end.recv()
        time.sleep(rng.uniform(0.0, 0.25))
        writer.kill()
        writer.join()
        assert writer.exitcode == -9, f"writer {i} ended on its own: {writer.exitcode}"
    stop.set()
    hits, misses = results.get(timeout=60)
    reader.join(30)
    assert reader.exitcode == 0
    assert hits > 0

    store = open_local(store_dir)
    leftovers = list((store.root / "tmp").iterdir())
    report = store.verify()
    assert report.clean, report.damaged
    assert report.tmp_removed == len(leftovers)
    assert list((store.root / "tmp").iterdir()) == []
    stored = list(store.records())
    assert stored, "no writer ever finished a put"
    for record in stored:
        assert store.get(record.key) == _kill_payload(record.key)
    assert store.stats().quarantined == 0


# -- single-flight -------------------------------------------------------------------------


def _single_flight(store_dir: str, k: str, log_path: str, barrier, refused, results) -> None:
    store = LocalStore(store_dir)
    barrier.wait()
    try:
        with store.lock(k, timeout=0):  # one try: exactly one process gets it
            if store.get(k) is None:  # look again under the lock: someone may have built it
                with open(log_path, "a") as log:
                    log.write(f"{os.getpid()}\n")
                # "Compiling" until every other process has asked for the lock and been
                # refused: the lock, not the timing, kept them out.
                for _ in range(7):
                    assert refused.acquire(timeout=60)
                store.put(k, f"built by {os.getpid()}".encode(), kind="target")
    except LockTimeout:
        refused.release()
        with store.lock(k, timeout=60):  # then wait for the build, and build nothing
            assert store.get(k) is not None
    results.put(store.get(k))


def worker_single_flight(*args) -> None:
    _run(_single_flight, *args)


def test_single_flight_exactly_one_builds(open_local, store_dir, tmp_path):
    open_local(store_dir)
    ctx = _ctx()
    k = key("single-flight")
    log_path = tmp_path / "builds.log"
    barrier, refused, results = ctx.Barrier(8), ctx.Semaphore(0), ctx.Queue()
    procs = [ctx.Process(target=worker_single_flight,
                         args=(str(store_dir), k, str(log_path), barrier, refused, results))
             for _ in range(8)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    assert _join_all(procs) == [0] * 8
    builders = log_path.read_text().split()
    assert len(builders) == 1
    assert got == [f"built by {builders[0]}".encode()] * 8


def _hold_lock(store_dir: str, k: str, held, release) -> None:
    store = LocalStore(store_dir)
    with store.lock(k):
        held.set()
        release.wait(60)


def worker_hold_lock(*args) -> None:
    _run(_hold_lock, *args)


def test_lock_timeout_names_the_key_and_dead_holders_release(open_local, store_dir):
    store = open_local(store_dir)
    ctx = _ctx()
    k = key("held")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=worker_hold_lock, args=(str(store_dir), k, held, release))
    holder.start()
    assert held.wait(30)
    with pytest.raises(LockTimeout) as info:
        with store.lock(k, timeout=0.3):
            pass
    assert k in str(info.value) and "another process (or thread) holds it" in str(info.value)
    holder.kill()  # a holder that dies, however it dies, releases the lock
    holder.join()
    with store.lock(k, timeout=5):
        pass


# -- GC while another process reads ----------------------------------------------------------


GC_KEYS = [key(f"gc-{i}") for i in range(30)]


def _gc_reader(store_dir: str, passes, stop, results) -> None:
    store = LocalStore(store_dir)
    expected = {k: payload_for(k, 200_000) for k in GC_KEYS}
    hits = misses = 0
    while not stop.is_set():
        for k in GC_KEYS:
            data = store.get(k)
            if data is None:
                misses += 1
            else:
                assert data == expected[k]
                hits += 1
            path = store.materialize(k, ".so")
            if path is not None:
                try:
                    with open(path, "rb") as f:
                        assert f.read() == expected[k]
                except FileNotFoundError:
                    pass  # removed by GC between materialize and open: a miss
        with passes.get_lock():
            passes.value += 1
    results.put((hits, misses))


def worker_gc_reader(*args) -> None:
    _run(_gc_reader, *args)


def test_gc_while_another_process_reads(open_local, store_dir):
    store = open_local(store_dir)
    for k in GC_KEYS:
        store.put(k, payload_for(k, 200_000), kind="target")
    ctx = _ctx()
    passes, stop, results = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=worker_gc_reader, args=(str(store_dir), passes, stop, results))
    reader.start()
    rng = random.Random(3)
    rounds = 0
    # GC and puts go on for as long as the reader takes to read every key 10 times over.
    while rounds < 4 or passes.value < 10:
        assert reader.is_alive(), "the reader died"
        store.gc(max_size=rng.choice([0, 500_000, 2_000_000]))
        for k in rng.sample(GC_KEYS, 10):
            store.put(k, payload_for(k, 200_000), kind="target")
        rounds += 1
    stop.set()
    hits, misses = results.get(timeout=60)
    reader.join(30)
    assert reader.exitcode == 0
    assert rounds > 3 and hits > 0 and misses > 0
    assert store.verify().clean


def test_a_short_lock_held_long_by_another_process_is_waited_for_out_loud(tmp_path, caplog):
    """A process stopped while holding an entry lock (a store's short lock): a `gc` waits for
    it, and says so, naming the lock, instead of hanging silently."""
    import subprocess
    import sys

    from store.locking import SAY_WAIT_AFTER_S, flocked

    lock = tmp_path / "entry.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDONLY | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\n"
        f"time.sleep({SAY_WAIT_AFTER_S + 2})\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="cachebuild.store"), flocked(lock):
            waited = time.monotonic() - started
        assert waited >= SAY_WAIT_AFTER_S
        said = [r.getMessage() for r in caplog.records if "waiting for the lock" in r.getMessage()]
        assert len(said) == 1 and str(lock) in said[0]
    finally:
        holder.kill()
        holder.wait()
