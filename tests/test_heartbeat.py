"""A long wait on a log that is not a terminal is never silent: each phase is a line as
it starts, and a phase that says nothing for ``QUIET_S`` seconds says that it still runs,
in the library's start and in the CLI's piped output."""

from __future__ import annotations

import io
import logging
import threading
import time

from rich.console import Console

from cachebuild.building import notice


def wait_for(predicate, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_quiet_wait_says_what_still_runs_and_stops_when_the_block_ends():
    lines: list[str] = []
    with notice.Heartbeat(lines.append, quiet=0.05) as heartbeat:
        time.sleep(0.2)
        assert lines == []  # nothing runs yet: nothing to say
        heartbeat.said("tracing Tiny")
        assert wait_for(lambda: len(lines) >= 2)
        heartbeat.said("building 2 targets")
        assert wait_for(lambda: lines[-1].startswith("still building 2 targets ("))
    assert lines[0].startswith("still tracing Tiny (") and lines[0].endswith(" s)")
    said = len(lines)
    time.sleep(0.2)
    assert len(lines) == said  # the block ended: no more beats
    assert not any(t.name == "cachebuild-heartbeat" for t in threading.enumerate())


def test_a_line_said_puts_the_next_beat_off():
    """On a clock the test moves: a beat is due ``quiet`` seconds after the last line
    said, names what runs and for how long, and nothing is due while nothing runs."""
    now = [100.0]
    heartbeat = notice.Heartbeat(lambda line: None, quiet=15.0, clock=lambda: now[0])
    now[0] = 200.0
    assert heartbeat.due(now[0])[0] is None  # quiet for long, but nothing runs
    heartbeat.said("building 2 targets")
    for _ in range(10):  # a line every 10 s: never quiet for 15 s
        now[0] += 10.0
        line, wait = heartbeat.due(now[0])
        assert line is None and wait == 5.0  # looked at again just when a beat falls due
        heartbeat.said()
    now[0] += 15.0
    line, wait = heartbeat.due(now[0])
    assert line == "still building 2 targets (115 s)" and wait == 15.0
    assert heartbeat.due(now[0] + 1.0)[0] is None  # the beat counts as a line said


def test_a_closed_pipe_stops_the_beats_quietly():
    def say(line: str) -> None:
        raise BrokenPipeError
    with notice.Heartbeat(say, quiet=0.05) as heartbeat:
        heartbeat.said("tracing Tiny")
        assert wait_for(lambda: not heartbeat._thread.is_alive())


def test_piped_warm_lines_name_each_phase_and_a_quiet_one(monkeypatch):
    from cachebuild.cli.model import _progress

    monkeypatch.setattr(notice, "QUIET_S", 0.05)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    progress = logging.getLogger("cachebuild.progress")
    with _progress(console) as (_, phase):
        progress.info("tracing %s", "model.py")
        assert wait_for(lambda: "still tracing model.py (" in out.getvalue())
        phase("building 3 targets in worker processes")
        assert wait_for(lambda: "still building 3 targets in worker processes (" in
                        out.getvalue())
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("] tracing model.py") and lines[0].startswith("[")
    assert all(line.startswith("[") and " s] " in line for line in lines)


def test_a_piped_start_says_each_target_and_that_builds_still_run(monkeypatch, caplog):
    monkeypatch.setattr(notice, "QUIET_S", 0.05)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    with caplog.at_level(logging.WARNING, logger="cachebuild"), \
            notice.build_progress(2) as done:
        assert wait_for(lambda: "cachebuild: still building 2 targets (" in caplog.text)
        done("piece 0 range 1-4", 1.5)
        assert "built piece 0 range 1-4 in 1.5 s (1 of 2," in caplog.text
