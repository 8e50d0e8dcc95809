"""The AOTI toolchain: the probe picks a C++ compiler whose libraries load, refusing one
that builds libraries that crash on load; builds may begin with the compiler it presumes,
and nothing built with one it then refuses is used; the chosen compiler is a target-key
factor; an explicit ``aoti`` flavour with no working compiler is refused at plan time; a
build that fails for want of disk space fails, and never changes the flavour."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import models
import pytest

from cachebuild.backends import probe
from cachebuild.building.planner import Planner
from cachebuild.errors import ConfigError
from cachebuild.keys import diff_manifests
from cachebuild.tracing.trace import trace_model

DYN = {0: 0, 1: 0}

#: A constructor that kills the process with SIGSEGV as the library loads.
BOOM_C = "#include <signal.h>\n__attribute__((constructor)) static void boom(void) { raise(SIGSEGV); }\n"

#: A compiler wrapper: the system g++, plus the object above in every shared library it links
#: but the probe's small library (``check.cpp``): a compiler whose libraries load beside
#: torch and then crash inside AOTI's loader, the worst case, known only when a package
#: built with it loads.
WRAPPER = """#!/bin/sh
case "$*" in *check.cpp*) exec {gxx} "$@";; esac
for a in "$@"; do
  if [ "$a" = "-shared" ]; then exec {gxx} "$@" {boom}; fi
done
exec {gxx} "$@"
"""


def crashing_compiler(folder: Path) -> Path:
    gxx = probe.candidate_compilers()[0]
    (folder / "boom.c").write_text(BOOM_C)
    subprocess.run(["gcc", "-c", "-fPIC", "-o", str(folder / "boom.o"), str(folder / "boom.c")],
                   check=True)
    wrapper = folder / "crashing-g++"
    wrapper.write_text(WRAPPER.format(gxx=gxx, boom=folder / "boom.o"))
    wrapper.chmod(0o755)
    return wrapper


#: A cold start in a fresh process: one piece in two buckets, so two targets that build in
#: two worker processes; each compared with eager.
COLD_START = """
import json
import torch
import cachebuild
from cachebuild.backends import probe
from cachebuild.store import LocalStore

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        return torch.relu(self.lin(x)) * 2.0 + 1

torch.manual_seed(0)
model = Tiny().eval()
# The cold start waits for its own builds (the subject here), as it would on a GPU.
config = cachebuild.CompileConfig(splitting_ops=(), compile_ranges=((1, 4), (5, 16)),
                                  while_building="wait")
compiled = cachebuild.compile(model, config, {0: 0}, store=LocalStore(STORE))
equal = True
with torch.no_grad():
    for n in (3, 9):
        x = torch.randn(n, 8)
        equal &= bool(torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5))
v = probe.verdict("cpu")
print(json.dumps({"equal": equal, "candidates": probe.candidate_compilers(),
                  "verdict": v.to_json(), "line": v.describe(), "stats": cachebuild.stats()}))
