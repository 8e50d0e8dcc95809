"""The two front doors: ``torch.compile(model, backend=cachebuild.backend(config))`` and
``cachebuild.compile(model, config=..., dynamic_dims=...)``. Both match eager in every
bucket, and both plan the same targets, so either finds what the other built."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import models
import pytest
import torch

import cachebuild
from cachebuild.errors import UsageError

#: Models of this module share forward code that Dynamo would answer from its cache.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


DYN = {0: 0, 1: 0}
BUCKETED = {"compile_ranges": ((1, 16), (17, 48)), "compile_sizes": (4, 24)}
SIZES = (9, 1, 4, 16, 17, 24, 30, 48)


def torch_compiled(model, config, store, mark_dynamic=False):
    compiled = torch.compile(model, backend=cachebuild.backend(config, store=store),
                             fullgraph=True)
    if not mark_dynamic:
        return compiled

    def call(*args):
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        return compiled(*args)

    return call


@pytest.mark.parametrize("layers", [2, 4])
def test_torch_compile_matches_eager_in_every_bucket(open_local, tmp_path, layers):
    """Plain torch.compile usage: the first call is traced static, later sizes dynamic."""
    model = models.make(models.Decoder, layers=layers)
    store = open_local(tmp_path / "store")
    compiled = torch_compiled(model, models.config(**BUCKETED), store)
    before = cachebuild.stats()
    for size in SIZES:
        models.assert_matches_eager(compiled, model, models.inputs(size))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["traced"] == 0  # Dynamo traced, through torch.compile's own path
    assert delta["built"] >= 12 and delta["failed"] == 0
    # The dynamic graph dedups like cachebuild.compile: 3 unique pieces per bucket.
    assert len([r for r in store.records() if r.kind == "fx-graph"]) == delta["built"]


def test_torch_compile_with_marked_dynamic_dim_plans_the_targets_cachebuild_compile_built(
        open_local, tmp_path):
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=2)
    direct = cachebuild.compile(model, models.config(**BUCKETED), DYN, store=store)
    models.assert_matches_eager(direct, model, models.inputs(9))
    keys = set(direct.runtime.entry.target_keys())
    assert len(keys) == 12

    other = models.make(models.Decoder, layers=4, seed=3)
    compiled = torch_compiled(other, models.config(**BUCKETED), store, mark_dynamic=True)
    before = cachebuild.stats()
    for size in (9, 4, 16, 17, 24, 48, 2):
        models.assert_matches_eager(compiled, other, models.inputs(size))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] == 0 and delta["unique"] == 12
    assert {r.key for r in store.records() if r.kind == "fx-graph"} == keys


def test_torch_compile_with_graph_breaks(open_local, tmp_path):
    """Without fullgraph, every graph Dynamo hands over goes through the build graph."""

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = models.make(models.Decoder, layers=2)

        def forward(self, ids, pos):
            x = self.inner.embed(ids)
            x = self.inner.layers[0](x, pos)
            torch._dynamo.graph_break()
            x = self.inner.layers[1](x, pos)
            return self.inner.lm_head(self.inner.norm(x))

    model = Broken().eval()
    store = open_local(tmp_path / "store")
    compiled = torch.compile(model, backend=cachebuild.backend(models.config(), store=store))
    before = cachebuild.stats()
    for size in (5, 12):
        models.assert_matches_eager(compiled, model, models.inputs(size))
    assert models.counters_delta(before, cachebuild.stats())["built"] > 0


def test_a_graph_between_breaks_that_calls_no_splitting_op_is_one_piece(open_local, tmp_path):
    """A graph break after the last attention leaves Dynamo a graph without any splitting
    op: one piece, as with torch.compile's own backends, not a refusal."""

    class Tail(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = models.make(models.Decoder, layers=1)

        def forward(self, ids, pos):
            x = self.inner.layers[0](self.inner.embed(ids), pos)
            torch._dynamo.graph_break()
            return self.inner.lm_head(self.inner.norm(x))

    model = Tail().eval()
    compiled = torch.compile(model, backend=cachebuild.backend(
        models.config(), store=open_local(tmp_path / "store")))
    for size in (5, 12):
        models.assert_matches_eager(compiled, model, models.inputs(size))


def test_first_call_with_one_token(open_local, tmp_path):
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(), DYN, store=open_local(tmp_path / "s"))
    for size in (1, 2, 7):
        models.assert_matches_eager(compiled, model, models.inputs(size))


