"""On CPU a standalone artifact carries its built kernels: a warm load builds no C++, and
runs nothing but what came out of the verified store.

One cold build (a fresh process) serves the module; each warm start is a fresh process
too, with C++ builds made to fail (in-process: compile workers are off), so that any
kernel or ISA check compiled during a load fails the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trust import as_nobody, public_dir

from cachebuild.backends.pack import unpack
from cachebuild.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"LLAMA_LAYERS": "2", "LLAMA_HIDDEN": "64", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2",
         "LLAMA_MLP": "128", "LLAMA_VOCAB": "128"}

CHILD = r"""
import dataclasses, json, sys, torch
sys.path.insert(0, sys.argv[1])
import torch._inductor.cpp_builder as cpp_builder

def refuse(self, *args, **kwargs):
    raise RuntimeError("C++ was built during a warm load: " + self.get_target_file_path())

if sys.argv[3] == "warm":
    cpp_builder.CppBuilder.build = refuse  # any compile of C++ now fails the load
import llama, cachebuild
from cachebuild.store import LocalStore
torch.manual_seed(0)
model = llama.make_model()
cfg = dataclasses.replace(llama.config(), flavour="standalone")
compiled = cachebuild.compile(model, cfg, {0: 0, 1: 0}, store=LocalStore(sys.argv[2]))
ids, pos = llama.example_inputs(model, 13)
with torch.no_grad():
    torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=1e-4, atol=1e-4)
print(json.dumps(cachebuild.stats()))
"""

# A library that announces itself when loaded: what an attacker plants.
EVIL_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


def run(phase: str, store: Path, inductor_dir: Path, **env: str) -> dict:
    full = {**os.environ, **SMALL, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
            "TORCHINDUCTOR_COMPILE_THREADS": "1", **env}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples"), str(store),
                           phase], capture_output=True, text=True, env=full, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A store holding the tiny llama's three standalone targets, built in a fresh process."""
    tmp = tmp_path_factory.mktemp("standalone")
    cold = run("cold", tmp / "store", tmp / "inductor-build")
    assert cold["built"] == 3
    return tmp / "store"


def _copy(store: Path, dest: Path) -> Path:
    shutil.copytree(store, dest, symlinks=True)
    return dest


@pytest.mark.slow
def test_standalone_warm_load_builds_no_cpp(built, tmp_path):
    # A fresh process with an empty Inductor cache and another default compiler: the
    # kernels, the compiler and the vector ISA all come from the artifacts.
    store = _copy(built, tmp_path / "store")
    warm = run("warm", store, tmp_path / "fresh-inductor", CXX="c++",
               CACHEBUILD_LOAD_THREADS="8")
    assert warm["built"] == 0 and warm["traced"] == 0 and warm["loaded"] == 3
    # Nothing went to Inductor's own cache directory (importing Dynamo makes it, empty),
    # and the private one is gone.
    assert not list((tmp_path / "fresh-inductor").rglob("*"))
    assert list((store / "v1" / "scratch").iterdir()) == []


@pytest.mark.slow
def test_kernels_planted_in_inductors_cache_dir_never_run(built, tmp_path):
    with contextlib.ExitStack() as stack:
        _planted_kernels_never_run(built, tmp_path, stack)


def _planted_kernels_never_run(built: Path, tmp_path: Path, stack: contextlib.ExitStack) -> None:
    prefix = as_nobody()
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the library an attacker would plant")
    store = _copy(built, tmp_path / "store")
    # Inductor's default cache directory is /tmp/torchinductor_<user>: any user can make
    # it first. Here the same, in a sticky world-writable directory of the test's own.
    public = stack.enter_context(public_dir())
    shared = public / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted_dir = shared / "torchinductor_root"
    evil_c = shared / "evil.c"
    evil_c.write_text(EVIL_C)
    marker = tmp_path / "MARKER"
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o",
                    str(shared / "evil.so"), str(evil_c)], check=True)
    os.chmod(shared / "evil.so", 0o755)
    # Another user plants a library under the name of every kernel the artifacts carry,
    # and a truncated one under a few.
    names = set()
    reader = LocalStore(store)
    for record in reader.records(kind="standalone"):
        parts = unpack(reader.get(record.key))
        names |= {n for n in parts if n.endswith((".so", ".o"))}
    reader.close()
    assert names
    script = ["set -e", f"mkdir -m 777 {planted_dir}"]
    for i, name in enumerate(sorted(names)):
        target = planted_dir / name
        script.append(f"mkdir -p -m 777 {target.parent}")
        if i % 4 == 0:
            script.append(f"head -c 100 {shared / 'evil.so'} > {target}")
        else:
            script.append(f"cp {shared / 'evil.so'} {target}")
    script.append(f"chmod -R a+rwX {planted_dir}")
    subprocess.run([*prefix, "sh", "-c", "\n".join(script)], check=True, cwd=shared)
    assert (planted_dir / sorted(names)[1]).stat().st_uid == 65534

    warm = run("warm", store, planted_dir, CXX="c++")
    assert warm["built"] == 0 and warm["loaded"] == 3
    assert not marker.exists(), "a planted library ran in the server"
