"""A build worker process (``python -m cachebuild.worker FD``), started by
``workers.BuildPool``: set up as told, then build each job sent on stdin, one at a time,
and send each result on file descriptor FD."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
from typing import Any

from cachebuild.building.pool import NOT_SET_UP, Result, WorkerSetup, receive, send
from cachebuild.errors import one_line

#: Warning classes (by name) a worker hands to the caller instead of printing: the caller
#: says each once, not once per worker.
_FORWARDED_WARNINGS = ("RemoteDownWarning", "UnsignedRemoteWarning")


def serve(results_fd: int) -> None:
    """Set up, then build each job sent until stdin closes."""
    # A Ctrl-C at a terminal reaches the caller's whole process group: the caller decides
    # (it leaves a background build, or stops waiting); a worker whose caller has gone
    # ends once its job is stored (its next send fails, or stdin closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import warnings

    jobs = sys.stdin.buffer
    results = os.fdopen(results_fd, "wb")
    # What every build needs, imported before the setup is read: a pool may start before
    # its caller knows what it will build, and these imports overlap that (a trace, say).
    import torch._inductor.compile_fx  # noqa: F401
    import torch.export  # noqa: F401

    import cachebuild.passes.ops  # noqa: F401  # the fusion passes' ops
    from cachebuild.building.build import build_one

    try:
        setup: WorkerSetup = receive(jobs)
    except EOFError:  # closed before it was told anything
        return
    said: list[tuple[str, str]] = []
    show = warnings.showwarning

    def forward(message: Any, category: type[Warning], filename: str, lineno: int,
                file: Any = None, line: str | None = None) -> None:
        if category.__name__ in _FORWARDED_WARNINGS:
            said.append((category.__name__, str(message)))
        else:
            show(message, category, filename, lineno, file, line)

    try:
        store = _set_up(setup)
    except Exception as e:  # every job it is given fails, saying why: no traceback here
        said = one_line(e)
        if setup.withheld and "No module named" in said:
            said += (f"; build workers import nothing from a folder another user could "
                     f"change, and the caller's path has {len(setup.withheld)} such: "
                     f"{'; '.join(setup.withheld)}")
        _refuse_all(jobs, results, f"{NOT_SET_UP}{said}")
        return
    warnings.showwarning = forward
    try:
        while True:
            try:
                job = receive(jobs)
            except EOFError:
                return
            done = build_one(store, job)
            result = Result(job.target.key, done.built, done.seconds, done.error,
                            list(said), done.phases)
            said.clear()
            try:
                send(results, result)
            except BrokenPipeError:  # the caller is gone: what was built is stored
                return
    finally:
        store.close()


def _set_up(setup: WorkerSetup) -> Any:
    """Import what ``setup`` names (the model file registers its ops) and open its store."""
    from cachebuild.store import open_store

    for path in reversed(setup.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    if setup.model_file:
        from cachebuild.modelfile import import_model

        import_model(setup.model_file)
    for name in setup.modules:
        importlib.import_module(name)
    return open_store(setup.options)


def _refuse_all(jobs: Any, results: Any, error: str) -> None:
    """Answer every job sent until stdin closes with ``error``: a worker that could not
    set up (its model file failed to import here, its store could not be opened)."""
    while True:
        try:
            job = receive(jobs)
            send(results, Result(job.target.key, False, 0.0, error, died=True))
        except (EOFError, BrokenPipeError):
            return


def end() -> None:
    """End the process at once, its exit handlers run (scratch folders removed, probe
    children stopped) and its output flushed. Every build's results are stored, synced
    and sent by then; the interpreter's own teardown of torch and Inductor would only
    add about a second to every caller's wait for its workers (``BuildPool.close``)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # none, or closed: nothing to flush
            stream.flush()
    os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    end()