@dataclasses.dataclass
class Counted:
    """An output no pytree knows: kept as an object, its fields rebuilt at each call."""

    y: torch.Tensor
    tokens: int
    heads: int  # a constant, equal to the traced call's token count


class CountsTokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        tokens = x.shape[0]
        return self.lin(x), tokens, {"n": tokens}, Counted(self.lin(x) * 2, tokens, 5)


def test_a_size_returned_in_an_object_is_the_size_of_each_call(open_local, tmp_path):
    """A token count returned inside an object (a dataclass, beside a dict) is the call's,
    not the traced call's, and a constant equal to the traced count stays the constant:
    cold, then warm from the store in the same process."""
    torch.manual_seed(0)
    model = CountsTokens().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    store = open_local(tmp_path / "s")
    for compiled in (cachebuild.compile(model, config, {0: 0}, store=store),
                     cachebuild.compile(model, config, {0: 0}, store=store)):
        with torch.no_grad():
            for size in (5, 3, 1, 9):
                y, n, d, counted = compiled(torch.randn(size, 4))
                assert (n, d["n"], counted.tokens, counted.heads) == (size, size, size, 5)
                assert y.shape[0] == size and counted.y.shape[0] == size


class ComputesFromSizes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        n = x.shape[0]
        # 2.0 is the traced call's n / 2: a constant equal to it stays a constant
        return self.lin(x), n * 1000, n + 1, n / 2, Counted(self.lin(x), n - 1, n / 2), 2.0


def _numbers_match(compiled: Any, model: torch.nn.Module, sizes: tuple[int, ...]) -> None:
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(size, 4)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got[0], want[0])
            assert [type(v) for v in got[1:4]] == [int, int, float], got[1:4]
            assert got[1:4] == want[1:4] == (size * 1000, size + 1, size / 2)
            assert (got[4].tokens, got[4].heads, got[5]) == (size - 1, size / 2, 2.0)


@pytest.mark.parametrize("flavour", ["eager_fusion", pytest.param("aoti", marks=pytest.mark.slow)])
def test_numbers_computed_from_sizes_are_each_calls_numbers(open_local, tmp_path, flavour):
    """Ints and floats a forward computes from sizes (``n * 1000``, ``n / 2``), returned
    as they are or inside an object, are those of each call and Python numbers (an
    AOTInductor piece hands them back as 0-dim tensors; a float was once kept as the
    traced call's): cold, warm from the store, and through the torch.compile door."""
    torch.manual_seed(0)
    model = ComputesFromSizes().eval()
    config = (cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
              if flavour == "eager_fusion" else
              cachebuild.CompileConfig(flavour="aoti", compile_ranges=((1, 16),)))
    store = open_local(tmp_path / "s")
    cold = cachebuild.compile(model, config, {0: 0}, store=store)
    _numbers_match(cold, model, (4, 7))
    before = cachebuild.stats()
    warm = cachebuild.compile(model, config, {0: 0}, store=store)
    _numbers_match(warm, model, (5, 4, 9))
    assert models.counters_delta(before, cachebuild.stats())["built"] == 0
    _numbers_match(torch.compile(model, backend=cachebuild.backend(config, store=store),
                                 dynamic=True), model, (6, 3))


def test_a_global_module_hook_runs_on_the_model_not_on_its_pieces(open_local, tmp_path):
    """torch's global forward pre-hooks are the caller's, for its modules: through the
    torch.compile door the model's ones run as Dynamo runs them, and an ``eager_fusion``
    piece (a GraphModule) is not one of them (its inputs, weights too, were doubled)."""
    import copy

    model = models.make(models.Decoder, layers=1)
    eager = copy.deepcopy(model)
    # In place: torch.compile's wrapper would be one more module for the hook to run on.
    model.compile(backend=cachebuild.backend(models.config(), store=open_local(tmp_path / "s")),
                  dynamic=False)
    doubled = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: tuple(a * 2 if a.is_floating_point() else a for a in args))
    try:
        models.assert_matches_eager(model, eager, models.inputs(5))
    finally:
        doubled.remove()


