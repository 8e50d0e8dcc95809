"""Targets and their keys: identical layers share one key (dedup), and a key changes with
every factor that decides the compiled output (pass source, pass config, bucket, backend
options, environment) and with nothing else (parameter names, weight values)."""

from __future__ import annotations

import sys

import models
import pytest

import cachebuild
import cachebuild.tracing.env
from cachebuild.building.planner import Planner
from cachebuild.keys import diff_manifests, make_key
from cachebuild.passes import PassConfig, PassManager
from cachebuild.tracing.targets import RECIPE
from cachebuild.tracing.trace import trace_model

DYN = {0: 0, 1: 0}


def trace(model, tokens=8):
    return trace_model(model, models.inputs(tokens), DYN)


def plan(model, traced, config, passes=None):
    """The entry (pieces, targets, keys) of ``traced`` under ``config``; builds nothing."""
    planner = Planner(model, config, DYN, store=None, passes=passes)
    key, factors = planner.entry_key(models.inputs(8))
    entry = planner.plan(traced, factors)
    return key, entry


def keys_by_piece(entry):
    return [[t.key for t in p.targets] for p in entry.pieces if p.compiled]


@pytest.fixture(scope="module")
def decoder():
    model = models.make(models.Decoder, layers=2)
    return model, trace(model)


@pytest.fixture(scope="module")
def base(decoder):
    model, traced = decoder
    return plan(model, traced, models.config())


# -- dedup -----------------------------------------------------------------------------

def test_unique_targets_do_not_grow_with_depth(open_local, tmp_path):
    """2, 4 and 8 layers plan 3 unique targets per bucket; the deeper models find every
    one of them already built."""
    store = open_local(tmp_path / "store")
    cfg = models.config(compile_sizes=(4,))
    seen = []
    for layers in (2, 4, 8):
        model = models.make(models.Decoder, layers=layers)
        before = cachebuild.stats()
        compiled = cachebuild.compile(model, cfg, DYN, store=store)
        models.assert_matches_eager(compiled, model, models.inputs(6))
        delta = models.counters_delta(before, cachebuild.stats())
        entry = compiled.runtime.entry
        compiled_pieces = [p for p in entry.pieces if p.compiled]
        assert len(compiled_pieces) == layers + 1
        assert delta["planned"] == (layers + 1) * 2
        seen.append((delta["unique"], len(entry.target_keys()), delta["built"]))
        # Every middle layer's piece has the same keys as the first middle one.
        middle = [tuple(t.key for t in p.targets) for p in compiled_pieces[1:-1]]
        assert len(set(middle)) == 1
    assert seen == [(6, 6, 6), (6, 6, 0), (6, 6, 0)]


def test_targets_carry_their_factors(base):
    _, entry = base
    for target in entry.targets():
        assert set(target.manifest) == {"graph", "bucket", "backend", "passes", "env",
                                        "recipe"}
        assert target.manifest["bucket"] == target.bucket == {"range": [1, 32]}
        # A version before the recipe's factors for the default dtype and codegen settings
        # built under any of them with the key a default process's target has: none of its
        # keys is one this version looks up.
        assert target.manifest["recipe"] == RECIPE >= 2
        older = {k: v for k, v in target.manifest.items() if k != "recipe"}
        assert make_key(older) != target.key == make_key(target.manifest)
        assert target.manifest["backend"]["name"] == "eager_fusion"
        # Inputs are described by position and canonical symbol, never by a layer's name.
        text = str(target.manifest["graph"])
        assert "layers" not in text and "s0" in text


# -- what changes a key ----------------------------------------------------------------

def assert_all_keys_change(old_entry, new_entry):
    old, new = keys_by_piece(old_entry), keys_by_piece(new_entry)
    assert len(old) == len(new)
    for a, b in zip(old, new, strict=True):
        assert not set(a) & set(b)


def test_bucket_changes_the_key(decoder, base):
    model, traced = decoder
    _, wider = plan(model, traced, models.config(compile_ranges=((1, 64),)))
    assert_all_keys_change(base[1], wider)
    manifest_a = base[1].targets()[0].manifest
    manifest_b = wider.targets()[0].manifest
    assert [d.path for d in diff_manifests(manifest_a, manifest_b)] == ["bucket.range"]


def test_an_exact_size_adds_targets_and_keeps_the_range_keys(decoder, base):
    model, traced = decoder
    _, with_size = plan(model, traced, models.config(compile_sizes=(4,)))
    for old, new in zip(keys_by_piece(base[1]), keys_by_piece(with_size), strict=True):
        assert len(new) == 2 and new[1] == old[0] and new[0] != old[0]


