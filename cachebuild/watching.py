"""Warming again as a model's code changes: ``cachebuild warm --watch``.

A new ``cachebuild warm`` after an edit pays, before the trace and the one build the edit
needs, its process's start, the imports of torch, Dynamo and Inductor, and Inductor's
first-use set-up: on a small model, more than the edit's own work. ``watch`` pays those
while the user edits. It keeps one *round* ready: a ``cachebuild warm --round`` process
that has made those imports (``prepare``) and waits for a line on its stdin, the model
file not imported yet. When a watched file changes, that round goes: it imports the
edited model, traces it, builds what changed (one target in that process, more in
workers, as ``warm`` does) and records the entry. Each round is a new process, so nothing
of the code before the edit stays loaded; the next round gets ready while the user edits.

The watching process imports no torch. It watches the model file, every file the last
round's entry was traced from and every module of code outside installed libraries that
round loaded (``watched_files``), by their stamps (``sources.stamp``), ``POLL_S`` apart. A
round says which files those are on its stdout, in a line that begins with ``FILES``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

#: Seconds between two looks at the watched files' stamps.
POLL_S = 0.2

#: Seconds a round has to end once told to (then it is killed).
STOP_S = 30.0

#: How a round's line naming the files to watch begins (the rest: JSON, the paths and
#: whether every target was built or stored).
FILES = "cachebuild-watch-files "

#: The line a round says once prepared, ready to go.
READY = "cachebuild-watch-ready"

#: Runs a module as ``python -m`` does, with the given ``sys.path`` (a round imports
#: from where the watching command does, which is where ``cachebuild warm`` would).
_BOOT = ("import json, runpy, sys\n"
         "sys.path[:] = json.loads(sys.argv[1])\n"
         "sys.argv = sys.argv[2:]\n"
         "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


# -- in a round -------------------------------------------------------------------------

def prepare(device: str | None) -> None:
    """What every round needs before it knows the model: torch, Dynamo, Inductor, export
    and cachebuild's tracing and building imported, and Inductor's first-use set-up made
    for ``device`` (default: the CPU, and the first GPU where there is one)."""
    import torch
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.export  # noqa: F401

    import cachebuild.building.build  # noqa: F401
    import cachebuild.building.planner  # noqa: F401
    import cachebuild.passes.ops  # noqa: F401  # the fusion passes' ops
    from cachebuild import compat

    if device is not None:
        devices = [torch.device(device)]
    else:
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda", 0))
    devices = [d if d.type == "cpu" or d.index is not None else torch.device(d.type, 0)
               for d in devices]
    compat.prepare_inductor(devices)


def wait_for_go() -> bool:
    """Say that this round is ready, then block until the watching process says go (a
    line on stdin): True; False where it is gone (stdin closed) and the round is not to
    run. Once it goes, a watching process that goes away (its end of stdin closes: it
    was killed) ends the round as a Ctrl-C would, its builds with it."""
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    if not sys.stdin.readline():
        return False

    def end_with_watcher() -> None:
        sys.stdin.read()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=end_with_watcher, name="cachebuild-watcher", daemon=True).start()
    return True


class ReadStamps:
    """The stamps of the user's module files as a round loads them, each taken as its
    module's code starts to run (an audit hook on ``exec``: Python runs a module's code
    right after reading it, from its source or its cached bytecode). The watching process
    takes these, not the stamps a file has once the round is done, as a file's first, so
    that an edit made while the round runs (to a module its model file imports, or one its
    ``build()`` or forward imports later) is a change after it. A round process makes one
    as it goes (before that it loaded only torch and cachebuild): an audit hook stays for
    the process's life."""

    def __init__(self) -> None:
        self.stamps: dict[str, Any] = {}
        self._on = True
        sys.addaudithook(self._heard)

    def _heard(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "exec" and self._on and args:
            self._take(getattr(args[0], "co_filename", None))

    def _take(self, path: Any) -> None:
        from cachebuild.trust.sources import stamp

        if isinstance(path, str) and path.endswith(".py"):
            path = os.path.abspath(path)
            if path not in self.stamps:
                self.stamps[path] = stamp(path)

    def stop(self) -> dict[str, Any]:
        """Stop taking stamps; those of the user's files (file → stamp as first run)."""
        self._on = False
        return {f: self.stamps[f] for f in _users_files(set(self.stamps)) if self.stamps[f]}


def tell_files(files: Sequence[str], ok: bool, read: dict[str, Any] | None = None,
               error: bool = False) -> None:
    """Say, on stdout, which files the watching process is to watch now, whether every
    target was built or stored (``ok``), and the stamps of those the round read as it
    loaded them (``read``: ``ReadStamps.stop``); with ``error``, that the round is ending
    on an error (its exit code says which). The round's work is recorded by then: an
    interrupt while it ends (the watcher letting go of its stdin) has nothing to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    files = sorted(set(files))
    said = {"files": files, "ok": ok, "error": error,
            "stamps": {f: read[f] for f in files if read and f in read}}
    sys.stdout.write(FILES + json.dumps(said) + "\n")
    sys.stdout.flush()


def watched_files(store: Any | None, entry_keys: Sequence[str]) -> list[str]:
    """The files on disk, outside installed libraries, that the stored entries
    ``entry_keys`` were traced from, and those of every module this round loaded from
    outside them (the model file's helpers, a config module its ``build()`` reads) but
    cachebuild's own."""
    from cachebuild.building.entry import read_entry

    files: set[str] = set()
    for key in entry_keys if store is not None else ():
        data = store.get(key, touch=False)
        entry = read_entry(data) if data is not None else None
        files |= set(entry.source_files) if entry is not None else set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        spec = getattr(module, "__spec__", None)  # ``__main__`` is cachebuild.cli's here
        real = getattr(spec, "name", None) or name
        if isinstance(path, str) and path.endswith(".py") and \
                real.split(".")[0] != "cachebuild":
            files.add(os.path.abspath(path))
    return _users_files(files)


def error_files(error: BaseException, model_file: str) -> list[str]:
    """The user's files a round's ``error`` names, along its chain of causes: where a
    syntax error is, the frames it went through, and, for a module not found, where it
    would be made beside the model file (``helper.py``, ``helper/__init__.py``): a file
    that is not there yet is watched for its making."""
    from cachebuild.errors import causes

    found: set[str] = set()
    missing: set[str] = set()
    for e in causes(error):
        if isinstance(e, SyntaxError) and e.filename:
            found.add(os.path.abspath(e.filename))
        if isinstance(e, ModuleNotFoundError) and e.name:
            folder = os.path.dirname(os.path.abspath(model_file))
            top = e.name.split(".")[0]
            missing |= {os.path.join(folder, top + ".py"),
                        os.path.join(folder, top, "__init__.py")}
        tb = e.__traceback__
        while tb is not None:
            module = str(tb.tb_frame.f_globals.get("__name__", ""))
            if module.split(".")[0] != "cachebuild":  # cachebuild's own frames aside
                found.add(os.path.abspath(tb.tb_frame.f_code.co_filename))
            tb = tb.tb_next
    return sorted({*_users_files(found), *(f for f in missing if not os.path.exists(f))})


def _users_files(files: set[str]) -> list[str]:
    from cachebuild.trust.sources import is_library_file

    return sorted(f for f in files if os.path.isfile(f) and not is_library_file(f)
                  and not f.startswith(_STDLIB))


_STDLIB = os.path.dirname(os.__file__) + os.sep


# -- in the watching process ------------------------------------------------------------------

class Round:
    """One ``cachebuild warm --round`` process: started at once (it prepares), told to go
    later; its output is the command's own, but for its ``READY`` and ``FILES`` lines."""

    def __init__(self, args: Sequence[str],
                 on_ready: Callable[[float], None] | None = None) -> None:
        self.args = list(args)
        self.files: list[str] | None = None
        self.read: dict[str, Any] = {}  # file → its stamp as the round read it
        self.ok = False  # every target built or stored
        self.error = False  # it said it ends on an error
        self.went = False  # told to go
        self.started = time.perf_counter()
        self.on_ready = on_ready  # told its set-up's seconds, once ready
        self.done = threading.Event()  # its FILES line came, or it ended
        # A session of its own: a Ctrl-C at the terminal reaches the watching process
        # alone, which ends its rounds itself (``stop``), never one still starting up.
        self.proc = subprocess.Popen(
            # -P: the working directory is not put first on the path before ``_BOOT``
            # sets it (a json.py another user left there would run)
            [sys.executable, "-P", "-c", _BOOT, json.dumps(sys.path), "cachebuild.cli", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True)
        assert self.proc.stdout is not None
        threading.Thread(target=self._relay, args=(self.proc.stdout,), daemon=True).start()
        # Its end, apart from its output's: the build workers it starts hold that pipe
        # open, and one killed leaves them building their last job.
        threading.Thread(target=lambda: (self.proc.wait(), self.done.set()),
                         daemon=True).start()

    def _relay(self, out: IO[str]) -> None:
        for line in out:
            if line.rstrip("\n") == READY:
                if self.on_ready is not None and not self.went:
                    self.on_ready(time.perf_counter() - self.started)
            elif line.startswith(FILES):
                try:
                    said = json.loads(line[len(FILES):])
                    self.files, self.ok = [str(p) for p in said["files"]], bool(said["ok"])
                    self.error = bool(said.get("error"))
                    self.read = {str(f): v for f, v in dict(said.get("stamps", {})).items()}
                except (ValueError, KeyError, TypeError):
                    pass
                self.done.set()
            else:
                try:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                except (OSError, ValueError):  # our reader has gone: the round goes on
                    pass
        self.done.set()

    def go(self) -> Round:
        """Start the round's work (it waits for this once prepared). One that ended
        before it was told (its model file was gone as it started) is replaced by a new
        one, told at once: the round that goes."""
        if self.proc.poll() is not None:
            fresh = Round(self.args, self.on_ready)
            return fresh.go()
        assert self.proc.stdin is not None
        self.went = True
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it ended meanwhile: ``wait`` says so
            pass
        return self

    def wait(self) -> int | None:
        """Wait until the round has recorded its work (its FILES line) or ended: its exit
        code where it ended on an error (a model file that does not import, say), else
        None (the process may still be ending: nothing of it is waited for)."""
        self.done.wait()
        if self.files is not None and not self.error:
            return None
        return self.proc.wait()

    def stop(self, how: signal.Signals = signal.SIGINT) -> None:
        """End the round: one still waiting to go as its stdin closes; one under way as
        a command ends on ``how`` (Ctrl-C's SIGINT, or SIGTERM): its builds with it, the
        store whole."""
        if self.went and self.proc.poll() is None and self.files is None:
            self.proc.send_signal(how)  # its stdin stays open: a closed one ends it too
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def ended(code: int) -> str:
    """How a round that ended without recording anything ended, in words."""
    if code < 0:
        return f"round killed by signal {-code}"
    return f"round ended with exit code {code}"


def stamps(files: Sequence[str]) -> dict[str, Any]:
    """Each file's stamp (None: not there)."""
    from cachebuild.trust.sources import stamp

    return {f: stamp(f) for f in files}


def next_change(seen: dict[str, Any], poll_s: float = POLL_S) -> tuple[str, float]:
    """Block until one of the files of ``seen`` (file → stamp) has another stamp; return
    it and when that was seen (``time.perf_counter()``). A change seen is waited on for
    one more poll, so that a save written in steps is one change."""
    while True:
        now = stamps(list(seen))
        changed = [f for f in seen if now[f] != seen[f]]
        if changed:
            at = time.perf_counter()
            time.sleep(poll_s)
            return changed[0], at
        time.sleep(poll_s)


def watch(args: Sequence[str], model_file: str, say: Callable[[str], None],
          on_ready: Callable[[float], None] | None = None) -> None:
    """Run rounds of ``cachebuild`` ``args`` (a ``warm ... --round`` command line) for
    ever: the first at once, each next one as a watched file changes, and say how long
    each took from the change seen to its entry recorded. ``on_ready(seconds)``: called
    as each next round is ready (its set-up took ``seconds``). Ends with a
    KeyboardInterrupt (Ctrl-C, or SIGTERM as the command line raises it), the round
    under way with it."""
    model = os.path.abspath(model_file)
    files = [model]
    seen = stamps(files)
    current: Round | None = None
    try:
        current = Round(args).go()
        started, first = time.perf_counter(), True
        while True:
            code = current.wait()
            took = time.perf_counter() - started
            if current.files is not None:
                # A round that failed loaded less than the one before: it adds to the watch.
                files = sorted(set(current.files) | {model} | set(files if current.error else ()))
                # A file new to the watch: as the round read it, where it says, so that an
                # edit made while it ran is a change (a file it does not say: as it is now).
                new = {**stamps([f for f in files if f not in seen]), **current.read}
                seen = {f: seen[f] if f in seen else new[f] for f in files}
            what = (ended(code) if code is not None
                    else "round ended with targets that failed" if not current.ok
                    else "warmed" if first else "warmed again")
            # The next one gets ready while the user edits (where there is a model file
            # to warm: one started without it would only fail).
            current = Round(args, on_ready) if os.path.isfile(model) else None
            since = "" if first else " after the change"
            say(f"{what} in {took:.1f} s{since}; watching {len(files)} "
                f"file{'' if len(files) == 1 else 's'} for changes (Ctrl-C ends)")
            changed, started = next_change(seen)
            first = False
            seen = stamps(files)
            say(f"{changed} changed: warming again")
            current = (current or Round(args, on_ready)).go()
    except KeyboardInterrupt as e:
        if current is not None:
            current.stop(signal.SIGINT if type(e) is KeyboardInterrupt else signal.SIGTERM)
        raise
    finally:
        if current is not None:
            current.stop()
