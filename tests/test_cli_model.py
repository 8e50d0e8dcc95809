"""The model commands through the real CLI: warm, plan, explain, pin, and bad model files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cachebuild.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"LLAMA_LAYERS": "2", "LLAMA_HIDDEN": "64", "LLAMA_HEADS": "4", "LLAMA_KV_HEADS": "2",
         "LLAMA_MLP": "128", "LLAMA_VOCAB": "128"}
SUMMARY = re.compile(r"(\d+) targets?: (\d+) already stored, (\d+) built, (\d+) failed")

MODEL = f"""
import dataclasses, sys
sys.path.insert(0, {str(ROOT / "examples")!r})
import llama

def build():
    spec = llama.build()
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, backend="eager_fusion"))
"""


def cli(store: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True):
    full_env = {**os.environ, **SMALL, **(env or {}), "CACHEBUILD_DIR": str(store),
                }
    command = [sys.executable, "-m", "cachebuild.cli", *args]
    if not wait:
        return subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=600)


def summary(text: str) -> tuple[int, int, int, int]:
    match = SUMMARY.search(" ".join(text.split()))
    assert match, text[-2000:]
    return tuple(int(g) for g in match.groups())  # type: ignore[return-value]


def snapshot(store: Path) -> set:
    """What the store holds: records (key, kind, size, pinned, and their use: hits and last
    used, which GC goes by), blob files, and the store's hit and miss counts."""
    with LocalStore(store) as s:
        records = {(r.key, r.kind, r.size, r.pinned, r.hits, r.last_used)
                   for r in s.records(manifests=False)}
        stats = s.stats()
    files = {str(p.relative_to(store)) for p in (store / "v1" / "objects").rglob("*") if p.is_file()}
    return records | files | {("hits", stats.hits), ("misses", stats.misses)}


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


@pytest.mark.parametrize(("source", "expected"), [
    (None, "no such model file"),
    ("import nonexistent_module_xyz\n", "failed to import: ModuleNotFoundError"),
    ("x = 1\n", "defines no build() function"),
    ("def build():\n    raise RuntimeError('no weights here')\n", "build() raised RuntimeError"),
    ("def build():\n    return 42\n", "not a cachebuild.ModelSpec"),
])
def test_bad_model_files_exit_2_with_one_line(tmp_path, source, expected):
    path = tmp_path / "bad.py"
    if source is not None:
        path.write_text(source)
    proc = cli(tmp_path / "store", "warm", str(path))
    assert proc.returncode == 2, proc.stderr
    # Piped, each phase is a line as it starts ("[  0.1 s] importing bad.py ..."): what the
    # command was doing when it failed; the error itself is one line, and the only other.
    said = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    lines = [ln for ln in said if not re.match(r"\[ *[0-9.]+ s\] ", ln)]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert all("importing bad.py" in ln for ln in said if ln not in lines), proc.stderr
    assert expected in lines[0] and str(path) in " ".join(lines[0].split())
    assert "Traceback" not in proc.stderr
    if source and "raise" in source:
        assert f"{path}:2" in lines[0]  # the line that raised


_SPEC = ("import torch, cachebuild\n"
         "def build():\n"
         "    return cachebuild.ModelSpec({model}, (torch.randn(4, 4),), {{0: 0}},\n"
         "                                cachebuild.CompileConfig(backend='eager_fusion'))\n")