def test_an_expanded_input_builds_through_the_torch_compile_door(open_local, tmp_path):
    """An input whose elements share memory (``expand``, stride 0) is a layout Dynamo
    compiles for: its piece is built and proven on inputs of that layout (the proof's
    random inputs were once written element by element, which such a layout refuses)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = torch.compile(model, backend=cachebuild.backend(
        config, store=open_local(tmp_path / "s")), dynamic=False)
    with torch.no_grad():
        for x in (torch.randn(4, 8), torch.randn(1, 8).expand(4, 8)):
            torch.testing.assert_close(compiled(x), model(x))


def test_a_deep_copy_is_the_model_copied_and_compiled_as_this_one_is(open_local, tmp_path):
    """``copy.deepcopy`` of a compiled module (it raised: a lock cannot be pickled) is a
    compiled copy of the model: its first call loads what the original stored, and a
    change to the copy's weights leaves the original's alone."""
    import copy

    model = models.make(models.Decoder, layers=1)
    compiled = cachebuild.compile(model, models.config(), DYN, store=open_local(tmp_path / "s"))
    models.assert_matches_eager(compiled, model, models.inputs(5))
    before = cachebuild.stats()
    twin = copy.deepcopy(compiled)
    assert twin.model is not model
    with torch.no_grad():
        twin.model.lm_head.weight.mul_(2)
    models.assert_matches_eager(twin, twin.model, models.inputs(6))
    models.assert_matches_eager(compiled, model, models.inputs(6))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] == 0 and delta["traced"] == 0, delta


def test_a_pickled_compiled_module_is_compiled_again_where_it_is_loaded(open_local, tmp_path,
                                                                          monkeypatch):
    """``torch.save`` of a compiled module after its first call (it raised on a local
    function): saved as its model and how it was compiled, loaded compiled again on the
    store the environment names, and its first call finds what the original stored. One
    given a store (whose keys must not go into a file) says what to pickle instead."""
    import io
    import pickle

    monkeypatch.setenv("CACHEBUILD_DIR", str(tmp_path / "s"))
    model = models.make(models.Decoder, layers=1)
    compiled = cachebuild.compile(model, models.config(), DYN)
    models.assert_matches_eager(compiled, model, models.inputs(5))
    before = cachebuild.stats()
    saved = io.BytesIO()
    torch.save(compiled, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert loaded.model is not model
    models.assert_matches_eager(loaded, loaded.model, models.inputs(6))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] == 0 and delta["traced"] == 0, delta
    given = cachebuild.compile(model, models.config(), DYN, store=open_local(tmp_path / "t"))
    with pytest.raises(TypeError, match=r"pickle its model \(\.model\)"):
        pickle.dumps(given)


def test_a_cold_start_under_inference_mode(open_local, tmp_path):
    """A server's first call under ``torch.inference_mode()`` (as the README serves) with
    nothing stored: traced, split and built (its look at what each piece writes reads
    version counters, which tensors made in that mode do not keep: it raised), then warm
    from the store; outputs equal to eager's."""
    store = open_local(tmp_path / "s")
    for expect in ({"traced": 1}, {"traced": 0, "built": 0}):
        model = models.make(models.Decoder, layers=1)
        before = cachebuild.stats()
        compiled = cachebuild.compile(model, models.config(), DYN, store=store)
        with torch.inference_mode():
            for size in (5, 9):
                args = models.inputs(size)
                torch.testing.assert_close(compiled(*args), model(*args), **models.TOL)
        delta = models.counters_delta(before, cachebuild.stats())
        assert {k: delta[k] for k in expect} == expect, delta


def _attend_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.cachebuild_tests.attention(q * 1.5, k, v) * 2


def test_views_of_a_wider_input_at_a_size_dynamo_recompiles_for(open_local, tmp_path):
    """q, k and v unbound from one tensor (strides wider than their shapes), called at 5
    tokens and then at 1: Dynamo's recompile hands over static sizes with a symbolic
    stride and a size input that is that stride, which a build could not give a value to
    (it raised SympifyError); it is proven on dense views, and every call equals eager."""
    compiled = torch.compile(_attend_views, backend=cachebuild.backend(
        models.config(), store=open_local(tmp_path / "s")))
    with torch.no_grad():
        for tokens in (5, 1, 3):
            q, k, v = torch.randn(tokens, 3, models.KV_HEADS, 8).unbind(1)
            torch.testing.assert_close(compiled(q, k, v), _attend_views(q, k, v))


