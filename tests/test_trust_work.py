"""Trust, the build work folder (issue 32, item 4): it is checked like the store, the
directories above it included, and what a build reuses from it (the C++ object cache)
is checked against a record kept outside it before it goes into a target.

The command-line tests run real processes; the other user is uid 65534, whose
directories the tests make as root (skipped elsewhere).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trust import (
    NOBODY,
    assert_one_line_error,
    clean_env,
    cli,
    linked_environment,
    public_dir,
    require_root,
    share_with_a_group,
)

from cachebuild.backends import compilers
from cachebuild.backends.kernel_dir import build_work_dir
from cachebuild.compat import CxxBuild
from cachebuild.store.layout import UnsafeStore, prepare_work_dir
from cachebuild.store.work import ObjectRecords

#: A model file that leaves a marker when it is imported: nothing may import it (let
#: alone trace it) when the work folder is unusable.
MODEL = """
from pathlib import Path
Path({marker!r}).write_text("imported")

def build():
    raise RuntimeError("not reached")
"""


def _model(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "imported"
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(marker=str(marker)))
    return path, marker


@pytest.mark.parametrize("work", ["/etc/passwd", "/etc/passwd/work", "file"])
def test_a_work_folder_that_is_a_file_or_cannot_be_made_is_refused_before_tracing(
        tmp_path, work):
    model, marker = _model(tmp_path)
    if work == "file":
        work = str(tmp_path / "file")
        Path(work).write_text("not a folder")
    proc = cli("--cache-dir", str(tmp_path / "store"), "warm", str(model),
               env=clean_env(CACHEBUILD_WORK_DIR=work))
    assert_one_line_error(proc, 2, "work folder")
    assert not marker.exists()


def test_a_work_folder_another_user_could_change_is_refused_and_nothing_is_made_there(
        tmp_path):
    require_root()
    model, marker = _model(tmp_path)
    with public_dir() as public:
        theirs = public / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, NOBODY, NOBODY)
        open_dir = public / "open"
        open_dir.mkdir()
        os.chmod(open_dir, 0o777)
        (open_dir / "work").mkdir(mode=0o700)
        cases = [(theirs / "cache" / "work", r"theirs above it is owned by uid 65534"),
                 (open_dir / "work", r"open above it is writable by others")]
        for work, why in cases:
            proc = cli("--cache-dir", str(tmp_path / "store"), "warm", str(model),
                       env=clean_env(CACHEBUILD_WORK_DIR=str(work)))
            assert_one_line_error(proc, 2, why)
        assert list(theirs.iterdir()) == []  # not even an empty folder was made there
        assert list((open_dir / "work").iterdir()) == []
        assert not marker.exists()


def test_a_work_folder_open_to_others_is_refused_by_every_build_and_gc(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    with build_work_dir(store) as work:
        pass
    os.chmod(work, 0o777)
    with pytest.raises(UnsafeStore, match="work folder .* writable by group and others"), \
            build_work_dir(store):
        pass
    (work / "theirs").write_bytes(b"x")
    with pytest.raises(UnsafeStore, match="work folder"):  # nor is it emptied
        store.gc()
    assert (work / "theirs").exists()
    os.chmod(work, 0o700)
    share_with_a_group(work / "inductor", 0o770)
    with pytest.raises(UnsafeStore, match="inductor: it is writable by group"), \
            build_work_dir(store):
        pass


def test_a_work_folder_no_build_of_ours_made_is_emptied_before_use(open_local, tmp_path,
                                                                     caplog):
    store = open_local(tmp_path / "store")
    work = prepare_work_dir(store.work_dir)  # made by hand: the store has no record of it
    planted = work / "inductor" / "fxgraph" / "planted"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"a cached graph nobody here made")
    with caplog.at_level(logging.WARNING, logger="cachebuild.building.build"), build_work_dir(store):
        assert not planted.exists()
        kept = work / "inductor" / "ours"
        kept.write_bytes(b"made by a build")
    assert "emptied the work folder" in caplog.text
    with build_work_dir(store):
        assert kept.read_bytes() == b"made by a build"  # the store made this folder


def test_a_kept_object_is_linked_only_if_it_matches_its_record(tmp_path, caplog):
    """A kept C++ object is reused only if it hashes to the record made when a build of
    ours kept it; one that does not (or has no record) is compiled again, said once.
    (Each test starts on a fresh process state: nothing said in an earlier one counts.)"""
    work = tmp_path / "work"
    work.mkdir()
    records = ObjectRecords(tmp_path / "records")
    source = tmp_path / "kernel.cpp"
    source.write_text("int kernel() { return 1; }\n")
    target = tmp_path / "out" / "kernel.o"
    build = CxxBuild(f"g++ -c {source} -o {target}", (str(source),), str(target), "object")
    runs: list[int] = []

    def run() -> None:
        runs.append(1)
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(b"compiled here")

    with caplog.at_level(logging.WARNING, logger="cachebuild.building.build"), \
            compilers.watch(work, tmp_path / "isa", records) as cache:
        compilers._cxx(build, run)  # compiled, kept, recorded
        (kept,) = cache.glob("*.o")
        target.unlink()
        compilers._cxx(build, run)  # reused
        assert runs == [1] and target.read_bytes() == b"compiled here"
        assert "does not match" not in caplog.text
        kept.write_bytes(b"an object with a planted constructor")
        target.unlink()
        compilers._cxx(build, run)
        assert runs == [1, 1] and target.read_bytes() == b"compiled here"
        assert kept.read_bytes() == b"compiled here"  # kept again, with its record
        assert caplog.text.count("does not match its record") == 1
        (records.folder / kept.name).unlink()  # kept before records were made
        target.unlink()
        compilers._cxx(build, run)
        assert runs == [1, 1, 1]
    # Without the store's records (a folder nothing else uses), nothing is reused.
    (tmp_path / "other").mkdir()
    with compilers.watch(tmp_path / "other", None):
        target.unlink()
        compilers._cxx(build, run)
        assert runs == [1, 1, 1, 1]




def test_an_object_is_reused_on_the_cpu_it_was_made_for_and_from_a_folder_it_cannot_lock(
        tmp_path, monkeypatch):
    """Inductor compiles for the CPU it runs on: an object kept in an environment folder
    that machines share (a home on NFS) is reused only on a CPU like the one that made it.
    A records folder whose lock cannot be had (read-only) is read without it."""
    from cachebuild.store import work

    (tmp_path / "work").mkdir()
    records = ObjectRecords(tmp_path / "records")
    source = tmp_path / "kernel.cpp"
    source.write_text("int kernel() { return 1; }\n")
    target = tmp_path / "out" / "kernel.o"
    build = CxxBuild(f"g++ -march=native -c {source} -o {target}", (str(source),),
                     str(target), "object")
    runs: list[int] = []

    def run() -> None:
        runs.append(1)
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(b"compiled here")

    with compilers.watch(tmp_path / "work", tmp_path / "isa", records):
        compilers._cxx(build, run)
        target.unlink()

        def no_lock(path):
            raise PermissionError(13, "Read-only file system", str(path))

        with monkeypatch.context() as m:
            m.setattr(work, "flocked_shared", no_lock)
            compilers._cxx(build, run)  # reused all the same
        assert runs == [1] and target.read_bytes() == b"compiled here"
        target.unlink()
        monkeypatch.setattr(compilers, "cpu_identity", lambda: "model name : another CPU")
        compilers._cxx(build, run)
        assert runs == [1, 1]


def test_a_work_folder_whose_claim_cannot_be_written_is_built_in_all_the_same(
        tmp_path, monkeypatch, caplog):
    """A full disk under the records (the environment folder in a home over quota, the
    store elsewhere): the build goes on in the folder, said once; the claim is made by a
    later build that can write it."""
    import errno

    from cachebuild.store import work

    real = work.write_whole

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "work").mkdir(mode=0o700)
    (tmp_path / "work" / "tmp").mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="cachebuild.building.build"), \
            monkeypatch.context() as m:
        m.setattr(work, "write_whole", full)
        folder = work.open_work_dir(tmp_path / "work", tmp_path / "records")
    assert folder == (tmp_path / "work").resolve()
    assert "cannot record the work folder" in caplog.text and "No space left" in caplog.text
    assert not list((tmp_path / "records" / "claims").iterdir())  # nothing half-written
    assert work.write_whole is real
    work.open_work_dir(tmp_path / "work", tmp_path / "records")
    assert len(list((tmp_path / "records" / "claims").iterdir())) == 1


def test_a_kernel_key_leaves_out_only_comment_lines_at_the_edges():
    """Comment lines at a source's start and end (the work folder's path, the commands
    Inductor appends) change no key; a line a backslash continues into is code (here a
    string's text), so two sources that differ there have different keys."""
    strip = compilers._without_edge_comments
    body = b"int f() { return 1; }"
    assert strip(b"// /srv/store-a/wrapper.cpp\n" + body + b"\n// g++ -c x\n") == \
        strip(b"// /srv/store-b/wrapper.cpp\n" + body + b"\n// g++ -c y\n\n") == body
    spliced = b'int g();\nconst char* s = "abc\\\n'
    assert strip(spliced + b'// one";\n') != strip(spliced + b'// two";\n')
    assert strip(b"// goes on \\\nint h;\n" + body) == b"// goes on \\\nint h;\n" + body


def test_a_gpu_wrapper_whose_kernels_changed_is_compiled_once(tmp_path):
    """AOTInductor lists each Triton kernel's Python code in a GPU wrapper, in a block
    comment on lines of its own right inside the kernel's launcher: two wrappers that
    differ only there (a kernel's constant edited) compile to one object, reused, and what
    is compiled is the source without the listings (the object and its key agree). What
    only looks like one (a raw string's text, a comment holding no kernel, one never
    closed) and comments within a line stay."""
    records = ObjectRecords(tmp_path / "records")
    (tmp_path / "work").mkdir()
    code = ("void launch_{0}() {{\n    /*\n    @triton.jit\n    def k(x): return x + {1}\n"
            "    */\n    load(/*smem=*/0);\n}}\n")
    target = tmp_path / "out" / "c1.wrapper.o"
    runs: list[str] = []

    def build(eps: str) -> tuple[CxxBuild, Any]:
        source = tmp_path / f"w{eps}" / "c1.wrapper.cpp"
        source.parent.mkdir()
        source.write_text(code.format("a", eps))

        def run() -> None:
            runs.append(source.read_text())
            target.parent.mkdir(exist_ok=True)
            target.write_bytes(b"compiled")
        return CxxBuild(f"g++ -c {source} -o {target}", (str(source),), str(target),
                        "object"), run

    with compilers.watch(tmp_path / "work", tmp_path / "isa", records):
        for eps in ("1e-5", "1e-6"):
            b, run = build(eps)
            compilers._cxx(b, run)
            target.unlink()
    assert runs == ["void launch_a() {\n    load(/*smem=*/0);\n}\n"]
    for text in ('const char* s = R"(\n/*\n@triton.jit\n*/\n)";\n',  # not after a `{`
                 "void f() {\n/*\nint b;\n*/\n}\n",  # no kernel in it
                 "void f() {\n/*\n@triton.jit\n"):  # never closed
        kept = tmp_path / "kept.cpp"
        kept.write_text(text)
        compilers.without_kernel_listings(kept)
        assert kept.read_text() == text


#: Keeps 200 objects 5 times over, each time with bytes of this process's own (as two
#: builds of one object differ), reading each back as a build would; exits 1 if a read
#: ever finds an object that does not match its record.
KEEP_MANY = """
import sys
from pathlib import Path
from cachebuild.store.work import ObjectRecords

folder, seed = Path(sys.argv[1]), sys.argv[2]
records = ObjectRecords(folder / "records")
for r in range(5):
    for i in range(200):
        name = f"{i:04x}.o"
        kept = folder / "cxx" / name
        records.keep(name, kept, f"object {i} by process {seed}, round {r}".encode())
        if records.verified(name, kept) is None:
            sys.exit(f"object {name} does not match its record")
"""


def test_two_builds_keeping_one_object_at_once_leave_it_matching_its_record(tmp_path):
    """Two processes keep the same objects at the same time with different bytes (real
    processes): every read and every object left matches its record, and nothing is
    said about objects that do not match."""
    procs = [subprocess.Popen([sys.executable, "-c", KEEP_MANY, str(tmp_path), str(seed)],
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "does not match" not in err, err
    records = ObjectRecords(tmp_path / "records")
    kept = sorted((tmp_path / "cxx").glob("*.o"))
    assert len(kept) == 200
    assert all(records.verified(path.name, path) is not None for path in kept)


#: A constructor that leaves a marker when the library it is linked into is loaded.
PLANTED_OBJECT = """
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void cachebuild_planted(void) {
    int fd = open("%s", O_CREAT | O_WRONLY, 0600);
    if (fd >= 0) close(fd);
}
"""

MODEL = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "examples")!r})
from llama import build
"""

SERVE = """
import sys
import torch
import cachebuild
from cachebuild.modelfile import load_spec
spec = load_spec(sys.argv[1])
compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims)
with torch.no_grad():
    torch.testing.assert_close(compiled(*spec.example_inputs), spec.model(*spec.example_inputs),
                               rtol=2e-2, atol=2e-2)