"""


def cold_start(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str],
                                                              dict]:
    """``COLD_START`` in a fresh process with ``env``, a new probe folder (``probe``) and
    store under ``tmp_path`` and two build workers: the process and what it printed."""
    env = env | {"CACHEBUILD_PROBE_DIR": str(tmp_path / "probe"), "CACHEBUILD_BUILD_JOBS": "2"}
    code = COLD_START.replace("STORE", repr(str(tmp_path / "store")))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_compiler_presumed_and_then_refused_is_never_used_and_the_start_plans_again(tmp_path,
                                                                                       monkeypatch):
    """The builds of a first cold start begin with the compiler the probe presumes (its
    small library loaded) while the probe still builds its package; the package crashes
    on load, so the verdict refuses it: the start plans again with the verdict's compiler,
    and answers right."""
    if not probe.candidate_compilers():
        pytest.skip("no C++ compiler here")
    bad = crashing_compiler(tmp_path)
    # A fresh process with CXX set to the wrapper, as an image might set it.
    proc, out = cold_start(tmp_path, {**os.environ, "CXX": str(bad)})
    assert out["equal"], out
    assert out["candidates"][0] == str(bad)  # $CXX is tried first
    verdict = probe.Verdict.from_json(out["verdict"])
    assert verdict.compiler is not None and verdict.compiler.path != str(bad)
    assert verdict.refused[0][0] == str(bad)
    assert "crashed on load (SIGSEGV)" in verdict.refused[0][1]
    assert "refused" in out["line"] and str(bad) in out["line"]
    # The wrapper was presumed (its workers died loading what it built), then refused.
    assert f"builds began with {bad}" in proc.stderr and "planning Tiny again" in proc.stderr
    assert out["stats"]["traced"] == 2, out["stats"]
    # The chosen compiler's build recorded the CPU's vector ISAs beside the verdict (for
    # every later build in any store sharing the folder to take).
    from cachebuild import compat

    records = [json.loads(p.read_text()) for p in (tmp_path / "probe").glob("vec_isa-*.json")]
    assert any(r and compat.vec_isas_from_record(r) for r in records), records
    # The verdict is cached per environment: the wrapper is not built with again.
    monkeypatch.setenv("CACHEBUILD_PROBE_DIR", str(tmp_path / "probe"))
    cached = probe.cached_verdicts()
    assert [v.to_json() for v in cached] == [verdict.to_json()]


@pytest.mark.slow
def test_a_first_cold_starts_builds_prove_the_compiler_and_the_probe_builds_no_package(tmp_path):
    """On a CPU the probe's child checks its compiler's small library and the vector ISAs
    and then waits: the first cold start's builds, proven in their workers, are the
    verdict, and the child builds no package of its own. Answers match eager; the verdict
    is kept for the next process."""
    candidates = probe.candidate_compilers()
    if not candidates:
        pytest.skip("no C++ compiler here")
    folder = tmp_path / "probe"
    proc, out = cold_start(tmp_path, {k: v for k, v in os.environ.items() if k != "CXX"})
    assert out["equal"], out
    assert out["stats"]["traced"] == 1 and out["stats"]["built"] == 2, out["stats"]
    verdict = probe.Verdict.from_json(out["verdict"])
    assert verdict.compiler is not None
    assert os.path.realpath(verdict.compiler.path) == os.path.realpath(out["candidates"][0])
    assert probe.PROVEN_BY_BUILD in proc.stderr, proc.stderr[-3000:]
    assert [v.to_json() for v in probe.cached_verdicts(folder)] == [verdict.to_json()]
    # The builds precompiled the package's two headers, side by side, into the folder; the
    # one beside the wrapper's is the one Inductor then asked for (no third).
    assert len(list((folder / "headers").glob("*.gch"))) == 2


@pytest.mark.slow
def test_a_probe_waiting_for_a_proof_that_never_comes_still_reaches_a_verdict(tmp_path,
                                                                             monkeypatch):
    """A process whose builds never come (its trace failed) must not hold the verdict, and
    its lock, forever: the waiting child builds its own package after a while."""
    candidates = probe.candidate_compilers()
    if not candidates:
        pytest.skip("no C++ compiler here")
    monkeypatch.setattr(probe, "PROOF_PATIENCE_S", 0.5)
    running = probe._Inflight()
    found = probe._probe_all("cpu", candidates[:1], records=tmp_path, running=running)
    assert found.compiler is not None and found.compiler.path == candidates[0], found
    assert running.guess.done() and running.guess.result().compiler == found.compiler
    assert not running.wanted and not running.proven  # nobody asked, nothing proved it
    assert not (tmp_path / "headers").exists()  # a waiting child precompiles none


#: A process whose probe waits for a build's proof that never comes (as in a start whose
#: trace failed): it starts the probe, waits until its child has done its checks (or,
#: with "verdict", until another process made the verdict file), and ends.
HOLDER = """
import atexit, sys, time, weakref
from pathlib import Path

class Kept:
    pass

KEPT = Kept()
weakref.finalize(KEPT, print)  # weakref's exit hook (temporary folders) first, as torch's
atexit.register(time.sleep, 1.0)  # more of the process's own ending, after the probe's
from cachebuild.backends import probe