@pytest.mark.parametrize(("model", "expected"), [
    ("type('M', (torch.nn.Module,), {'forward': lambda self, x: None})()",
     "the model's forward computes no tensor (it returns None"),
    ("torch.nn.BatchNorm1d(4).eval()",
     "graph calls torch.nn.functional.batch_norm, which stored graphs may not call"),
])
def test_a_model_that_traces_to_nothing_to_store_is_bad_input(tmp_path, model, expected):
    """Refused after the trace, before any build: exit 2 (bad input), one line."""
    path = tmp_path / "m.py"
    path.write_text(_SPEC.format(model=model))
    proc = cli(tmp_path / "store", "warm", str(path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("name", "expected"), [
    ("missing.py", "no such model file; a model file is a .py file that defines build()"),
    ("README.md", "not a Python file; a model file is a .py file that defines build()"),
])
def test_a_path_that_is_no_model_file_is_one_line_before_anything_starts(tmp_path, name,
                                                                         expected):
    """``warm`` of a path that names no model file says so, and what a model file is,
    before any phase line (no "importing ..." for a file that is not there)."""
    path = tmp_path / name
    if name.endswith(".md"):
        path.write_text("# notes\n")
    proc = cli(tmp_path / "store", "warm", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: {path}: {expected} -> cachebuild.ModelSpec\n"
    assert not (tmp_path / "store").exists()
    # Refused at once: torch (seconds to import) is not imported for it.
    code = ("import sys\nfrom click.testing import CliRunner\nfrom cachebuild.cli.main import main\n"
            f"result = CliRunner().invoke(main, ['warm', {str(path)!r}])\n"
            "print(result.exit_code, 'torch' in sys.modules)")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.stdout.split() == ["2", "False"], child.stderr


@pytest.mark.parametrize("env,expected", [
    ({"CACHEBUILD_REMOTE_MODE": "bogus"}, "must be one of rw, ro, off, not 'bogus'"),
    ({"CACHEBUILD_DIR": "open"}, "Fix with: chmod 700"),
])
def test_the_quick_start_server_says_bad_settings_in_one_line(tmp_path, env, expected):
    """``python examples/llama.py`` (the README's server) with a bad setting: one line,
    exit 2, no traceback and nothing built."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    env = {k: str(open_dir) if v == "open" else v for k, v in env.items()}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "llama.py")],
                          env={**os.environ, **SMALL, "CACHEBUILD_DIR": str(tmp_path / "s"),
                               **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    said = [line for line in proc.stderr.splitlines() if not line.startswith("cachebuild")]
    assert len([line for line in said if line.startswith("error: ")]) == 1, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "s" / "v1" / "objects").exists() or \
        not any((tmp_path / "s" / "v1" / "objects").iterdir())


def test_a_bad_building_variable_is_one_line_before_a_model_command_traces(tmp_path, model):
    proc = cli(tmp_path / "store", "plan", str(model), env={"CACHEBUILD_BUILD_MEMORY": "lots"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: CACHEBUILD_BUILD_MEMORY='lots'")
    assert "tracing" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_file_imported_already_is_not_run_twice(tmp_path, monkeypatch):
    """A model file its server imported as a plain module (``import mymodel``) defines its
    custom ops once: loading it as a model file hands back that module."""
    from cachebuild.modelfile import import_model

    path = tmp_path / "mf_ops_once.py"
    path.write_text("import torch\n_LIB = torch.library.Library('mf_ops_once', 'DEF')\n"
                    "_LIB.define('twice(Tensor x) -> Tensor')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mf_ops_once  # noqa: F401 (the server's own import)

    assert import_model(path) is sys.modules["mf_ops_once"]
    assert import_model(str(path)) is sys.modules["mf_ops_once"]


def test_a_model_file_imports_the_modules_beside_it_and_its_package(tmp_path, monkeypatch):
    """As ``python m.py`` and ``python -m pkg.models.m`` import them: a file's siblings by
    their own names; a file inside a package under its dotted name, relative imports and
    all, the very module a server importing ``pkg.models.m`` gets."""
    from cachebuild.modelfile import import_model

    monkeypatch.setattr(sys, "path", list(sys.path))
    loaded = set(sys.modules)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "mf_sibling.py").write_text("VALUE = 3\n")
    (plain / "mf_plain.py").write_text("import mf_sibling\nVALUE = mf_sibling.VALUE\n")
    assert import_model(plain / "mf_plain.py").VALUE == 3
    models_dir = tmp_path / "root" / "mfpkg" / "models"
    models_dir.mkdir(parents=True)
    (models_dir.parent / "__init__.py").write_text("")
    (models_dir / "__init__.py").write_text("")
    (models_dir / "parts.py").write_text("VALUE = 5\n")
    (models_dir / "m.py").write_text("from . import parts\nVALUE = parts.VALUE\n")
    module = import_model(models_dir / "m.py")
    assert module.__name__ == "mfpkg.models.m" and module.VALUE == 5
    import mfpkg.models.m  # noqa: F401 (what a server does)

    assert sys.modules["mfpkg.models.m"] is module
    for name in set(sys.modules) - loaded:  # the test's files, gone with its folder
        del sys.modules[name]


@pytest.mark.slow
def test_dry_run_plan_and_explain_change_nothing(tmp_path, model):
    """Looking is not using: ``warm --dry-run``, ``plan`` and ``explain`` store nothing and
    count no hit, so they change nothing GC goes by; where there is no store they make none
    (a mistyped path stays absent), and say so."""
    store = tmp_path / "store"
    for args in (["warm", "--dry-run"], ["plan"], ["explain"]):
        proc = cli(store, *args, str(model))
        assert proc.returncode == 0, proc.stderr
        assert f"no store at {store} yet" in " ".join(proc.stderr.split()), proc.stderr
        assert "missing" in proc.stdout + proc.stderr
        assert not store.exists(), args
    # A place no store could be made is refused as `warm` refuses it, not looked past.
    (tmp_path / "a-file").write_text("")
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    for place in (tmp_path / "a-file", tmp_path / "open"):
        for args in (["plan"], ["warm", "--dry-run"], ["warm"]):
            proc = cli(place, *args, str(model))
            assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    store.mkdir()  # an empty folder is no store either, and stays empty
    assert "would be built" in cli(store, "warm", "--dry-run", str(model)).stderr
    assert not any(store.iterdir())
    assert snapshot(store) == {("hits", 0), ("misses", 0)}  # an empty store stays empty
    assert "would be built" in cli(store, "warm", "--dry-run", str(model)).stderr
    warm = cli(store, "warm", str(model), "--jobs", "2")
    assert summary(warm.stderr)[2] == 3
    # No noise: torch's own warnings during a build are not printed (nor NumPy's absence).
    assert "Warning" not in warm.stderr and "NumPy" not in warm.stderr, warm.stderr
    before = snapshot(store)
    for args in (["warm", "--dry-run"], ["plan"], ["explain"]):
        proc = cli(store, *args, str(model))
        assert proc.returncode == 0, proc.stderr
    assert snapshot(store) == before
    plan = cli(store, "plan", str(model)).stdout
    assert plan.count("stored") >= 3 and "missing" not in plan
    assert "every target is stored" in cli(store, "explain", str(model)).stdout


def test_plan_says_an_imported_entry_is_not_trusted_rather_than_none(tmp_path, model):
    """An entry imported from a bundle nobody trusted is not served: plan says so and how
    to serve it, not that there is no entry."""
    source, target = tmp_path / "source", tmp_path / "target"
    assert cli(source, "warm", str(model)).returncode == 0
    bundle = tmp_path / "cache.tar"
    assert cli(source, "export", str(bundle)).returncode == 0
    assert cli(target, "import", str(bundle)).returncode == 0
    said = " ".join(cli(target, "plan", str(model)).stdout.split())
    assert f"stored but not trusted: `cachebuild trust 'bundle {bundle.name} (" in said
    assert ")'` serves it" in said
    assert cli(target, "trust", f"bundle {bundle.name}").returncode == 0
    assert "(stored)" in cli(target, "plan", str(model)).stdout


def test_two_warms_at_once_build_each_target_once(tmp_path, model):
    store = tmp_path / "store"
    runs = [cli(store, "warm", str(model), "--jobs", "2", wait=False) for _ in range(2)]
    results = [r.communicate(timeout=600) for r in runs]
    assert all(r.returncode == 0 for r in runs), results
    totals = [summary(err) for _, err in results]
    assert {t[0] for t in totals} == {3}
    assert sum(t[2] for t in totals) == 3  # built once in total
    assert cli(store, "warm", str(model)).returncode == 0
    assert summary(cli(store, "warm", str(model)).stderr)[1:3] == (3, 0)


def test_explain_names_what_changed_and_pin_keeps_the_entry(open_local, tmp_path, model):
    store = tmp_path / "store"
    assert cli(store, "warm", str(model)).returncode == 0
    proc = cli(store, "explain", str(model), env={"LLAMA_MAX_TOKENS": "256"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert text.count("missing") == 3 and "a different shape bucket" in text
    # Same buckets, a wider MLP: the two pieces holding an MLP are stale; the first piece
    # (embedding, norm, qkv) has no MLP and is still stored.
    plan = cli(store, "plan", str(model), env={"LLAMA_MLP": "192"}).stdout
    assert plan.count("stale") == 2 and plan.count("stored") == 1
    changed = " ".join(cli(store, "explain", str(model), env={"LLAMA_MLP": "192"}).stdout.split())
    # The same two pieces are stale in explain's words too, and it names what changed.
    assert changed.count(") stale; nearest ") == 2, changed
    assert "float32 [64, 128] → float32 [64, 192]" in changed  # the down projection
    assert "parameter layers.0.down.weight: float32 [64, 128] → float32 [64, 192]" in changed
    assert cli(store, "pin", str(model)).returncode == 0
    with open_local(store) as s:
        entries = [r for r in s.records() if r.kind == "entry"]
    assert len(entries) == 1 and entries[0].pinned
    gc = cli(store, "gc", "--max-size", "0")
    assert gc.returncode == 0, gc.stderr
    assert summary(cli(store, "warm", str(model)).stderr)[1:3] == (3, 0)  # survived GC


def test_failing_target_is_reported_and_the_others_build(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL + textwrap.dedent("""
        from cachebuild.backends import register_backend
        from cachebuild.backends.eager_fusion import EagerFusionBackend

        class Flaky(EagerFusionBackend):
            name = "flaky"
            def compile(self, request):
                if any("embedding" in str(n.target) for n in request.gm.graph.nodes):
                    raise RuntimeError("this compiler rejects the piece")  # the first piece
                return super().compile(request)

        register_backend("flaky", Flaky)

        def build():
            spec = llama.build()
            return dataclasses.replace(spec, config=dataclasses.replace(spec.config, backend="flaky"))
        """))
    proc = cli(tmp_path / "store", "warm", str(path), "--jobs", "2")
    total, stored, built, failed = summary(proc.stderr)
    assert (total, built, failed) == (3, 2, 1)
    assert proc.returncode == 1
    text = " ".join(proc.stderr.split())
    assert "this compiler rejects the piece" in text and "piece 0 range 1-512" in text


@pytest.mark.parametrize("folder, said", [("sp ace", "a space"), ("o'q", "a \"'\""),
                                          ("back\\slash", "a '\\\\'")])
def test_a_store_path_with_a_space_says_how_to_build_there(tmp_path, folder, said):
    """Inductor splits its C++ compiler's command as a shell would: a build whose work
    folder has a space, a quote or a backslash in its path is refused in words that say
    what to set, not with the compiler's "C++ compile error" (or a piece quietly built
    another way): a usage error (exit 2), before the model is traced."""
    path = tmp_path / "model.py"
    path.write_text(MODEL.replace('backend="eager_fusion"', 'backend="inductor"'))
    proc = cli(tmp_path / folder / "store", "warm", str(path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    text = " ".join(proc.stderr.split())
    assert f"has {said} in its path" in text and "CACHEBUILD_WORK_DIR" in text, text[-2000:]
    assert "targets of model.py" not in text and "built piece" not in text, text[-2000:]


def test_a_server_start_on_a_store_path_with_a_space_says_it_once_before_tracing(tmp_path):
    """The library's front door says what `warm` says, once, before the trace (it traced,
    failed every piece saying it each time, and raised CompileFailed)."""
    import torch

    import cachebuild
    from cachebuild.counters import COUNTERS
    from cachebuild.errors import UsageError
    from cachebuild.store import LocalStore

    store = LocalStore(tmp_path / "sp ace" / "store")
    compiled = cachebuild.compile(torch.nn.Linear(4, 4), cachebuild.CompileConfig(
        backend="inductor"), {0: 0}, store=store)
    traced = COUNTERS.traced
    with pytest.raises(UsageError, match="has a space in its path.*CACHEBUILD_WORK_DIR"):
        compiled(torch.randn(3, 4))
    assert COUNTERS.traced == traced
    store.close()


def test_a_store_that_cannot_be_made_is_a_usage_error_naming_the_variable(tmp_path):
    """A store path under a folder this user may not write (a read-only mount here):
    `warm` refuses it in one line, exit 2, naming CACHEBUILD_DIR (it was exit 1, the
    system's words alone), and `plan` says the same."""
    from mounts import mounted

    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o700)
    with mounted(["--bind", "-o", "ro", str(ro)], ro, "a read-only bind"):
        for command in ("warm", "plan"):
            proc = cli(ro / "store", command, str(path))
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
            assert "CACHEBUILD_DIR" in errors[0] and "Traceback" not in proc.stderr, errors
        assert not (ro / "store").exists()


