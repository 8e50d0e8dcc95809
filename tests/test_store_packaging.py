"""The package installs under the one import name ``cachebuild``, in wheel and editable
installs alike, and never installs a generic top-level ``store``, ``passes`` or ``backends``.

Both installs go into fresh virtual environments that see this interpreter's packages
(torch and friends) but not the source tree: the import checks run from an empty folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("cachebuild", "backends", "passes", "store")
MODULES = ("cachebuild", "cachebuild.store", "cachebuild.backends", "cachebuild.passes")

_CHECK = """
import importlib.util, json, os, sys, sysconfig
import {modules}
out = {{"files": {{m: sys.modules[m].__file__ for m in {modules_list!r}}},
        "top_level": {{n: importlib.util.find_spec(n) is not None
                      for n in ("store", "passes", "backends")}},
        "purelib": sysconfig.get_paths()["purelib"]}}
print(json.dumps(out))
"""


def _copy_source(dest: Path) -> Path:
    """A copy of what a build needs, so builds never write into the working tree."""
    dest.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", dest)
    readme = ROOT / "README.md"
    if readme.exists():
        shutil.copy2(readme, dest)
    else:
        (dest / "README.md").write_text("cachebuild\n")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so")
    for name in PACKAGE_DIRS:
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)])
    return path / "bin" / "python"


def _pip_install(python: Path, *args: str) -> None:
    # This interpreter's pip installs into the venv (--python); --ignore-installed because
    # the venv also sees any cachebuild installed here.
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-build-isolation", "--ignore-installed", "--no-index", *args])


def _imports(python: Path, cwd: Path) -> dict:
    code = _CHECK.format(modules=", ".join(MODULES), modules_list=list(MODULES))
    return json.loads(_run([str(python), "-c", code], cwd=cwd).strip().splitlines()[-1])


@pytest.mark.slow
def test_wheel_and_editable_installs_import_as_cachebuild(tmp_path):
    src = _copy_source(tmp_path / "src")
    empty = tmp_path / "empty"
    empty.mkdir()

    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("cachebuild-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        top = {name.split("/")[0] for name in zf.namelist()}
        names = set(zf.namelist())
    assert {t for t in top if not t.endswith(".dist-info")} == {"cachebuild"}
    for module in ("store/local.py", "store/blob.py", "backends/__init__.py",
                   "passes/__init__.py", "cli/main.py"):
        assert f"cachebuild/{module}" in names

    wheel_python = _venv(tmp_path / "venv-wheel")
    _pip_install(wheel_python, str(wheel))
    found = _imports(wheel_python, empty)
    purelib = Path(found["purelib"])
    for module, file in found["files"].items():
        assert Path(file).is_relative_to(purelib / "cachebuild"), (module, file)
    assert Path(found["files"]["cachebuild.store"]).parent == purelib / "cachebuild" / "store"
    assert found["top_level"] == {"store": False, "passes": False, "backends": False}
    assert not any((purelib / name).exists() for name in ("store", "passes", "backends"))

    edit_python = _venv(tmp_path / "venv-editable")
    _pip_install(edit_python, "-e", str(src))
    found = _imports(edit_python, empty)
    expected = {"cachebuild": "cachebuild/__init__.py", "cachebuild.store": "store/__init__.py",
                "cachebuild.backends": "backends/__init__.py",
                "cachebuild.passes": "passes/__init__.py"}
    for module, rel in expected.items():
        assert Path(found["files"][module]) == src / rel, module
    assert found["top_level"] == {"store": False, "passes": False, "backends": False}
