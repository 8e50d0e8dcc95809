"""Writes in place are exact, or refused: every pattern of ``inplace_models`` (a written
input, a written buffer, a view read after its base is written, a cache written in a piece
and read by the splitting op, written in one piece and read in the next, written by a
splitting op, outputs that alias inputs and each other) gives eager's outputs *and* leaves
eager's state, call after call, through both front doors and in every graph mode; the
model with all of them does so with every backend, cold and warm in fresh processes.
"""

from __future__ import annotations

import warnings
from typing import Any

import inplace_models as im
import models
import pytest
import torch

import cachebuild
from cachebuild.errors import BuildError, UsageError
from cachebuild.graph.effects import graph_effects

MODES = ("none", "piecewise", "full")
#: Calls of a sequence: 4 and 1 are capture sizes (captured at their first call, replayed
#: at their second), 5 and 3 are not.
SIZES = (5, 4, 1, 3, 4, 1)


def mode_config(mode: str, **overrides: object) -> cachebuild.CompileConfig:
    graphs = {} if mode == "none" else {"cudagraph_mode": mode, "capture_sizes": (1, 4, 8)}
    return im.config(**graphs, **overrides)


def eager_results(cls: type) -> list[list[torch.Tensor]]:
    model = im.make(cls)
    return im.run_sequence(model, model, cls, SIZES)


@pytest.mark.parametrize("cls", im.PATTERNS, ids=lambda c: c.__name__)
def test_pattern_through_cachebuild_compile_in_every_graph_mode(open_local, cls, tmp_path):
    want = eager_results(cls)
    store = open_local(tmp_path / "store")
    for mode in MODES:
        model = im.make(cls)
        compiled = cachebuild.compile(model, mode_config(mode), im.dynamic_dims(cls), store=store)
        im.assert_same(im.run_sequence(compiled, model, cls, SIZES), want)
        if mode != "none":  # sizes 4 and 1 replayed from graphs, in every piece
            replayers = compiled.runtime.replayers()
            assert compiled.runtime.captured_sizes == [1, 4]
            assert all(r.misses == 0 for r in replayers)
            assert all(r.replays == 1 for r in replayers), [r.replays for r in replayers]


@pytest.mark.parametrize("cls", im.PATTERNS, ids=lambda c: c.__name__)
def test_pattern_through_torch_compile(open_local, cls, tmp_path):
    model = im.make(cls)
    config = im.config()
    compiled = torch.compile(model, backend=cachebuild.backend(
        config, store=open_local(tmp_path / "store")))
    im.assert_same(im.run_sequence(compiled, model, cls, SIZES), eager_results(cls))


class WritesOneOfTwoViews(im.Base):
    """Two arguments that are overlapping views of one tensor: one written, one read."""

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = im.attend(self.q(x), x, x)
        a.add_(1.0)
        return y + b.sum()


