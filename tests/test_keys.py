"""Keys and manifests: canonical JSON, xxh3-128, and the diff that explain is built on."""

from __future__ import annotations

import os
import sys

import pytest

from cachebuild.building.nearest import describe, explain
from cachebuild.keys import MISSING, canonical_json, diff_manifests, make_key


def test_key_is_32_lowercase_hex_and_ignores_dict_order():
    a = make_key({"graph": [1, 2], "env": {"torch": "2.13.0", "python": "3.11"}})
    b = make_key({"env": {"python": "3.11", "torch": "2.13.0"}, "graph": [1, 2]})
    assert a == b and len(a) == 32 and all(c in "0123456789abcdef" for c in a)


def test_canonical_json_keeps_types_apart():
    assert make_key({"x": 1}) != make_key({"x": 1.0}) != make_key({"x": "1"})
    assert make_key({"x": True}) != make_key({"x": 1})
    assert canonical_json({"t": (1, 2)}) == canonical_json({"t": [1, 2]})


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": object()}, {1: "non-string key"}])
def test_ambiguous_factors_are_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        make_key(bad)


def test_diff_names_each_differing_factor():
    old = {"env": {"torch": "2.11.0", "python": "3.12"}, "bucket": {"range": [1, 512]},
           "graph": {"nodes": [1, 2, 3]}}
    new = {"env": {"torch": "2.13.0", "python": "3.12"}, "bucket": {"range": [1, 512]},
           "graph": {"nodes": [1, 2, 4]}, "extra": 1}
    diffs = {d.path: d for d in diff_manifests(old, new)}
    assert set(diffs) == {"env.torch", "graph.nodes", "extra"}
    assert diffs["extra"].old is MISSING
    assert describe(diffs["env.torch"]) == ["torch 2.11.0 → 2.13.0"]


def test_explain_picks_the_nearest_manifest_and_says_why_in_words():
    wanted = {"env": {"torch": "2.13.0"}, "bucket": {"size": 4},
              "passes": {"config": {}, "passes": [{"name": "rms_quant", "uuid": "b"}]}}
    near = {"env": {"torch": "2.13.0"}, "bucket": {"size": 4},
            "passes": {"config": {}, "passes": [{"name": "rms_quant", "uuid": "a"}]}}
    far = {"env": {"torch": "2.11.0"}, "bucket": {"size": 8},
           "passes": {"config": {}, "passes": []}}
    why = explain(wanted, [("far", far), ("near", near)])
    assert why.nearest == "near" and why.reasons == ["pass rms_quant changed"]
    assert explain(wanted, []).nearest is None


def test_triton_is_a_factor_of_cpu_targets_only_where_it_builds_for_the_cpu(tmp_path,
                                                                            monkeypatch):
    """A stock Triton (GPUs alone) installed, upgraded or removed leaves CPU keys as they
    were (a CPU build never runs it); a Triton with a CPU backend is a factor."""
    from cachebuild.tracing import env

    fake = tmp_path / "site" / "triton"
    (fake / "backends" / "nvidia").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "triton", raising=False)  # found, not the one imported
    monkeypatch.setattr(env, "_triton_version", lambda: "9.9.9")
    env._triton_builds_for_cpu.cache_clear()
    try:
        assert env.env_factors("cpu")["triton"] is None
        (fake / "backends" / "cpu").mkdir()
        env._triton_builds_for_cpu.cache_clear()
        assert env.env_factors("cpu")["triton"] == "9.9.9"
    finally:
        env._triton_builds_for_cpu.cache_clear()


def test_a_long_value_that_differs_late_is_shown_where_it_differs():
    """A list of inputs one value apart: each side shown from a little before the value,
    not cut before it."""
    from cachebuild.keys import Difference

    old = [{"kind": "tensor", "dtype": "float32", "shape": ["s0", 32]}, {"kind": "int", "value": 3}]
    new = [{"kind": "tensor", "dtype": "float32", "shape": ["s0", 32]}, {"kind": "int", "value": 4}]
    said = Difference("inputs", old, new).describe()
    assert '"value":3' in said and '"value":4' in said, said
    assert Difference("env.torch", "2.11.0", "2.13.0").describe() == "env.torch: 2.11.0 → 2.13.0"


def test_inductor_variables_that_change_its_code_are_target_factors(monkeypatch):
    """``TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1`` (read as Inductor is imported, in each
    build worker too) builds other code: another target. Where Inductor keeps files and
    how many processes it uses are no factor (a warm start elsewhere must find them)."""
    from cachebuild.backends import get_backend
    from cachebuild.config import CompileConfig

    for name in [k for k in os.environ if k.startswith("TORCHINDUCTOR_")]:
        monkeypatch.delenv(name)
    inductor, config = get_backend("inductor"), CompileConfig()
    plain = inductor.factors(config)
    assert "environment" not in plain
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    assert inductor.factors(config) == plain
    monkeypatch.setenv("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "1")
    assert inductor.factors(config)["environment"] == {
        "TORCHINDUCTOR_EMULATE_PRECISION_CASTS": "1"}
