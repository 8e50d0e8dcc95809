"""``cachebuild.warm`` and ``cachebuild.plan``: warming as a library call with a typed
report, from a ModelSpec, a build() function or a model file; the ``warm`` command prints
the same report, a line per target when its output is not a terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import models
import pytest

import cachebuild
from cachebuild.backends import register_backend
from cachebuild.backends.eager_fusion import EagerFusionBackend
from cachebuild.building.entry import Entry
from cachebuild.errors import UsageError

DYN = {0: 0, 1: 0}


def spec(backend: str = "eager_fusion") -> cachebuild.ModelSpec:
    model = models.make(models.LayerStack, layers=2)
    return cachebuild.ModelSpec(model, models.hidden_inputs(8), DYN,
                                models.config(compile_ranges=((1, 16),), backend=backend))


def test_warm_a_spec_then_a_server_starts_warm(open_local, tmp_path):
    store = tmp_path / "store"
    planned = cachebuild.plan(spec(), store=store)
    assert isinstance(planned, cachebuild.PlanReport)
    assert {t.state for t in planned.targets} == {"missing"}
    assert planned.entries[0].why == "no entry"
    assert not store.exists()  # looking makes no store, as `cachebuild plan` makes none
    report = cachebuild.warm(spec(), store=store)
    assert isinstance(report, cachebuild.WarmReport) and report.ok
    assert [t.state for t in report.targets] == ["built"] * len(report.targets)
    assert report.entries[0].recorded and report.seconds > 0
    with open_local(store) as s:
        entry = Entry.from_bytes(s.get(report.entry_key))
        assert all(s.contains(t.key) for t in report.targets)
    # Each unique target once, with every compiled piece that uses it.
    assert [t.key for t in report.targets] == entry.target_keys()
    assert sorted(p for t in report.targets for p in t.pieces) == [
        i for i, piece in enumerate(entry.pieces) if piece.compiled]
    again = cachebuild.warm(spec(), store=store)
    assert again.built == [] and len(again.stored) == len(report.targets)
    assert again.entry_key == report.entry_key and again.entries[0].why == "fresh"
    assert {t.state for t in cachebuild.plan(spec(), store=store).targets} == {"stored"}
    # A server: traces nothing, builds nothing.
    served = spec()
    before = cachebuild.stats()
    compiled = cachebuild.compile(served.model, served.config, DYN, store=open_local(store))
    models.assert_matches_eager(compiled, served.model, models.hidden_inputs(5))
    delta = models.counters_delta(before, cachebuild.stats())
    assert (delta["traced"], delta["built"], delta["entries_loaded"]) == (0, 0, 1)


class Flaky(EagerFusionBackend):
    """Refuses the pieces holding an MLP (every one but the first)."""

    name = "flaky_warming"

    def compile(self, request):
        if any("silu" in str(n.target) for n in request.gm.graph.nodes):
            raise RuntimeError("this compiler rejects the piece")
        return super().compile(request)


def test_a_failed_target_is_in_the_report_and_the_others_build(tmp_path):
    register_backend("flaky_warming", Flaky)
    seen = []
    report = cachebuild.warm(lambda: spec("flaky_warming"), store=tmp_path / "store",
                             on_target=lambda t, done, total: seen.append((t.state, done, total)))
    states = sorted(t.state for t in report.targets)
    assert not report.ok and states == ["built", "failed", "failed"], states
    failed = report.failed[0]
    assert "this compiler rejects the piece" in failed.error and failed.label.startswith("piece ")
    assert [s[1] for s in seen] == list(range(1, len(report.targets) + 1))
    assert {s[2] for s in seen} == {len(report.targets)}


def test_bad_input_is_one_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot warm int"):
        cachebuild.warm(42, store=tmp_path / "store")
    with pytest.raises(UsageError, match="no such model file"):
        cachebuild.warm(tmp_path / "missing.py", store=tmp_path / "store")
    with pytest.raises(UsageError, match="returned str, not a cachebuild.ModelSpec"):
        cachebuild.plan(lambda: "no spec", store=tmp_path / "store")


MODEL_FILE = """
import torch
import cachebuild
import models


def build():
    model = models.make(models.LayerStack, layers=1)
    return cachebuild.ModelSpec(model, models.hidden_inputs(8), {0: 0, 1: 0},
                                models.config(compile_ranges=((1, 16),)))
"""


def test_a_model_file_builds_in_workers_and_the_command_prints_a_line_per_target(open_local,
                                                                                 tmp_path):
    """With -v, each built target's line is followed by its phases, and the model's trace
    and split are said before the summary."""
    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE)
    store = tmp_path / "store"
    dry = cachebuild.warm(path, store=store, dry_run=True)
    assert dry.dry_run and {t.state for t in dry.targets} == {"missing"}
    with open_local(store) as s:
        assert not any(r.kind == "entry" for r in s.records())
    cli = [str(Path(sys.executable).with_name("cachebuild")), "--cache-dir", str(store),
           "-v", "warm", "--jobs", "2", str(path)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(models.TESTS_DIR)})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    built = [line for line in lines if line.startswith("built piece ")]
    total = len(dry.targets)
    assert len(built) == total, lines
    assert sorted(line.rsplit("(", 1)[1] for line in built) == [
        f"{i} of {total})" for i in range(1, total + 1)]
    phases = [lines[lines.index(line) + 1] for line in built]
    # Phases under 0.05 s are not printed: a small piece's proof may be one of them.
    assert all(p.startswith("  ") and "lowering" in p for p in phases), phases
    # The CPU's vector ISAs are the environment's, checked once with the probe: a fresh
    # store's builds take that record.
    assert not any("cxx_isa" in p for p in phases), phases
    summary = [line for line in lines if line.startswith(f"{total} targets:")]
    assert summary[0].startswith(f"{total} targets: 0 already stored, {total} built, 0 failed")
    assert any(line.startswith("model: trace ") for line in lines), lines
    report = cachebuild.warm(path, store=store)
    assert report.built == [] and len(report.stored) == total


def test_a_target_gc_takes_before_the_entry_is_recorded_is_said_failed(tmp_path, monkeypatch):
    """Nothing refers to a built target until its entry is recorded: a `cachebuild gc` in
    that window may take it. The report says so (failed, with what to do), not "built"."""
    from cachebuild.building import entry as entry_module
    from cachebuild.store import LocalStore

    real = entry_module.record_entry
    taken = []

    def gc_first(entry, store):
        with LocalStore(tmp_path / "store") as other:  # another process's gc, in effect
            taken.append(entry.target_keys()[0])
            other.delete(taken[0])
        return real(entry, store)

    monkeypatch.setattr(entry_module, "record_entry", gc_first)
    report = cachebuild.warm(spec(), store=tmp_path / "store")
    assert not report.ok
    lost = [t for t in report.targets if t.key == taken[0]]
    assert lost[0].state == "failed" and "cachebuild warm` again" in lost[0].error
    assert all(t.state == "built" for t in report.targets if t.key != taken[0])
    monkeypatch.setattr(entry_module, "record_entry", real)
    again = cachebuild.warm(spec(), store=tmp_path / "store")
    assert again.ok and [t.key for t in again.built] == taken
