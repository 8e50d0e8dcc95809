"""The first run on a new machine, as a user runs it: the command line in fresh processes
with a HOME (and XDG_CACHE_HOME) of their own and no CACHEBUILD_PROBE_DIR.

What holds per environment (the toolchain verdict, the ISA checks, the precompiled
headers) is kept once in the user's cache folder, shared by every store of the user:
a second store finds it (its ``plan`` probes nothing), no store holds a ``probe/``
folder, and a read-only imported store serves an edited model by building into memory
with it. ``warm`` says each phase as it starts when its output is piped. ``stats`` counts
every byte the user pays for, as ``du -sb`` does; ``gc --environments`` removes other
environments' folders and says so; a mistyped store path is named, never made.

The environment folder of the test's HOME is the session's probe folder, linked file by
file (``CACHEBUILD_PROBE_DIR``, probed once per session): no test here pays the probe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import models
import pytest
from mounts import read_only

#: The model file: one piece, built by the default backend (AOTInductor here).
MODEL = '''
"""A tiny model served the way a first run on a new machine serves it."""
import json

import torch
import torch.nn as nn

import cachebuild

CONFIG = cachebuild.CompileConfig(splitting_ops=(), compile_ranges=((1, 16),))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2.0 + 1


def make_model():
    torch.manual_seed(0)
    return Tiny().eval()


def build():
    return cachebuild.ModelSpec(make_model(), (torch.randn(4, 8),), {0: 0}, CONFIG)


def serve():
    """A server's start: compile, answer calls of three sizes on random inputs, each
    checked against eager; report the counters."""
    model = make_model()
    compiled = cachebuild.compile(model, CONFIG, {0: 0})
    equal = True
    with torch.no_grad():
        for n in (5, 3, 16):
            x = torch.randn(n, 8)
            equal &= bool(torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5))
    stats = cachebuild.stats()
    print(json.dumps({k: stats[k] for k in ("traced", "built", "entries_loaded")}
                     | {"equal": equal}))


if __name__ == "__main__":
    serve()
'''

CLI = str(Path(sys.executable).with_name("cachebuild"))
PROBING = "probing the C++ compilers"


def _du(*paths: Path) -> int:
    """``du -sb`` of each path, summed."""
    total = 0
    for path in paths:
        out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True,
                             check=True)
        total += int(out.stdout.split()[0])
    return total


def _snapshot(folder: Path) -> set[tuple[str, int, int]]:
    """Every file under ``folder``: its path, size and modification time."""
    return {(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A new user's HOME whose environment folder is the session's probe folder (linked
    file by file), the model file, and store A warmed from it with ``cachebuild warm``
    (output piped). Returns the folders, the environment for the commands, and the warm's
    result."""
    from trust import linked_environment

    from cachebuild.backends import environment

    root = tmp_path_factory.mktemp("first-run")
    home = root / "home"
    home.mkdir(mode=0o700)
    folder = home / ".cache" / "cachebuild" / "env" / environment.fingerprint()
    folder.parent.mkdir(parents=True)
    linked_environment(folder)  # the session's probe folder, probed once per session
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CACHEBUILD_") and k not in ("PYTHONPATH",)}
    env |= {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
            "CACHEBUILD_BUILD_JOBS": "1"}
    app = root / "app"
    app.mkdir()
    (app / "fr.py").write_text(MODEL)
    store = root / "a"
    warm = subprocess.run([CLI, "--cache-dir", str(store), "warm", str(app / "fr.py")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr
    return {"root": root, "home": home, "env": env, "folder": folder, "app": app,
            "store": store, "warm": warm}


def _run(first_run, *args: str, cwd: Path | None = None, **extra: str
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), env=first_run["env"] | extra, capture_output=True,
                          text=True, timeout=900, cwd=cwd)


def test_a_first_run_says_each_phase_and_keeps_the_environment_out_of_the_store(first_run):
    said = first_run["warm"].stderr
    # Piped: a line as each phase starts, before the first target is done.
    for phase in ("importing fr.py", "tracing fr.py", "building 1 target",
                  "built piece 0 range 1-16"):
        assert phase in said, said
    assert said.index("tracing fr.py") < said.index("built piece 0")
    assert PROBING not in said  # the environment folder had the verdict
    assert not (first_run["store"] / "v1" / "probe").exists()
    folder = first_run["folder"]
    assert json.loads((folder / "environment.json").read_text())["factors"]["torch"]
    # A server started from the store traces and builds nothing and matches eager.
    served = _run(first_run, sys.executable, "fr.py", cwd=first_run["app"],
                  CACHEBUILD_DIR=str(first_run["store"]))
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout.splitlines()[-1]) == {
        "traced": 0, "built": 0, "entries_loaded": 1, "equal": True}


