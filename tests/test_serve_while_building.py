"""Serving while the targets build (``while_building``), with real processes: a cold
start serves at once with eager_fusion targets while its AOTI targets build in a worker
process, then the next call after they are stored swaps to them. Every call matches
eager, no call runs pieces of both kinds, the interim runtime's captured sizes do not
carry over (the new runtime captures its own), and the entry recorded afterwards serves a
second process warm with the AOTI targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import models
import pytest

from cachebuild.config import CompileConfig
from cachebuild.errors import ConfigError, UsageError
from cachebuild.serving.start import interim_config

SERVER = textwrap.dedent("""
    import json, os, sys, time
    import cachebuild
    import cachebuild.api as api
    import cachebuild.serving.stitch as stitch
    import models
    from cachebuild.store import LocalStore

    kinds = []  # of the pieces the call in progress ran
    run_piece = stitch.PieceRunner.__call__

    def watched(self, *args):
        fn = self.select(self.size_of(args))
        kinds.append("aoti" if hasattr(fn, "loader") else "interim")
        return run_piece(self, *args)

    stitch.PieceRunner.__call__ = watched
    swap_in = api.CompiledModule._swap_in
    at_swap = []  # sizes the new runtime had captured when it took over

    def watched_swap(self, args):
        old = self.runtime
        swap_in(self, args)
        if self.runtime is not old:
            at_swap.append(list(self.runtime.captured_sizes))
            at_swap.append(old.capturer._stop.is_set())

    api.CompiledModule._swap_in = watched_swap
    config = models.config(backend="inductor", flavour="aoti",
                           compile_ranges=(models.AOTI_RANGE,), while_building="eager_fusion",
                           cudagraph_mode="piecewise", capture="lazy", capture_sizes=(3, 8))
    model = models.make(models.Decoder, layers=2)
    store = LocalStore(sys.argv[1])
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    start = time.perf_counter()
    calls, runtimes = [], []
    first_output = swapped = None
    deadline = time.monotonic() + 500
    after = 0
    while after < 3 and time.monotonic() < deadline:
        if compiled.swap is not None and compiled.swap.claimed:
            after += 1
        for size in (3, 8):
            kinds.clear()
            models.assert_matches_eager(compiled, model, models.inputs(size))
            first_output = first_output or time.perf_counter() - start
            if id(compiled.runtime) not in runtimes:
                runtimes.append(id(compiled.runtime))
                if len(runtimes) == 2:
                    swapped = time.perf_counter() - start
            calls.append([runtimes.index(id(compiled.runtime)), sorted(set(kinds))])
        time.sleep(0.05)
    s = cachebuild.stats()
    print(json.dumps({"calls": calls, "swaps": s["swaps"], "built": s["built"],
                      "error": compiled.swap.error if compiled.swap else "no swap",
                      "at_swap": at_swap, "captured_now": compiled.runtime.captured_sizes,
                      "targets": compiled.runtime.entry.target_keys(),
                      "first_output_s": first_output, "swapped_s": swapped,
                      "phases": compiled.swap.builder.worker_phases}))