def test_default_store_is_cachebuild_dir(open_local, tmp_path, monkeypatch):
    path = tmp_path / "from-env"
    monkeypatch.setenv("CACHEBUILD_DIR", str(path))
    monkeypatch.delenv("CACHEBUILD_REMOTE", raising=False)
    model = models.make(models.Decoder, layers=1)
    compiled = cachebuild.compile(model, models.config(), DYN)
    models.assert_matches_eager(compiled, model, models.inputs(3))
    kinds = sorted(r.kind for r in open_local(path).records())
    assert kinds == ["entry", "fx-graph", "fx-graph", "guards"]


def test_model_spec_is_validated():
    model = models.make(models.Decoder, layers=1)
    spec = cachebuild.ModelSpec(model, list(models.inputs(4)), DYN, models.config())
    assert isinstance(spec.example_inputs, tuple)
    with pytest.raises(UsageError, match="torch.nn.Module"):
        cachebuild.ModelSpec(lambda x: x, models.inputs(4), DYN, models.config())
    with pytest.raises(UsageError, match="CompileConfig"):
        cachebuild.ModelSpec(model, models.inputs(4), DYN, {"backend": "inductor"})
    # One tensor where a tuple of one belongs: said so (iterated, it read as many inputs).
    with pytest.raises(UsageError, match=r"not a Tensor: for one argument write \(x,\)"):
        cachebuild.ModelSpec(model, models.inputs(4)[0], DYN, models.config())
    # Example inputs no range holds: `warm` traced at a size no call is served at.
    with pytest.raises(UsageError, match=r"4 long at the dynamic dim \(argument 0, dim 0\), "
                                         r"outside every compile range \[\(1, 2\)\]"):
        cachebuild.ModelSpec(model, models.inputs(4), DYN, models.config(compile_ranges=((1, 2),)))


@pytest.mark.slow
def test_torch_compile_aoti_loads_what_cachebuild_compile_built(open_local):
    """The torch.compile front door with AOTInductor: the pieces of Dynamo's graph have the
    keys cachebuild.compile built (``models.aoti_store``), so nothing is compiled."""
    warmed = models.aoti_store()
    model = models.make(models.Decoder, layers=2, seed=9)
    compiled = torch_compiled(model, models.aoti_config(), open_local(warmed["path"]),
                              mark_dynamic=True)
    before = cachebuild.stats()
    for size in (5, 32, 2, 17):
        models.assert_matches_eager(compiled, model, models.inputs(size))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] == 0 and delta["unique"] == 3


# -- the torch.compile front door takes what Dynamo gives ---------------------------------

def test_dynamic_true_with_unspecialised_floats(open_local, tmp_path):
    """``dynamic=True`` passes module floats (RMSNorm epsilons) as 0-d tensors read with
    ``.item()``; a piece built on one failed with DataDependentOutputException. They are
    baked in per value, and another value gets its own build."""
    model = models.make(models.Decoder, layers=2)
    store = open_local(tmp_path / "store")
    compiled = torch.compile(model, backend=cachebuild.backend(models.config(), store=store),
                             dynamic=True)
    for size in (5, 9, 17):
        models.assert_matches_eager(compiled, model, models.inputs(size))
    built = cachebuild.stats()["built"]
    for norm in (model.layers[0].input_norm, model.layers[1].post_norm):
        norm.eps = 0.5  # same frame, same guards: the values arrive at the call
    models.assert_matches_eager(compiled, model, models.inputs(6))
    assert cachebuild.stats()["built"] > built


def test_guard_failure_recompiles_into_new_targets(open_local, tmp_path):
    model = models.make(models.Decoder, layers=2)
    store = open_local(tmp_path / "store")
    compiled = torch_compiled(model, models.config(), store, mark_dynamic=True)
    models.assert_matches_eager(compiled, model, models.inputs(7))
    model.layers[1].input_norm.eps = 0.5  # a guarded constant: Dynamo compiles again
    before = cachebuild.stats()
    models.assert_matches_eager(compiled, model, models.inputs(7))
    models.assert_matches_eager(compiled, model, models.inputs(12))
    assert models.counters_delta(before, cachebuild.stats())["built"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["auto", "aoti"])
