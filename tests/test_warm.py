"""Warm starts: a fresh process with a warmed store runs no Dynamo frame, builds nothing,
matches eager, and (on the AOTI path) imports neither Dynamo nor Inductor; traced source
files decide whether an entry is still valid; calls that do not fit the entry are refused."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import warnings
from dataclasses import replace

import models
import pytest
import torch

import cachebuild
from cachebuild.building.entry import Entry
from cachebuild.errors import UsageError
from cachebuild.store import LocalStore

DYN = {0: 0, 1: 0}

#: Runs in a fresh process: compile a 2-layer Decoder against STORE, compare with eager
#: at a few sizes, and report the counters, Dynamo's own counters and the compiler
#: modules imported (looked at before anything imports Dynamo to read its counters).
WARM_CHILD = """
import json, os, sys

import torch

import cachebuild
import models
from cachebuild.store import LocalStore

config = models.aoti_config() if os.environ["BACKEND"] == "aoti" else models.config()
model = models.make(models.Decoder, layers=2, seed=11)
compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=LocalStore(os.environ["STORE"]))
with torch.no_grad():
    calls = [(compiled(*args), args) for args in map(models.inputs, models.AOTI_SIZES)]
# Dynamo, Inductor and what tracing alone needs (sympy: seconds to import), looked at
# before torch.testing's comparison imports them
compilers = sorted(m for m in sys.modules if m.split(".")[:2] in (["torch", "_dynamo"],
                                                                  ["torch", "_inductor"])
                   or m in ("sympy", "torch.fx.experimental.symbolic_shapes"))
with torch.no_grad():
    for out, args in calls:
        torch.testing.assert_close(out, model(*args), **models.TOL)
from torch._dynamo.utils import counters

print(json.dumps({"stats": cachebuild.stats(), "compilers": compilers,
                  "frames": counters["frames"]["total"],
                  "graphs": counters["stats"]["unique_graphs"]}))
"""


def assert_fully_warm(child, unique):
    assert child["frames"] == 0 and child["graphs"] == 0  # Dynamo compiled no frame
    stats = child["stats"]
    assert stats["traced"] == 0 and stats["built"] == 0 and stats["failed"] == 0
    assert stats["entries_loaded"] == 1 and stats["loaded"] == unique


@pytest.mark.slow
def test_fresh_process_after_warm_aoti_imports_no_compiler():
    warmed = models.aoti_store()
    child = models.run_python(WARM_CHILD, env={"STORE": str(warmed["path"]), "BACKEND": "aoti"})
    assert_fully_warm(child, unique=3)
    assert child["compilers"] == []


def test_fresh_process_after_warm_eager_fusion(tmp_path):
    path = tmp_path / "store"
    cold = models.run_python(WARM_CHILD, env={"STORE": str(path), "BACKEND": "eager_fusion"})
    # The cold process traced: Dynamo's counters do see it (the warm check below can fail).
    assert cold["stats"]["traced"] == 1 and cold["graphs"] >= 1 and cold["stats"]["built"] == 3
    warm = models.run_python(WARM_CHILD, env={"STORE": str(path), "BACKEND": "eager_fusion"})
    assert_fully_warm(warm, unique=3)
    assert warm["compilers"] == []


# -- traced source files ---------------------------------------------------------------

LAYERS_FILE = '''
import torch.nn.functional as F


def mlp(x, gate_up, down):
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)
'''

MODEL_FILE = '''
import torch
import torch.nn as nn

import edit_layers
import models


class EditModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = models.make(models.Decoder, layers=2)
        torch.manual_seed(1)
        self.gate_up = nn.Linear(models.HIDDEN, 2 * models.MLP, bias=False)
        self.down = nn.Linear(models.MLP, models.HIDDEN, bias=False)

    def forward(self, ids, pos):
        x = self.inner.embed(ids)
        for layer in self.inner.layers:
            x = layer(x, pos)
        x = x + edit_layers.mlp(self.inner.norm(x), self.gate_up, self.down)
        return self.inner.lm_head(x)
'''

EDIT_CHILD = """
import json, os

import cachebuild
import edit_model
import models
from cachebuild.store import LocalStore

model = edit_model.EditModel().eval()
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                              store=LocalStore(os.environ["STORE"]))
for size in (3, 16):
    models.assert_matches_eager(compiled, model, models.inputs(size))