def test_plan_names_tmpdir_when_its_look_in_store_cannot_be_made_there(tmp_path):
    """`plan` with no store looks in an empty one in the temporary folder: where TMPDIR
    is open to others, the refusal says it came from TMPDIR (it named a folder the user
    never gave)."""
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    open_tmp = tmp_path / "open"
    open_tmp.mkdir()
    os.chmod(open_tmp, 0o777)
    proc = cli(tmp_path / "none" / "store", "plan", str(path), env={"TMPDIR": str(open_tmp)})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "(TMPDIR)" in errors[0] and "set TMPDIR" in errors[0], errors


def test_a_work_folder_on_a_noexec_mount_is_named(tmp_path):
    """Libraries built in a work folder mounted noexec cannot be loaded: the build says
    so and names CACHEBUILD_WORK_DIR, not that the piece does not match eager."""
    from mounts import mounted

    path = tmp_path / "model.py"
    path.write_text(MODEL.replace('backend="eager_fusion"', 'backend="inductor"'))
    mnt = tmp_path / "nx"
    mnt.mkdir()
    with mounted(["-t", "tmpfs", "-o", "size=512m,mode=0700,noexec", "tmpfs"], mnt,
                 "a noexec tmpfs"):
        proc = cli(mnt / "store", "warm", str(path), "--jobs", "1")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "mounted noexec" in text, text[-3000:]
    assert "CACHEBUILD_WORK_DIR" in text and "does not match" not in text, text[-3000:]


