"""What a trace read besides tensors: recorded with the entry, checked on the live model at
a warm start without Dynamo, named by ``explain``.

Two models that differ only in a value the trace baked in (an activation, an epsilon, a
sliding window, a rotary base, a flag that takes another branch, an environment variable)
never share an entry: a warm start from the other model's entry would compute the other
model's function.
"""

from __future__ import annotations

import enum
import json
import logging
import os

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from click.testing import CliRunner

import cachebuild
from cachebuild.cli import main as cli
from cachebuild.tracing.guard_export import Collected, Unrecordable, records_from
from cachebuild.tracing.guards import GuardRecord, GuardSet, identity, plain
from cachebuild.tracing.trace import trace_model

#: Models of this module share forward code that Dynamo would answer from its cache.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DYN = {0: 0, 1: 0}



class _Kernel:
    """An object compared by identity only, held by a module global: the kind a decorator
    leaves in place of a function (transformers' hub kernels)."""


PLAIN_ROTARY = _Kernel()
SCALED_ROTARY = _Kernel()


class Tunable(nn.Module):
    """A decoder whose layers read plain attributes: no config object anywhere, so the
    entry key is the same for every setting and only the guards tell them apart."""

    def __init__(self, act: nn.Module | None = None, eps: float = 1e-5, flag: bool = False,
                 base: float = 10000.0, kernel: _Kernel = PLAIN_ROTARY) -> None:
        super().__init__()
        self.inner = models.make(models.Decoder, layers=1)
        self.act = act if act is not None else nn.SiLU()
        self.eps = eps
        self.parallel = flag
        self.base = base
        self.kernel = kernel

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.inner.embed(ids)
        scale = (pos[:, None].float() / self.base).cos()
        if self.kernel is SCALED_ROTARY:
            scale = scale * 2
        h = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        if self.parallel:
            x = x + self.act(h) * scale + self.inner.layers[0](h, pos)
        else:
            x = self.inner.layers[0](x + self.act(h) * scale, pos)
        return self.inner.lm_head(x)


VARIANTS = {
    "activation": ({}, {"act": nn.GELU()}, "act: SiLU → GELU"),
    "epsilon": ({}, {"eps": 1e-2}, "eps: 1e-05 → 0.01"),
    "rotary base": ({}, {"base": 500000.0}, "base: 10000.0 → 500000.0"),
    "flag": ({}, {"flag": True}, "parallel: False → True"),
    "module-level object": ({}, {"kernel": SCALED_ROTARY}, "kernel: PLAIN_ROTARY → SCALED_ROTARY"),
}


@pytest.mark.parametrize("which", list(VARIANTS))
def test_models_differing_in_a_value_never_share_an_entry(open_local, tmp_path, which, caplog):
    """The failure this fixes: the second model warm-started from the first's entry and
    silently computed the first model's function."""
    first, second, named = VARIANTS[which]
    store = open_local(tmp_path / "store")
    a, b = Tunable(**first).eval(), Tunable(**second).eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert not torch.allclose(a(*models.inputs(6)), b(*models.inputs(6)))
    first_compiled = cachebuild.compile(a, models.config(), DYN, store=store)
    models.assert_matches_eager(first_compiled, a, models.inputs(6))
    before = cachebuild.stats()
    with caplog.at_level(logging.INFO, logger="cachebuild"):
        compiled = cachebuild.compile(b, models.config(), DYN, store=store)
        models.assert_matches_eager(compiled, b, models.inputs(6))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["traced"] == 1 and delta["entries_loaded"] == 0
    assert named in caplog.text  # the log says which value differed
    assert compiled.runtime.entry.key != first_compiled.runtime.entry.key

    # Each model now warm-starts from its own entry, in either order.
    for model in (a, b, a):
        before = cachebuild.stats()
        models.assert_matches_eager(cachebuild.compile(model, models.config(), DYN, store=store),
                                    model, models.inputs(9))
        delta = models.counters_delta(before, cachebuild.stats())
        assert delta["entries_loaded"] == 1 and delta["traced"] == 0 and delta["built"] == 0