def test_inductor_recompile_for_a_new_shape_on_an_empty_store(open_local, tmp_path, flavour):
    """Llama at 1×37, then 1×8 (Dynamo recompiles with a dynamic dim): under ``auto`` it
    raised "Guard failed on the same frame it was created", under ``aoti`` "Constraints
    violated", because pieces were exported inside Dynamo's compile."""
    import hf_families

    family = hf_families.FAMILIES["llama"]
    model = family.model().hf  # the transformers model itself: [1, T] in, a ModelOutput out
    config = cachebuild.CompileConfig(splitting_ops=(hf_families.SDPA,),
                                      compile_ranges=((1, 64),), backend="inductor",
                                      flavour=flavour)
    compiled = torch.compile(model, backend=cachebuild.backend(
        config, store=open_local(tmp_path / "store")))
    with torch.no_grad():
        for tokens in (37, 8, 20):
            ids = hf_families.ids(tokens)[0][None]
            hf_families.assert_close(compiled(input_ids=ids, use_cache=False).logits,
                                     model(input_ids=ids, use_cache=False).logits)


def test_transposed_weights_compile_through_both_front_doors(open_local, tmp_path):
    """``x @ self.weight.T`` (Falcon's linear layers): Dynamo records ``getattr(w, 'T')``,
    a pure read that stored graphs allow. Each door builds, matches eager, and the other
    door and a second compile load what was stored."""
    model = models.make(models.TransposedWeights)
    store = open_local(tmp_path / "store")
    compiled = cachebuild.compile(model, models.config(), DYN, store=store)
    for size in (5, 12):
        models.assert_matches_eager(compiled, model, models.inputs(size))
    built = len([r for r in store.records() if r.kind == "fx-graph"])
    assert built >= 2
    torch._dynamo.reset()
    door = torch_compiled(model, models.config(), store, mark_dynamic=True)
    before = cachebuild.stats()
    for size in (5, 12):
        models.assert_matches_eager(door, model, models.inputs(size))
    assert models.counters_delta(before, cachebuild.stats())["failed"] == 0
    again = cachebuild.compile(model, models.config(), DYN, store=store)
    models.assert_matches_eager(again, model, models.inputs(7))
    assert len([r for r in store.records() if r.kind == "fx-graph"]) == built


def test_a_python_int_that_changes_builds_variants_and_says_so_once(open_local, tmp_path,
                                                                      caplog):
    """A count kept in a Python int (as transformers' sliding-window static cache keeps its
    tokens) is made dynamic by Dynamo but carried by no tensor: each value is baked into a
    build of its own. Every call matches eager; one warning line says why builds go on."""

    class Count:  # a cache object's Python int, not a module's attribute
        def __init__(self):
            self.seen = 0

    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, count):
            count.seen += 1
            return self.lin(x) * count.seen

    model = Counted().eval()
    store = open_local(tmp_path / "store")
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    compiled = torch.compile(model, backend=cachebuild.backend(config, store=store))
    x, count, eager_count = torch.randn(4, 8), Count(), Count()
    with torch.no_grad(), caplog.at_level("WARNING", logger="cachebuild"):
        for _ in range(5):
            torch.testing.assert_close(compiled(x, count), model(x, eager_count))
    told = [r.getMessage() for r in caplog.records if "new variant" in r.getMessage()]
    assert len(told) == 1, told
    assert "seen" in told[0] and "→" in told[0], told


def test_a_python_int_only_counted_is_one_build_for_every_value(open_local, tmp_path):
    """A count that the graph bumps and hands back, and no tensor reads: one build serves
    every value, and the count after each call is eager's."""

    class Count:
        def __init__(self):
            self.seen = 0

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, count):
            count.seen += 2
            return self.lin(x).relu()

    model = Counting().eval()
    store = open_local(tmp_path / "store")
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    compiled = torch.compile(model, backend=cachebuild.backend(config, store=store))
    x, count, eager_count = torch.randn(4, 8), Count(), Count()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, count), model(x, eager_count))
        torch.testing.assert_close(compiled(x, count), model(x, eager_count))
        built = cachebuild.stats()["built"]
        for _ in range(4):
            torch.testing.assert_close(compiled(x, count), model(x, eager_count))
            assert count.seen == eager_count.seen
    assert cachebuild.stats()["built"] == built