folder, until = Path(sys.argv[1]), sys.argv[2]
probe.PROOF_PATIENCE_S = 3600.0  # only another process's wish decides it
probe.start("cpu", folder)
for _ in range(6000):
    time.sleep(0.1)
    if until == "checked" and list(folder.glob("vec_isa-*.json")):
        time.sleep(0.5)
        break
    if until == "verdict" and list(folder.glob("aoti-cpu-*.json")):
        break
print("ending", flush=True)
"""


def _probing_in(folder: Path) -> dict[str, str]:
    """This process's environment, its probe folder ``folder`` (not the session's)."""
    return {**os.environ, "CACHEBUILD_PROBE_DIR": str(folder)}


@pytest.mark.slow
def test_a_process_ending_while_its_probe_waits_keeps_no_verdict(tmp_path):
    """Its child killed at the exit is no verdict on the compiler: none is kept, and the
    next process probes again (before, a kill could be kept as "crashed")."""
    if not probe.candidate_compilers():
        pytest.skip("no C++ compiler here")
    folder = tmp_path / "probe"
    proc = subprocess.run([sys.executable, "-c", HOLDER, str(folder), "checked"],
                          capture_output=True, text=True, timeout=600, env=_probing_in(folder))
    assert proc.returncode == 0 and "ending" in proc.stdout, proc.stderr[-3000:]
    assert list(folder.glob("vec_isa-*.json")), "the child never did its checks"
    assert not list(folder.glob("aoti-cpu-*.json")), [p.read_text() for p in
                                                      folder.glob("aoti-cpu-*.json")]


@pytest.mark.slow
def test_another_process_waiting_for_the_verdict_has_it_decided_at_once(tmp_path):
    """A process (a replica, another rank) that wants the verdict while a first one's
    probe waits for its builds' proof asks that one to decide: its child builds its
    package, and both go on (without the ask this waits for an hour)."""
    if not probe.candidate_compilers():
        pytest.skip("no C++ compiler here")
    folder = tmp_path / "probe"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), "verdict"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_probing_in(folder))
    try:
        for _ in range(3000):  # the holder's child has done its checks: it holds the lock
            if list(folder.glob("vec_isa-*.json")):
                break
            time.sleep(0.1)
        waiter = subprocess.run(
            [sys.executable, "-c", "import sys; from pathlib import Path; "
             "from cachebuild.backends import probe; "
             "print(probe.verdict('cpu', Path(sys.argv[1])).describe())", str(folder)],
            capture_output=True, text=True, timeout=600, env=_probing_in(folder))
        out, err = holder.communicate(timeout=600)
    finally:
        holder.kill()
    assert waiter.returncode == 0, waiter.stderr[-3000:]
    assert "AOTInductor (cpu): " in waiter.stdout and "no compiler" not in waiter.stdout
    assert "ending" in out, err[-3000:]
    assert not list(folder.glob("*.wanted"))  # the ask is gone with the verdict


def test_a_builds_proof_reaches_only_a_cpu_probe(monkeypatch):
    """On a GPU the probe's package is also captured in a CUDA graph, which a build does
    not do: a CUDA build proves nothing to it. A CPU probe in flight takes the proof, by
    the compiler's real path."""
    cpu, cuda = probe._Inflight(), probe._Inflight()
    monkeypatch.setattr(probe, "_inflight", {"cpu|": cpu, "cuda|": cuda})
    gxx = probe.candidate_compilers()[0] if probe.candidate_compilers() else "/usr/bin/g++"
    probe.proven("cuda:0", gxx)
    assert cpu.news() == (set(), False) and cuda.news() == (set(), False)
    probe.proven("cpu", gxx)
    assert cpu.news() == ({os.path.realpath(gxx)}, False) and cuda.news() == (set(), False)


