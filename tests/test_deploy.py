"""Deploying: ``cachebuild warm`` once, then a server that starts warm however it starts.

One tiny model file is warmed once (eager_fusion) from a folder that is then removed, as a
build image's folder is, and every start below runs in a fresh process from copies of the
file elsewhere, side by side: ``python dm.py``; a server script doing ``import dm``;
``python -m pkg.server`` importing ``pkg.models.dm``; another working directory; another
HOME with the store given by CACHEBUILD_DIR; the file's text exec'd from a string whose
source linecache holds (a notebook cell); the store on a read-only mount; the store owned
by root and served to another user. Each one traces nothing, builds nothing, loads the
entry once, matches eager, and draws the same random numbers after compiling as a seeded
process that never compiled. A change to the traced code or to a value the trace read is
still a miss, and on a read-only store that miss builds into memory and says so on one
line, leaving the store as it was.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import models
import pytest
from trust import public_dir

#: The model file: a wrapper module around an inner one, split at an op of its own.
MODEL = '''
"""A tiny served model: a wrapper around an inner module, split at its attention op."""
import json
import os

import torch
import torch.nn as nn

import cachebuild

_LIB = torch.library.Library("deploy_tests", "DEF")
_LIB.define("attn(Tensor x) -> Tensor")
_LIB.impl("attn", lambda x: x.softmax(-1), "CompositeExplicitAutograd")


@torch.library.register_fake("deploy_tests::attn", lib=_LIB)
def _(x):
    return torch.empty_like(x)


SCALE = float(os.environ.get("DM_SCALE", "2.0"))  # a value the trace reads


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.ops.deploy_tests.attn(torch.relu(self.a(x)) * SCALE))


class Served(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x) + 1


CONFIG = cachebuild.CompileConfig(splitting_ops=("deploy_tests::attn",),
                                  compile_ranges=((1, 32),), backend="eager_fusion")


def make_model():
    torch.manual_seed(0)
    return Served().eval()


def build():
    return cachebuild.ModelSpec(make_model(), (torch.randn(8, 16),), {0: 0}, CONFIG)


def serve():
    """A server's start: compile, answer one call; report the counters, whether the output
    equals eager's, and whether the seeded random stream is where a process that never
    compiled would have it."""
    model = make_model()
    compiled = cachebuild.compile(model, CONFIG, {0: 0})
    x = torch.randn(5, 16)
    torch.manual_seed(7)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    drawn = torch.rand(4)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(7))
    stats = cachebuild.stats()
    print(json.dumps({k: stats[k] for k in ("traced", "built", "entries_loaded")}
                     | {"equal": bool(torch.allclose(out, ref, rtol=1e-4, atol=1e-5)),
                        "rng": bool(torch.equal(drawn, expected))}))


if __name__ == "__main__":
    serve()
'''

SERVER = "import dm\n\ndm.serve()\n"
PKG_SERVER = "from pkg.models import dm\n\ndm.serve()\n"
#: A notebook cell: the file's text run from a string, its source registered in linecache.
NOTEBOOK = """
import linecache, sys
text = open(sys.argv[1]).read()
linecache.cache["<cell-3>"] = (len(text), None, text.splitlines(True), "<cell-3>")
cell = {"__name__": "notebook"}
exec(compile(text, "<cell-3>", "exec"), cell)
cell["serve"]()
"""

WARM = {"traced": 0, "built": 0, "entries_loaded": 1, "equal": True, "rng": True}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DM_SCALE")}
    return env | extra


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 0, f"{proc.args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _said(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def _snapshot(folder: Path) -> set[tuple[str, int, int]]:
    """Every file under ``folder``: its path, size and modification time."""
    return {(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """The model warmed once, from a folder removed afterwards; copies of the file where
    the starts run from. Returns the folders."""
    root = tmp_path_factory.mktemp("deploy")
    build = root / "build"
    build.mkdir()
    (build / "dm.py").write_text(MODEL)
    store = root / "store"
    cli = [str(Path(sys.executable).with_name("cachebuild")), "warm", str(build / "dm.py")]
    warm = subprocess.run(cli, env=_env(CACHEBUILD_DIR=str(store)), capture_output=True,
                          text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr
    assert "2 targets: 0 already stored, 2 built, 0 failed" in " ".join(warm.stderr.split())
    shutil.rmtree(build)  # the image's build folder: gone where the server runs
    app = root / "app"
    app.mkdir()
    (app / "dm.py").write_text(MODEL)
    (app / "server.py").write_text(SERVER)
    (app / "notebook.py").write_text(NOTEBOOK)
    package = root / "pkgroot" / "pkg"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models" / "__init__.py").write_text("")
    (package / "models" / "dm.py").write_text(MODEL)
    (package / "server.py").write_text(PKG_SERVER)
    other = root / "elsewhere" / "deep"
    other.mkdir(parents=True)
    (other / "dm.py").write_text(MODEL)
    (other / "server.py").write_text(SERVER)
    return {"root": root, "store": store, "app": app, "pkgroot": root / "pkgroot",
            "other": other}


def test_every_way_of_starting_finds_the_warmed_entry(deployed):
    app, store = deployed["app"], str(deployed["store"])
    home = deployed["root"] / "another-home"
    home.mkdir(exist_ok=True)
    python = sys.executable
    starts = {
        "python dm.py": ([python, "dm.py"], _env(CACHEBUILD_DIR=store), app),
        "import dm": ([python, "server.py"], _env(CACHEBUILD_DIR=store), app),
        "python -m pkg.server": ([python, "-m", "pkg.server"], _env(CACHEBUILD_DIR=store),
                                 deployed["pkgroot"]),
        "a copy in another folder, another cwd": (
            [python, str(deployed["other"] / "server.py")], _env(CACHEBUILD_DIR=store), "/"),
        "another HOME": ([python, str(app / "dm.py")],
                         _env(CACHEBUILD_DIR=store, HOME=str(home)), home),
        "a notebook cell": ([python, "notebook.py", "dm.py"], _env(CACHEBUILD_DIR=store), app),
    }
    results = models.run_side_by_side(list(starts.values()))
    for name, proc in zip(starts, results, strict=True):
        assert _result(proc) == WARM, (name, proc.stderr[-3000:])
        assert _said(proc) == [], (name, proc.stderr[-3000:])  # a warm start is silent
    assert not any(home.iterdir())  # nothing written to the other HOME


def test_a_change_of_code_or_of_a_value_the_trace_read_is_a_miss(deployed, tmp_path):
    """Seeded cold starts too: tracing and building leave the random stream alone."""
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "dm.py").write_text(MODEL.replace("return self.inner(x) + 1",
                                                "return self.inner(x) + 2"))
    fresh = tmp_path / "fresh-store"
    store = str(deployed["store"])
    python, app = sys.executable, deployed["app"]
    value, code, cold = models.run_side_by_side([
        ([python, "dm.py"], _env(CACHEBUILD_DIR=store, DM_SCALE="3.0"), app),
        ([python, "dm.py"], _env(CACHEBUILD_DIR=store), edited),
        ([python, "dm.py"], _env(CACHEBUILD_DIR=str(fresh)), app),
    ])
    # SCALE is baked into the first piece, the "+ 1" into the last: each rebuilds one.
    assert _result(value) == {**WARM, "traced": 1, "built": 1, "entries_loaded": 0}
    assert "its stored entry was traced for other values: globals['SCALE']: 2.0 → 3.0" in \
        value.stderr, value.stderr
    assert _result(code) == {**WARM, "traced": 1, "built": 1, "entries_loaded": 0}
    assert "its source differs from the one warmed" in code.stderr, code.stderr
    assert _result(cold) == {**WARM, "traced": 1, "built": 2, "entries_loaded": 0}
    # The cold start names the file to warm (it has a build()).
    assert f"`cachebuild warm {app / 'dm.py'}` before the server starts avoids this" in \
        cold.stderr, cold.stderr


def _mount_read_only(source: Path, view: Path) -> None:
    view.mkdir()
    done = subprocess.run(["mount", "--bind", "-o", "ro", str(source), str(view)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        view.rmdir()
        pytest.skip(f"cannot make a read-only bind mount here: {done.stderr.strip()}")


def test_a_store_on_a_read_only_mount_serves_warm_and_a_miss_builds_in_memory(deployed,
                                                                              tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    view = tmp_path / "read-only-store"
    _mount_read_only(deployed["store"], view)
    try:
        before = _snapshot(deployed["store"])
        python, app = sys.executable, deployed["app"]
        warm, miss = models.run_side_by_side([
            ([python, "dm.py"], _env(CACHEBUILD_DIR=str(view)), app),
            ([python, "dm.py"], _env(CACHEBUILD_DIR=str(view), DM_SCALE="4.0"), app),
        ])
        assert _result(warm) == WARM, warm.stderr
        assert _said(warm) == [], warm.stderr  # works, writes nothing, says nothing
        assert _result(miss) == {**WARM, "traced": 1, "built": 1, "entries_loaded": 0}
        said = [line for line in _said(miss) if "read-only here" in line]
        assert said == [f"cachebuild: the store at {view} is read-only here, so what this "
                        "process builds goes to memory, gone when this process exits (set "
                        "CACHEBUILD_OVERLAY_DIR to a folder of yours to keep it)"], miss.stderr
        assert _snapshot(deployed["store"]) == before
        # The command line reads it too, and refuses to change it in one line.
        cli = str(Path(sys.executable).with_name("cachebuild"))
        env = _env(CACHEBUILD_DIR=str(view))
        stats = subprocess.run([cli, "stats"], env=env, capture_output=True, text=True)
        assert stats.returncode == 0 and "(read-only here)" in stats.stdout, stats.stderr
        gc = subprocess.run([cli, "gc", "--max-size", "0"], env=env, capture_output=True,
                            text=True)
        assert gc.returncode == 2 and gc.stderr.startswith("error: cannot collect garbage")
        assert len(gc.stderr.strip().splitlines()) == 1, gc.stderr
        # `warm` finds everything stored (exit 0), but refuses to build what it could not
        # keep (another value read: a new entry), before building anything.
        model = str(deployed["app"] / "dm.py")
        kept = subprocess.run([cli, "warm", model], env=env, capture_output=True, text=True)
        assert kept.returncode == 0 and "0 built" in kept.stderr, kept.stderr
        lost = subprocess.run([cli, "warm", model], env=env | {"DM_SCALE": "5.0"},
                              capture_output=True, text=True)
        assert lost.returncode == 2, lost.stderr
        assert "error: cannot warm 1 missing target: the store at" in lost.stderr, lost.stderr
        assert _snapshot(deployed["store"]) == before
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)


# -- a store root owns, served to another user ------------------------------------------

USER = "cachebuild-deploy"

#: Started as root, the server loads its code, then drops to the user before it opens
#: the store (as a server does that is started by root and runs as its own user): used
#: where the user may not run this interpreter (installed in root's home).
AS_USER = """
import os, pwd, sys
sys.path.insert(0, os.getcwd())
import torch, torch.fx
import cachebuild, cachebuild.api, cachebuild.building.build, cachebuild.building.entry, cachebuild.building.planner
import cachebuild.serving.runtime, cachebuild.trust.sources, cachebuild.store.overlay
import cachebuild.backends.eager_fusion, cachebuild.passes
import dm
cachebuild.trust.sources.library_roots()
user = pwd.getpwnam(sys.argv[1])
os.setgroups([])
os.setgid(user.pw_gid)
os.setuid(user.pw_uid)
os.environ["HOME"] = user.pw_dir
dm.serve()
"""


@pytest.fixture
def other_user():
    """A user without a home, made for the test and removed after it (root only)."""
    if os.geteuid() != 0:
        pytest.skip("making a second user needs root")
    made = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        done = subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent",
                               "--shell", "/usr/sbin/nologin", USER], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot make a second user: {done.stderr.strip()}")
        made = True
    yield pwd.getpwnam(USER)
    if made:
        subprocess.run(["userdel", USER], check=False, capture_output=True)


def test_a_store_root_owns_serves_another_user_warm(deployed, other_user):
    # The image: root warmed the store and made it readable (its checks refuse only
    # writes by others); the app's files are readable as an image's are.
    with public_dir() as image:
        shutil.copytree(deployed["store"], image / "store")
        shutil.copytree(deployed["app"], image / "app")
        subprocess.run(["chmod", "-R", "a+rX", str(image)], check=True)
        before = _snapshot(image / "store")
        env = _env(CACHEBUILD_DIR=str(image / "store"), HOME=other_user.pw_dir)
        try:
            runs = subprocess.run([sys.executable, "-c", "import torch"], user=other_user.pw_uid,
                                  group=other_user.pw_gid, extra_groups=[],
                                  capture_output=True).returncode == 0
        except OSError:
            runs = False
        if runs:  # the user can run this interpreter and torch: start as them
            argv = [sys.executable, "dm.py"]
            kwargs = {"user": other_user.pw_uid, "group": other_user.pw_gid,
                      "extra_groups": []}
        else:
            argv, kwargs = [sys.executable, "-c", textwrap.dedent(AS_USER), USER], {}
        proc = subprocess.run(argv, env=env, cwd=image / "app", capture_output=True,
                              text=True, timeout=600, **kwargs)
        assert _result(proc) == WARM, proc.stderr[-3000:]
        assert _said(proc) == [], proc.stderr
        assert _snapshot(image / "store") == before
        # The same store is refused once anyone else may write it.
        os.chmod(image / "store" / "v1", 0o777)
        proc = subprocess.run(argv, env=env, cwd=image / "app", capture_output=True,
                              text=True, timeout=600, **kwargs)
        assert proc.returncode != 0 and "writable by others" in proc.stderr, proc.stderr
