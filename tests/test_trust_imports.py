"""Trust, what build and probe processes import (issue 32, item 3): run from a folder
anyone may write (``/tmp``-like, mode 1777), where modules named like cachebuild's, torch's
and the standard library's were planted, a warm build with worker processes and a fresh
toolchain probe imports none of them, and builds what it should.

Real processes. A planted module leaves a marker when it is imported: a test fails if a
marker exists, whatever the command said.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli_model import SMALL, summary
from trust import NOBODY, ROOT, assert_one_line_error, clean_env, cli, public_dir

from cachebuild.trust.processes import (
    child_env,
    import_path,
    python_command,
    reachable,
    trusted_dir,
)

#: Names a child would import from its working directory if it put that first on its
#: path: cachebuild and torch themselves, modules they import later, and the standard
#: library's (a ``python -c`` child puts its working directory before it).
PLANTED = ("cachebuild", "torch", "filelock", "xxhash", "ctypes", "json", "runpy", "sympy")

MODEL = f"""
import sys
sys.path.insert(0, {str(ROOT / "examples")!r})
from llama import build
"""


def plant(folder: Path, marker: Path) -> None:
    """Packages under ``folder`` that each append their name to ``marker`` when imported."""
    for name in PLANTED:
        package = folder / name
        package.mkdir()
        (package / "__init__.py").write_text(textwrap.dedent(f"""
            with open({str(marker)!r}, "a") as f:
                f.write({name!r} + "\\n")
        """))
        if os.geteuid() == 0:
            os.chown(package, NOBODY, NOBODY)
            os.chown(package / "__init__.py", NOBODY, NOBODY)


def cachebuild_command() -> list[str]:
    """``cachebuild`` as a user runs it: the installed script (its own folder first on its
    path, not the working directory)."""
    script = Path(sys.executable).parent / "cachebuild"
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "cachebuild.cli"]


@contextlib.contextmanager
def planted_shared_folder(marker: Path) -> Iterator[Path]:
    """A 1777 folder where another user planted packages that write ``marker`` if run."""
    with public_dir() as public:
        shared = public / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        plant(shared, marker)
        yield shared


@pytest.mark.slow
def test_warm_from_a_shared_folder_imports_nothing_planted_there(tmp_path):
    """The audit's case: ``cachebuild warm`` run in a folder where another user planted
    packages; the probe (a fresh folder: it runs) and the build workers import none of
    them, and every target builds."""
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    marker = tmp_path / "planted-code-ran"
    with planted_shared_folder(marker) as shared:
        env = clean_env(CACHEBUILD_PROBE_DIR=str(tmp_path / "probe"), **SMALL)
        proc = subprocess.run([*cachebuild_command(), "--cache-dir", str(tmp_path / "store"),
                               "warm", str(model), "--jobs", "2"], cwd=shared, env=env,
                              capture_output=True, text=True, timeout=1500)
        assert not marker.exists(), marker.read_text()
        assert proc.returncode == 0, proc.stderr[-3000:]
        total, stored, built, failed = summary(proc.stderr + proc.stdout)
        assert total > 0 and built == total and failed == 0
        assert (tmp_path / "probe").exists() and list((tmp_path / "probe").glob("aoti-cpu-*"))
        again = subprocess.run([*cachebuild_command(), "--cache-dir", str(tmp_path / "store"),
                                "plan", str(model)], cwd=shared, env=env,
                               capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert not marker.exists(), marker.read_text()


#: A server's start, as examples/llama.py makes it, saying where its targets build.
SERVER = f"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.path.insert(0, {str(ROOT / "examples")!r})
import llama
llama.main()
"""


