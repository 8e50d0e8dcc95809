"""Weights that change under a compiled model, as serving does with LoRA adapters and
checkpoint reloads: values copied in place are used in every graph mode; tensors replaced
by new objects are looked up again, or, where captured graphs still hold the old ones,
refused with a clear error. Stale weights are never used silently."""

from __future__ import annotations

import models
import pytest
import torch

import cachebuild
from cachebuild.errors import UsageError
from cachebuild.store import LocalStore

DYN = {0: 0, 1: 0}
MODES = ["none", "piecewise", "full"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module: every mode loads the same three targets. Closed after
    the module."""
    with LocalStore(tmp_path_factory.mktemp("rebind") / "store") as shared:
        yield shared


def compiled_model(store, mode):
    model = models.make(models.Decoder, layers=2)
    config = models.config(cudagraph_mode=mode, capture_sizes=(4, 8))
    compiled = cachebuild.compile(model, config, DYN, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(8))
    return model, compiled


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_in_every_graph_mode(store, mode):
    model, compiled = compiled_model(store, mode)
    for seed in (5, 6):
        model.load_state_dict(models.make(models.Decoder, layers=2, seed=seed).state_dict())
        for size in (8, 4, 5):  # captured sizes and one that is not
            models.assert_matches_eager(compiled, model, models.inputs(size))


@pytest.mark.parametrize("mode", MODES)
def test_in_place_update_of_one_weight(store, mode):
    """A LoRA-style update: one projection changes in place."""
    model, compiled = compiled_model(store, mode)
    with torch.no_grad():
        model.layers[0].gate_up.weight.add_(torch.randn_like(model.layers[0].gate_up.weight))
    models.assert_matches_eager(compiled, model, models.inputs(8))


@pytest.mark.parametrize("replace", ["parameter", "buffer", "submodule", "assign"])
def test_replaced_tensors_are_rebound(store, replace):
    model, compiled = compiled_model(store, "none")
    other = models.make(models.Decoder, layers=2, seed=7)
    if replace == "parameter":
        model.layers[1].down.weight = torch.nn.Parameter(other.layers[1].down.weight.clone())
    elif replace == "buffer":
        model.layers[0].inv_freq = model.layers[0].inv_freq * 3
    elif replace == "submodule":
        model.layers[1] = other.layers[1]
    else:
        model.load_state_dict(other.state_dict(), assign=True)
    models.assert_matches_eager(compiled, model, models.inputs(8))
    models.assert_matches_eager(compiled, model, models.inputs(3))


def test_a_weight_replaced_inside_a_replaced_submodule_is_rebound(store):
    """The new submodule is watched like the old one: replacing a weight inside it later
    is seen too."""
    model, compiled = compiled_model(store, "none")
    other = models.make(models.Decoder, layers=2, seed=7)
    model.layers[1] = other.layers[1]
    models.assert_matches_eager(compiled, model, models.inputs(8))
    model.layers[1].down.weight = torch.nn.Parameter(torch.randn_like(model.layers[1].down.weight))
    models.assert_matches_eager(compiled, model, models.inputs(8))
    models.assert_matches_eager(compiled, model, models.inputs(5))


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_replaced_weight_after_graph_capture_is_an_error(store, mode):
    model, compiled = compiled_model(store, mode)
    model.layers[1].down.weight = torch.nn.Parameter(torch.randn_like(model.layers[1].down.weight))
    for _ in range(2):  # and again: never the old weights
        with pytest.raises(UsageError, match=r"layers\.1\.down\.weight were replaced by new "
                                             r"tensors .*after graph capture"):
            compiled(*models.inputs(8))


def test_modules_built_elsewhere_do_not_rebind(store, monkeypatch):
    """Only modules a compiled model reads weights through count: building other models
    (or a forward that slices a ModuleList) costs nothing per call."""
    model, compiled = compiled_model(store, "none")
    calls = []
    runtime = compiled.runtime
    original = runtime.rebind
    monkeypatch.setattr(runtime, "rebind", lambda: calls.append(1) or original())
    models.make(models.Decoder, layers=2, seed=9)
    model.layers[:1]  # a new ModuleList holding existing layers
    models.assert_matches_eager(compiled, model, models.inputs(8))
    assert calls == []


@pytest.mark.parametrize("mode", MODES)
def test_a_converted_model_is_refused_until_compiled_again(store, mode):
    """``model.half()`` sets every weight's ``.data`` under the same tensor objects: the
    next call sees it (every weight's pointer compared per call) and is refused in every mode, as
    long as the weights stay converted. Converted back, the model answers eager's again
    where pieces take weights per call; captured graphs still read the old memory, so
    there the call is refused."""
    model, compiled = compiled_model(store, mode)
    model.half()
    for _ in range(2):
        with pytest.raises(UsageError, match=r"is torch\.float16, not torch\.float32"):
            compiled(*models.inputs(8))
    model.float()
    if mode == "none":
        models.assert_matches_eager(compiled, model, models.inputs(8))
        return
    with pytest.raises(UsageError, match=r"new memory under their \.data\) after graph capture"):
        compiled(*models.inputs(8))


@pytest.mark.parametrize("mode", MODES)
def test_one_converted_submodule_is_refused(store, mode):
    """``submodule.half()`` sets the ``.data`` of that submodule's weights alone, none of
    them the first weight the model binds: every weight's memory is compared at every
    call, so the call is refused (the pieces would read float16 bytes as float32)."""
    model, compiled = compiled_model(store, mode)
    assert compiled.runtime._bound[0] is not model.layers[1].down.weight
    model.layers[1].down.half()
    for _ in range(2):
        with pytest.raises(UsageError, match=r"layers\.1\.down\.weight.* is torch\.float16, "
                                             r"not torch\.float32"):
            compiled(*models.inputs(8))


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_new_memory_under_the_last_weights_data_after_capture_is_an_error(store, mode):
    """``w.data = ...`` on one weight late in the model, after graph capture: refused, never
    replayed over the old memory."""
    model, compiled = compiled_model(store, mode)
    weight = model.lm_head.weight
    weight.data = torch.randn_like(weight)
    with pytest.raises(UsageError, match=r"lm_head\.weight were replaced by new tensors "
                                         r"\(or new memory under their \.data\) after graph capture"):
        compiled(*models.inputs(8))


def test_another_model_set_on_the_compiled_module_is_refused(store):
    model, compiled = compiled_model(store, "none")
    with pytest.raises(UsageError, match="serves the model it was compiled from"):
        compiled.model = models.make(models.Decoder, layers=2, seed=7)
    models.assert_matches_eager(compiled, model, models.inputs(8))


def test_new_memory_under_a_weights_data_is_read_without_graphs(store):
    """``weight.data = other`` of the same shape and dtype: read from the next call on
    where pieces take weights per call (no graph mode)."""
    model, compiled = compiled_model(store, "none")
    weight = model.layers[0].gate_up.weight
    weight.data = torch.randn_like(weight)
    models.assert_matches_eager(compiled, model, models.inputs(8))


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_call_with_autograd_on_replays_graphs_as_under_no_grad(store, mode):
    """Captured graphs serve inference: a call with autograd on answers eager's values
    (it raised in piecewise mode: graph buffers made without autograd, written with it)."""
    model, compiled = compiled_model(store, mode)
    args = models.inputs(8)
    torch.testing.assert_close(compiled(*args), model(*args).detach(), **models.TOL)