def test_environment_variable_read_while_tracing(open_local, tmp_path, monkeypatch, caplog):
    class EnvScaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = models.make(models.Decoder, layers=1)

        def forward(self, ids, pos):
            scale = 2.0 if os.environ.get("CACHEBUILD_TEST_SCALE") == "2" else 1.0
            return self.inner(ids, pos) * scale

    store = open_local(tmp_path / "store")
    model = EnvScaled().eval()
    monkeypatch.delenv("CACHEBUILD_TEST_SCALE", raising=False)
    models.assert_matches_eager(cachebuild.compile(model, models.config(), DYN, store=store),
                                model, models.inputs(5))
    monkeypatch.setenv("CACHEBUILD_TEST_SCALE", "2")
    before = cachebuild.stats()
    with caplog.at_level(logging.INFO, logger="cachebuild"):
        models.assert_matches_eager(cachebuild.compile(model, models.config(), DYN, store=store),
                                    model, models.inputs(5))
    assert models.counters_delta(before, cachebuild.stats())["traced"] == 1
    assert "environment variable CACHEBUILD_TEST_SCALE: unset → '2'" in caplog.text


def test_environment_names_are_any_constant_but_the_shells_own():
    """Where a trace reads the environment (held by an attribute, here), every constant
    that could name a variable is recorded (in lower case too), but not bash's ``_`` (the
    command's path: ``cachebuild warm`` and the server would differ) or the folder's."""
    from cachebuild.tracing.guard_export import environment_records
    from cachebuild.tracing.guards import GuardRecord

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.env = os.environ

    def forward(kind):
        return os.environ.get("_".join([kind, "FLAG"])), os.getenv("my_flag"), "PWD"

    reads = GuardRecord((("model",), ("attr", "env")), "id", None, 0)
    names = {r.path[0][1] for r in environment_records([reads], [forward.__code__],
                                                         Holder(), ())}
    assert {"FLAG", "my_flag"} <= names and not names & {"_", "PWD"}, names


# -- the records themselves ------------------------------------------------------------

def test_records_read_values_plainly_and_name_what_differs():
    model = Tunable(eps=1e-5).eval()
    records = [
        GuardRecord((("model",), ("attr", "act")), "type", None, {"type": "torch.nn.modules.activation.SiLU"}),
        GuardRecord((("model",), ("attr", "eps")), "equals", None, plain(1e-5)),
        GuardRecord((("model",), ("attr", "inner"), ("attr", "_modules"), ("item", "layers"),
                     ("attr", "_modules"), ("item", "0"), ("attr", "heads")), "equals", None, 4),
        GuardRecord((("model",), ("attr", "inner")), "exists", "lm_head", True),
        GuardRecord((("module", "torch.nn.functional"), ("attr", "rms_norm")), "id", None,
                    identity(F.rms_norm)),
        GuardRecord((("env", "CACHEBUILD_TEST_UNSET"),), "equals", None, None),
    ]
    guards = GuardSet.from_data([r.to_data() for r in records])
    assert guards.mismatches(model, models.inputs(3)) == []
    model.act, model.eps = nn.GELU(), 1e-6
    model.inner.layers[0].heads = 8
    del model.inner.lm_head
    said = [m.describe() for m in guards.mismatches(model, models.inputs(3))]
    assert said == ["act: SiLU → GELU", "eps: 1e-05 → 1e-06", "inner.layers.0.heads: 4 → 8",
                    "inner.lm_head: True → False"]


@pytest.mark.parametrize("form", ["keyword", "attribute source"])
def test_hasattr_guards_of_either_torch_form_record_the_same(form):
    """torch 2.13 puts HASATTR on the object with the name as a keyword; torch 2.11 and
    2.12 on the attribute's own source (and record the attribute's value, not the object's)."""
    import functools
    from types import SimpleNamespace

    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.source import AttrSource, LocalSource
    from torch._guards import Guard

    model = Tunable()
    inner = AttrSource(LocalSource("self"), "inner")
    if form == "keyword":
        guard, value = Guard(inner, functools.partial(GuardBuilder.HASATTR, attr="lm_head")), model.inner
    else:
        guard, value = Guard(AttrSource(inner, "lm_head"), GuardBuilder.HASATTR), model.inner.lm_head
    entry = SimpleNamespace(guard_type="HASATTR", has_value=True, value=value, orig_guard=guard)
    records = records_from(Collected([entry]), model, models.inputs(3), set())
    assert GuardRecord((("model",), ("attr", "inner")), "exists", "lm_head", True) in records