@pytest.mark.slow
def test_a_cold_start_from_a_shared_folder_imports_nothing_planted_there(tmp_path):
    """A server started in such a folder builds its targets in workers that import none
    of what was planted there, and serves what eager serves."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    marker = tmp_path / "planted-code-ran"
    with planted_shared_folder(marker) as shared:
        env = clean_env(CACHEBUILD_DIR=str(tmp_path / "store"), CACHEBUILD_BUILD_JOBS="2",
                        **SMALL)
        proc = subprocess.run([sys.executable, str(script)], cwd=shared, env=env,
                              capture_output=True, text=True, timeout=1500)
        assert not marker.exists(), marker.read_text()
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "worker processes" in proc.stderr and "output matches eager" in proc.stderr
        assert "in this process" not in proc.stderr, proc.stderr[-3000:]


def test_a_child_imports_from_the_callers_safe_path_entries_only(tmp_path):
    """A child gets this process's path entries that nobody else could change, in order;
    never one others may write, nor its working directory."""
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o755)
    (ours / "mine_ops.py").write_text("WHERE = 'ours'\n")
    (ours / "show_path.py").write_text(textwrap.dedent("""
        import mine_ops
        print(mine_ops.WHERE)
        try:
            import only_shared
            print("only_shared imported")
        except ImportError:
            print("only_shared not found")
    """))
    with public_dir() as public:
        shared = public / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        (shared / "mine_ops.py").write_text("WHERE = 'shared'\n")
        (shared / "only_shared.py").write_text("")
        given = import_path(["", ".", str(shared), str(ours), *sys.path])
        assert str(ours) in given and str(shared) not in given
        assert "" not in given and "." not in given
        assert "writable by others" in (trusted_dir(shared) or "")
        sys.path[:0] = [str(shared), str(ours)]
        try:
            done = subprocess.run(python_command("show_path"), cwd=shared, env=child_env(),
                                  capture_output=True, text=True, timeout=120)
        finally:
            sys.path.remove(str(shared))
            sys.path.remove(str(ours))
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split("\n")[:2] == ["ours", "only_shared not found"]
        assert child_env({"X": "1"})["PYTHONSAFEPATH"] == "1"


def test_an_op_module_from_a_shared_folder_is_not_imported_by_a_worker(tmp_path):
    """A module that registered ops, imported from a folder others may write, is not one
    a worker imports: such jobs build in the calling process."""
    import importlib

    with public_dir() as public:
        shared = public / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        (shared / "shared_ops_mod.py").write_text("X = 1\n")
        sys.path.insert(0, str(shared))
        try:
            module = importlib.import_module("shared_ops_mod")
            assert not reachable(module)
        finally:
            sys.path.remove(str(shared))
            sys.modules.pop("shared_ops_mod", None)
    import cachebuild.building.pool

    assert reachable(cachebuild.building.pool)


@pytest.mark.parametrize("where", ["shared", "private"])
def test_a_model_files_folder_is_on_the_path_only_if_nobody_else_could_change_it(
        tmp_path, where):
    code = textwrap.dedent("""
        import sys
        from cachebuild.modelfile import import_model
        folder = sys.argv[1]
        import_model(folder + "/model.py")
        print(folder in sys.path)
    """)
    with public_dir() as public:
        folder = public / "shared" if where == "shared" else tmp_path / "private"
        folder.mkdir()
        if where == "shared":
            os.chmod(folder, 0o1777)
        (folder / "model.py").write_text("def build():\n    pass\n")
        done = subprocess.run([sys.executable, "-P", "-c", code, str(folder)],
                              env=clean_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == ("False" if where == "shared" else "True")


def test_a_model_file_in_a_shared_folder_does_not_import_what_lies_beside_it(tmp_path):
    """A model file in a folder others may write imports nothing from that folder; the
    error says why."""
    with public_dir() as public:
        shared = public / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        (shared / "beside_it.py").write_text("")
        (shared / "model.py").write_text("import beside_it\n")
        proc = cli("--cache-dir", str(tmp_path / "store"), "plan", str(shared / "model.py"))
        assert_one_line_error(proc, 2, r"No module named 'beside_it'.* is not put on sys.path:"
                                       r" .*writable by others .*a module put there would run "
                                       r"in this process; keep the model and the modules it "
                                       r"imports in a folder only you")
        assert "store" not in proc.stderr.split("not put on sys.path")[1]  # not a store's


def test_a_worker_that_cannot_import_a_module_of_a_withheld_folder_says_why(tmp_path):
    """The model imports a helper from a $PYTHONPATH folder others may write: this process
    imports it, its build workers do not. `warm` says why, names the folder, and builds
    the targets in its own process (every target failed, saying only "No module named
    'model_helper'")."""
    with public_dir() as public:
        shared = public / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        (shared / "model_helper.py").write_text("X = 1\n")
        model = tmp_path / "model.py"
        model.write_text("import model_helper\n" + MODEL)
        env = clean_env(**SMALL, LLAMA_BACKEND="eager_fusion",
                        CACHEBUILD_DIR=str(tmp_path / "store"))
        env["PYTHONPATH"] = os.pathsep.join([str(shared), env["PYTHONPATH"]])
        proc = cli("warm", str(model), "--jobs", "1", env=env, timeout=600)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 0 and "No module named 'model_helper'" in text, text[-3000:]
    assert "another user could change" in text and str(shared) in text, text[-3000:]
    assert "building 3 targets in this process instead" in text, text[-3000:]
    assert summary(proc.stderr)[1:] == (0, 3, 0), text[-3000:]


def test_a_child_gets_the_callers_warning_filters_but_error(tmp_path):
    """A caller's ``-W error`` (or ``PYTHONWARNINGS=error``) is about its own code: a build
    worker or probe child that inherited it failed as torch's compiler warned while it was
    imported. Filters that only decide what is shown still reach the child."""
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o755)
    (ours / "show_warnings.py").write_text(textwrap.dedent("""
        import json, os, subprocess, sys, warnings
        warnings.warn("deprecated", DeprecationWarning)  # an error under -W error
        grandchild = subprocess.run([sys.executable, "-c", "import sys; print(sys.warnoptions)"],
                                    capture_output=True, text=True, check=True)
        print(json.dumps([sys.warnoptions, os.environ.get("PYTHONWARNINGS"),
                          grandchild.stdout.strip()]))
    """))
    parent = textwrap.dedent(f"""
        import os, subprocess, sys
        sys.path.insert(0, {str(ours)!r})
        from cachebuild.trust.processes import child_env, python_command
        done = subprocess.run(python_command("show_warnings"), env=child_env(),
                              capture_output=True, text=True, timeout=120)
        print(done.stdout, end="")
        sys.stderr.write(done.stderr)
        sys.exit(done.returncode)
    """)
    env = {**os.environ, "PYTHONWARNINGS": "error,ignore::FutureWarning"}
    done = subprocess.run([sys.executable, "-W", "error", "-W", "ignore::UserWarning", "-W",
                           "e::ResourceWarning", "-c", parent], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    options, variable, grandchild = json.loads(done.stdout)
    assert options == ["ignore::FutureWarning", "ignore::UserWarning"]  # the variable's too
    assert variable == "ignore::FutureWarning"
    assert grandchild == "['ignore::FutureWarning']"
