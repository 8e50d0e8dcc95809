"""``cachebuild warm --watch`` through the real CLI, in real processes: it warms, then
warms again after each edit of the model file (a value the trace reads), building only the
piece that changed; a model file that breaks is one round that fails, and the next edit
warms again; Ctrl-C ends it, its waiting round with it. What a round records is what a
fresh process finds: the edited model served from the store, equal to eager."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.test_cli_model import ROOT, SMALL, _marked, summary

#: The line edited: the final norm's epsilon, which only the last piece reads.
EDIT = ("self.norm = nn.RMSNorm(hidden, eps=1e-5)", "self.norm = nn.RMSNorm(hidden, eps=1e-2)")

CHECK = """
import sys, torch, cachebuild
from cachebuild.modelfile import import_model
from cachebuild.store import LocalStore
llama = import_model(sys.argv[1])
torch.manual_seed(0)
spec = llama.build()
compiled = cachebuild.compile(spec.model, spec.config, spec.dynamic_dims,
                              store=LocalStore(sys.argv[2]))
with torch.no_grad():
    for tokens in (3, 9):
        ids, pos = llama.example_inputs(spec.model, tokens=tokens)
        torch.testing.assert_close(compiled(ids, pos), spec.model(ids, pos),
                                   rtol=1e-4, atol=1e-4)