def test_a_failed_cxx_compile_says_what_the_compiler_said():
    from torch._inductor.exc import CppCompileError

    from cachebuild.building.build import compiler_said

    output = "In file included from x.h:1,\nx.cpp:3:5: error: 'y' was not declared\n"
    try:
        try:
            raise CppCompileError(["g++", "x.cpp"], output)
        except CppCompileError as inner:
            raise RuntimeError("InductorError: CppCompileError: C++ compile error") from inner
    except RuntimeError as e:
        assert compiler_said(e) == "x.cpp:3:5: error: 'y' was not declared"
    assert compiler_said(ValueError("no compiler here")) is None


def test_a_long_list_said_is_cut_after_an_item_not_inside_a_word():
    from cachebuild.cli.common import printable

    owners = "; ".join(f"layers.{i}: DecoderLayer" for i in range(40))
    said = printable(f"source of llama.py a → b ({owners})", 300)
    assert said.endswith("DecoderLayer; …") and len(said) <= 303
    assert printable("x" * 400, 300) == "x" * 300 + "…"
    assert printable("a\x1b[2Jb", 300) == "a\\x1b[2Jb"


@pytest.mark.parametrize("name,code,said", [("SIGTERM", 143, "error: terminated (SIGTERM)"),
                                             ("SIGINT", 130, "error: interrupted (Ctrl-C)")])