def test_the_presumption_is_the_first_candidate_whose_library_loaded(tmp_path):
    versions = {"a": "1", "b": "1", "c": None}  # c does not run
    running = {name: (None, tmp_path / name, None) for name in "ab"}  # a child's stdout
    for _, out, _ in running.values():
        out.write_text("")

    def presume(results=None):
        return probe._presumption(["c", "a", "b"], versions, results or {}, running)

    assert presume() is None  # a, first to run, has said nothing yet
    running["b"][1].write_text("library\n")
    assert presume() is None  # b loaded its library, but a comes first
    running["a"][1].write_text("library\n")
    assert presume() == "a"
    assert presume({"a": (False, "crashed on load (SIGSEGV)")}) == "b"
    assert presume({"a": (False, "x"), "b": (False, "y")}) == ""  # none: standalone


def test_a_library_that_crashes_on_load_is_named_in_the_refusal(tmp_path):
    class Crashed:
        returncode = -11

    (tmp_path / "out").write_text("")
    (tmp_path / "err").write_text("")
    ok, why = probe._outcome(Crashed(), tmp_path / "out", tmp_path / "err")
    assert not ok and why == "crashed on load (SIGSEGV) of a small C++ library built with it"
    (tmp_path / "out").write_text("library\nbuilt\n")
    assert probe._outcome(Crashed(), tmp_path / "out", tmp_path / "err")[1] == \
        "crashed on load (SIGSEGV)"


def test_confirm_waits_for_the_verdict_and_refuses_what_it_did_not_choose(monkeypatch):
    """``presumed`` answers while the probe runs; ``confirm`` waits for the verdict: at
    once where nothing was presumed, silently where it agrees, ToolchainRefuted where
    not, to every caller until the refutation is forgotten (the caller plans again)."""
    import threading

    from cachebuild.errors import ToolchainRefuted

    monkeypatch.setattr(probe, "_PRESUMED", {})
    monkeypatch.setattr(probe, "_inflight", {})
    gxx = probe.Compiler("/usr/bin/g++", "g++ (Test) 12.2.0", "x")
    other = probe.Compiler("/usr/bin/c++", "c++ (Test) 12.2.0", "y")
    for final, refused in ((gxx, False), (other, True)):
        release = threading.Event()

        def found(device, folder, running=None, final=final, release=release):
            if running is not None:  # the probe thread: presumes, then takes its time
                running.presume(probe.Verdict("cpu", gxx))
                release.wait(30)
            return probe.Verdict("cpu", final)

        monkeypatch.setattr(probe, "_verdict", found)
        probe.confirm("cpu")  # nothing presumed: at once
        probe.start("cpu:test")
        assert probe.presumed("cpu:test").compiler == gxx
        outcome: list[BaseException | None] = []

        def confirming(outcome=outcome):
            try:
                probe.confirm("cpu:test")
                outcome.append(None)
            except ToolchainRefuted as e:
                outcome.append(e)

        waiter = threading.Thread(target=confirming)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not outcome  # waits for the verdict
        release.set()
        waiter.join(30)
        if not refused:
            assert outcome == [None]
            probe.confirm("cpu:test")  # confirmed: nothing presumed now
            continue
        assert isinstance(outcome[0], ToolchainRefuted)
        assert "builds began with /usr/bin/g++" in str(outcome[0])
        assert outcome[0].device == "cpu:test"
        with pytest.raises(ToolchainRefuted):  # another caller is refused too
            probe.confirm("cpu")
        probe.forget_refuted("cpu:test")
        probe.confirm("cpu:test")  # planned again with the verdict: nothing presumed


def _plant(folder: Path, compiler: probe.Compiler | None, refused=()) -> None:
    """Write the verdict the probe would cache for this environment (no child runs), with
    the hash of the compiler's file as it is now."""
    if compiler is not None and not compiler.sha256:
        compiler = dataclasses.replace(compiler, sha256=probe.content_hash(compiler.path))
    candidates = probe.candidate_compilers()
    fingerprint = probe._fingerprint("cpu", candidates)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    verdict = probe.Verdict("cpu", compiler, list(refused))
    (folder / f"aoti-cpu-{fingerprint}.json").write_text(json.dumps(verdict.to_json()))
    probe._VERDICTS.clear()


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A probe folder of this test's own, and the in-process verdicts forgotten after."""
    folder = tmp_path / "probe"
    monkeypatch.setenv("CACHEBUILD_PROBE_DIR", str(folder))
    yield folder
    probe._VERDICTS.clear()