from torch._dynamo.utils import counters

print(json.dumps({"stats": cachebuild.stats(), "entry": compiled.runtime.entry.key,
                  "files": sorted(compiled.runtime.entry.source_files),
                  "graphs": counters["stats"]["unique_graphs"]}))
"""


def test_traced_files_decide_whether_the_entry_is_valid(open_local, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    layers, model_file = src / "edit_layers.py", src / "edit_model.py"
    layers.write_text(LAYERS_FILE)
    model_file.write_text(MODEL_FILE)
    path = tmp_path / "store"

    def run():
        return models.run_python(EDIT_CHILD, env={"STORE": str(path)}, extra_path=[src])

    cold = run()
    assert cold["stats"]["traced"] == 1 and cold["graphs"] >= 1
    assert {str(layers), str(model_file), str(models.TESTS_DIR / "models.py")} <= set(
        cold["files"])

    # Comments and blank lines only, in both files: the entry stays valid.
    layers.write_text("# helpers for the edit test\n\n" + LAYERS_FILE.replace(
        "    gate, up", "    # split the projection\n\n    gate, up") + "\n\n# end\n")
    model_file.write_text(MODEL_FILE.replace("        x = x + edit_layers",
                                             "        # the extra MLP\n\n        x = x + edit_layers"))
    warm = run()
    assert warm["stats"]["traced"] == 0 and warm["graphs"] == 0
    assert warm["stats"]["entries_loaded"] == 1 and warm["stats"]["built"] == 0
    assert warm["entry"] == cold["entry"]

    # Code in a traced helper file: the entry is stale, traced again, recorded beside it
    # (under a variant of its key for this code: the other version's entry is kept).
    layers.write_text(LAYERS_FILE.replace("F.silu(gate)", "F.gelu(gate)"))
    stale = run()
    assert stale["stats"]["traced"] == 1 and stale["graphs"] >= 1
    assert stale["stats"]["built"] >= 1  # the piece holding the edited MLP changed
    assert stale["entry"] != cold["entry"]
    store = open_local(path)
    assert Entry.from_bytes(store.get(stale["entry"])).stale_files() == []
    assert Entry.from_bytes(store.get(cold["entry"])).stale_files()  # kept, for the old code
    again = run()
    assert again["stats"]["traced"] == 0 and again["entry"] == stale["entry"]

    # Code in the file that defines the model class: traced again too.
    model_file.write_text(MODEL_FILE.replace("x = x + edit_layers", "x = x - edit_layers"))
    edited = run()
    assert edited["stats"]["traced"] == 1 and edited["graphs"] >= 1
    assert edited["stats"]["built"] >= 1


def test_stale_entry_in_this_process(open_local, tmp_path, monkeypatch):
    """The same check in-process: a traced file that vanished makes the entry stale."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "vanishing_helpers.py").write_text(textwrap.dedent("""
        def double(x):
            return x * 2
    """))
    spec = importlib.util.spec_from_file_location("vanishing_helpers", src / "vanishing_helpers.py")
    helpers = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "vanishing_helpers", helpers)
    spec.loader.exec_module(helpers)

    class UsesHelper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = models.make(models.Decoder, layers=1)

        def forward(self, ids, pos):
            return helpers.double(self.inner(ids, pos))

    store = open_local(tmp_path / "store")
    model = UsesHelper().eval()
    models.assert_matches_eager(cachebuild.compile(model, models.config(), DYN, store=store),
                                model, models.inputs(4))
    before = cachebuild.stats()
    models.assert_matches_eager(cachebuild.compile(model, models.config(), DYN, store=store),
                                model, models.inputs(4))
    assert models.counters_delta(before, cachebuild.stats())["traced"] == 0
    (src / "vanishing_helpers.py").unlink()
    before = cachebuild.stats()
    models.assert_matches_eager(cachebuild.compile(model, models.config(), DYN, store=store),
                                model, models.inputs(4))
    assert models.counters_delta(before, cachebuild.stats())["traced"] == 1


# -- calls that do not fit the entry ---------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A LayerStack (hidden states [T, 32], positions [T]) compiled for T in 1..16; its
    store closed after the module."""
    model = models.make(models.LayerStack, layers=2)
    with LocalStore(tmp_path_factory.mktemp("stack") / "store") as store:
        compiled = cachebuild.compile(model, models.config(compile_ranges=((1, 16),)), DYN,
                                      store=store)
        models.assert_matches_eager(compiled, model, models.hidden_inputs(8))
        yield model, compiled, store