class Windowed(torch.nn.Module):
    """A sliding window of 4 rows, as Mistral's mask takes it: the rows past the window
    are cut, so a graph traced with more than 4 rows holds only for more than 4."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] > 4:
            x = x[x.shape[0] - 4:]
        return self.lin(x).relu()


def test_a_graph_dynamo_guards_to_one_side_of_a_branch_builds_for_that_side(open_local,
                                                                            tmp_path):
    """Dynamo traces the first call (7 rows) dynamic and guards its graph to more than 4
    rows: the graph's range is cut to 5-64 (a build across 4 would fail), and the calls
    of 4 rows or fewer get Dynamo's other graph, built for 1-4. Every call is eager's."""
    from cachebuild.dynamo_backend import graph_fakes, within_guards

    torch.manual_seed(0)
    model = Windowed().eval()
    config = cachebuild.CompileConfig(compile_ranges=((1, 64),))
    seen = []

    def backend(gm, example_inputs):
        seen.append(within_guards(config, graph_fakes(gm, example_inputs)).compile_ranges)
        return cachebuild.backend(config, store=open_local(tmp_path / "store"))(
            gm, example_inputs)

    compiled = torch.compile(model, backend=backend, dynamic=True)
    before = cachebuild.stats()
    with torch.no_grad():
        for rows in (7, 9, 2, 4, 30):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert seen == [((5, 64),), ((1, 4),)]
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["failed"] == 0 and delta["built"] == 2


@pytest.mark.parametrize("out_of_range", ["error", "eager"])
def test_torch_compile_door_keeps_out_of_range_as_the_config_says(open_local, tmp_path,
                                                                   out_of_range):
    """A call whose token count no bucket holds is refused with the same words as
    ``cachebuild.compile`` says them, or runs eagerly (one warning for the graph) and
    matches eager; calls in range still run the built targets."""
    import warnings

    model = models.make(models.Decoder, layers=2)
    store = open_local(tmp_path / "store")
    config = models.config(compile_ranges=((1, 16),), out_of_range=out_of_range)
    compiled = torch_compiled(model, config, store, mark_dynamic=True)
    models.assert_matches_eager(compiled, model, models.inputs(9))
    before = cachebuild.stats()
    if out_of_range == "error":
        with pytest.raises(UsageError, match=r"size 30 of the dynamic dim is outside every "
                                             r"compile range \[\(1, 16\)\]; add a range"):
            compiled(*models.inputs(30))
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for size in (30, 40):
                models.assert_matches_eager(compiled, model, models.inputs(size))
        said = [w for w in caught if "outside every compile range" in str(w.message)]
        assert [str(w.message) for w in said] == [
            "size 30 is outside every compile range; running eagerly"]
        assert said[0].filename == models.__file__  # the line that called the model
    models.assert_matches_eager(compiled, model, models.inputs(12))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] == 0 and delta["failed"] == 0


class SumsRows(torch.nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y.sum(1, keepdim=True) * y[:, :1]


@pytest.mark.slow
def test_torch_compile_door_serves_inputs_that_are_not_dense(open_local, tmp_path):
    """Through ``torch.compile(backend=cachebuild.backend(...))`` with Inductor, an input
    sliced from a wider tensor: its piece is built for its strides and answers as eager
    (every such build failed its proof; other layouts: ``test_verify``)."""
    model = SumsRows()
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="inductor",
                                      while_building="wait")
    door = torch.compile(model, dynamic=False,
                         backend=cachebuild.backend(config, store=open_local(tmp_path / "s")))
    y = torch.randn(5, 9).t()[:4]  # strides (1, 9)
    with torch.no_grad():
        torch.testing.assert_close(door(y), model(y), **models.TOL)


class ReturnsTransposed(torch.nn.Module):
    """Outputs in other layouts than contiguous: a transposed result, an op on a
    transposed value (eager keeps its input's dimension order), a 3-D permute, a slice
    and the parts of a split of a value the forward made (views into its memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.relu(self.lin(x))
        q, k = (h + 1).split([5, 3], dim=1)
        return ((h * 2).t(), h.t() * 3, h.view(-1, 2, 4).permute(2, 0, 1) + 1, h.sum(1),
                self.lin(h)[:, :6], q, k.unsqueeze(0))


@pytest.mark.parametrize("backend", ["eager_fusion", pytest.param("inductor", marks=pytest.mark.slow)])
def test_outputs_keep_the_layout_eager_gives_them(open_local, tmp_path, backend):
    """A caller reading ``.stride()``, or a ``view`` that only eager's layout allows, sees
    what eager gives, in every bucket (eager_fusion functionalises views into copies, which
    it lays out contiguous: it lays its outputs out again)."""
    torch.manual_seed(0)
    model = ReturnsTransposed().eval()
    config = cachebuild.CompileConfig(backend=backend, compile_ranges=((1, 16),),
                                      compile_sizes=(4,), while_building="wait")
    compiled = cachebuild.compile(model, config, {0: 0}, store=open_local(tmp_path / "s"))
    for size in (4, 5, 16):
        models.assert_matches_eager(compiled, model, (torch.randn(size, 8),))


class WritesInPlace(torch.nn.Module):
    """In-place writes to values the forward made: through ``.diagonal()`` and a slice,
    ``zero_`` of a whole tensor (functionalised into ``diagonal_scatter``, ``zero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        g = h.t() @ h
        g.diagonal().fill_(1.0)
        g.diagonal().add_(h.sum())
        m = h.clone()
        m[:, :2].zero_()
        return g, m, torch.empty_like(h).zero_() + h


class Flagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.use_bias, self.scale = torch.nn.Linear(8, 8), True, 1.0
        self.drop = torch.nn.Dropout(0.5)
        self.config = types.SimpleNamespace(logit_scale=1.0)  # as transformers' models have

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x)) * self.scale * self.config.logit_scale
        return h + 1 if self.use_bias else h


def test_changes_made_through_the_compiled_module_reach_the_model(open_local, tmp_path):
    """``model = cachebuild.compile(model)`` keeps only the handle: a flag set on it, a
    submodule swapped through it, ``eval()`` on it change the model (they sat on the
    wrapper, where the forward never read them, and the old answer was served)."""
    torch.manual_seed(0)
    model = Flagged().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(model, config, {0: 0}, store=open_local(tmp_path / "s"))
    x = torch.randn(5, 8)
    models.assert_matches_eager(compiled, model, (x,))
    assert compiled.lin is model.lin and compiled.use_bias is True and not compiled.training
    compiled.use_bias = False
    compiled.scale = 0.5
    assert model.use_bias is False and model.scale == 0.5 and "use_bias" not in vars(compiled)
    models.assert_matches_eager(compiled, model, (x,))
    compiled.lin = torch.nn.Linear(8, 8)
    assert model.lin is compiled.lin
    models.assert_matches_eager(compiled, model, (x,))
    compiled.config.logit_scale = 2.0  # the model's config, not cachebuild's
    assert model.config.logit_scale == 2.0 and compiled.compile_config is config
    models.assert_matches_eager(compiled, model, (x,))
    compiled.train()
    assert model.training and compiled.training
    compiled.eval()
    del compiled.scale
    assert not hasattr(model, "scale")


class CausalAttention(torch.nn.Module):
    """``F.scaled_dot_product_attention`` inside a piece (no splitting op): its math path
    with a causal mask is ``_safe_softmax``, which eager_fusion's stored graph calls."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, 2, 8).permute(1, 2, 0, 3)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(0, 1).reshape(x.shape[0], 16))


class ShiftsInts(torch.nn.Module):
    def forward(self, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b = a.clone()
        b <<= 1
        return (a << 3) + 1, a >> 1, torch.bitwise_left_shift(a, 2), b


@pytest.mark.parametrize(("make", "given"), [
    (CausalAttention, lambda n: torch.randn(n, 16)),
    (WritesInPlace, lambda n: torch.randn(n, 8)),
    (ShiftsInts, lambda n: torch.randint(0, 1000, (n, 4), dtype=torch.int32))])
def test_eager_fusion_builds_attention_in_place_writes_and_shifts_and_matches_eager(
        open_local, tmp_path, make, given):
    """Attention inside a piece; in-place writes to values a piece made; shifts of
    integers (``aten::__lshift__``, an operator named as Python's dunder methods are)."""
    torch.manual_seed(0)
    model = make().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(model, config, {0: 0}, store=open_local(tmp_path / "s"))
    for size in (5, 1, 16):
        models.assert_matches_eager(compiled, model, (given(size),))


class PReLU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.prelu(x, torch.full((1,), 0.25))


def test_an_operator_stored_graphs_may_not_call_is_refused_at_the_line_that_calls_it(
        open_local, tmp_path):
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(PReLU(), config, {0: 0}, store=open_local(tmp_path / "s"))
    with pytest.raises(Exception) as e:
        compiled(torch.randn(4, 8))
    said = str(e.value)
    assert "aten::prelu is not in the table" in said and "\n" not in said
    assert "made by test_frontdoors.py:" in said and "in forward: return torch.nn.functional" \
        ".prelu" in said and "write that line with operators stored graphs may call" in said