def _plan(config):
    model = models.make(models.Decoder, layers=1)
    traced = trace_model(model, models.inputs(8), DYN)
    planner = Planner(model, config, DYN, store=None)
    _, factors = planner.entry_key(models.inputs(8))
    return planner, planner.plan(traced, factors)


def test_the_chosen_compiler_is_a_target_key_factor_and_not_an_entry_factor(planted):
    config = models.config(backend="inductor", flavour="auto")
    _plant(planted, probe.Compiler("/usr/bin/g++", "g++ (Test) 12.2.0"))
    planner_a, a = _plan(config)
    _plant(planted, probe.Compiler("/usr/bin/g++", "g++ (Test) 13.1.0"))
    planner_b, b = _plan(config)
    keys_a = [t.key for t in a.targets()]
    keys_b = [t.key for t in b.targets()]
    assert keys_a and all(x != y for x, y in zip(keys_a, keys_b, strict=True))
    paths = {d.path for d in diff_manifests(a.targets()[0].manifest, b.targets()[0].manifest)}
    assert paths == {"backend.toolchain.cxx_version"}
    # The entry key is computed without the probe, so a warm start never waits for one.
    assert planner_a.entry_key(models.inputs(8))[0] == planner_b.entry_key(models.inputs(8))[0]


def test_explicit_aoti_without_a_working_compiler_is_refused_at_plan(planted):
    _plant(planted, None, [("/opt/x/g++", "crashed on load (SIGSEGV)")])
    with pytest.raises(ConfigError, match=r"flavour 'aoti'.*crashed on load \(SIGSEGV\)"):
        _plan(models.config(backend="inductor", flavour="aoti"))
    # auto plans standalone builds instead, and says so in the key.
    _, entry = _plan(models.config(backend="inductor", flavour="auto"))
    assert entry.targets()[0].manifest["backend"]["toolchain"]["aoti"] is False


FULL_DISK_CHILD = """
import json, os
import cachebuild, models
from cachebuild.errors import BuildError
from cachebuild.store import LocalStore

store = LocalStore(os.environ["STORE"], work_dir=os.environ["WORK"])
model = models.make(models.Decoder, layers=1)
# Waiting for its own targets: the interim standalone pieces a cold CPU start serves
# with meanwhile build on the same full disk, and one may fit (it is then stored, as a
# piece to serve with, not in the AOTI target's place).
compiled = cachebuild.compile(model, models.config(backend="inductor", flavour="auto",
                                                   compile_ranges=((1, 16),),
                                                   while_building="wait"),
                              {0: 0, 1: 0}, store=store)
import traceback
try:
    compiled(*models.inputs(4))
    error, stages = None, []
except BuildError as e:
    error = str(e)
    stages = [f.name for f in traceback.extract_tb(e.__cause__.__traceback__)]
print(json.dumps({"error": error, "stages": stages, "stats": cachebuild.stats(),
                  "kinds": sorted({r.kind for r in store.records()})}))
"""


@pytest.mark.slow
def test_a_full_disk_fails_the_build_and_never_changes_the_flavour(tmp_path, tiny_fs):
    """The store's build work folder (where Inductor's cache and the temp files of a build
    go) on a 1 MiB tmpfs: the AOTI build runs out of space. The build fails; no standalone
    artifact takes its place."""
    assert probe.verdict("cpu").aoti  # probed now (on a disk with room), cached for the child
    out = models.run_python(FULL_DISK_CHILD, env={
        "STORE": str(tmp_path / "store"), "WORK": str(tiny_fs / "work")})
    assert out["error"] is not None and "failed to compile" in out["error"], out
    # gcc says ENOSPC, or that it could not write its output (a file it made vanished).
    assert ("No space left on device: the machine ran short" in out["error"]
            or "when writing output to: the machine ran short" in out["error"]), out
    # The AOTI build's own error: no standalone build was tried in its place.
    assert "_compile_aoti" in out["stages"] and "_compile_standalone" not in out["stages"]
    assert out["kinds"] == [], out
    assert out["stats"]["fallbacks"] == 0