@pytest.mark.parametrize("args,message", ids=["dtype", "arg-dtype", "rank-up", "rank-down",
                                              "static-dim", "missing-arg", "not-a-tensor"],
                         argvalues=[
    (lambda x, p: (x.double(), p), "argument 0 is float64 with 2 dims; the compiled model "
                                   "takes float32 with 2 dims"),
    (lambda x, p: (x, p.int()), "argument 1 is int32 with 1 dims"),
    (lambda x, p: (x[None], p), "argument 0 is float32 with 3 dims"),
    (lambda x, p: (x.flatten(), p), "argument 0 is float32 with 1 dims"),
    (lambda x, p: (torch.cat([x, x], dim=1), p),
     "argument 0 has size 64 in dim 1, which was compiled static at 32"),
    (lambda x, p: (x,), "expected at least 2 arguments, got 1"),
    (lambda x, p: (x, p.tolist()), "dynamic_dims names argument 1, which is not a tensor "
                                   "argument"),
])
def test_calls_that_do_not_fit_are_refused(stack, args, message):
    _, compiled, _ = stack
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        compiled(*args(*models.hidden_inputs(5)))
    # ... and the module still works afterwards.
    models.assert_matches_eager(compiled, stack[0], models.hidden_inputs(5))


def test_calls_that_do_not_fit_a_warm_loaded_entry_are_refused(stack):
    model, _, store = stack
    warm = cachebuild.compile(model, models.config(compile_ranges=((1, 16),)), DYN, store=store)
    before = cachebuild.stats()
    models.assert_matches_eager(warm, model, models.hidden_inputs(3))
    assert models.counters_delta(before, cachebuild.stats())["entries_loaded"] == 1
    x, p = models.hidden_inputs(3)
    with pytest.raises(UsageError, match="compiled static at 32"):
        warm(torch.cat([x, x], dim=1), p)
    with pytest.raises(UsageError, match="float16"):
        warm(x.half(), p)


def test_size_outside_every_range_is_an_error(stack):
    _, compiled, _ = stack
    with pytest.raises(UsageError, match=r"size 17 of the dynamic dim is outside every compile "
                                         r"range \[\(1, 16\)\]; add a range or set "
                                         r"out_of_range='eager'"):
        compiled(*models.hidden_inputs(17))


def test_size_outside_every_range_runs_eagerly_with_one_warning(open_local, tmp_path):
    model = models.make(models.LayerStack, layers=2)
    compiled = cachebuild.compile(
        model, models.config(compile_ranges=((1, 16),), out_of_range="eager"), DYN,
        store=open_local(tmp_path / "store"))
    models.assert_matches_eager(compiled, model, models.hidden_inputs(4))
    with pytest.warns(UserWarning, match="size 20 is outside every compile range; running "
                                         "eagerly") as caught:
        models.assert_matches_eager(compiled, model, models.hidden_inputs(20))
    said = [w for w in caught if "outside every compile range" in str(w.message)]
    assert len(said) == 1 and said[0].filename == models.__file__  # the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second out-of-range call warns no more
        models.assert_matches_eager(compiled, model, models.hidden_inputs(33))
    models.assert_matches_eager(compiled, model, models.hidden_inputs(16))


def test_a_first_call_outside_every_range_runs_eagerly_before_anything_is_traced(open_local,
                                                                              tmp_path):
    model = models.make(models.LayerStack, layers=2)
    compiled = cachebuild.compile(
        model, models.config(compile_ranges=((1, 16),), out_of_range="eager"), DYN,
        store=open_local(tmp_path / "store"))
    before = cachebuild.stats()
    with pytest.warns(UserWarning, match="size 20 is outside every compile range") as caught:
        models.assert_matches_eager(compiled, model, models.hidden_inputs(20))
    assert caught[0].filename == models.__file__
    assert cachebuild.stats()["traced"] == before["traced"]  # nothing traced for it
    models.assert_matches_eager(compiled, model, models.hidden_inputs(4))
    assert cachebuild.stats()["traced"] == before["traced"] + 1