def test_a_server_rebuilding_a_damaged_target_uses_the_environment_headers(first_run):
    """A warm server (Inductor not imported yet) that finds its target damaged rebuilds it
    in its own process with the environment folder's precompiled headers: none are
    compiled into the store, and the answer is eager's."""
    import shutil

    from cachebuild.store import LocalStore

    store = first_run["root"] / "damaged"
    shutil.copytree(first_run["store"], store, symlinks=True)
    with LocalStore(store) as opened:
        targets = [r.key for r in opened.records() if r.kind.startswith("aoti")]
    assert targets
    for key in targets:
        blob = store / "v1" / "objects" / key[:2] / key
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        os.chmod(blob, 0o600)
        blob.write_bytes(bytes(data))
        for made in blob.parent.glob(key + ".*"):  # what a load made of it
            made.unlink()
    served = _run(first_run, sys.executable, "fr.py", cwd=first_run["app"],
                  CACHEBUILD_DIR=str(store))
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout.splitlines()[-1]) == {
        "traced": 0, "built": len(targets), "entries_loaded": 1, "equal": True}
    assert list(store.rglob("*.gch")) == [], "precompiled headers made in the store"


def test_damaged_precompiled_headers_are_dropped_and_the_build_stays_aoti(first_run, tmp_path):
    """Precompiled headers kept for the environment that are damaged (bit rot, a half-copied
    home folder) fail every C++ build that uses them: the build compiles without them,
    says so once, removes them (the next build precompiles them again) and stores the
    package it would have stored, not a standalone artifact in its place."""
    import shutil

    from trust import linked_environment

    from cachebuild.backends import environment
    from cachebuild.store import LocalStore

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    folder = home / ".cache" / "cachebuild" / "env" / environment.fingerprint()
    folder.parent.mkdir(parents=True)
    linked_environment(folder)
    headers = sorted((folder / "headers").glob("*.gch"))
    assert headers
    damaged = {}
    for header in headers:  # a damaged copy in its place (the session's stays whole)
        data = bytearray(header.read_bytes())
        data[len(data) // 2: len(data) // 2 + 4096] = bytes(4096)
        header.unlink()
        header.write_bytes(bytes(data))
        damaged[header] = header.stat().st_ino
    store = tmp_path / "store"
    shutil.copytree(first_run["store"], store, symlinks=True)
    edited = tmp_path / "fr.py"
    edited.write_text(MODEL.replace("* 2.0 + 1", "* 3.0 + 1"))
    env = first_run["env"] | {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    warm = subprocess.run([CLI, "--cache-dir", str(store), "warm", str(edited)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr
    assert "1 built, 0 failed" in warm.stdout + warm.stderr, warm.stderr
    said = warm.stdout + warm.stderr
    assert said.count("taken as damaged") == 1, said
    with LocalStore(store) as opened:
        kinds = [r.kind for r in opened.records() if r.kind not in ("entry", "guards")]
    assert kinds and all(k == "aoti-cpu" for k in kinds), kinds
    assert not [h for h, inode in damaged.items() if h.exists() and h.stat().st_ino == inode]
    served = subprocess.run([sys.executable, str(edited)], env=env | {
        "CACHEBUILD_DIR": str(store)}, capture_output=True, text=True, timeout=900,
        cwd=tmp_path)
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout.splitlines()[-1]) == {
        "traced": 0, "built": 0, "entries_loaded": 1, "equal": True}


def test_a_second_store_uses_the_same_environment_folder_and_probes_nothing(first_run):
    folder = first_run["folder"]
    (verdict_file,) = folder.glob("aoti-cpu-*.json")
    before = verdict_file.stat()
    other = first_run["root"] / "b"
    plan = _run(first_run, CLI, "--cache-dir", str(other), "plan",
                str(first_run["app"] / "fr.py"))
    assert plan.returncode == 0, plan.stderr
    assert "missing" in plan.stdout and "tracing fr.py" in plan.stderr
    assert PROBING not in plan.stderr, plan.stderr
    after = verdict_file.stat()  # the probe's own record, untouched
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not other.exists()  # looking makes no store
    from cachebuild.store import LocalStore

    LocalStore(other).close()  # a second store, as `warm` or `import` makes it
    assert not (other / "v1" / "probe").exists()
    stats = _run(first_run, CLI, "--cache-dir", str(other), "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    environments = [p["path"] for p in json.loads(stats.stdout)["disk"]["parts"]
                    if p["what"] == "environment"]
    assert environments == [str(folder)]


def test_stats_counts_every_byte_du_counts(first_run):
    store = first_run["store"]
    stats = _run(first_run, CLI, "--cache-dir", str(store), "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    disk = json.loads(stats.stdout)["disk"]
    assert disk["total"] == _du(store / "v1", first_run["folder"])
    assert [p["what"] for p in disk["parts"]] == ["store on disk", "environment"]
    table = _run(first_run, CLI, "--cache-dir", str(store), "stats")
    assert "disk in all" in table.stdout and str(first_run["folder"]) in table.stdout


@pytest.mark.parametrize("command", ["ls", "stats", "verify", "gc"])
def test_a_store_that_is_not_there_is_named_and_never_made(first_run, command):
    typo = first_run["root"] / "stroe"
    done = _run(first_run, CLI, "--cache-dir", str(typo), command)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: no store at {typo}: no such directory")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert not typo.exists()


def test_an_imported_store_served_read_only_builds_an_edited_model_into_memory(first_run):
    root, app = first_run["root"], first_run["app"]
    bundle = root / "fr.tar"
    out = _run(first_run, CLI, "--cache-dir", str(first_run["store"]), "export", str(bundle),
               str(app / "fr.py"))
    assert out.returncode == 0, out.stderr
    imported = root / "imported"
    out = _run(first_run, CLI, "--cache-dir", str(imported), "import", "--trust", str(bundle))
    assert out.returncode == 0, out.stderr
    with read_only(imported, root / "image") as view:
        edited = root / "edited"
        edited.mkdir()
        text = MODEL.replace("* 2.0 + 1", "* 3.0 + 1")
        assert text != MODEL
        (edited / "fr.py").write_text(text)
        before = _snapshot(imported)
        warm, miss = models.run_side_by_side([
            ([sys.executable, "fr.py"], first_run["env"] | {"CACHEBUILD_DIR": str(view)}, app),
            ([sys.executable, "fr.py"], first_run["env"] | {"CACHEBUILD_DIR": str(view)},
             edited),
        ])
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout.splitlines()[-1]) == {
            "traced": 0, "built": 0, "entries_loaded": 1, "equal": True}
        assert miss.returncode == 0, miss.stderr
        assert "Traceback" not in miss.stderr
        assert json.loads(miss.stdout.splitlines()[-1]) == {
            "traced": 1, "built": 1, "entries_loaded": 0, "equal": True}
        assert "read-only here, so what this process builds goes to memory" in miss.stderr
        assert PROBING not in miss.stderr  # the user's environment folder served it
        assert _snapshot(imported) == before  # nothing written, nothing changed


def test_gc_environments_removes_other_environments_and_keeps_this_one(first_run):
    store, folder = first_run["store"], first_run["folder"]
    other = folder.parent / "0123456789abcdef0123"
    other.mkdir(mode=0o700)
    (other / "environment.json").write_text(json.dumps(
        {"factors": {"torch": "2.11.0+cpu", "python": "3.12"}}))
    (other / "headers").mkdir()
    (other / "headers" / "old.h.gch").write_bytes(b"\0" * 4096)
    notes = folder.parent / "my-notes"  # not one of ours: kept
    notes.mkdir(mode=0o700)
    (notes / "todo.txt").write_text("keep me")
    legacy = store / "v1" / "probe"
    legacy.mkdir(mode=0o700)
    (legacy / "aoti-cpu-old.json").write_text("{}")
    dry = _run(first_run, CLI, "--cache-dir", str(store), "gc", "--environments", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would remove environment folder {other} (torch 2.11.0+cpu, Python 3.12" \
        in " ".join(dry.stdout.split()), dry.stdout
    assert other.exists() and legacy.exists()
    done = _run(first_run, CLI, "--cache-dir", str(store), "gc", "--environments")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert f"removed environment folder {other}" in text
    assert f"removed environment folder {legacy}" in text
    assert not other.exists() and not legacy.exists()
    assert f"kept {notes}: not an environment folder" in text
    assert (notes / "todo.txt").read_text() == "keep me"
    assert (folder / "environment.json").exists() and list(folder.glob("aoti-cpu-*.json"))
    # With $CACHEBUILD_PROBE_DIR elsewhere, this torch's, Python's and CPU's own folder
    # (what this user's other shells use) is still this environment's: kept.
    elsewhere = first_run["root"] / "probe-elsewhere"
    again = _run(first_run, CLI, "--cache-dir", str(store), "gc", "--environments",
                 CACHEBUILD_PROBE_DIR=str(elsewhere))
    assert again.returncode == 0, again.stderr
    assert str(folder) not in again.stdout, again.stdout
    assert (folder / "environment.json").exists()


def test_the_folder_of_environment_folders_is_made_private(tmp_path):
    """A new user's first environment folder: it and the folder holding every one of them
    are 0700, so no one else learns which environments this user has."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEBUILD_")}
    env |= {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    made = subprocess.run([sys.executable, "-c", "from cachebuild.backends.probe import "
                           "checked_dir; print(checked_dir())"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    folder = Path(made.stdout.strip())
    assert folder.parent == home / ".cache" / "cachebuild" / "env"
    assert (folder.stat().st_mode & 0o777, folder.parent.stat().st_mode & 0o777) == (0o700, 0o700)


def test_gc_removes_kept_objects_no_build_used_for_a_week_unless_a_build_holds_them(tmp_path):
    """The C++ objects builds keep for reuse (every store of the user shares them) go
    with their records once no build has made or reused them for a week; newer ones stay,
    and nothing goes while a build holds the folder."""
    import time

    from cachebuild.backends import environment

    folder = tmp_path / "environment"
    for part in environment.OBJECTS:
        (folder / part).mkdir(mode=0o700, parents=True)
    os.chmod(folder, 0o700)
    now = time.time()
    for name, age_days in (("old.o", 8), ("new.o", 1)):
        kept = folder / "cxx" / name
        kept.write_bytes(b"x" * 100)
        (folder / "built" / "cxx" / name).write_text("digest")
        os.utime(kept, (now - age_days * 86400,) * 2)
    with environment.in_use(folder):  # a build runs
        assert environment.clean_objects(folder, dry_run=False, now=now) == (0, False)
    assert environment.clean_objects(folder, dry_run=True, now=now) == (100, True)
    assert (folder / "cxx" / "old.o").exists()
    assert environment.clean_objects(folder, dry_run=False, now=now) == (100, True)
    assert sorted(p.name for p in (folder / "cxx").iterdir()) == ["new.o"]
    assert sorted(p.name for p in (folder / "built" / "cxx").iterdir()) == ["new.o"]


def test_gc_counts_only_the_objects_it_removed_and_names_a_folder_it_cannot_lock(
        tmp_path, monkeypatch):
    """An object that cannot be removed is not reported as removed (run again, it is not
    counted twice); a folder whose lock cannot be opened is named with the reason, not
    taken for one a build holds."""
    import time

    from click.testing import CliRunner

    from cachebuild.backends import environment
    from cachebuild.cli import main as cli
    from cachebuild.store import LocalStore

    folder = tmp_path / "environment"
    for part in environment.OBJECTS:
        (folder / part).mkdir(mode=0o700, parents=True)
    os.chmod(folder, 0o700)
    now = time.time()
    for name in ("stuck.o", "gone.o"):
        kept = folder / "cxx" / name
        kept.write_bytes(b"x" * 100)
        (folder / "built" / "cxx" / name).write_text("digest")
        os.utime(kept, (now - 8 * 86400,) * 2)
    unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if str(path).endswith("cxx/stuck.o"):
            raise PermissionError(13, "Permission denied", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    assert environment.clean_objects(folder, dry_run=False, now=now) == (100, True)
    assert environment.clean_objects(folder, dry_run=False, now=now) == (0, True)
    assert [p.name for p in (folder / "cxx").iterdir()] == ["stuck.o"]
    monkeypatch.undo()

    (folder / environment.IN_USE).unlink(missing_ok=True)
    (folder / environment.IN_USE).mkdir()  # a lock file that cannot be opened
    with pytest.raises(OSError):
        environment.clean_objects(folder, dry_run=False, now=now)
    monkeypatch.setenv("CACHEBUILD_PROBE_DIR", str(folder))
    with LocalStore(tmp_path / "store"):
        pass
    result = CliRunner().invoke(cli.main, ["--cache-dir", str(tmp_path / "store"), "gc"])
    assert result.exit_code == 0, result.output
    assert f"kept C++ objects of {folder} stay: " in result.output, result.output
    assert "a build is running" not in result.output