def test_a_global_dynamo_installed_for_a_module_is_that_module():
    """``type(x)`` of a tensor reads ``torch.Tensor`` through a global Dynamo installs
    (``_<id>_c<n>``, gone at a warm start): recorded as the module it stands for."""
    from torch._dynamo.source import AttrSource, GlobalSource

    from cachebuild.tracing.guard_export import Frame, source_path

    frame = Frame(("self",), None, None, ())
    assert source_path(AttrSource(GlobalSource(f"_{id(torch)}_c0"), "Tensor"), frame) == [
        ["module", "torch"], ["attr", "Tensor"]]
    assert source_path(GlobalSource(f"_{id(torch)}_c3"), frame) == [["module", "torch"]]
    with pytest.raises(Unrecordable, match="neither a module nor"):
        source_path(GlobalSource(f"_{id(object())}_c0"), frame)


def test_identity_is_by_name_and_code_never_by_address():
    def make(k):
        return lambda x: x * k

    assert identity(torch.nn.functional) == {"module": "torch.nn.functional"}
    assert identity(F.silu) != identity(F.gelu)
    assert identity(lambda x: x * 2) != identity(lambda x: x * 3)  # same qualname
    assert identity(make(2)) == identity(make(3))  # closures: the cell is its own record
    with pytest.raises(ValueError):
        identity(object())  # an instance compared by identity has no plain form
    # ... unless a global of the module defining its class holds it: then by that name.
    assert identity(PLAIN_ROTARY)["global"].endswith(".PLAIN_ROTARY")
    assert identity(PLAIN_ROTARY) != identity(SCALED_ROTARY)
    with pytest.raises(ValueError):
        identity(_Kernel())


def test_a_guard_kind_with_no_plain_form_refuses_the_entry():
    class Entry_:
        guard_type = "WEAKREF_ALIVE"
        has_value = False
        value = None

        class orig_guard:  # noqa: N801
            name = "G['x']"

    with pytest.raises(Unrecordable, match="WEAKREF_ALIVE has no plain form"):
        records_from(Collected([Entry_()]), Tunable(), models.inputs(3), set())


@pytest.mark.parametrize("form", ["count", "append a size", "list item"])
def test_side_effects_on_existing_objects_are_refused_and_never_made(form):
    """Refused in one line, before the frame makes them: the refused trace leaves the
    objects as they were (a caller running the model eagerly next must not see them
    twice)."""
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = models.make(models.Decoder, layers=1)
            self.calls = 0
            self.log: list[object] = []
            self.hist = [torch.zeros(())]

        def forward(self, ids, pos):
            out = self.inner(ids, pos)
            if form == "count":
                self.calls += 1
            elif form == "append a size":  # a symbolic size: Dynamo's list cannot say it
                self.log.append(ids.shape[0])
            else:
                self.hist[0] = out.sum()
            return out

    from cachebuild.errors import UsageError

    model = Counting().eval()
    before = model.hist[0]
    name = {"count": "calls", "append a size": "log", "list item": "hist"}[form]
    with pytest.raises(UsageError, match=f"changes .*{name}.*replays no side effects"):
        trace_model(model, models.inputs(4), DYN)
    assert (model.calls, model.log) == (0, []) and model.hist[0] is before