stats = cachebuild.stats()
print("built", stats["built"], "traced", stats.get("traced"))
"""


class Lines:
    """The command's output, line by line, read in a thread (to wait for one with a
    time limit)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def until(self, text: str, timeout: float = 600) -> list[str]:
        """The lines up to and with the next one holding ``text``."""
        got: list[str] = []
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {text!r} in time:\n" + "".join(self.seen))
            if line is None:
                pytest.fail(f"ended before {text!r}:\n" + "".join(self.seen))
            got.append(line)
            self.seen.append(line)
            if text in line:
                return got

    def rest(self, timeout: float = 60) -> str:
        """Every line left, once the output has ended."""
        while True:
            line = self._q.get(timeout=timeout)
            if line is None:
                return "".join(self.seen)
            self.seen.append(line)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_watch_warms_again_after_each_edit_and_ctrl_c_ends_it(tmp_path):
    model = tmp_path / "llama.py"
    text = (ROOT / "examples" / "llama.py").read_text()
    assert text.count(EDIT[0]) == 1 and text.count("\nimport cachebuild\n") == 1
    # A module beside it that the model file imports (its build() could read it): watched
    text = text.replace("\nimport cachebuild\n", "\nimport cachebuild\nimport beside  # noqa\n")
    (tmp_path / "beside.py").write_text("SIZE = 1\n")
    model.write_text(text)
    store = tmp_path / "store"
    mark = f"cachebuild-watch-test-{uuid.uuid4().hex}"  # in every process it starts
    env = {**os.environ, **SMALL, "LLAMA_BACKEND": "eager_fusion", "CACHEBUILD_DIR": str(store),
           mark: "1"}
    # Run as a user runs it, the command from a folder where another user left a json.py:
    # neither the watcher nor its rounds may import it.
    command = Path(sys.executable).with_name("cachebuild")
    planted = tmp_path / "cwd"
    planted.mkdir()
    (planted / "json.py").write_text(f"open({str(tmp_path / 'PLANTED')!r}, 'w').close()\n"
                                     "from importlib import import_module\n")
    proc = subprocess.Popen([str(command) if command.exists() else sys.executable,
                             *([] if command.exists() else ["-m", "cachebuild.cli"]),
                             "warm", str(model), "--watch"], env=env, cwd=planted,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = Lines(proc)
        first = out.until("watching")
        assert summary("".join(first))[2] == 3, "".join(first)  # 3 targets built
        assert "warmed in" in first[-1] and "2 files" in first[-1], first[-1]

        time.sleep(1.0)  # an edit comes later than this
        model.write_text(text.replace(*EDIT))
        again = out.until("watching")
        assert f"{model} changed: warming again" in "".join(again)
        assert summary("".join(again))[1:] == (2, 1, 0), "".join(again)  # the last piece
        assert "warmed again in" in again[-1], again[-1]

        model.write_text(text.replace(*EDIT) + "\nthis is not python\n")
        broken = out.until("watching")
        assert "round ended with exit code 2" in broken[-1], "".join(broken)
        assert "Traceback" not in "".join(broken)
        model.write_text(text.replace(*EDIT) + "\n# fixed\n")
        fixed = out.until("watching")
        assert summary("".join(fixed))[1:] == (3, 0, 0), "".join(fixed)  # nothing to build
        (tmp_path / "beside.py").write_text("SIZE = 2\n")
        helper = out.until("watching")
        assert f"{tmp_path / 'beside.py'} changed" in "".join(helper), "".join(helper)
        # A module imported for the first time and broken from the start (it never ran),
        # then one the model file imports and that is not there: the fix of the one and
        # the making of the other each warm again.
        imports = "\nimport beside  # noqa\n"
        (tmp_path / "fresh.py").write_text("def f(:\n")
        for name in ("fresh", "absent"):
            module = tmp_path / f"{name}.py"
            model.write_text(text.replace(*EDIT).replace(imports, f"{imports}import {name}\n"))
            broken = out.until("watching")
            assert "round ended with exit code 2" in broken[-1], "".join(broken)
            module.write_text("SIZE = 1\n")
            fixed = out.until("watching")
            assert f"{module} changed: warming again" in "".join(fixed), "".join(fixed)
            assert summary("".join(fixed))[1:] == (3, 0, 0), "".join(fixed)
        # A module the model's build() imports from now on, edited while that round runs
        # (after its import): the edit is a change after the round, which warms again.
        late = tmp_path / "late.py"
        late.write_text("SIZE = 1\n")
        build = "def build() -> cachebuild.ModelSpec:\n"
        assert text.count(build) == 1
        model.write_text(text.replace(*EDIT).replace(build, build + "    __import__('late')\n"))
        out.until("tracing")
        late.write_text("SIZE = 2\n")
        out.until("watching")
        after = out.until("watching", timeout=300)
        assert f"{late} changed: warming again" in "".join(after), "".join(after)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 0, "".join(out.seen)
    assert out.rest().splitlines()[-1] == "stopped watching", out.seen[-5:]
    assert not (tmp_path / "PLANTED").exists()
    for _ in range(100):  # the round that waited for the next edit ends with it
        if not _marked(mark):
            break
        time.sleep(0.1)
    assert _marked(mark) == []

    check = tmp_path / "check.py"
    check.write_text(CHECK)
    done = subprocess.run([sys.executable, str(check), str(model), str(store)],
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "built 0 traced 0" in done.stdout, done.stdout + done.stderr[-2000:]


def test_watch_with_dry_run_is_a_usage_error(tmp_path):
    from tests.test_cli_model import cli

    model = tmp_path / "llama.py"
    model.write_text((ROOT / "examples" / "llama.py").read_text())
    proc = cli(tmp_path / "store", "warm", str(model), "--watch", "--dry-run")
    assert proc.returncode == 2
    assert "leave out --dry-run" in proc.stderr
    assert not (tmp_path / "store").exists()


#: An edit of every layer's MLP: every piece but the first changes, built in workers.
EVERY_LAYER = ("self.down(F.silu(gate) * up)", "self.down(F.gelu(gate) * up)")


def _watcher(tmp_path, model, mark: str) -> subprocess.Popen:
    env = {**os.environ, **SMALL, "LLAMA_BACKEND": "eager_fusion",
           "CACHEBUILD_DIR": str(tmp_path / "store"), mark: "1"}
    return subprocess.Popen([sys.executable, "-m", "cachebuild.cli", "warm", str(model),
                             "--watch"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _all_gone(mark: str, seconds: float = 60) -> bool:
    end = time.monotonic() + seconds
    while _marked(mark) and time.monotonic() < end:
        time.sleep(0.2)
    return not _marked(mark)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_watch_ends_its_rounds_and_their_workers_however_it_ends(tmp_path):
    """A model file deleted and written again is warmed once it is back; Ctrl-C while a
    round builds in workers ends all of them (exit 0); the watcher killed (-9) while a
    round builds ends that round and its workers too; the store is whole after each."""
    from tests.test_cli_model import cli

    model = tmp_path / "llama.py"
    text = (ROOT / "examples" / "llama.py").read_text()
    assert text.count(EDIT[0]) == 1 and text.count(EVERY_LAYER[0]) == 1
    model.write_text(text)
    mark = f"cachebuild-watch-test-{uuid.uuid4().hex}"
    proc = _watcher(tmp_path, model, mark)
    out = Lines(proc)
    try:
        out.until("watching")
        model.unlink()
        gone = out.until("watching")
        assert "round ended with exit code 2" in gone[-1], "".join(gone)
        time.sleep(1.0)
        model.write_text(text.replace(*EDIT))
        back = out.until("watching")
        assert summary("".join(back))[1:] == (2, 1, 0), "".join(back)
        model.write_text(text.replace(*EDIT).replace(*EVERY_LAYER))
        out.until("in worker processes")
        before = len(out.seen)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at the terminal, mid-build
        assert proc.wait(timeout=120) == 0, out.rest()
        said = out.rest()[len("".join(out.seen[:before])):]
        assert said.splitlines()[-1] == "stopped watching" and "error:" not in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _all_gone(mark), _marked(mark)
    assert cli(tmp_path / "store", "verify").returncode == 0

    model.write_text(text)  # the first version again, then every layer edited once more
    proc = _watcher(tmp_path, model, mark)
    out = Lines(proc)
    try:
        out.until("watching")
        model.write_text(text.replace(*EVERY_LAYER))
        out.until("in worker processes")
    finally:
        proc.kill()  # -9: its round is left to see it
    assert _all_gone(mark), _marked(mark)
    assert cli(tmp_path / "store", "verify").returncode == 0