def test_transient_errors_are_the_machines_not_the_pieces():
    import errno
    import subprocess as sp

    from cachebuild.errors import transient

    assert transient(OSError(errno.ENOSPC, "No space left on device"))
    assert transient(MemoryError())
    import torch

    assert transient(torch.OutOfMemoryError("CUDA out of memory")) == "out of memory"
    assert transient(RuntimeError("C++ compile error: ... No space left on device"))
    assert transient(sp.CalledProcessError(-9, ["g++"]))  # the compiler was killed
    # ... or the compiler the driver ran (the driver exits 1): gcc's and clang's words
    from torch._inductor.exc import CppCompileError

    for said in ("g++: fatal error: Killed signal terminated program cc1plus",
                 "clang++: error: clang frontend command failed due to signal (use -v)"):
        try:
            try:
                raise sp.CalledProcessError(1, ["g++"], output=said.encode())
            except sp.CalledProcessError as e:
                raise CppCompileError(["g++"], said) from e
        except CppCompileError as killed:
            assert transient(killed) == "the compiler was killed"
    # The compiler driver killed, as Inductor raises it: its CppCompileError wrapped in an
    # InductorError ``from None``.
    from torch._inductor.exc import InductorError

    try:
        try:
            raise sp.CalledProcessError(-9, ["g++"], output=b"")
        except sp.CalledProcessError as e:
            raise CppCompileError(["g++"], "") from e
    except CppCompileError as inner:
        assert transient(InductorError(inner, None)) == "the compiler was killed"
    try:
        try:
            raise OSError(errno.ENOSPC, "disk full")
        except OSError as e:
            raise RuntimeError("lowering failed") from e
    except RuntimeError as wrapped:
        assert transient(wrapped)  # caused by a full disk
    assert not transient(ValueError("AOTInductor pieces take tensors only"))
    assert not transient(sp.CalledProcessError(1, ["g++"]))  # the code did not compile
    try:
        try:
            raise OSError(errno.ENOENT, "could not get source code")
        except OSError:
            raise RuntimeError("unsupported operator") from None
    except RuntimeError as unrelated:
        assert not transient(unrelated)  # an OSError met and handled on the way is not it
    # A file size limit (ulimit -f), and gcc unable to write its output (a disk that filled
    # mid-file): the machine's, never a reason to build a standalone artifact instead.
    assert transient(OSError(errno.EFBIG, "File too large"))
    for said in ("g++: internal compiler error: File size limit exceeded signal terminated "
                 "program as",
                 "fatal error: when writing output to /w/header.i: No such file or directory"):
        assert transient(CppCompileError(["g++"], said)), said


def test_a_failed_aoti_build_on_a_nearly_full_disk_is_the_disks_fault(monkeypatch, tmp_path):
    """A compiler that ran out of room mid-file says anything (a truncated file's syntax
    error): with little room left where the compilers write, a failed AOTInductor build
    fails as the machine's fault rather than falling back to a standalone artifact."""
    import errno
    import shutil
    from collections import namedtuple

    from torch._inductor.exc import CppCompileError

    from cachebuild.backends import inductor
    from cachebuild.errors import transient, transient_advice

    usage = namedtuple("usage", "total used free")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * 2**30, 10 * 2**30, 2**20))
    with pytest.raises(OSError) as short:
        inductor._check_room(CppCompileError(["g++"], "expected ';' before '}' token"))
    assert short.value.errno == errno.ENOSPC and "1 MiB free" in str(short.value)
    inductor._check_room(ValueError("AOTInductor pieces take tensors only"))  # wrote nothing
    assert "free some" in transient_advice(transient(short.value))
    assert "read-only" in transient_advice(transient(OSError(errno.EROFS, "Read-only file system")))
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * 2**30, 0, 10 * 2**30))
    inductor._check_room(CppCompileError(["g++"], "an error"))  # room: the piece's