def test_sigterm_ends_a_command_as_ctrl_c_does(tmp_path, name, code, said):
    """SIGTERM (a `kill`, a job's timeout) ends a command the way Ctrl-C does: one line,
    exit 128 + the signal's number, as shells count it, and the command lets go of what
    it held: here the temporary store a look at a place with no store uses, which the
    default SIGTERM would leave behind."""
    import signal
    import time

    slow = tmp_path / "slow.py"
    slow.write_text("import time\nprint('importing', flush=True)\ntime.sleep(120)\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = cli(tmp_path / "none", "plan", str(slow), env={"TMPDIR": str(scratch)}, wait=False)
    assert proc.stdout.readline().strip() == "importing"
    assert [p.name for p in scratch.iterdir()][0].startswith("cachebuild-look-")
    proc.send_signal(getattr(signal, name))
    began = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - began < 30
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == said, err
    assert "Traceback" not in err, err
    assert not any(scratch.iterdir()) and not (tmp_path / "none").exists()


def test_a_worker_that_cannot_set_up_fails_its_targets_in_one_line_each(tmp_path):
    """A build worker whose setup fails (here the model file imports in the command's
    process but raises in any other) prints no traceback: each target fails with the
    reason, and `warm` ends with exit 1."""
    marker = tmp_path / "first-import"
    model = tmp_path / "once.py"
    model.write_text(textwrap.dedent(f"""
        import os, sys
        marker = {str(marker)!r}
        if os.path.exists(marker) and open(marker).read() != str(os.getpid()):
            raise RuntimeError("this model file imports in one process only")
        open(marker, "w").write(str(os.getpid()))
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import llama

        def build():
            return llama.build()
    """))
    proc = cli(tmp_path / "store", "warm", str(model), "--jobs", "1")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    said = " ".join(proc.stderr.split())
    # Each target's reason on its progress line and again in the summary of failures.
    assert said.count("the build worker could not set up: ") == 6, proc.stderr
    assert "RuntimeError: this model file imports in one process only" in said, proc.stderr
    assert summary(proc.stderr)[2:] == (0, 3), proc.stderr


OUTPUT_CLASSES = f"""
import collections, dataclasses, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import torch, cachebuild, models


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    pair: tuple


Pair = collections.namedtuple("Pair", "first second")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = models.make(models.LayerStack, layers=1)

    def forward(self, x, pos):
        h = self.inner(x, pos)
        return Out(h, Pair(h * 2, h.sum()))


def build():
    torch.manual_seed(0)
    return cachebuild.ModelSpec(Net().eval(), models.hidden_inputs(8), {{0: 0, 1: 0}},
                                models.config(compile_ranges=((1, 16),)))


def serve():
    spec = build()
    compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims)
    x, pos = models.hidden_inputs(5)
    with torch.no_grad():
        got, want = compiled(x, pos), spec.model(x, pos)
    assert type(got) is Out and type(got.pair) is Pair, (type(got), type(got.pair))
    for a, b in ((got.hidden, want.hidden), (got.pair.first, want.pair.first),
                 (got.pair.second, want.pair.second)):
        torch.testing.assert_close(a, b, **models.TOL)
    print(cachebuild.stats()["traced"])


if __name__ == "__main__":
    serve()
"""


def test_output_classes_of_the_model_file_are_found_whatever_it_is_imported_as(tmp_path):
    """A dataclass or namedtuple the model's file defines, as its output: `warm` imports
    the file under a name of its own, the server runs it as __main__ (or imports it by its
    name): each finds the class in the file it loaded."""
    path = tmp_path / "outputs_model.py"
    path.write_text(OUTPUT_CLASSES)
    store = tmp_path / "store"
    warmed = cli(store, "warm", str(path))
    assert warmed.returncode == 0, warmed.stderr[-2000:]
    env = {**os.environ, "CACHEBUILD_DIR": str(store)}
    served = subprocess.run([sys.executable, str(path)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert served.returncode == 0, served.stderr[-3000:]
    assert served.stdout.split()[-1] == "0"  # warm: nothing traced
    imported = subprocess.run([sys.executable, "-c", "import outputs_model; "
                               "outputs_model.serve()"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.split()[-1] == "0"


def test_warm_of_a_model_no_entry_can_be_recorded_for_says_so_in_its_last_line(tmp_path):
    """An nn.Sequential called as the model: its forward's ``*args`` has no plain path for
    a guard, so no entry is recorded. The targets are built; the summary names no entry
    key (a start would not find one)."""
    path = tmp_path / "seq.py"
    path.write_text(textwrap.dedent("""
        import cachebuild, torch
        import torch.nn as nn

        def build():
            m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
            return cachebuild.ModelSpec(m, (torch.randn(3, 4),), {0: 0},
                                        cachebuild.CompileConfig(backend="eager_fusion"))
        """))
    proc = cli(tmp_path / "store", "warm", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "no entry recorded: every start traces the model" in last, last
    assert " entry " not in last.split(";")[-1].replace("no entry recorded", "")


TWO_VERSIONS_MODEL = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import torch, cachebuild, models
import helper


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = models.make(models.LayerStack, layers=1)

    def forward(self, x, pos):
        return helper.mix(self.inner(x, pos))


def build():
    torch.manual_seed(0)
    return cachebuild.ModelSpec(Net().eval(), models.hidden_inputs(8), {{0: 0, 1: 0}},
                                models.config(compile_ranges=((1, 16),)))


if __name__ == "__main__":
    spec = build()
    compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims)
    x, pos = models.hidden_inputs(5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, pos), spec.model(x, pos), **models.TOL)
    print(cachebuild.stats()["traced"])
"""


def test_two_versions_of_a_module_the_model_imports_keep_their_entries_in_one_store(tmp_path):
    """Two checkouts of one model whose model file is the same and whose imported helper
    differs (a rolling deploy onto one store): each version's entry is kept, so that
    neither start traces again after both were warmed (they replaced each other's)."""
    store = tmp_path / "store"
    for name, op in (("a", "tanh"), ("b", "sigmoid")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.py").write_text(TWO_VERSIONS_MODEL)
        (tmp_path / name / "helper.py").write_text(
            f"import torch\n\ndef mix(x):\n    return torch.{op}(x) + x\n")
        warmed = cli(store, "warm", str(tmp_path / name / "model.py"))
        assert warmed.returncode == 0, warmed.stderr[-2000:]
    env = {**os.environ, "CACHEBUILD_DIR": str(store)}
    for name in ("a", "b", "a"):
        served = subprocess.run([sys.executable, str(tmp_path / name / "model.py")], env=env,
                                capture_output=True, text=True, timeout=600)
        assert served.returncode == 0, served.stderr[-3000:]
        assert served.stdout.split()[-1] == "0", (name, served.stderr[-2000:])


def test_output_classes_no_file_holds_are_kept_by_name_as_before(monkeypatch):
    """A class from a notebook cell (its text in linecache, its module no file of it) is
    kept by its module's name, as pickle keeps it; one made inside a function is refused
    when traced, not at every call after."""
    import dataclasses
    import linecache
    import types

    import torch

    from cachebuild.errors import UsageError
    from cachebuild.graph.outputs import output_builder, output_recipe

    def make():
        @dataclasses.dataclass
        class Local:
            logits: torch.Tensor
        return Local

    t = torch.ones(2)
    with pytest.raises(UsageError, match="cannot be rebuilt without Dynamo"):
        output_recipe(make()(t), [t])

    text = "import dataclasses, torch\n@dataclasses.dataclass\nclass CellOut:\n" \
           "    logits: torch.Tensor\n"
    cell = "/tmp/ipykernel_0/cell_for_output_classes.py"
    monkeypatch.setitem(linecache.cache, cell, (len(text), None, text.splitlines(True), cell))
    module = types.ModuleType("cell_module_for_output_classes")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(text, cell, "exec"), vars(module))
    rebuilt = output_builder(output_recipe(module.CellOut(t), [t]))([t * 2], [], [])
    assert type(rebuilt) is module.CellOut and torch.equal(rebuilt.logits, t * 2)


def _marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``mark`` (the command's and its children's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_ctrl_c_during_warm_ends_its_builds_and_starts_none(tmp_path):
    """A Ctrl-C at the terminal (SIGINT to the command's process group) while a target
    builds: no build starts after it, the workers end with the command (none writes to the
    store after it exits; a second Ctrl-C left them building), exit 130, and the store is
    whole."""
    import signal
    import uuid

    path = tmp_path / "model.py"
    path.write_text(MODEL.replace('backend="eager_fusion"', 'backend="inductor"'))
    mark = f"cachebuild-test-{uuid.uuid4().hex}"
    env = {**os.environ, **SMALL, "CACHEBUILD_DIR": str(tmp_path / "store"), mark: "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild.cli", "warm", "-j", "1",
                             str(path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "building piece" in line:
            break
    else:
        pytest.fail("".join(seen))
    os.killpg(proc.pid, signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 130, "".join(seen) + rest
    assert "building piece" not in rest, rest
    assert rest.strip().splitlines()[-1] == "error: interrupted (Ctrl-C)", rest
    # The workers are gone; what they started ends as its pipes close (a moment).
    import time

    for _ in range(100):
        if not _marked(mark):
            break
        time.sleep(0.1)
    assert _marked(mark) == []
    verify = cli(tmp_path / "store", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
