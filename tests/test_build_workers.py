"""Targets built in worker processes: a cold start farms its missing targets out to
workers that build them exactly as it would (the same store, the same ops, proven before
stored) where they can, and builds them itself where they cannot; each build says where
its time went."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import models
import pytest
import torch

import cachebuild
from cachebuild import process_state
from cachebuild.building.build import BuildJob
from cachebuild.building.pool import jobs_here, op_modules
from cachebuild.clock import PHASES, BuildClock, measuring, phase
from cachebuild.errors import BuildError
from cachebuild.store import LocalStore


def test_a_cold_start_builds_its_missing_targets_in_workers(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CACHEBUILD_BUILD_JOBS", "2")
    # As a fresh process (conftest's fresh process state): targets an earlier test loaded
    # here would count as hits.
    model = models.make(models.Decoder, layers=2)
    before = cachebuild.stats()
    with caplog.at_level(logging.INFO, logger="cachebuild.building.build"):
        compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                                      store=LocalStore(tmp_path / "store"))
        models.assert_matches_eager(compiled, model, models.inputs(7))
    assert "targets in 2 worker processes" in caplog.text
    unique = len(compiled.runtime.entry.target_keys())
    delta = models.counters_delta(before, cachebuild.stats())
    assert unique >= 2 and delta["built"] == unique and delta["loaded"] == unique
    models.assert_matches_eager(compiled, model, models.inputs(19))


def _job(target: str) -> BuildJob:
    nodes = [{"op": "placeholder", "name": "x", "target": "x"},
             {"op": "call_function", "name": "y", "target": target},
             {"op": "output", "name": "output", "target": "output"}]
    return BuildJob(None, nodes, [], models.config())  # type: ignore[arg-type]


def test_workers_import_the_modules_that_registered_a_pieces_ops():
    assert op_modules([_job("op:aten::mm.default"), _job("op:cachebuild::x.default")]) == []
    assert op_modules([_job(f"op:{models.TRANSPOSED}.default")]) == ["models"]
    # An op registered by code no worker can import (a script's __main__, a notebook).
    cell = compile(
        "lib = torch.library.Library('cachebuild_tests_main', 'DEF')\n"
        "lib.define('twice(Tensor x) -> Tensor')\n"
        "torch.library.register_fake('cachebuild_tests_main::twice',\n"
        "                            lambda x: x.new_empty(x.shape), lib=lib)\n",
        "<cell>", "exec")
    scope: dict = {"torch": torch}
    exec(cell, scope)
    assert op_modules([_job("op:cachebuild_tests_main::twice.default")]) is None


def test_the_job_count_never_exceeds_cpus_memory_or_targets(monkeypatch):
    monkeypatch.setattr("cachebuild.building.pool.usable_cpus", lambda: 8)
    monkeypatch.setattr("cachebuild.building.pool.available_memory", lambda: 5 * 2**30)
    assert jobs_here(20) == 3  # 5 GiB at 1.5 GiB a build
    assert jobs_here(2) == 2
    monkeypatch.setenv("CACHEBUILD_BUILD_MEMORY", "512M")
    assert jobs_here(20) == 8
    monkeypatch.setattr("cachebuild.building.pool.available_memory", lambda: 100 * 2**20)
    assert jobs_here(20) == 1


def test_phases_count_each_second_once():
    clock = BuildClock()
    with measuring(clock), phase("lowering"):
        with phase("cxx_wrapper"):
            pass
        with phase("packaging"):
            pass
    assert set(clock.seconds) == {"lowering", "cxx_wrapper", "packaging"}
    assert list(clock.report()) == [p for p in PHASES if p in clock.seconds]
    with phase("lowering"):  # no clock on this thread: nothing recorded anywhere
        pass


def test_the_cpus_vector_isas_are_checked_once_per_environment(tmp_path, monkeypatch):
    """Inductor's ISA checks (a compile and a load per ISA) run once for a records folder
    (the probe's, shared by every store of the environment) and are taken from its record
    after, by any work folder; a record this CPU cannot honour is checked again."""
    import json

    from torch._inductor import cpu_vec_isa

    from cachebuild import compat
    from cachebuild.backends import compilers

    isas = cpu_vec_isa.valid_vec_isa_list()  # what Inductor finds here, checked
    checks = []

    def check():
        checks.append(1)
        return isas

    monkeypatch.setattr(compilers, "_isas", {})
    records = tmp_path / "probe"
    records.mkdir()
    with _work(tmp_path / "a", records):
        first = compilers._vec_isas(check)
    assert checks == [1] and [str(i) for i in first] == [str(i) for i in isas]
    (record,) = records.glob("vec_isa-*.json")
    monkeypatch.setattr(compilers, "_isas", {})  # a new process, another store
    with _work(tmp_path / "b", records):
        again = compilers._vec_isas(check)
    assert checks == [1]
    assert [(str(i), i.build_arch_flags()) for i in again] == [
        (str(i), i.build_arch_flags()) for i in isas]
    assert json.loads(record.read_text()) == compat.vec_isa_record(isas)
    record.write_text(json.dumps([["avx9000", "-mavx9000"]]))  # no such ISA here
    monkeypatch.setattr(compilers, "_isas", {})
    with _work(tmp_path / "c", records):
        compilers._vec_isas(check)
    assert checks == [1, 1]
    assert json.loads(record.read_text()) == compat.vec_isa_record(isas)


def test_the_isa_checks_run_at_once_a_thread_apiece(monkeypatch):
    """Each check compiles and loads a program (seconds apiece): made at the same time,
    the first build on a new machine waits for the longest, not for their sum."""
    import threading

    from torch._inductor import cpu_vec_isa

    from cachebuild import compat

    # A CPU that claims every x86 ISA Inductor knows: four checks to make.
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker",
                        lambda: ["avx2", "avx512", "avx512_vnni", "amx_tile"])
    claimed = [i for i in cpu_vec_isa.supported_vec_isa_list if str(i) != "asimd"]
    together = threading.Barrier(len(claimed), timeout=30)
    threads, compilers = [], []

    def run(check):
        together.wait()  # every check is under way at once, or this breaks
        threads.append(threading.current_thread().name)
        compilers.append(config.cpp.cxx)  # the compiler being checked, not the default

    from torch._inductor import config

    with config.patch({"cpp.cxx": (None, "/opt/checked/g++")}):
        compat.check_vec_isas_at_once(run)
    assert not together.broken and len(set(threads)) == len(claimed) == 4
    assert compilers == [(None, "/opt/checked/g++")] * 4
    with config.patch({"cpp.vec_isa_ok": True}):  # the operator decided: nothing checked
        compat.check_vec_isas_at_once(run)
    assert len(threads) == 4


def _work(folder, records):
    from cachebuild.backends import compilers

    folder.mkdir()
    return compilers.watch(folder, records)


def _environ(proc: subprocess.Popen) -> list[bytes]:
    """The environment ``proc`` runs with, read from /proc once the kernel shows it (on a
    loaded machine it may read empty for a moment after the start)."""
    import time

    deadline = time.monotonic() + 30
    while True:
        variables = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        if variables != [b""] or time.monotonic() > deadline:
            assert proc.poll() is None, f"the worker ended with status {proc.returncode}"
            return variables
        time.sleep(0.05)


def test_a_pool_started_before_its_setup_waits_for_it_and_closes_its_unused_workers(
        monkeypatch):
    """A cold start's workers start before its trace, told what to build after its plan;
    the ones that never got a job end when the pool closes (not after their imports)."""
    import pytest

    from cachebuild.building.pool import BuildPool

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    pool = BuildPool(2)
    procs = [w.proc for w in pool._idle]
    # Each worker compiles with its share of the CPUs, not a pool as large as the machine.
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for proc in procs:
        assert f"TORCHINDUCTOR_COMPILE_THREADS={share}".encode() in _environ(proc)
    with pytest.raises(RuntimeError, match="begin"):
        pool.run([], lambda job, result: None)
    pool.close()
    assert all(p.poll() is not None for p in procs)


def test_a_cpu_packages_two_headers_are_precompiled_side_by_side(monkeypatch):
    """The call for the wrapper's header also precompiles the kernels' prefix header with
    the same command, at the same time, on another thread; a GPU's (no prefix header)
    and every other call are left as they are."""
    import threading
    import time

    from torch._inductor import codecache

    from cachebuild import compat

    calls: list[tuple[str, str, dict, str, float, float]] = []

    def precompile(header, cmd, **options):
        start = time.monotonic()
        time.sleep(0.3)
        calls.append((header, cmd, options, threading.current_thread().name, start,
                      time.monotonic()))
        return f"/headers/{header}"

    monkeypatch.setattr(codecache, "_precompile_header", precompile)
    monkeypatch.setitem(compat._HOOKED, "headers", False)
    beside: list[str] = []
    compat.hook_header_precompiles(lambda run: beside.append(str(run())))
    options = {"device_type": "cpu", "aot_mode": True, "vec_isa": "avx2"}
    wrapper = "torch/csrc/inductor/aoti_include/cpu.h"
    assert codecache._precompile_header(wrapper, "g++ -O1", min_optimize=True,
                                        **options) == f"/headers/{wrapper}"
    prefix = codecache._get_cpp_prefix_header("cpu")
    assert sorted((c[0], c[1], c[2]) for c in calls) == sorted([
        (wrapper, "g++ -O1", {"min_optimize": True, **options}), (prefix, "g++ -O1", options)])
    (first, second) = calls
    assert first[3] != second[3] and first[4] < second[5] and second[4] < first[5]  # at once
    assert beside == [f"/headers/{prefix}"]
    calls.clear()
    codecache._precompile_header(prefix, "g++ -O1", **options)  # Inductor's own call
    codecache._precompile_header("torch/csrc/inductor/aoti_include/cuda.h", "g++",
                                 min_optimize=True, device_type="cuda")
    assert [c[0] for c in calls] == [prefix, "torch/csrc/inductor/aoti_include/cuda.h"]


def test_the_operators_compile_threads_are_kept(monkeypatch):
    from cachebuild.building.pool import compile_threads

    monkeypatch.setattr("cachebuild.building.pool.usable_cpus", lambda: 16)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert compile_threads(3) == {"TORCHINDUCTOR_COMPILE_THREADS": "5"}
    assert compile_threads(32) == {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    assert compile_threads(3) == {}  # the worker inherits the operator's


def test_a_warm_start_with_targets_gone_builds_them_in_workers(tmp_path, monkeypatch, caplog):
    """A warm start whose artifacts load on threads (as Inductor's do), and whose store
    lost targets since (evicted), builds the lost ones in workers."""
    from cachebuild.backends.protocol import LoadNeeds

    monkeypatch.setenv("CACHEBUILD_BUILD_JOBS", "2")
    monkeypatch.setenv("CACHEBUILD_LOAD_THREADS", "2")
    model = models.make(models.Decoder, layers=2)
    store = LocalStore(tmp_path / "store")
    compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(7))
    keys = sorted(compiled.runtime.entry.target_keys())
    assert len(keys) >= 3
    for key in keys[:2]:
        assert store.delete(key)
    process_state.current().loaded.clear()  # as a fresh process
    monkeypatch.setattr("cachebuild.building.build.load_needs",
                        lambda keys, builder: LoadNeeds(inductor=True))
    with caplog.at_level(logging.INFO, logger="cachebuild.building.build"):
        again = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
        models.assert_matches_eager(again, model, models.inputs(9))
    assert "warm start from entry" in caplog.text
    assert "building 2 targets in 2 worker processes" in caplog.text


def test_a_worker_ends_at_once_with_its_exit_handlers_run(tmp_path):
    """A worker done with its jobs skips the interpreter's teardown (about a second that
    every caller waits for at ``BuildPool.close``), but runs its exit handlers (scratch
    folders removed, probe children stopped) and flushes what it printed."""
    import subprocess
    import sys

    done = tmp_path / "handled"
    code = ("import atexit, pathlib, sys\n"
            f"atexit.register(pathlib.Path({str(done)!r}).write_text, 'yes')\n"
            "print('said', end='')\n"
            "from cachebuild.worker import end\n"
            "end()\n"
            "sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "said"), proc.stderr
    assert done.read_text() == "yes"


#: A server's cold start of a one-layer decoder, as a fresh process; it prints whether it
#: imported Inductor's compiler, and what it built and loaded.
_SERVER = """
import json, os, sys
import cachebuild, models
from cachebuild.store import LocalStore

before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
model = models.make(models.Decoder, layers=1)
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                              store=LocalStore(sys.argv[1]))
models.assert_matches_eager(compiled, model, models.inputs(7))
stats = cachebuild.stats()
print(json.dumps({"inductor": "torch._inductor.compile_fx" in sys.modules,
                  "environment": os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before,
                  "built": stats["built"], "loaded": stats["loaded"],
                  "keys": sorted(compiled.runtime.entry.target_keys())}))