def test_compiled_pieces_refuse_autocast_and_say_once_they_answer_without_autograd(
        caplog, fresh_dynamo):
    """AOTI pieces are built without autocast and run without autograd: a call under
    ``torch.autocast`` is refused through both doors (their outputs would keep float32);
    a call with autograd on answers eager's values and says once that the outputs carry
    no gradient history. A call outside autocast afterwards still runs."""
    warmed = models.aoti_store()
    before = cachebuild.stats()
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.aoti_config(), DYN,
                                  store=LocalStore(warmed["path"]))
    args = models.inputs(5)
    with caplog.at_level("WARNING", logger="cachebuild"):
        for _ in range(2):
            out = compiled(*args)
            torch.testing.assert_close(out, model(*args).detach(), **models.TOL)
    said = [r for r in caplog.records if "carry no gradient history" in r.getMessage()]
    assert len(said) == 1, caplog.text
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(UsageError, match=r"called under torch.autocast \(cpu\)"):
        compiled(*args)
    models.assert_matches_eager(compiled, model, args)
    door = torch.compile(model, backend=cachebuild.backend(
        models.aoti_config(), store=LocalStore(warmed["path"])))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(Exception, match=r"called under torch.autocast \(cpu\)"):
        door(*args)
    assert models.counters_delta(before, cachebuild.stats())["built"] == 0


def test_a_call_under_autocast_is_refused_before_anything_and_never_remembered(
        open_local, tmp_path):
    """On an empty store too: refused before a trace, and not remembered as the model's
    failure, so a call without autocast is compiled as usual (not 'failed earlier')."""
    from cachebuild import process_state

    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.aoti_config(), DYN,
                                  store=open_local(tmp_path / "store"))
    before = cachebuild.stats()
    for _ in range(2):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
                pytest.raises(UsageError, match=r"called under torch.autocast \(cpu\)"):
            compiled(*models.inputs(5))
    assert not process_state.current().failed
    assert models.counters_delta(before, cachebuild.stats())["traced"] == 0
    # With on_failure="eager", such a call runs eagerly (autocast applies) while it lasts.
    config = replace(models.aoti_config(), on_failure="eager")
    lenient = cachebuild.compile(model, config, DYN, store=open_local(tmp_path / "store"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = lenient(*models.inputs(5)), model(*models.inputs(5))
    assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want)
    assert not lenient._eager  # not for good: the next call without autocast compiles
    assert models.counters_delta(before, cachebuild.stats())["traced"] == 0


class NormAfterLinear(torch.nn.Module):
    """A float32 norm weight after a linear that autocast runs in bfloat16: eager's
    composite ``rms_norm`` returns bfloat16, its ops taken apart and run under autocast
    again would return float32; and ``with torch.autocast`` blocks of the forward's own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(16, 16), torch.nn.RMSNorm(16)
        self.group = torch.nn.GroupNorm(2, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        with torch.autocast("cpu", enabled=False):  # a part the forward keeps in float32
            kept = self.lin(h.float())
        with torch.autocast("cpu", dtype=torch.bfloat16):  # and a part it casts itself
            cast = self.lin(x)
        return self.norm(h), self.group(h), torch.nn.functional.silu(h) * x, kept, cast


def test_eager_fusion_pieces_run_under_the_callers_autocast(open_local, tmp_path, fresh_dynamo):
    """``eager_fusion`` pieces are lowered under the autocast of the call they serve, its
    casts in their graph: the same dtypes and values as eager, before and after a call
    without it, and from a second compile that loads what the first built."""
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(), DYN, store=open_local(tmp_path / "s"))
    args = models.inputs(6)
    models.assert_matches_eager(compiled, model, args)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = compiled(*args), model(*args)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    models.assert_matches_eager(compiled, model, args)

    torch.manual_seed(0)
    norm = NormAfterLinear().eval()
    store = open_local(tmp_path / "norm")
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    for first in (True, False):
        again = cachebuild.compile(norm, config, {0: 0}, store=store)
        built = cachebuild.stats()["built"]
        for size in (5, 12):
            x = torch.randn(size, 16)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                out, want = again(x), norm(x)
            assert [o.dtype for o in out] == [w.dtype for w in want], (out, want)
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
            models.assert_matches_eager(again, norm, (x,))
        assert first or cachebuild.stats()["built"] == built  # the second loads them