class BufferViewsBuffer(im.Base):
    """A buffer that is a view of another: the view written, the other read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("big", torch.zeros(4, im.H))
        self.register_buffer("head", self.big[:2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = im.attend(self.q(x), x, x)
        self.head.add_(1.0)
        return y + self.big.sum()


def test_torch_compile_runs_a_graph_eagerly_where_a_written_input_shares_memory(open_local,
                                                                              tmp_path):
    """Where an input written in place shares memory with another input, the pieces would
    take the two apart (the read would miss the write): that graph runs as Dynamo made it,
    with a warning (``cachebuild.compile`` refuses both in one line)."""
    backend = cachebuild.backend(im.config(), store=open_local(tmp_path / "store"))
    torch.manual_seed(0)
    views, buffers = WritesOneOfTwoViews(), BufferViewsBuffer()
    eager_views, eager_buffers = im.make(WritesOneOfTwoViews), im.make(BufferViewsBuffer)
    eager_views.load_state_dict(views.state_dict())
    eager_buffers.load_state_dict(buffers.state_dict())
    compiled_views = torch.compile(views, backend=backend)
    compiled_buffers = torch.compile(buffers, backend=backend)
    with torch.no_grad(), pytest.warns(UserWarning, match="overlaps .* in memory"):
        for tokens in (3, 5):
            x = torch.randn(tokens, im.H)
            base, eager_base = torch.zeros(6, im.H), torch.zeros(6, im.H)
            got = compiled_views(x, base[0:4], base[2:6])
            want = eager_views(x, eager_base[0:4], eager_base[2:6])
            torch.testing.assert_close(got, want)
            assert torch.equal(base, eager_base)
            torch.testing.assert_close(compiled_buffers(x), eager_buffers(x))
            assert torch.equal(buffers.big, eager_buffers.big)
    # Disjoint slices of one tensor (one cache, a slice per layer) take the pieces.
    disjoint, eager_disjoint = WritesOneOfTwoViews(), im.make(WritesOneOfTwoViews)
    eager_disjoint.load_state_dict(disjoint.state_dict())
    compiled_disjoint = torch.compile(disjoint, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no graph runs eagerly
        for tokens in (3, 5):
            x = torch.randn(tokens, im.H)
            base, eager_base = torch.zeros(6, im.H), torch.zeros(6, im.H)
            got = compiled_disjoint(x, base[0:3], base[3:6])
            torch.testing.assert_close(got, eager_disjoint(x, eager_base[0:3], eager_base[3:6]))
            assert torch.equal(base, eager_base)


def test_outputs_alias_what_eager_outputs_alias(open_local, tmp_path):
    model = im.make(im.AliasingOutputs)
    compiled = cachebuild.compile(model, im.config(), {0: 0, 1: 0},
                                  store=open_local(tmp_path / "store"))
    x, slots, cache, _ = im.call_args(im.AliasingOutputs, 5)
    with torch.no_grad():
        out, flat, head = compiled(x, slots, cache)
    assert head.data_ptr() == cache.data_ptr()  # a view of the caller's cache, as in eager
    assert flat.data_ptr() == out.data_ptr()
    flat.zero_()
    assert float(out.abs().sum()) == 0.0


class ReturnsAnUnreadArgument(im.Base):
    """Hands back an argument its graph never reads (the positions, as they came)."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> Any:
        return self.o(im.attend(self.q(x), x, x)), slots


def test_an_argument_the_graph_does_not_read_is_returned_as_it_came(open_local, tmp_path):
    """Dynamo hands it back from the caller's frame: the compiled forward gives the
    caller's own tensor at every size of the range, from one trace, cold and warm."""
    store = open_local(tmp_path / "store")
    model = im.make(ReturnsAnUnreadArgument)
    for start in ("cold", "warm"):
        compiled = cachebuild.compile(model, im.config(), {0: 0, 1: 0}, store=store)
        before = cachebuild.stats()
        with torch.no_grad():
            for tokens in (1, 5, 3):
                x, slots = torch.randn(tokens, im.H), torch.arange(tokens)
                out, back = compiled(x, slots)
                assert back is slots
                torch.testing.assert_close(out, model(x, slots)[0])
        assert cachebuild.stats()["traced"] - before["traced"] == (start == "cold"), start


def test_effects_name_the_writes_and_the_written_inputs():
    model = im.make(im.AllPatterns)
    args = im.call_args(im.AllPatterns, 5)
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, example_inputs
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    gm = captured["gm"]
    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    effects = graph_effects(gm, fakes)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    written = sorted(names[i] for i in effects.written_inputs)
    assert written == sorted(["l_cache_", "l_acc_", "l_self_buffers_calls_"])
    writers = sorted(str(getattr(n.target, "__name__", n.target)) for n in effects.writes)
    assert writers == sorted(["mul_", "index_copy_", "iadd", "iadd", "write_cache"])