def test_stats_says_which_compiler_builds_here_and_why_others_were_refused(planted, tmp_path,
                                                                         monkeypatch):
    from click.testing import CliRunner

    from cachebuild.cli import main as cli
    from cachebuild.store import LocalStore

    _plant(planted, probe.Compiler("/usr/bin/g++", "g++ (Test) 12.2.0"),
           [("/opt/wrapped/g++", "crashed on load (SIGSEGV)")])
    LocalStore(tmp_path / "store").close()
    # No environment folder of the user's own (an earlier run's, in ~/.cache) is listed.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = CliRunner().invoke(cli.main, ["--cache-dir", str(tmp_path / "store"), "stats"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "toolchain (cpu) /usr/bin/g++ (g++ (Test) 12.2.0); refused /opt/wrapped/g++: " \
           "crashed on load (SIGSEGV)" in text
    result = CliRunner().invoke(cli.main, ["--cache-dir", str(tmp_path / "store"), "stats",
                                           "--json"])
    (toolchain,) = json.loads(result.output)["toolchains"]
    assert toolchain["compiler"]["path"] == "/usr/bin/g++" and toolchain["refused"]
    # What the environment keeps (verdicts, ISA checks, precompiled headers) is counted.
    parts = json.loads(result.output)["disk"]["parts"]
    (environment,) = [p for p in parts if p["what"] == "environment"]
    assert environment["path"] == str(planted) and environment["bytes"] > 0
    assert "environment" in text and str(planted) in text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_the_probe_runs_neither_waits_for_it_nor_stops_its_children():
    """The probe's thread and its children are the parent's: a forked child waited
    forever for that thread's verdict (a pre-fork server's child taking its parent's
    targets), and at its exit killed the parent's probe children, whose deaths the parent
    read as crashes of their compilers."""
    import threading

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    key = probe._inflight_key("cpu", None)
    with probe._inflight_lock:
        probe._inflight[key] = probe._Inflight()
    probe._children.add(sleeper)
    # The probe's lock held by another thread across the fork, as the probe's thread holds
    # it a moment at a time: that thread is not in the child to let it go.
    held, fork_done = threading.Event(), threading.Event()

    def hold() -> None:
        with probe._inflight_lock:
            held.set()
            fork_done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        child = os.fork()
        if child == 0:
            ok = not probe._inflight and not probe._children and probe._inflight_lock.acquire(
                timeout=5)
            probe._stop_children()  # as the child's exit runs it
            os._exit(0 if ok else 3)
        fork_done.set()
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sleeper.poll() is None  # the parent's probe child lives
        assert key in probe._inflight and sleeper in probe._children  # the parent's own
    finally:
        fork_done.set()
        holder.join()
        with probe._inflight_lock:
            probe._inflight.pop(key, None)
        probe._children.discard(sleeper)
        sleeper.kill()
        sleeper.wait()


def test_a_probe_child_short_of_the_machine_decides_nothing(tmp_path):
    """A candidate whose check failed for the machine's sake (a file size limit, a full
    disk) is not refused for good: it is undecided, and a probe whose verdict depends on it
    fails as the machine's fault (never remembered as the model's), its verdict
    unwritten."""
    import types

    from cachebuild.errors import MachineShort, transient

    out, err = tmp_path / "stdout", tmp_path / "stderr"
    out.write_text("short File size limit exceeded\n")
    err.write_text("")
    passed, why = probe._outcome(types.SimpleNamespace(returncode=probe.SHORT_EXIT), out, err)
    assert not passed and why == probe.SHORT + "File size limit exceeded"
    out.write_text("")  # a compiler that fails by itself is refused, as ever
    passed, why = probe._outcome(types.SimpleNamespace(returncode=1), out, err)
    assert not passed and why.startswith("exit 1")
    short = MachineShort("the probe could not decide", "File size limit exceeded")
    assert transient(short) == "File size limit exceeded"