print("served", cachebuild.stats()["loaded"])
"""


@pytest.mark.slow
def test_a_tampered_kept_object_never_reaches_a_signed_target(tmp_path):
    """The audit's case: a C++ object kept for reuse (in the environment folder every
    store of the user shares) is changed (a constructor linked in) between two builds into
    two stores with a key that signs every target; the second build compiles that object
    again, and loading what it stored runs no planted code. The test has an environment
    folder of its own (the session's verdicts and headers, linked): the objects it plants
    are no other test's."""
    import shutil
    import subprocess

    from test_cli_model import SMALL, summary
    from trust import python

    if not (shutil.which("ld") and shutil.which("gcc")):
        pytest.skip("needs ld and gcc")
    marker = tmp_path / "planted-constructor-ran"
    environment = linked_environment(tmp_path / "environment")
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    env = clean_env(CACHEBUILD_PROBE_DIR=str(environment), CACHEBUILD_SIGNING_KEY="fleet-signing-key",
                    CACHEBUILD_REQUIRE_SIGNATURE="1", **SMALL)
    first = cli("--cache-dir", str(tmp_path / "one"), "warm", str(model), env=env, timeout=1500)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = sorted((environment / "cxx").glob("*.o"))
    if not kept:
        pytest.skip("no C++ objects kept here (no AOTInductor build)")
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_OBJECT % marker)
    planted = tmp_path / "planted.o"
    subprocess.run(["gcc", "-c", "-fPIC", str(source), "-o", str(planted)], check=True)
    for obj in kept:  # each keeps its own symbols, plus the constructor
        combined = tmp_path / "combined.o"
        subprocess.run(["ld", "-r", str(obj), str(planted), "-o", str(combined)], check=True)
        shutil.copyfile(combined, obj)
    second = cli("--cache-dir", str(tmp_path / "two"), "warm", str(model), env=env,
                 timeout=1500)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not marker.exists()
    total, _, built, failed = summary(second.stderr + second.stdout)
    assert built == total and failed == 0
    assert "does not match its record" in second.stderr
    assert not any(b"cachebuild_planted" in obj.read_bytes() for obj in kept)
    served = python(SERVE, str(model), env={**env, "CACHEBUILD_DIR": str(tmp_path / "two")},
                    timeout=900)
    assert served.returncode == 0, served.stderr[-3000:]
    assert "served" in served.stdout
    assert not marker.exists()