def _traced(model: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """Dynamo's graph of ``model(*args)`` with the first dim of every argument symbolic,
    and its fake inputs."""
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    for a in args:
        torch._dynamo.maybe_mark_dynamic(a, 0)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    gm = captured["gm"]
    return gm, [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


def test_effects_on_static_stand_ins_are_those_of_the_symbolic_run():
    """``graph_effects`` runs a graph on static stand-ins of symbolic inputs (faster):
    every fact (writes, written inputs, bases, values returned as is, reshapes) is what a
    run on the symbolic inputs finds, for a graph with every in-place pattern and inputs
    sharing memory; a graph whose op needs the symbols (a size that depends on data) is
    run on them instead, with the same facts."""
    from cachebuild.graph import effects as fx_effects
    from cachebuild.graph.facts import fake_mode_of

    class DataDependent(torch.nn.Module):
        def forward(self, x, cache):
            cache[: x.shape[0]].add_(1)
            return x[x > 0].sum() + cache.sum()

    cases = [(im.make(im.AllPatterns), im.call_args(im.AllPatterns, 5)),
             (DataDependent(), (torch.randn(3, 4), torch.zeros(6, 4)))]
    for model, args in cases:
        gm, fakes = _traced(model, args)
        assert any(isinstance(s, torch.SymInt) for f in fakes if isinstance(f, torch.Tensor)
                   for s in f.shape)
        symbolic = fx_effects._run(gm, fake_mode_of(fakes), fakes)
        got = graph_effects(gm, fakes)
        for field in ("writes", "written_inputs", "base", "same", "reshapes"):
            assert getattr(got, field) == getattr(symbolic, field), field
        assert got.writes
    stand_ins = fx_effects.stand_ins(_traced(*cases[0])[1])
    assert stand_ins is not None
    assert all(not isinstance(s, torch.SymInt) for t in stand_ins[1]
               if isinstance(t, torch.Tensor) for s in t.shape)


class WritesThroughTorchFunctions(im.Base):
    """Writes made by torch's in-place functions rather than methods: a cache by
    ``torch.index_put_``, a counter by ``torch.index_put_`` too, the input by
    ``torch.relu_`` after it was read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(im.SLOTS, im.H))
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        k = self.k(x)
        torch.index_put_(self.cache, (slots,), k)
        torch.index_put_(self.calls, (torch.zeros(1, dtype=torch.long),), self.calls + 1)
        out = self.o(im.attend(self.q(x), k, k)) * self.calls
        torch.relu_(x)
        return out


def test_writes_by_torch_in_place_functions_are_kept(open_local, tmp_path):
    """``torch.index_put_(buffer, ...)`` and ``torch.relu_(x)`` (functions, not methods,
    whose writes no schema of their own names) are writes: served with eager's outputs and
    state call after call, at one token too (a counter they bump was bumped twice by the
    check of the one-token path, which then refused the model as branching there)."""
    compiled_model, eager_model = im.make(WritesThroughTorchFunctions), \
        im.make(WritesThroughTorchFunctions)
    compiled = cachebuild.compile(compiled_model, mode_config("none", backend="eager_fusion"),
                                  {0: 0, 1: 0}, store=open_local(tmp_path / "store"))
    with torch.no_grad():
        for start, tokens in ((0, 4), (4, 1), (5, 3)):
            x, slots = im.call_args(im.MutatedBuffer, tokens, start)
            x_eager = x.clone()
            torch.testing.assert_close(compiled(x, slots), eager_model(x_eager, slots))
            torch.testing.assert_close(x, x_eager)  # relu_ on the caller's input
            torch.testing.assert_close(compiled_model.cache, eager_model.cache)
            assert compiled_model.calls.item() == eager_model.calls.item()


def test_in_place_torch_functions_are_seen_as_writes():
    """``might_write`` and ``graph_effects`` know torch's in-place functions: by their
    form, and by their aten op's schema where the fake run moves no version counter
    (``torch._foreach_add_``)."""
    from cachebuild.graph.effects import might_write

    class Functions(torch.nn.Module):
        def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            torch._foreach_add_([c], 1.0)
            torch.exp_(c)
            return torch.relu_(x) * 2

    gm, fakes = _traced(Functions(), (torch.randn(4), torch.zeros(4)))
    calls = {getattr(n.target, "__name__", str(n.target)): n for n in gm.graph.nodes
             if n.op == "call_function"}
    assert [name for name, n in calls.items() if might_write(n)] == \
        ["_foreach_add_", "exp_", "relu_"]
    effects = graph_effects(gm, fakes)
    tensors = [i for i, f in enumerate(fakes) if isinstance(f, torch.Tensor)]
    assert sorted(effects.written_inputs) == tensors and len(tensors) == 2
    assert calls["_foreach_add_"] in effects.writes


# -- every backend, cold and warm in fresh processes --------------------------------------

#: Runs in a fresh process: AllPatterns through cachebuild.compile in every graph mode with
#: BACKEND/FLAVOUR against STORE, the sequence's outputs and state, and the counters.
CHILD = """
import json, os

import torch

import cachebuild
import inplace_models as im
from cachebuild.store import LocalStore

backend, flavour = os.environ["BACKEND"], os.environ["FLAVOUR"]
store = LocalStore(os.environ["STORE"])
results = {}
for mode in os.environ["MODES"].split(","):
    graphs = {} if mode == "none" else {"cudagraph_mode": mode, "capture_sizes": (1, 4, 8)}
    model = im.make(im.AllPatterns)
    config = im.config(backend=backend, flavour=flavour, **graphs)
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=store)
    sizes = tuple(map(int, os.environ["SIZES"].split(",")))
    got = im.run_sequence(compiled, model, im.AllPatterns, sizes)
    results[mode] = [[t.tolist() for t in step] for step in got]
print(json.dumps({"results": results, "stats": cachebuild.stats()}))
"""


BACKENDS = [("eager_fusion", "auto"), ("inductor", "aoti"), ("inductor", "standalone")]


def run_children(tmp_path):
    """One child per backend, side by side."""
    found = models.run_pythons(CHILD, [
        {"STORE": str(tmp_path / f"store-{flavour}"), "BACKEND": backend, "FLAVOUR": flavour,
         "MODES": ",".join(MODES), "SIZES": ",".join(map(str, SIZES))}
        for backend, flavour in BACKENDS])
    return {flavour: child for (_, flavour), child in zip(BACKENDS, found, strict=True)}


@pytest.mark.slow
def test_all_patterns_every_backend_cold_then_warm(tmp_path):
    want = eager_results(im.AllPatterns)
    cold = run_children(tmp_path)
    warm = run_children(tmp_path)
    for flavour in cold:
        assert cold[flavour]["stats"]["built"] > 0 and cold[flavour]["stats"]["fallbacks"] == 0
        assert warm[flavour]["stats"]["traced"] == 0 and warm[flavour]["stats"]["built"] == 0
        for child in (cold[flavour], warm[flavour]):
            for mode in MODES:
                got = [[torch.tensor(v).to(w.dtype) for v, w in zip(step, ws, strict=True)]
                       for step, ws in zip(child["results"][mode], want, strict=True)]
                im.assert_same(got, want)


# -- what cannot be exact is refused --------------------------------------------------------

class WritesAConstant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(im.H, im.H)
        self.table = torch.zeros(8, im.H)  # a plain attribute, not a buffer

    def forward(self, x, slots):
        self.table.index_copy_(0, slots, self.lin(x))
        return im.attend(x, x, x) + self.table.sum()


def test_a_write_into_a_tensor_that_is_not_the_models_state_is_refused(open_local, tmp_path):
    compiled = cachebuild.compile(WritesAConstant().eval(), im.config(), {0: 0, 1: 0},
                                  store=open_local(tmp_path / "store"))
    with pytest.raises(UsageError, match="register"), torch.no_grad():
        compiled(torch.randn(3, im.H), torch.arange(3))


def test_a_written_argument_that_shares_memory_with_another_is_refused(open_local, tmp_path):
    model = im.make(im.MutatedInput)
    compiled = cachebuild.compile(model, im.config(), {0: 0, 1: 0},
                                  store=open_local(tmp_path / "store"))
    x, slots, cache, _ = im.call_args(im.MutatedInput, 4)
    with torch.no_grad():
        compiled(x, slots, cache)
        before = cache.clone()
        with pytest.raises(UsageError, match="shares memory with argument 0"):
            compiled(cache[:4], slots, cache)
    assert torch.equal(cache, before)  # refused before anything ran


class ReshapedAcrossTheSplit(torch.nn.Module):
    """Changes the layout of a value made before attention, after it: ``unsqueeze_`` or
    ``t_`` (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = torch.nn.Linear(im.H, im.H), torch.nn.Linear(im.H, im.H)

    def forward(self, x):
        h = self.a(x)
        if self.how == "a view taken before":  # reshaped where made, its view used after
            v = h[0]
            h.unsqueeze_(0)
            y = im.attend(x, x, x)
            return self.b(y) + v
        y = im.attend(h, h, h)
        if self.how == "unsqueeze_":
            h.unsqueeze_(0)
            return self.b(y) + h
        h.t_()
        return self.b(y) + h.t()


class ReshapedWhereMade(torch.nn.Module):
    """Changes layouts in place in the piece that makes the value, before and after
    attention, and hands the reshaped values on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(im.H, im.H), torch.nn.Linear(im.H, im.H)

    def forward(self, x):
        h = self.a(x)
        h.unsqueeze_(0)
        g = h.squeeze(0)
        y = im.attend(g, g, g)
        z = self.b(y)
        z.t_().unsqueeze_(0)
        return z * 2, h


@pytest.mark.parametrize("how", ["unsqueeze_", "t_", "a view taken before"])
def test_a_layout_changed_in_place_across_a_split_is_refused_in_one_line(open_local, how,
                                                                          tmp_path):
    """Pieces hand over a tensor with the layout the trace saw last; one reshaped in place
    after the piece that made it handed it on is refused before anything is built, and so
    is one reshaped where it is made while a view taken of it before is used after a split
    (that view would be taken again from the reshaped tensor: a wrong result, silently)."""
    model = ReshapedAcrossTheSplit(how).eval()
    compiled = cachebuild.compile(model, im.config(), {0: 0}, store=open_local(tmp_path / "s"))
    op = how if how.endswith("_") else "unsqueeze_"
    with pytest.raises(UsageError, match=rf"^the forward changes the layout of a tensor in "
                                         rf"place across a split: {op} .* reshapes h,") as e, \
            torch.no_grad():
        compiled(torch.randn(5, im.H))
    assert "\n" not in str(e.value)
    assert cachebuild.stats()["built"] == 0 or not list((tmp_path / "s").rglob("*.pt2"))


def test_a_layout_changed_in_place_where_the_value_is_made_is_served(open_local, tmp_path):
    model = ReshapedWhereMade().eval()
    compiled = cachebuild.compile(model, im.config(), {0: 0}, store=open_local(tmp_path / "s"))
    with torch.no_grad():
        for n in (5, 3, 16):
            x = torch.randn(n, im.H)
            got, want = compiled(x), model(x)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape
                torch.testing.assert_close(g, w)


def test_effects_name_what_a_node_reshapes():
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(ReshapedWhereMade().eval(), backend=backend, fullgraph=True)(
            torch.randn(4, im.H))
    torch._dynamo.reset()
    gm = captured["gm"]
    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    reshapes = {(n.target, n.args[0].name): [a.name for a in args]
                for n, args in graph_effects(gm, fakes).reshapes.items()}
    # each names the tensor it is called on (``t_`` returned ``z`` itself); nothing else
    assert reshapes == {("unsqueeze_", "h"): ["h"], ("t_", "z"): ["z"],
                        ("unsqueeze_", "t_"): ["t_"]}, reshapes


def test_proof_compares_what_pieces_write(open_local, monkeypatch, tmp_path):
    """An artifact that drops a write is caught before it is stored."""
    from cachebuild.building import verify

    def dropping(fn):
        def run(*inputs):
            return fn(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
        return run

    real_check = verify.check
    failures = []

    def check(fn, *args, **kwargs):
        try:
            return real_check(dropping(fn), *args, **kwargs)
        except verify.Mismatch as e:
            failures.append(str(e))
            raise

    monkeypatch.setattr(verify, "check", check)
    compiled = cachebuild.compile(im.make(im.MutatedInput), im.config(), {0: 0, 1: 0},
                                  store=open_local(tmp_path / "store"))
    with pytest.raises(BuildError, match="written in place"), torch.no_grad():
        compiled(*im.call_args(im.MutatedInput, 4)[:3])
    assert failures and all("written in place" in f for f in failures)


# -- the caller's other state ---------------------------------------------------------------

def test_compiling_leaves_the_callers_random_state_alone(open_local, tmp_path):
    """Tracing, building, proving and capturing draw from copies of torch's generators: a
    seeded caller draws the same numbers whether the call it made compiled or not. The
    model keeps the attributes it had."""
    model = im.make(im.MutatedInput)
    args = im.call_args(im.MutatedInput, 5)[:3]
    torch.manual_seed(123)
    with torch.no_grad():
        model(*[a.clone() for a in args])
    want = torch.rand(4)
    served = im.make(im.MutatedInput)
    attributes = dict(vars(served))
    compiled = cachebuild.compile(served, mode_config("full"), {0: 0, 1: 0},
                                  store=open_local(tmp_path / "store"))
    torch.manual_seed(123)
    with torch.no_grad():
        compiled(*[a.clone() for a in args])  # cold: trace, build, prove, capture, run
    assert torch.equal(torch.rand(4), want)
    assert vars(served) == attributes  # nor is anything set on the model (by torch.compile)


#: A cold start in a process whose environment names no Inductor folder (torch writes its
#: default one there as Dynamo is imported): prints which variables changed.
COLD_ENV_CHILD = """
import json, os
os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
import torch
import cachebuild
import models
from cachebuild.store import LocalStore

before = dict(os.environ)
model = models.make(models.Decoder, layers=2)
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                              store=LocalStore(os.environ["STORE"]))
models.assert_matches_eager(compiled, model, models.inputs(5))
after = dict(os.environ)
print(json.dumps({"traced": cachebuild.stats()["traced"],
                  "changed": sorted(k for k in set(before) | set(after)
                                    if before.get(k) != after.get(k))}))
"""


def test_compiling_leaves_the_callers_environment_alone(tmp_path):
    child = models.run_python(COLD_ENV_CHILD, env={"STORE": str(tmp_path / "store")})
    assert child == {"traced": 1, "changed": []}


class _RunningMean(torch.nn.Module):
    """Running statistics kept the usual ways: under ``no_grad``, and from a detached value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("total", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
        self.total.add_(y.detach().sum(0))
        return y.relu()


@pytest.mark.parametrize("backend", ["eager_fusion", "inductor"])
@pytest.mark.parametrize("door", ["cachebuild.compile", "torch.compile"])
def test_state_kept_under_no_grad_takes_no_gradient_history_with_autograd_on(
        open_local, tmp_path, backend, door):
    """Called with autograd on, a buffer updated under ``no_grad`` or from a detached value
    is eager's and holds no gradient history (an ``eager_fusion`` piece, traced without
    autograd, had lost both and chained every call's graph onto the buffer); through
    torch.compile, whose trace keeps the ``no_grad`` block, the graph names torch's
    grad-mode switch, which a stored graph may call."""
    import copy

    torch.manual_seed(0)
    model = _RunningMean().eval()
    ref = copy.deepcopy(model)
    config = cachebuild.CompileConfig(backend=backend, compile_ranges=((1, 16),))
    store = open_local(tmp_path / "store")
    if door == "torch.compile":
        compiled = torch.compile(model, backend=cachebuild.backend(config, store),
                                 dynamic=False)
    else:
        compiled = cachebuild.compile(model, config, {0: 0}, store=store)
    for size in (4, 4, 6):
        x = torch.randn(size, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, want = compiled(x), ref(x)
        torch.testing.assert_close(out, want, **models.TOL)
        assert out.grad_fn is None and not out.requires_grad  # as under torch.no_grad()
        for name in ("ema", "total"):
            torch.testing.assert_close(getattr(model, name), getattr(ref, name), **models.TOL)
            assert not getattr(model, name).requires_grad, name
            assert getattr(model, name).grad_fn is None, name


@pytest.mark.parametrize("cls", [*im.PATTERNS, im.AllPatterns], ids=lambda c: c.__name__)
def test_a_split_takes_its_pieces_values_from_the_trace_as_a_run_would_make_them(cls,
                                                                                   monkeypatch):
    """The stitch's values are taken from what the trace left on the pieces' nodes
    (``split._values_from_pieces``); the pieces then take, give, write and keep exactly
    what they do when the stitch is run again on fake inputs, for every pattern of writes
    and aliases."""
    from cachebuild.tracing import split
    from cachebuild.tracing.trace import trace_model

    model = im.make(cls)
    traced = trace_model(model, im.call_args(cls, 5)[:im.arity(cls)], im.dynamic_dims(cls))
    config = im.config()

    def pieces(plan: Any) -> list[Any]:
        return [(p.name, p.compiled, repr(p.input_metas), p.single_output, p.written,
                 p.size_input, p.gm.code) for p in plan.pieces] + [plan.stitch.code,
                                                                     plan.written_inputs]

    taken = []
    real = split._values_from_pieces
    monkeypatch.setattr(split, "_values_from_pieces",
                        lambda *a: taken.append(real(*a)) or taken[-1])
    from_trace = pieces(split.split_graph(traced, config.splitting_ops))
    monkeypatch.setattr(split, "_values_from_pieces", lambda *a: False)
    assert taken == [True]
    assert from_trace == pieces(split.split_graph(traced, config.splitting_ops))
