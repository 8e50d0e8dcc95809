"""Counters for operators: ``cachebuild.stats()`` counts store hits and misses, and the
Prometheus text export renders them in the exposition format, written atomically."""

from __future__ import annotations

import models

import cachebuild
from cachebuild.metrics import Metric, render, write


def test_render_follows_the_exposition_format():
    text = render([Metric("hits_total", 3, "Hits."),
                   Metric("phase_seconds_total", 1.5, "Seconds.", labels=(("phase", 'bu"ild'),)),
                   Metric("phase_seconds_total", 2, "Seconds.", labels=(("phase", "load"),)),
                   Metric("records", 7, "Records.", kind="gauge")])
    assert text.splitlines() == [
        "# HELP cachebuild_hits_total Hits.",
        "# TYPE cachebuild_hits_total counter",
        "cachebuild_hits_total 3",
        "# HELP cachebuild_phase_seconds_total Seconds.",
        "# TYPE cachebuild_phase_seconds_total counter",
        'cachebuild_phase_seconds_total{phase="bu\\"ild"} 1.5',
        'cachebuild_phase_seconds_total{phase="load"} 2',
        "# HELP cachebuild_records Records.",
        "# TYPE cachebuild_records gauge",
        "cachebuild_records 7",
    ]


def test_write_is_atomic_and_readable(tmp_path):
    target = tmp_path / "cachebuild.prom"
    write("a 1\n", target)
    write("a 2\n", target)
    assert target.read_text() == "a 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["cachebuild.prom"]


def test_process_counters_count_hits_and_misses(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=1)
    before = cachebuild.stats()
    compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(4))
    cold = models.counters_delta(before, cachebuild.stats())
    assert cold["misses"] == cold["built"] == cold["unique"] > 0
    again = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(again, model, models.inputs(4))
    warm = models.counters_delta(before, cachebuild.stats())
    assert warm["hits"] - cold["hits"] == cold["unique"] and warm["misses"] == cold["misses"]
    text = cachebuild.prometheus_text()
    assert f"cachebuild_misses_total {cachebuild.stats()['misses']}" in text
    assert 'cachebuild_phase_seconds_total{phase="build"}' in text


def test_cli_stats_reports_builds_loads_and_time_across_processes(tmp_path):
    """A cold and a warm process on one store; then ``stats --json`` and ``--prometheus``
    report what they did: builds, loads, their time, traces, warm starts."""
    import json

    from click.testing import CliRunner

    from cachebuild.cli import main as cli

    store = tmp_path / "store"
    code = """
import sys, cachebuild, models
from cachebuild.store import LocalStore
model = models.make(models.Decoder, layers=1)
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=LocalStore(sys.argv[1]))
models.assert_matches_eager(compiled, model, models.inputs(4))
print("{}")
"""
    for _ in range(2):
        models.run_python(code.replace("sys.argv[1]", repr(str(store))))
    result = CliRunner().invoke(cli.main, ["--cache-dir", str(store), "stats", "--json"])
    stats = json.loads(result.stdout)
    assert stats["builds"] == 2 and stats["traces"] == 1 and stats["warm_starts"] == 1
    assert stats["loads"] == 4 and stats["build_seconds"] > 0 and stats["load_seconds"] >= 0
    prom = tmp_path / "cachebuild.prom"
    result = CliRunner().invoke(cli.main, ["--cache-dir", str(store), "stats", "--prometheus",
                                           str(prom)])
    assert result.exit_code == 0, result.output
    text = prom.read_text()
    assert "cachebuild_store_builds_total 2" in text and "cachebuild_store_warm_starts_total 1" in text
    assert "# TYPE cachebuild_store_records gauge" in text
