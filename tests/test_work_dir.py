"""What a build writes lives where the operator looks: compilers' working files go to the
store's ``work/`` folder (or ``CACHEBUILD_WORK_DIR``) while a target builds, and the
caller's environment is put back after; ``stats`` counts them and ``gc`` empties the folder
when no build holds it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import models
import pytest

import cachebuild
from cachebuild.backends.kernel_dir import build_work_dir, environment_dir
from cachebuild.store import StoreOptions, WorkUsage, open_store

NAMES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR")


def test_a_build_points_the_compilers_at_the_work_folder_and_back(open_local, tmp_path):
    import torch._inductor.codecache as codecache

    store = open_local(tmp_path / "store")
    env_before = {n: os.environ.get(n) for n in NAMES}
    tempdir_before, headers_before = tempfile.tempdir, codecache._HEADER_DIR
    with build_work_dir(store) as work:
        assert work == store.root / "work"
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(work / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(work / "triton")
        assert tempfile.gettempdir() == str(work / "tmp")
        # Precompiled headers are the environment's (its probe folder's), not the store's.
        assert codecache._HEADER_DIR == str(environment_dir() / "headers")
        (work / "inductor" / "kernel.so").write_bytes(b"x" * 1000)
    assert {n: os.environ.get(n) for n in NAMES} == env_before
    assert tempfile.tempdir == tempdir_before and codecache._HEADER_DIR == headers_before
    work = store.stats().work
    assert work == WorkUsage(path=str(store.root / "work"), bytes=1000, files=1)


def test_a_load_on_another_thread_waits_for_a_build_and_a_build_for_it(open_local, tmp_path):
    """A build in this process and a load on another thread never see each other's
    folders in the environment: whichever comes second waits; the build's own load nests."""
    import threading

    from cachebuild.backends.kernel_dir import private_cache_dir

    store = open_local(tmp_path / "store")
    seen: dict[str, str | None] = {}
    loaded = threading.Event()

    def load() -> None:
        with private_cache_dir(store) as root:
            seen["load"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
            seen["root"] = str(root)
        loaded.set()

    with build_work_dir(store) as work:
        with private_cache_dir(store) as root:  # the build's proof: nested, not waiting
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(work / "inductor")
        other = threading.Thread(target=load)
        other.start()
        assert not loaded.wait(0.5)  # held back while the build has the environment
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(work / "inductor")
    other.join(60)
    assert loaded.is_set() and seen["load"] == seen["root"]

    release, inside = threading.Event(), threading.Event()

    def long_load() -> None:
        with private_cache_dir(store):
            inside.set()
            release.wait(60)

    other = threading.Thread(target=long_load)
    other.start()
    assert inside.wait(60)
    done = threading.Event()

    def build() -> None:
        with build_work_dir(store) as work:
            seen["build"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
            seen["work"] = str(work / "inductor")
        done.set()

    builder = threading.Thread(target=build)
    builder.start()
    assert not done.wait(0.5)  # a build waits for the other thread's load
    release.set()
    other.join(60)
    builder.join(60)
    assert done.is_set() and seen["build"] == seen["work"]


def test_compiling_leaves_the_environment_as_it_was(open_local, tmp_path):
    before = dict(os.environ), tempfile.tempdir
    model = models.make(models.LayerStack, layers=1)
    compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                                  store=open_local(tmp_path / "store"))
    models.assert_matches_eager(compiled, model, models.hidden_inputs(4))
    assert (dict(os.environ), tempfile.tempdir) == before


HOLD = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # what a running build holds
    print("held", flush=True)
    sys.stdin.read()
""")


def test_gc_empties_the_work_folder_unless_a_build_runs(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    with build_work_dir(store) as work:
        (work / "tmp" / "pch.gch").write_bytes(b"y" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(work / ".builds")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        report = store.gc()
        assert report.work_busy and report.work_bytes == 0
        assert (work / "tmp" / "pch.gch").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    dry = store.gc(dry_run=True)
    assert dry.work_bytes == 4096 and (work / "tmp" / "pch.gch").exists()
    report = store.gc()
    assert report.work_bytes == 4096 and not report.work_busy
    assert store.stats().work.bytes == 0 and list(work.iterdir()) == [work / ".builds"]


def test_the_operator_names_the_work_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_WORK_DIR", str(tmp_path / "scratch-disk"))
    store = open_store(StoreOptions.from_env(cache_dir=tmp_path / "store"))
    assert store.work_dir == tmp_path / "scratch-disk"
    with build_work_dir(store) as work:
        assert work == tmp_path / "scratch-disk"
    assert not (tmp_path / "store" / "v1" / "work").exists()
    done = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir",
                           str(tmp_path / "store"), "stats"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"({tmp_path / 'scratch-disk'})" in " ".join(done.stdout.split())


def test_a_folder_of_the_operators_own_is_never_emptied(tmp_path, monkeypatch):
    """``CACHEBUILD_WORK_DIR`` set to a folder of the operator's by mistake (their home,
    say): ``gc`` counts and removes only what builds made and marked there (not a ``tmp/``
    or ``cxx/`` of theirs: those names were all it went by), and a build refuses the
    folder rather than empty it (one holding nothing but a ``tmp/`` of theirs too)."""
    from cachebuild.store import UnsafeStore, mark_work_folder

    mine = tmp_path / "home"
    (mine / "projects").mkdir(mode=0o700, parents=True)
    mine.chmod(0o700)
    (mine / ".bashrc").write_text("a")
    (mine / "projects" / "x.py").write_text("b")
    (mine / "tmp").mkdir(mode=0o700)
    (mine / "tmp" / "notes.txt").write_text("c")  # theirs
    (mine / "cxx").mkdir(mode=0o700)
    mark_work_folder(mine / "cxx")
    (mine / "cxx" / "left.o").write_bytes(b"x" * 100)  # what a build leaves: removed
    monkeypatch.setenv("CACHEBUILD_WORK_DIR", str(mine))
    store = open_store(StoreOptions.from_env(cache_dir=tmp_path / "store"))
    assert store.work_dir_named and store.stats().work.bytes == 100

    def gc() -> str:
        done = subprocess.run([sys.executable, "-m", "cachebuild.cli", "--cache-dir",
                               str(tmp_path / "store"), "gc"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return " ".join(done.stdout.split())

    assert "100 B of build work files" in gc()
    assert sorted(p.name for p in mine.iterdir()) == [".bashrc", ".builds", "projects", "tmp"]
    assert (mine / "tmp" / "notes.txt").read_text() == "c"
    with pytest.raises(UnsafeStore, match=r"holds what no build put there "
                                          r"\(\.bashrc, projects, tmp\)"):
        with build_work_dir(store):
            pass
    assert (mine / ".bashrc").read_text() == "a" and (mine / "projects" / "x.py").exists()
    # A folder of theirs holding only a tmp/: refused too, not emptied.
    only = tmp_path / "only"
    (only / "tmp").mkdir(mode=0o700, parents=True)
    only.chmod(0o700)
    (only / "tmp" / "notes.txt").write_text("d")
    monkeypatch.setenv("CACHEBUILD_WORK_DIR", str(only))
    store = open_store(StoreOptions.from_env(cache_dir=tmp_path / "store"))
    with pytest.raises(UnsafeStore, match=r"holds what no build put there \(tmp\)"):
        with build_work_dir(store):
            pass
    assert (only / "tmp" / "notes.txt").read_text() == "d"
    assert "of build work files" not in gc() or "0 B of build work files" in gc()
    assert (only / "tmp" / "notes.txt").read_text() == "d"


@pytest.mark.slow
def test_an_inductor_build_keeps_its_precompiled_headers_with_the_environment():
    """The session's AOTI store was built in this process: Inductor's headers are in the
    probe folder (shared by every store of the environment, as the probe's verdict is),
    none in the store's work folder, and Inductor's own folder setting is as it was."""
    from torch._inductor import config

    from cachebuild.backends.probe import probe_dir

    if not (config.aot_inductor.precompile_headers or config.cpp_cache_precompile_headers):
        pytest.skip("Inductor precompiles no headers here")
    warmed = models.aoti_store()
    work = warmed["path"] / "v1" / "work"
    folder = probe_dir() / "headers"
    assert list(folder.glob("*.h")), sorted(str(p) for p in folder.parent.rglob("*"))[:20]
    assert not list(work.rglob("*.gch"))
    import torch._inductor.codecache as codecache

    assert not codecache._HEADER_DIR.startswith(str(warmed["path"]))  # put back after