def test_a_branch_on_the_token_count_inside_a_range_is_refused():
    class Short(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = models.make(models.Decoder, layers=1)

        def forward(self, ids, pos):
            out = self.inner(ids, pos)
            return out * 2 if ids.shape[0] > 8 else out

    from cachebuild.errors import UsageError

    with pytest.raises(UsageError, match=r"another branch at size 8 than at 12 .*T > 8.*\(1, 16\)"):
        trace_model(Short().eval(), models.inputs(12), DYN, ((1, 16),))
    trace_model(Short().eval(), models.inputs(12), DYN, ((9, 16),))  # one side: fine
    # Two ranges, one each side: one trace cannot serve both, and the message says so
    # (it said the other range held both sides).
    with pytest.raises(UsageError, match=r"one trace serves every compile range .*\(1, 8\) "
                                         r"lies on the other side"):
        trace_model(Short().eval(), models.inputs(12), DYN, ((1, 8), (9, 16)))


# -- explain ---------------------------------------------------------------------------

HF_MODEL = """
import os, sys
sys.path.insert(0, {tests!r})
import cachebuild, hf_families

def build():
    family = hf_families.FAMILIES[os.environ["HF_FAMILY"]]
    model = family.model(**{{os.environ["HF_FIELD"]: eval(os.environ["HF_VALUE"])}})
    return cachebuild.ModelSpec(model, hf_families.ids(9), {{0: 0}},
                                hf_families.compile_config(family))
"""


@pytest.mark.parametrize(("name", "field", "first", "second", "said"), [
    ("llama", "hidden_act", "'silu'", "'gelu'", ["config.hidden_act: silu → gelu",
                                                 "hf.model.layers.0.mlp.act_fn: SiLU"]),
    ("llama", "rms_norm_eps", "1e-06", "1e-05", [
        "config.rms_norm_eps: 1e-06 → 1e-05", "input_layernorm.variance_epsilon: 1e-06 → 1e-05"]),
    ("mistral", "sliding_window", "4", "6", ["config.sliding_window: 4 → 6",
                                             "sliding_window: 4 → 6"]),
])
def test_explain_names_the_config_value(open_local, tmp_path, monkeypatch, name, field, first, second, said):
    """A Hugging Face model's config is in the entry key; explain names the field and the
    module values the trace read from it."""
    import hf_families

    path = tmp_path / "model.py"
    path.write_text(HF_MODEL.format(tests=str(models.TESTS_DIR)))
    store = tmp_path / "store"
    monkeypatch.setenv("HF_FIELD", field)
    monkeypatch.setenv("HF_FAMILY", name)

    def run(*args):
        result = CliRunner().invoke(cli.main, ["--cache-dir", str(store), *args],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    monkeypatch.setenv("HF_VALUE", first)
    family = hf_families.FAMILIES[name]
    model = family.model(**{field: eval(first)})
    compiled = cachebuild.compile(model, hf_families.compile_config(family), {0: 0},
                                  store=open_local(store))
    hf_families.check_sizes(compiled, model, (9,))
    assert "every target is stored" in run("explain", str(path))
    monkeypatch.setenv("HF_VALUE", second)
    text = run("explain", str(path))
    assert "nearest entry" in text
    for words in said:
        assert words in text


def test_guards_alone_tell_config_values_apart(open_local, tmp_path, monkeypatch):
    """With the config left out of the key, the recorded guards still refuse the other
    model's entry: they are the source of truth."""
    import hf_families

    from cachebuild.building import entry_key

    monkeypatch.setattr(entry_key, "config_factor", lambda model: {})
    family = hf_families.FAMILIES["llama"]
    store = open_local(tmp_path / "store")
    a, b = family.model(rms_norm_eps=1e-6), family.model(rms_norm_eps=0.5)
    for model in (a, b):
        before = cachebuild.stats()
        compiled = cachebuild.compile(model, hf_families.compile_config(family), {0: 0},
                                      store=store)
        hf_families.check_sizes(compiled, model, (5, 11))
        assert models.counters_delta(before, cachebuild.stats())["traced"] == 1


# -- models without a source file ----------------------------------------------------

SOURCELESS = """
import json, os, sys
import torch, torch.nn as nn
import cachebuild, models
from cachebuild.store import LocalStore

code = '''
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = models.make(models.Decoder, layers=1)

    def forward(self, ids, pos):
        return self.inner(ids, pos) * SCALE
'''
namespace = {"__name__": "cell", "nn": nn, "models": models, "SCALE": 2.0}
exec(code.replace("SCALE", os.environ["SCALE"]) if os.environ.get("INLINE") else code, namespace)
if os.environ.get("HELPER"):
    exec("def helper(x):\\n    return x * 3\\n", namespace)
    namespace["Scaled"].forward = lambda self, ids, pos: namespace["helper"](self.inner(ids, pos))
model = namespace["Scaled"]().eval()
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                              store=LocalStore(os.environ["STORE"]))
for size in (3, 7):
    models.assert_matches_eager(compiled, model, models.inputs(size))
if os.environ.get("HELPER"):  # changed after the first calls: no record can see it
    exec("def helper(x):\\n    return x * 5\\n", namespace)
    for size in (3, 7):
        models.assert_matches_eager(compiled, model, models.inputs(size))
print(json.dumps({k: v for k, v in cachebuild.stats().items() if k != "seconds"}))
"""


def test_a_model_without_a_source_file(tmp_path):
    """``python -c`` with the class defined through exec: keyed by its code objects,
    warm-started in a fresh process; edited code is a new entry."""
    store = str(tmp_path / "store")

    def run(**env):
        return models.run_python(SOURCELESS, env={"STORE": store, **env})

    assert run(SCALE="2.0")["traced"] == 1
    warm = run(SCALE="2.0")
    assert warm["entries_loaded"] == 1 and warm["traced"] == 0 and warm["built"] == 0
    edited = run(SCALE="3.0", INLINE="1")  # the constant is in the class's code now
    assert edited["traced"] == 1 and edited["entries_loaded"] == 0


def test_a_sourceless_helper_compiles_without_an_entry(open_local, tmp_path):
    store = tmp_path / "store"
    for _ in range(2):
        child = models.run_python(SOURCELESS, env={"STORE": str(store), "HELPER": "1",
                                                   "SCALE": "2.0"})
        assert child["traced"] == 1 and child["entries_loaded"] == 0
    assert not [r for r in open_local(store).records() if r.kind == "entry"]


# -- cost ------------------------------------------------------------------------------

def test_guards_of_a_real_model_round_trip_and_hold():
    # What checking them costs is measured by tools/bench_checks.py, not asserted here.
    import hf_families

    model = hf_families.FAMILIES["llama"].model(num_hidden_layers=2)
    traced = trace_model(model, hf_families.ids(8), {0: 0}, (hf_families.RANGE,))
    assert traced.unrecordable is None and len(traced.guards) > 300
    guards = GuardSet.from_data([g.to_data() for g in traced.guards])
    assert len(guards) == len(traced.guards)
    with torch.no_grad():  # as traced (transformers' layers name torch.is_grad_enabled())
        assert guards.mismatches(model, hf_families.ids(8)) == []
        model.hf.model.layers[0].input_layernorm.variance_epsilon = 1e-3  # the trace read it
        assert guards.mismatches(model, hf_families.ids(8))


def test_guard_lists_are_checked_as_data_and_never_import():
    import sys

    from cachebuild.tracing.guards import GuardSet, check_data

    # A step holding an encoded key (bytes) is a dict: the set still holds it.
    data = [[[["model"], ["item", {"bytes": "6869"}]], "exists", "x", False],
            [[["module", "a_module_nobody_imported"], ["attr", "x"]], "equals", None, 1]]
    values = GuardSet(check_data(data)).values(object(), ())
    assert values == [False, {"missing": True}]
    assert "a_module_nobody_imported" not in sys.modules
    for bad in ([[[["module", ["os"]]], "id", None, None]], [[[["model"]], ["id"], None, 1]],
                [[[["model"], ["call", "system"]], "id", None, 1]], {"guards": []}, [[]]):
        with pytest.raises(ValueError):
            check_data(bad)


class _Level(enum.IntEnum):
    LOW = 1


class _Name(enum.StrEnum):
    FAST = "fast"


def test_values_equal_in_python_that_a_forward_tells_apart_have_other_plain_values():
    """``True == 1`` and ``_Level.LOW == 1``, yet ``x is True`` or ``x is _Level.LOW`` in a
    forward sees the difference: their recorded values differ, in this process and after
    JSON (another process)."""
    pairs = [(True, 1), (False, 0), (_Level.LOW, 1), (_Name.FAST, "fast"), (1.0, 1),
             ((True,), (1,)), ({"k": True}, {"k": 1})]
    for a, b in pairs:
        assert plain(a) != plain(b), (a, b)
        assert json.loads(json.dumps(plain(a))) != json.loads(json.dumps(plain(b))), (a, b)
    assert plain(True) == plain(True) and plain(_Level.LOW) == plain(_Level(1))