""")

WARM = textwrap.dedent("""
    import json, os, sys
    import cachebuild, models
    from cachebuild.store import LocalStore

    model = models.make(models.Decoder, layers=2)
    store = LocalStore(sys.argv[1])
    compiled = cachebuild.compile(model, models.aoti_config(), {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(5))
    s = cachebuild.stats()
    print(json.dumps({"traced": s["traced"], "built": s["built"],
                      "targets": compiled.runtime.entry.target_keys(),
                      "kinds": sorted({store.get_record(k).kind
                                       for k in compiled.runtime.entry.target_keys()})}))
""")


def _run(script: str, store, env) -> dict:
    done = subprocess.run([sys.executable, "-c", script, str(store)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_what_serves_while_building(monkeypatch):
    monkeypatch.delenv("CACHEBUILD_WHILE_BUILDING", raising=False)
    monkeypatch.delenv("CACHEBUILD_BUILD_JOBS", raising=False)
    aoti = models.aoti_config()
    assert aoti.while_building == "auto"
    # By default: standalone pieces for AOTI packages on a CPU, waiting on a GPU.
    served = interim_config(aoti, "cpu")
    assert (served.backend, served.flavour, served.while_building) == \
        ("inductor", "standalone", "wait")
    assert interim_config(CompileConfig(), "cpu").flavour == "standalone"
    assert interim_config(aoti, "cuda:0") is None
    assert interim_config(CompileConfig(flavour="standalone"), "cpu") is None
    assert interim_config(CompileConfig(backend="eager_fusion"), "cpu") is None
    # The operator's word, for "auto" only; builds asked in this process wait.
    monkeypatch.setenv("CACHEBUILD_WHILE_BUILDING", "wait")
    assert interim_config(aoti, "cpu") is None
    assert interim_config(replace(aoti, while_building="standalone"), "cpu") is not None
    monkeypatch.setenv("CACHEBUILD_WHILE_BUILDING", "eager_fusion")
    assert interim_config(aoti, "cuda:0").backend == "eager_fusion"
    monkeypatch.setenv("CACHEBUILD_WHILE_BUILDING", "eager")
    with pytest.raises(UsageError, match="CACHEBUILD_WHILE_BUILDING='eager': choose one of"):
        interim_config(aoti, "cpu")
    monkeypatch.delenv("CACHEBUILD_WHILE_BUILDING")
    monkeypatch.setenv("CACHEBUILD_BUILD_JOBS", "1")
    assert interim_config(aoti, "cpu") is None
    # Asked for by name, on any device.
    assert interim_config(CompileConfig(while_building="eager_fusion",
                                        backend="eager_fusion"), "cpu") is None
    served = interim_config(CompileConfig(while_building="eager_fusion", flavour="aoti"), "cpu")
    assert (served.backend, served.while_building) == ("eager_fusion", "wait")
    served = interim_config(CompileConfig(while_building="standalone", flavour="aoti"),
                            "cuda:0")
    assert (served.backend, served.flavour) == ("inductor", "standalone")
    assert interim_config(CompileConfig(while_building="standalone",
                                        flavour="standalone"), "cpu") is None
    with pytest.raises(ConfigError, match="while_building"):
        CompileConfig(while_building="eager")


@pytest.mark.slow
def test_a_cold_start_serves_interim_targets_then_swaps_between_calls(tmp_path):
    # The session's AOTI build of this model, into another store, kept its C++ objects in
    # the environment folder every store shares: the background build here reuses them.
    warmed = models.aoti_store()
    env = {**os.environ, "PYTHONPATH": str(models.TESTS_DIR)}
    store = tmp_path / "store"
    served = _run(SERVER, store, env)
    assert served["error"] is None and served["swaps"] == 1, served
    calls = served["calls"]
    # Each call ran pieces of one kind only, on one runtime: the interim one, then its own.
    assert all(len(kinds) == 1 for _, kinds in calls), calls
    assert [kinds[0] for runtime, kinds in calls] == [
        "interim" if runtime == 0 else "aoti" for runtime, _ in calls], calls
    runtimes = [runtime for runtime, _ in calls]
    assert runtimes == sorted(runtimes) and runtimes[0] == 0 and runtimes[-1] == 1, calls
    # The interim runtime's graphs went with it; the new one captured its own.
    assert served["at_swap"] == [[], True]
    assert served["captured_now"] == [3, 8]
    assert sorted(served["targets"]) == sorted(warmed["target_keys"])
    assert served["first_output_s"] < served["swapped_s"]
    # Built in a worker, each phase timed; the C++ objects the session's own build of
    # these pieces compiled (into another store) were reused.
    phases = served["phases"]
    assert sorted(phases) == sorted(served["targets"])
    assert all("lowering" in p["seconds"] and "proof" in p["seconds"] for p in phases.values())
    assert sum(p["counts"].get("cxx_reused", 0) for p in phases.values()) > 0, phases
    print(f"\nfirst output {served['first_output_s']:.2f} s, swapped at "
          f"{served['swapped_s']:.2f} s, builds: " + "; ".join(
              f"{k[:8]} {p['seconds']}" for k, p in phases.items()))
    again = _run(WARM, store, env)
    assert (again["traced"], again["built"]) == (0, 0)
    assert again["targets"] == served["targets"]
    assert again["kinds"] == warmed["kinds"]


def _failing_workers(jobs, builder, setup, workers, built, pool=None):
    """Workers whose every build fails (a worker killed, say)."""
    return [(job, "the build worker was killed") for job in jobs]


def test_a_failed_background_build_keeps_serving_the_interim_targets(tmp_path, monkeypatch):
    import cachebuild
    from cachebuild.store import LocalStore

    monkeypatch.setattr("cachebuild.building.background.run_in_workers", _failing_workers)
    model = models.make(models.Decoder, layers=1)
    config = models.config(backend="inductor", flavour="aoti", while_building="eager_fusion")
    store = LocalStore(tmp_path / "store")
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    before = cachebuild.stats()
    models.assert_matches_eager(compiled, model, models.inputs(4))
    assert compiled.wait_built(timeout=60)
    assert "the build worker was killed" in compiled.swap.error
    for size in (4, 9):  # still the interim targets, still right
        models.assert_matches_eager(compiled, model, models.inputs(size))
    assert {store.get_record(k).kind for k in compiled.runtime.entry.target_keys()} == {
        "fx-graph"}
    assert models.counters_delta(before, cachebuild.stats()).get("swaps", 0) == 0
    # Nothing recorded: a later start looks for its own targets again.
    assert not any(r.kind == "entry" for r in store.records())


#: A cold start with a newcomer's defaults (``CompileConfig`` as given, no building
#: variables): a model whose forward reads a plain attribute the caller changes between
#: calls. Prints what served each call and what the process counted.
DEFAULTS = textwrap.dedent("""
    import json, sys
    import torch
    import cachebuild, models
    from cachebuild.store import LocalStore

    class Scaled(models.Decoder):
        def __init__(self):
            super().__init__(layers=1)
            self.scale = 1.0

        def forward(self, input_ids, positions):
            return super().forward(input_ids, positions) * self.scale

    model = models.make(Scaled)
    store = LocalStore(sys.argv[1])
    config = cachebuild.CompileConfig(splitting_ops=(models.ATTENTION,),
                                      compile_ranges=(models.AOTI_RANGE,))
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    kinds = []
    for size, scale in ((3, 1.0), (8, 0.5), (5, 1.0), (3, 0.5)):
        model.scale = scale
        models.assert_matches_eager(compiled, model, models.inputs(size))
        kinds.append(sorted({store.get_record(k).kind
                             for k in compiled.runtime.entry.target_keys()}))
    s = cachebuild.stats()
    print(json.dumps({"kinds": kinds, "traced": s["traced"], "built": s["built"],
                      "swaps": s["swaps"]}))
""")


@pytest.mark.slow
def test_a_newcomers_cold_start_serves_standalone_pieces_and_its_exit_keeps_its_own(tmp_path):
    # The defaults on a CPU: the first calls run standalone pieces (built in workers, the
    # same kernels as AOTInductor's), a changed attribute is another variant served the
    # same way, and a process that ends before the AOTI packages are stored waits for
    # them at its exit: the next process starts warm on them.
    env = {k: v for k, v in os.environ.items()
           if k not in ("CACHEBUILD_BUILD_JOBS", "CACHEBUILD_WHILE_BUILDING")}
    env["PYTHONPATH"] = str(models.TESTS_DIR)
    store = tmp_path / "store"
    done = subprocess.run([sys.executable, "-c", DEFAULTS, str(store)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    cold = json.loads(done.stdout.strip().splitlines()[-1])
    assert cold["traced"] == 2, cold  # one variant per value of `scale`
    assert cold["kinds"][:2] == [["standalone"], ["standalone"]], cold
    assert "serves with standalone targets while its" in done.stderr
    assert "waiting for the" in done.stderr or cold["swaps"] == 2, done.stderr[-2000:]
    again = subprocess.run([sys.executable, "-c", DEFAULTS, str(store)], capture_output=True,
                           text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    warm = json.loads(again.stdout.strip().splitlines()[-1])
    assert (warm["traced"], warm["built"], warm["swaps"]) == (0, 0, 0), warm
    assert warm["kinds"] == [["aoti-cpu"]] * 4, warm


#: Two stores in one process, a compiled model each, the defaults otherwise; on the first,
#: a value read by the trace changes between calls. Waits for the background builds, then
#: calls every variant again.
TWO_STORES = textwrap.dedent("""
    import json, sys
    import cachebuild, models
    from cachebuild.store import LocalStore

    model = models.make(models.Decoder, layers=1)
    config = cachebuild.CompileConfig(splitting_ops=(models.ATTENTION,),
                                      compile_ranges=(models.AOTI_RANGE,))
    stores = [LocalStore(sys.argv[1]), LocalStore(sys.argv[2])]
    compiled = [cachebuild.compile(model, config, {0: 0, 1: 0}, store=s) for s in stores]
    variants = ((3, 1e-5), (8, 1e-3), (5, 1e-5))  # the final norm's epsilon
    for size, eps in variants:
        model.norm.eps = eps
        models.assert_matches_eager(compiled[0], model, models.inputs(size))
    model.norm.eps = 1e-5
    models.assert_matches_eager(compiled[1], model, models.inputs(4))
    assert all(c.wait_built(timeout=600) for c in compiled)
    kinds = []
    for size, eps in variants:
        model.norm.eps = eps
        models.assert_matches_eager(compiled[0], model, models.inputs(size))
        kinds.append(sorted({stores[0].get_record(k).kind
                             for k in compiled[0].runtime.entry.target_keys()}))
    s = cachebuild.stats()
    print(json.dumps({"kinds": kinds, "swaps": s["swaps"], "traced": s["traced"]}))
""")

#: A warm start on one store: what it traced and built, and the kinds it serves.
WARM_ON = textwrap.dedent("""
    import json, sys
    import cachebuild, models
    from cachebuild.store import LocalStore

    model = models.make(models.Decoder, layers=1)
    config = cachebuild.CompileConfig(splitting_ops=(models.ATTENTION,),
                                      compile_ranges=(models.AOTI_RANGE,))
    store = LocalStore(sys.argv[1])
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(4))
    s = cachebuild.stats()
    print(json.dumps({"traced": s["traced"], "built": s["built"], "kinds": sorted(
        {store.get_record(k).kind for k in compiled.runtime.entry.target_keys()})}))
