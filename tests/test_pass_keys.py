"""Editing a pass changes exactly the keys of the targets built with it, and explain says so."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import cachebuild
from cachebuild.building.nearest import explain
from cachebuild.building.planner import Planner
from cachebuild.passes import PassConfig
from cachebuild.passes.rewrites.fusions import RMSNormQuantFusion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import llama  # noqa: E402


def _targets(model, config, store) -> dict:
    planner = Planner(model, config, {0: 0, 1: 0}, store)
    entry = planner.trace(llama.example_inputs(model, 8))
    return {t.key: t.manifest for t in entry.targets()}


def test_editing_a_pass_changes_only_the_targets_that_use_it(open_local, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = llama.make_model()
    store = open_local(tmp_path / "store")
    base = dataclasses.replace(llama.config(), backend="eager_fusion")
    with_pass = dataclasses.replace(base, passes=PassConfig(rms_quant=True))
    without = dataclasses.replace(base, passes=PassConfig())

    before_with = _targets(model, with_pass, store)
    before_without = _targets(model, without, store)
    monkeypatch.setattr(RMSNormQuantFusion, "uuid", lambda self: "0" * 32)  # "edited"
    after_with = _targets(model, with_pass, store)
    after_without = _targets(model, without, store)

    assert set(after_without) == set(before_without)  # untouched: still stored
    assert not set(after_with) & set(before_with)  # every target with the pass is new
    for manifest in after_with.values():
        why = explain(manifest, list(before_with.items()))
        assert why.nearest in before_with
        assert why.reasons == ["pass rms_quant changed"], why.reasons


def test_changing_the_pass_config_is_explained(open_local, tmp_path):
    torch.manual_seed(0)
    model = llama.make_model()
    store = open_local(tmp_path / "store")
    base = dataclasses.replace(llama.config(), backend="eager_fusion")
    old = _targets(model, base, store)
    new = _targets(model, dataclasses.replace(base, passes=PassConfig(act_quant=True)), store)
    assert not set(new) & set(old)
    reasons = explain(next(iter(new.values())), list(old.items())).reasons
    assert "pass act_quant enabled" in reasons
    assert any("passes.config.act_quant" in r for r in reasons)
    assert cachebuild.stats()["traced"] >= 2
