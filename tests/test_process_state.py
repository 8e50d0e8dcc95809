"""What a process remembers lives in one object: a fresh one forgets it all."""

from __future__ import annotations

import models
import pytest
import torch
from test_compile_failures import NoSplit

import cachebuild
from cachebuild import process_state
from cachebuild.errors import CompileFailed, UsageError


class _Thread:
    def stop(self) -> None:
        pass


def test_a_fresh_state_remembers_nothing_and_the_old_one_comes_back_after():
    old = process_state.current()
    old.loaded["k", "cpu"] = object()
    old.verified.add("k")
    old.failed["entry"] = [process_state.Failure(ValueError("no"), "entry")]
    assert old.first_saying("bundle.tar")
    capturer = _Thread()
    old.capturers.add(capturer)
    with process_state.fresh() as state:
        assert process_state.current() is state is not old
        assert not state.loaded and not state.verified and not state.failed
        assert state.first_saying("bundle.tar")  # said again: a new process says it once
        assert capturer in state.capturers  # still stopped at exit
    assert process_state.current() is old
    assert not old.first_saying("bundle.tar")


def test_a_fresh_state_forgets_failed_models_and_loaded_targets(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    failing = NoSplit().eval()
    config = cachebuild.CompileConfig(splitting_ops=("aten::softmax",),
                                      compile_ranges=((1, 16),), backend="eager_fusion")
    with pytest.raises(UsageError, match="not found in the traced graph"):
        cachebuild.compile(failing, config, {0: 0}, store=store)(torch.randn(4, 8))
    model = models.make(models.Decoder, layers=1)
    compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(5))
    state = process_state.current()
    assert len(state.failed) == 1 and state.loaded
    # Remembered in this state: refused at once, its targets shared, not loaded again.
    before = cachebuild.stats()
    with pytest.raises(CompileFailed, match="NoSplit cannot be compiled"):
        cachebuild.compile(failing, config, {0: 0}, store=store)(torch.randn(4, 8))
    again = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
    models.assert_matches_eager(again, model, models.inputs(5))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["traced"] == 0 and delta["loaded"] == 0
    with process_state.fresh():
        # As a new process: the failing model is traced (and fails) again, and the
        # other one's targets are loaded from the store again.
        before = cachebuild.stats()
        with pytest.raises(UsageError, match="not found in the traced graph"):
            cachebuild.compile(failing, config, {0: 0}, store=store)(torch.randn(4, 8))
        fresh = cachebuild.compile(model, models.config(), {0: 0, 1: 0}, store=store)
        models.assert_matches_eager(fresh, model, models.inputs(5))
        delta = models.counters_delta(before, cachebuild.stats())
        assert delta["traced"] == 1 and delta["loaded"] == len(state.loaded)


def test_a_target_builds_under_the_default_dtype_it_was_traced_with():
    """``keep.default_dtype``: the manifest's dtype, float32 where it names none (a target
    traced in float32, built by a process whose default is float64), put back after."""
    import torch

    from cachebuild import keep

    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with keep.default_dtype(None):
            assert torch.get_default_dtype() == torch.float32
        assert torch.get_default_dtype() == torch.float64
        torch.set_default_dtype(torch.float32)
        with keep.default_dtype("float64"):
            assert torch.ones(1).dtype == torch.float64
        assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(before)