"""


def test_a_server_builds_even_one_missing_target_in_a_worker(tmp_path):
    """By default (no ``CACHEBUILD_BUILD_JOBS``) a cold start's targets build in worker
    processes, one missing target too (a warm start that lost one): the serving process
    never imports Inductor's compiler nor points its folders anywhere for a build."""
    import json
    import subprocess
    import sys

    store = tmp_path / "store"
    env = {k: v for k, v in os.environ.items() if k != "CACHEBUILD_BUILD_JOBS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(models.__file__).parent),
                                         env.get("PYTHONPATH", "")])

    def serve() -> dict:
        proc = subprocess.run([sys.executable, "-c", _SERVER, str(store)], env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold = serve()
    assert cold["built"] == len(cold["keys"]) >= 2 and cold["loaded"] == cold["built"]
    assert (cold["inductor"], cold["environment"]) == (False, True)
    with LocalStore(store) as opened:
        assert opened.delete(cold["keys"][0])
    again = serve()
    assert (again["built"], again["loaded"]) == (1, len(cold["keys"]))
    assert (again["inductor"], again["environment"]) == (False, True)


_DIES_ONCE = '''
import os
from pathlib import Path

import torch

MARK = Path(os.environ["CB_TESTS_DIES_MARK"])


@torch.library.custom_op("cb_tests_dies::step", mutates_args=())
def step(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@step.register_fake
def _(x):
    # The first build worker to plan this op dies at once, as one killed for its memory
    # does; the calling process (which traces it too) and later workers go on.
    if os.getpid() != int(os.environ["CB_TESTS_PARENT_PID"]) and not MARK.exists():
        if os.environ.get("CB_TESTS_FAIL"):  # a build that fails, every time
            raise RuntimeError("no kernel for step in a build worker")
        MARK.touch()
        os.kill(os.getpid(), 9)
    return torch.empty_like(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.ops.cb_tests_dies.step(self.lin(x)).relu()
'''


def _dies_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
               fails: bool = False) -> torch.nn.Module:
    """``_DIES_ONCE`` as module ``name`` (its op in a namespace of that name), importable;
    its first build worker dies (or, with ``fails``, every build fails); two workers.
    Returns its model."""
    import importlib

    (tmp_path / f"{name}.py").write_text(_DIES_ONCE.replace("cb_tests_dies", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CB_TESTS_DIES_MARK", str(tmp_path / "died"))
    monkeypatch.setenv("CB_TESTS_PARENT_PID", str(os.getpid()))
    if fails:
        monkeypatch.setenv("CB_TESTS_FAIL", "1")
    monkeypatch.setenv("CACHEBUILD_BUILD_JOBS", "2")
    return importlib.import_module(name).Model()


def test_a_job_whose_worker_died_is_built_again_in_a_new_worker_never_here(
        tmp_path, monkeypatch, caplog):
    """A worker killed while it builds (kill -9, as the kernel's OOM killer does): its job
    is built once more in a new worker, and the calling process (a server, whose memory
    the build could exhaust in turn) builds nothing itself."""
    from cachebuild.building.build import Builder

    model = _dies_once(tmp_path, monkeypatch, "cb_tests_dies_once")

    def not_here(self, job):
        raise AssertionError(f"piece {job.target.piece} was built in the calling process")

    monkeypatch.setattr(Builder, "build", not_here)
    with caplog.at_level(logging.WARNING, logger="cachebuild"):
        compiled = cachebuild.compile(model, models.config(splitting_ops=()), {0: 0},
                                      store=LocalStore(tmp_path / "store"))
        x = torch.randn(5, 16)
        torch.testing.assert_close(compiled(x), model(x), **models.TOL)
    assert (tmp_path / "died").exists(), "no worker died: the test did not test anything"
    assert "the build worker was killed by signal 9 while building it; building it again " \
           "in a new worker" in caplog.text
    x = torch.randn(11, 16)
    torch.testing.assert_close(compiled(x), model(x), **models.TOL)


def test_warm_builds_a_job_whose_worker_died_again_in_a_new_worker(tmp_path, monkeypatch,
                                                                  caplog):
    """``warm`` does as a cold start does: the job whose worker was killed is built once
    more, in a new worker, and the run succeeds."""
    _dies_once(tmp_path, monkeypatch, "cb_tests_warm_dies")
    path = tmp_path / "model_file.py"
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch, cachebuild, models\n"
        "from cb_tests_warm_dies import Model\n"
        "def build():\n"
        "    return cachebuild.ModelSpec(Model().eval(), (torch.randn(5, 16),), {0: 0},\n"
        "                                models.config(splitting_ops=()))\n")
    with caplog.at_level(logging.WARNING, logger="cachebuild"):
        report = cachebuild.warm(str(path), store=LocalStore(tmp_path / "store"), jobs=2)
    assert (tmp_path / "died").exists(), "no worker died: the test did not test anything"
    assert "building it again in a new worker" in caplog.text
    assert report.ok and [t.state for t in report.targets] == ["built"], report


@pytest.mark.slow
def test_a_background_build_whose_worker_died_builds_it_again_in_a_new_worker(
        tmp_path, monkeypatch, caplog):
    """The same for a server that serves while it builds: its background build gives the
    job a second worker too, and the swap comes; nothing of the model's own backend is
    built in the serving process."""
    from cachebuild.building.build import Builder

    model = _dies_once(tmp_path, monkeypatch, "cb_tests_bg_dies")
    build = Builder.build

    def interim_only(self, job):
        assert self.config.backend == "eager_fusion", \
            f"piece {job.target.piece} was built in the calling process"
        return build(self, job)

    monkeypatch.setattr(Builder, "build", interim_only)
    config = models.config(splitting_ops=(), backend="inductor", flavour="standalone",
                           while_building="eager_fusion")
    before = cachebuild.stats()["swaps"]
    with caplog.at_level(logging.WARNING, logger="cachebuild"):
        compiled = cachebuild.compile(model, config, {0: 0},
                                      store=LocalStore(tmp_path / "store"))
        x = torch.randn(5, 16)
        torch.testing.assert_close(compiled(x), model(x), **models.TOL)
        assert compiled.wait_built(timeout=600)
        torch.testing.assert_close(compiled(x), model(x), **models.TOL)
    assert (tmp_path / "died").exists(), "no worker died: the test did not test anything"
    assert "building it again in a new worker" in caplog.text
    assert cachebuild.stats()["swaps"] == before + 1
    x = torch.randn(11, 16)
    torch.testing.assert_close(compiled(x), model(x), **models.TOL)


def test_a_build_that_fails_in_a_worker_raises_its_words_and_builds_nothing_here(
        tmp_path, monkeypatch):
    from cachebuild.building.build import Builder

    model = _dies_once(tmp_path, monkeypatch, "cb_tests_fails", fails=True)

    def not_here(self, job):
        raise AssertionError(f"piece {job.target.piece} was built in the calling process")

    monkeypatch.setattr(Builder, "build", not_here)
    store = LocalStore(tmp_path / "store")
    compiled = cachebuild.compile(model, models.config(splitting_ops=()), {0: 0}, store=store)
    with pytest.raises(BuildError, match="no kernel for step in a build worker"):
        compiled(torch.randn(5, 16))
    assert not (tmp_path / "died").exists()
    assert not [r for r in store.records() if r.kind != "guards"]  # nothing stored



INTERRUPTED_CHILD = """
import json, signal, threading
from cachebuild.building import pool

released, built = threading.Event(), threading.Event()


class Worker:
    \"\"\"A build that takes 30 s.\"\"\"
    alive = True

    def run(self, job):
        released.wait(30)
        built.set()
        return pool.Result("key", True, 30.0, None)


waiting = object.__new__(pool.BuildPool)  # its workers, not processes
waiting.setup, waiting._idle, waiting._all = object(), [Worker()], []
waiting._closing = threading.Event()
pool.job_label = lambda job: "piece 0"
# A Ctrl-C the OS hands to another thread than the waiting one (it may pick any).
threading.Timer(1.0, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT)).start()
try:
    waiting.run([object()], lambda job, result: None)
    print(json.dumps({"interrupted": False}))
except KeyboardInterrupt:
    print(json.dumps({"interrupted": True, "while_building": not built.is_set()}))
released.set()
"""


def test_a_ctrl_c_reaches_a_start_waiting_for_its_builds_at_once():
    """Not when the next build finishes: a server's cold start waits for builds of
    seconds to minutes, and one Ctrl-C is to stop it."""
    assert models.run_python(INTERRUPTED_CHILD) == {"interrupted": True,
                                                    "while_building": True}


def test_warm_takes_its_workers_from_the_operator_where_jobs_are_not_given(tmp_path,
                                                                          monkeypatch):
    """``CACHEBUILD_BUILD_JOBS`` (a CI job with little memory, say) bounds ``warm`` too,
    not only a cold start; ``--jobs`` says otherwise where given."""
    import cachebuild.warming as warming

    class Started(Exception):
        pass

    def start_pool(workers, model_path, options):
        raise Started(workers)

    monkeypatch.setattr(warming, "start_pool", start_pool)
    path = tmp_path / "model_file.py"
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import cachebuild, models\n"
        "def build():\n"
        "    model = models.make(models.Decoder, layers=2)\n"
        "    return cachebuild.ModelSpec(model, models.inputs(4), {0: 0, 1: 0}, models.config())\n")
    monkeypatch.setenv("CACHEBUILD_BUILD_JOBS", "1")
    for jobs, workers in ((None, 1), (2, 2)):
        with pytest.raises(Started) as started:
            cachebuild.warm(str(path), store=LocalStore(tmp_path / "store"), jobs=jobs)
        assert started.value.args == (workers,)