""")


def _defaults_env() -> dict[str, str]:
    """A newcomer's building settings (none), the test session's folders otherwise."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CACHEBUILD_BUILD_JOBS", "CACHEBUILD_WHILE_BUILDING")}
    env["PYTHONPATH"] = str(models.TESTS_DIR)
    return env


@pytest.mark.slow
def test_every_variant_swaps_to_its_own_targets_and_each_store_records_its_entry(tmp_path):
    env = _defaults_env()
    a, b = tmp_path / "a", tmp_path / "b"
    done = subprocess.run([sys.executable, "-c", TWO_STORES, str(a), str(b)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Both variants on the first store run on their own AOTI targets after the builds (two
    # swaps; the second store's model swaps at its next call); three traces: two
    # variants, and the second store's own.
    assert out["kinds"] == [["aoti-cpu"]] * 3, out
    assert (out["swaps"], out["traced"]) == (2, 3), out
    # The second store holds its own entry: its next process starts warm.
    again = _run(WARM_ON, b, env)
    assert (again["traced"], again["built"], again["kinds"]) == (0, 0, ["aoti-cpu"]), again


#: One model whose head carries a low-rank adapter, switched to one of another rank while
#: its first build runs (other weights: another entry), and a second compiled model of it
#: that waits (``while_building="wait"``) started meanwhile.
ADAPTERS = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    import torch
    from torch import nn
    import cachebuild, models
    from cachebuild.store import LocalStore

    class Adapted(nn.Module):
        def __init__(self, base, rank):
            super().__init__()
            self.base = base
            self.down = nn.Linear(base.in_features, rank, bias=False)
            self.up = nn.Linear(rank, base.out_features, bias=False)
            with torch.no_grad():
                self.down.weight.normal_(0, 0.2)
                self.up.weight.normal_(0, 0.2)

        def forward(self, x):
            return self.base(x) + self.up(self.down(x))

    model = models.make(models.Decoder, layers=1)
    head = model.lm_head
    adapters = {2: Adapted(head, 2).eval(), 4: Adapted(head, 4).eval()}
    config = cachebuild.CompileConfig(splitting_ops=(models.ATTENTION,),
                                      compile_ranges=(models.AOTI_RANGE,))
    store = LocalStore(sys.argv[1])
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    kind = lambda c: sorted({store.get_record(k).kind for k in c.runtime.entry.target_keys()})
    model.lm_head = adapters[2]
    models.assert_matches_eager(compiled, model, models.inputs(3))
    served = [kind(compiled)]
    # Started while rank 2's own targets build: it waits for them, it builds none again.
    other = cachebuild.compile(model, replace(config, while_building="wait"), {0: 0, 1: 0},
                               store=store)
    building = compiled.swap.running
    models.assert_matches_eager(other, model, models.inputs(4))
    joined = building and cachebuild.stats()["entries_loaded"] == 0  # loaded no entry
    waited = kind(other)
    model.lm_head = adapters[4]
    models.assert_matches_eager(compiled, model, models.inputs(5))
    served.append(kind(compiled))
    assert compiled.wait_built(timeout=600)
    # Rank 2's build is ready while rank 4 is live: each swaps at a call of its own.
    for rank, size in ((4, 5), (2, 3), (4, 6)):
        model.lm_head = adapters[rank]
        models.assert_matches_eager(compiled, model, models.inputs(size))
        served.append(kind(compiled))
    s = cachebuild.stats()
    stored = [r.kind for r in store.records(manifests=False)
              if r.kind not in ("entry", "guards")]  # the artifacts
    print(json.dumps({"served": served, "waited": waited, "joined": joined, "swaps": s["swaps"],
                      "built": s["built"], "stored": len(stored),
                      "kinds": sorted(stored)}))
""")


@pytest.mark.slow
def test_a_variant_swaps_at_its_own_call_and_a_waiting_start_joins_the_build(tmp_path):
    out = _run(ADAPTERS, tmp_path / "store", _defaults_env())
    # Standalone pieces first for rank 2; rank 4, started once rank 2's AOTI targets were
    # stored, serves those of its pieces it shares with rank 2 as they are, and standalone
    # ones for the rest; then every call on its own AOTI targets.
    assert out["served"][:2] == [["standalone"], ["aoti-cpu", "standalone"]], out
    assert out["served"][2:] == [["aoti-cpu"]] * 3, out
    assert out["waited"] == ["aoti-cpu"] and out["joined"], out
    assert out["swaps"] == 2, out
    # Every target built once: the waiting start built none of rank 2's again.
    assert out["built"] == out["stored"], out


#: A pre-fork server: a cold start, its first call, then a fork while the AOTI targets
#: build in the background. The child serves, follows the parent's build through the
#: store (the threads building are the parent's), swaps to the targets once the parent
#: has stored them, and ends without waiting for anything; the parent's build goes on.
FORKED = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import cachebuild, models
    from cachebuild.building.background import running_builds
    from cachebuild.store import LocalStore

    torch.set_num_threads(1)  # OpenMP's threads, once used, hang a forked child's kernels
    model = models.make(models.Decoder, layers=1)
    store = LocalStore(sys.argv[1])
    config = cachebuild.CompileConfig(splitting_ops=(models.ATTENTION,),
                                      compile_ranges=(models.AOTI_RANGE,))
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(4))
    building = not compiled.wait_built(0)
    child = os.fork()
    if child == 0:
        models.assert_matches_eager(compiled, model, models.inputs(5))
        followed = compiled.wait_built(450) and compiled.swap.error is None
        models.assert_matches_eager(compiled, model, models.inputs(5))
        kinds = {store.get_record(k).kind for k in compiled.runtime.entry.target_keys()}
        swapped = cachebuild.stats()["swaps"] == 1 and kinds == {"aoti-cpu"}
        assert not running_builds(store)
        time.sleep(20)  # alive after the parent's build: it must not hold it up
        # Its exit handlers run: none may wait for anything.
        sys.exit(0 if followed and swapped else 3)
    built = compiled.wait_built(400) and compiled.swap.error is None
    # The child takes the targets within its longest look at the store, and ends.
    deadline = time.monotonic() + 150
    while (ended := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    if ended[0] == 0:
        os.kill(child, 9)
    models.assert_matches_eager(compiled, model, models.inputs(6))
    print(json.dumps({"building_at_fork": building, "child_ended": ended[0] != 0,
                      "child_status": ended[1], "built": built}))
""")


@pytest.mark.slow
def test_a_child_forked_while_targets_build_serves_and_ends(tmp_path):
    # It waited forever at its exit (and a start of its own waited forever to join) for a
    # build whose threads were its parent's; then it served its interim pieces for good.
    out = _run(FORKED, tmp_path / "store", _defaults_env())
    assert out == {"building_at_fork": True, "child_ended": True, "child_status": 0,
                   "built": True}, out


@pytest.mark.slow
def test_ctrl_c_while_an_ending_process_waits_leaves_the_build_and_the_store_whole(tmp_path):
    import signal
    import time

    env = _defaults_env()
    store = tmp_path / "store"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        # Its own process group, as a terminal's foreground job: Ctrl-C reaches every
        # process in it, the build workers too.
        proc = subprocess.Popen([sys.executable, "-c", DEFAULTS, str(store)], env=env,
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + 600
        while "waiting for the" not in err.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, err.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        began = time.monotonic()
        proc.wait(timeout=120)
        ended_in = time.monotonic() - began
    said = err.read_text()
    assert "left the targets building in the background" in said, said[-3000:]
    assert "building it again" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    assert ended_in < 30, (ended_in, said[-2000:])  # not after the builds
    verified = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir", str(store),
                               "verify"], capture_output=True, text=True, env=env, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # The next start builds what is missing and answers right.
    again = subprocess.run([sys.executable, "-c", DEFAULTS, str(store)], capture_output=True,
                           text=True, timeout=900, env=env)
    assert again.returncode == 0, again.stderr[-3000:]


ONE_MISSING = textwrap.dedent("""
    import json, sys
    import cachebuild, models
    from cachebuild.store import LocalStore

    model = models.make(models.Decoder, layers=2)
    store = LocalStore(sys.argv[1])
    compiled = cachebuild.compile(model, models.aoti_config(), {0: 0, 1: 0}, store=store)
    kind = lambda: sorted({store.get_record(k).kind for k in compiled.runtime.entry.target_keys()})
    models.assert_matches_eager(compiled, model, models.inputs(5))
    first = kind()
    built_first = cachebuild.stats()["built"]
    assert compiled.wait_built(timeout=600)
    models.assert_matches_eager(compiled, model, models.inputs(6))
    print(json.dumps({"first": first, "built_first": built_first, "then": kind(),
                      "traced": cachebuild.stats()["traced"]}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 2])
def test_a_start_missing_some_targets_serves_the_others_as_stored(tmp_path, lost):
    """A warmed store that lost targets (gc evicted them). One of three: the start builds
    it and waits (an interim piece for it, and loading that, cost as much). Two of three:
    it builds interim pieces for those alone and serves its stored AOTI target as it is
    meanwhile (it built an interim piece for every target)."""
    import shutil

    from cachebuild.store import LocalStore

    warmed = models.aoti_store()
    assert len(warmed["target_keys"]) == 3
    store = tmp_path / "store"
    shutil.copytree(warmed["path"], store)
    with LocalStore(store) as opened:
        for key in warmed["target_keys"][:lost]:
            assert opened.delete(key)
    out = _run(ONE_MISSING, store, _defaults_env())
    if lost == 1:
        assert out["first"] == ["aoti-cpu"] and out["built_first"] == 1, out
    else:
        assert out["first"] == ["aoti-cpu", "standalone"], out
        assert out["built_first"] == lost, out  # the interim pieces, before the first output
    assert out["then"] == ["aoti-cpu"] and out["traced"] == 0, out


def test_a_target_removed_before_it_was_loaded_is_built_again_in_the_background(monkeypatch):
    """A `cachebuild gc` between a background build storing a target and loading it: the
    build failed ("built but cannot be loaded back") and the model served its interim
    pieces for the rest of its life; the target is built again, as a start that waits
    for its builds does."""
    import types

    from cachebuild import process_state
    from cachebuild.building import background

    built: list[list[str]] = []
    gone = {"a"}  # evicted once, right after its first build

    def run_in_workers(jobs, builder, setup, workers, on_built):
        built.append([j.target.key for j in jobs])
        return []

    def load(key, job):
        if key in gone:
            gone.discard(key)
            return None
        return f"loaded {key}"

    jobs = {k: types.SimpleNamespace(target=types.SimpleNamespace(key=k)) for k in ("a", "b")}
    monkeypatch.setattr(background, "run_in_workers", run_in_workers)
    monkeypatch.setattr(background, "jobs_of", lambda entry, config: jobs)
    builder = types.SimpleNamespace(store=types.SimpleNamespace(reopen_options=lambda: None),
                                    load=load, config=None)
    with process_state.fresh():
        b = background.BackgroundBuild(types.SimpleNamespace(key="e"), builder,
                                       list(jobs.values()), 1, None, record=False)
        assert b.wait(30) and b.error is None, b.error
        assert built == [["a", "b"], ["a"]]
        assert b.claim(object()) == {"a": "loaded a", "b": "loaded b"}
        # Removed every time: the build fails, saying why.
        monkeypatch.setattr(builder, "load", lambda key, job: None if key == "a" else "x")
        b = background.BackgroundBuild(types.SimpleNamespace(key="e"), builder,
                                       list(jobs.values()), 1, None, record=False)
        assert b.wait(30) and "removed from the store before they were loaded" in b.error


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("parent", ["stores", "fails"])
def test_a_forked_child_follows_its_parents_build_to_its_end(monkeypatch, tmp_path, parent):
    """A child forked while its parent builds in the background takes the targets once
    the parent stored them, and, where the parent's build failed (it lives on, serving
    its interim pieces), stops following at once, rather than waiting for ever."""
    import threading
    import time
    import types

    from cachebuild import process_state
    from cachebuild.building import background

    go = threading.Event()

    def run_in_workers(jobs, builder, setup, workers, on_built):
        go.wait(60)
        if parent == "fails":
            return [(jobs[0], "the compiler said no")]
        for j in jobs:
            (tmp_path / j.target.key).touch()  # stored: a store both processes see
        return []

    jobs = {k: types.SimpleNamespace(target=types.SimpleNamespace(key=k)) for k in ("a", "b")}
    monkeypatch.setattr(background, "run_in_workers", run_in_workers)
    monkeypatch.setattr(background, "jobs_of", lambda entry, config: jobs)
    monkeypatch.setattr(background, "FOLLOW_POLL_S", (0.05, 0.2))
    store = types.SimpleNamespace(
        reopen_options=lambda: None,
        get_record=lambda k: object() if (tmp_path / k).exists() else None)
    builder = types.SimpleNamespace(store=store, load=lambda key, job: f"loaded {key}",
                                    config=None)
    with process_state.fresh():
        b = background.BackgroundBuild(types.SimpleNamespace(key="e"), builder,
                                       list(jobs.values()), 1, None, record=False)
        child = os.fork()
        if child == 0:  # the child, as a pre-fork server's worker: it follows at once
            ended = b.wait(30)
            if parent == "stores":
                ok = ended and b.error is None and b.claim(object()) == {
                    "a": "loaded a", "b": "loaded b"}
            else:
                ok = ended and "stopped building them" in (b.error or "")
            os._exit(0 if ok else 3)
        time.sleep(0.5)  # the child follows while the parent still builds
        go.set()
        _, status = os.waitpid(child, 0)
        assert b.wait(30)
        assert os.waitstatus_to_exitcode(status) == 0