def test_pass_config_changes_the_key(decoder, base):
    model, traced = decoder
    _, no_cleanup = plan(model, traced, models.config(passes=PassConfig(cleanup=False)))
    assert_all_keys_change(base[1], no_cleanup)


def load_pass(tmp_path, module_name, suffix=""):
    return models.load_silu_pass(tmp_path / "silu_pass.py", module_name, suffix)


def test_pass_source_changes_the_key(decoder, tmp_path, monkeypatch):
    model, traced = decoder
    for name in ("cb_test_silu_v1", "cb_test_silu_v2", "cb_test_silu_v3"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    original = load_pass(tmp_path, "cb_test_silu_v1")
    reloaded = load_pass(tmp_path, "cb_test_silu_v2")
    edited = load_pass(tmp_path, "cb_test_silu_v3", suffix=" + 0")
    cfg = models.config()
    _, a = plan(model, traced, cfg, PassManager([original]))
    _, b = plan(model, traced, cfg, PassManager([reloaded]))
    _, c = plan(model, traced, cfg, PassManager([edited]))
    assert keys_by_piece(a) == keys_by_piece(b)
    assert_all_keys_change(a, c)
    assert_all_keys_change(base_entry(model, traced), a)  # adding a pass changes keys too
    diffs = {d.path for d in diff_manifests(a.targets()[0].manifest, c.targets()[0].manifest)}
    assert diffs == {"passes.passes"}


def base_entry(model, traced):
    return plan(model, traced, models.config(), PassManager())[1]


def test_backend_options_change_the_key(decoder):
    model, traced = decoder
    aoti = models.config(backend="inductor", flavour="aoti")
    _, plain = plan(model, traced, aoti)
    _, tuned = plan(model, traced, models.config(backend="inductor", flavour="aoti",
                                                 inductor_options={"max_autotune": False}))
    _, standalone = plan(model, traced, models.config(backend="inductor", flavour="standalone"))
    _, fusion = plan(model, traced, models.config())
    assert_all_keys_change(plain, tuned)
    assert_all_keys_change(plain, standalone)
    assert_all_keys_change(plain, fusion)
    diffs = {d.path for d in diff_manifests(plain.targets()[0].manifest,
                                            tuned.targets()[0].manifest)}
    assert diffs == {"backend.options.max_autotune"}


def test_environment_changes_the_key(decoder, base, monkeypatch):
    model, traced = decoder
    monkeypatch.setattr(cachebuild.tracing.env, "_cpu_isa", lambda: "TEST_ISA")
    key, other = plan(model, traced, models.config())
    assert_all_keys_change(base[1], other)
    assert key != base[0]  # the entry key too
    diffs = {d.path for d in diff_manifests(base[1].targets()[0].manifest,
                                            other.targets()[0].manifest)}
    assert diffs == {"env.cpu_isa"}


def test_weight_values_do_not_change_any_key(base):
    model = models.make(models.Decoder, layers=2, seed=123)
    key, entry = plan(model, trace(model), models.config())
    assert keys_by_piece(entry) == keys_by_piece(base[1])
    assert key == base[0]


def test_renamed_parameters_do_not_change_target_keys(base):
    model = models.make(models.RenamedDecoder, layers=2)
    assert {n for n, _ in model.named_parameters()}.isdisjoint(
        {n for n, _ in models.make(models.Decoder, layers=2).named_parameters()})
    _, entry = plan(model, trace(model), models.config())
    assert keys_by_piece(entry) == keys_by_piece(base[1])


def test_trace_size_does_not_change_any_key(base):
    model = models.make(models.Decoder, layers=2)
    key, entry = plan(model, trace(model, tokens=23), models.config())
    assert keys_by_piece(entry) == keys_by_piece(base[1])
    assert key == base[0]


def test_a_different_mlp_changes_only_the_pieces_that_hold_it(base):
    model = models.make(models.Decoder, layers=2, mlp=48)
    _, entry = plan(model, trace(model), models.config())
    old, new = keys_by_piece(base[1]), keys_by_piece(entry)
    # Piece 0 (embedding, norm, QKV, rotary) has no MLP; the others each hold one.
    assert new[0] == old[0]
    assert new[1] != old[1] and new[2] != old[2]


def test_entry_key_follows_config_but_not_weights(decoder, base):
    model, _ = decoder
    planner = Planner(models.make(models.Decoder, layers=2, seed=7), models.config(), DYN, None)
    assert planner.entry_key(models.inputs(8))[0] == base[0]
    planner = Planner(model, models.config(compile_sizes=(4,)), DYN, None)
    assert planner.entry_key(models.inputs(8))[0] != base[0]
