"""The build graph end to end through ``cachebuild.compile``: compiled output equals eager
in every bucket, targets are built once per store (across processes too, even at the
same time), weights are bound live, and a failing piece is reported and stores nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import models
import pytest
import torch

import cachebuild
from cachebuild import process_state
from cachebuild.backends import register_backend
from cachebuild.backends.eager_fusion import EagerFusionBackend
from cachebuild.errors import BuildError
from cachebuild.keys import canonical_json, make_key
from cachebuild.passes import PassManager

DYN = {0: 0, 1: 0}

#: Two ranges and two exact sizes: four buckets.
BUCKETED = {"compile_ranges": ((1, 16), (17, 48)), "compile_sizes": (4, 24)}
#: Sizes at both edges of every range and at every exact size.
SIZES = (1, 4, 9, 16, 17, 24, 30, 48)


def runner(compiled, piece_index):
    """The PieceRunner of a compiled piece of a CompiledModule's runtime."""
    piece = compiled.runtime.entry.pieces[piece_index]
    return compiled.runtime.stitched.calls[piece.name]


@pytest.mark.parametrize("layers", [2, 4])
def test_matches_eager_in_every_bucket(open_local, tmp_path, layers):
    # Each run has a fresh store: targets this process loaded earlier from another store
    # are built into this one all the same (counted below).
    model = models.make(models.Decoder, layers=layers)
    compiled = cachebuild.compile(model, models.config(**BUCKETED), DYN,
                                  store=open_local(tmp_path / "store"))
    before = cachebuild.stats()
    for size in SIZES:
        models.assert_matches_eager(compiled, model, models.inputs(size))
    delta = models.counters_delta(before, cachebuild.stats())
    # 3 unique compiled pieces (first, middle layers, last) × 4 buckets.
    assert delta["planned"] == (layers + 1) * 4
    assert delta["unique"] == delta["built"] == 12
    assert delta["traced"] == 1 and delta["failed"] == 0
    # Each size ran the target of its bucket: exact size first, else its range.
    entry = compiled.runtime.entry
    first = next(p for p in entry.pieces if p.compiled)
    by_bucket = {str(t.bucket): t.key for t in first.targets}
    run = runner(compiled, entry.pieces.index(first))
    from cachebuild import process_state

    loaded = process_state.current().loaded
    for size, bucket in [(4, {"size": 4}), (24, {"size": 24}), (1, {"range": [1, 16]}),
                         (16, {"range": [1, 16]}), (17, {"range": [17, 48]}),
                         (48, {"range": [17, 48]})]:
        assert run.select(size) is loaded[by_bucket[str(bucket)], "cpu"]


def test_compiled_module_behaves_like_the_model(open_local, tmp_path):
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(), DYN, store=open_local(tmp_path / "s"))
    assert compiled.runtime is None
    models.assert_matches_eager(compiled, model, models.inputs(7))
    assert compiled.runtime is not None
    # Parameters are the model's own: the compiled module exposes them, and an in-place
    # update (loading a checkpoint) is seen by the next call without a rebuild.
    assert {n.removeprefix("model.") for n, _ in compiled.named_parameters()} == {
        n for n, _ in model.named_parameters()}
    before = cachebuild.stats()
    with torch.no_grad():
        model.lm_head.weight.mul_(-2.0)
        model.layers[1].down.weight.add_(0.5)
    models.assert_matches_eager(compiled, model, models.inputs(7))
    assert models.counters_delta(before, cachebuild.stats())["built"] == 0


def test_other_weights_load_the_same_entry_and_are_bound_live(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    first = models.make(models.Decoder, layers=2, seed=0)
    models.assert_matches_eager(cachebuild.compile(first, models.config(), DYN, store=store),
                                first, models.inputs(5))
    other = models.make(models.Decoder, layers=2, seed=1)
    before = cachebuild.stats()
    compiled = cachebuild.compile(other, models.config(), DYN, store=store)
    models.assert_matches_eager(compiled, other, models.inputs(5))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["entries_loaded"] == 1 and delta["traced"] == 0 and delta["built"] == 0
    with torch.no_grad():
        assert not torch.allclose(compiled(*models.inputs(5)), first(*models.inputs(5)))


def test_bfloat16_model_matches_eager(open_local, tmp_path):
    model = models.make(models.Decoder, layers=2).to(torch.bfloat16)
    compiled = cachebuild.compile(model, models.config(compile_sizes=(4,)), DYN,
                                  store=open_local(tmp_path / "store"))
    for size in (4, 1, 19):
        args = models.inputs(size)
        with torch.no_grad():
            out, ref = compiled(*args), model(*args)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_entry_whose_target_vanished_rebuilds_it_without_tracing(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=2)
    first = cachebuild.compile(model, models.config(), DYN, store=store)
    models.assert_matches_eager(first, model, models.inputs(6))
    gone = first.runtime.entry.target_keys()[1]
    assert store.delete(gone)
    before = cachebuild.stats()
    again = cachebuild.compile(model, models.config(), DYN, store=store)
    models.assert_matches_eager(again, model, models.inputs(6))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["entries_loaded"] == 1 and delta["traced"] == 0 and delta["built"] == 1
    assert store.contains(gone)


def test_a_damaged_entry_is_said_damaged_and_traced_again(open_local, tmp_path, caplog):
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=2)
    first = cachebuild.compile(model, models.config(), DYN, store=store)
    models.assert_matches_eager(first, model, models.inputs(6))
    blob = next((tmp_path / "store").rglob(first.runtime.entry.key))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.chmod(0o600)
    blob.write_bytes(bytes(data))
    again = cachebuild.compile(model, models.config(), DYN, store=store)
    caplog.clear()  # what the first start said
    with caplog.at_level("WARNING", logger="cachebuild"):
        models.assert_matches_eager(again, model, models.inputs(6))
    assert "its stored entry is not served here (damaged" in caplog.text, caplog.text
    assert "not warmed" not in caplog.text


def test_store_holds_entry_and_targets_with_manifests(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(compile_sizes=(4,)), DYN, store=store)
    models.assert_matches_eager(compiled, model, models.inputs(3))
    entry = compiled.runtime.entry
    record = store.get_record(entry.key)
    assert record.kind == "entry"
    assert canonical_json(record.manifest) == canonical_json(entry.factors)
    assert make_key(record.manifest) == entry.key
    for key in entry.target_keys():
        target = store.get_record(key)
        assert target.kind == "fx-graph"
        assert canonical_json(target.manifest) == canonical_json(entry.manifests[key])
        assert make_key(target.manifest) == key
    kinds = sorted(r.kind for r in store.records())
    assert kinds == ["entry"] + ["fx-graph"] * 6 + ["guards"]  # the seal of its guards


def test_custom_pass_runs_enters_the_keys_and_matches_eager(open_local, tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "cb_build_silu_pass", raising=False)
    fusion = models.load_silu_pass(tmp_path / "silu_pass.py", "cb_build_silu_pass")
    manager = PassManager([fusion])
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(), DYN,
                                  store=open_local(tmp_path / "store"), passes=manager)
    models.assert_matches_eager(compiled, model, models.inputs(6))
    # One SiLU per layer, in the two pieces that hold an MLP.
    assert manager.total_counts["silu_to_sigmoid"] == 2
    for manifest in compiled.runtime.entry.manifests.values():
        assert manifest["passes"]["passes"] == [{"name": "silu_to_sigmoid",
                                                 "uuid": fusion.uuid()}]


class FailingBackend(EagerFusionBackend):
    """eager_fusion, except that pieces holding an MLP do not compile."""

    name = "failing_for_tests"

    def compile(self, request):
        if any(n.op == "call_function" and "silu" in str(n.target) for n in request.gm.graph.nodes):
            raise RuntimeError("no kernel for silu on this device\nsecond line of detail")
        return super().compile(request)


class EnvironmentSeeingBackend(EagerFusionBackend):
    """eager_fusion, remembering the process environment each build ran in."""

    name = "environment_seeing_for_tests"
    seen: list[dict[str, str]] = []

    def compile(self, request):
        EnvironmentSeeingBackend.seen.append(dict(os.environ))
        return super().compile(request)


def test_a_build_that_generates_no_code_leaves_the_process_environment_alone(open_local,
                                                                           tmp_path):
    """A backend that only rewrites graphs builds in this process (a backend of its own)
    with the process environment as the caller left it: no compiler folder swapped in."""
    register_backend(EnvironmentSeeingBackend.name, EnvironmentSeeingBackend)
    EnvironmentSeeingBackend.seen.clear()
    before = dict(os.environ)
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(backend=EnvironmentSeeingBackend.name),
                                  DYN, store=open_local(tmp_path / "store"))
    models.assert_matches_eager(compiled, model, models.inputs(5))
    assert EnvironmentSeeingBackend.seen, "nothing was built"
    for seen in EnvironmentSeeingBackend.seen:
        assert seen == before
    assert dict(os.environ) == before


def test_failing_piece_names_piece_bucket_and_key_and_stores_nothing_partial(open_local, tmp_path):
    register_backend(FailingBackend.name, FailingBackend)
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(backend=FailingBackend.name), DYN,
                                  store=store)
    before = cachebuild.stats()
    with pytest.raises(BuildError) as info:
        compiled(*models.inputs(5))
    message = str(info.value)
    assert message.startswith("piece 2 (range 1-32, key ")
    assert "RuntimeError: no kernel for silu on this device" in message
    assert "second line" not in message
    failed_key = message.split("key ")[1].split(")")[0]
    assert failed_key not in {r.key for r in store.records()}
    # Piece 0 (no MLP) was built; no entry was recorded for a model that does not build.
    assert [r.kind for r in store.records()] == ["fx-graph"]
    assert models.counters_delta(before, cachebuild.stats())["failed"] == 1


def test_backend_artifact_kind_mismatch_is_refused():
    with pytest.raises(ValueError, match="cannot load artifacts of kind 'standalone'"):
        EagerFusionBackend().load("standalone", "0" * 32, source=None, device="cpu")


# -- other processes -------------------------------------------------------------------

CHILD = """
import json, os, sys

import cachebuild
import models
from cachebuild.store import LocalStore

if os.environ.get("TOGETHER"):  # start with a sibling: say so, and wait for the word
    print("ready", flush=True)
    sys.stdin.readline()
layers = int(os.environ.get("LAYERS", "2"))
model = models.make(models.Decoder, layers=layers)
store = LocalStore(os.environ["STORE"]) if "STORE" in os.environ else None  # else CACHEBUILD_DIR
compiled = cachebuild.compile(model, models.config(compile_sizes=(4,)), {0: 0, 1: 0}, store=store)
for size in (4, 11, 1, 32):
    models.assert_matches_eager(compiled, model, models.inputs(size))
print(json.dumps({"stats": cachebuild.stats(), "keys": compiled.runtime.entry.target_keys()}))
"""


def test_second_process_compiles_nothing(open_local, tmp_path):
    path = tmp_path / "store"
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(compile_sizes=(4,)), DYN,
                                  store=open_local(path))
    models.assert_matches_eager(compiled, model, models.inputs(11))
    child = models.run_python(CHILD, env={"CACHEBUILD_DIR": str(path)})
    stats = child["stats"]
    assert stats["built"] == 0 and stats["traced"] == 0 and stats["failed"] == 0
    assert stats["entries_loaded"] == 1
    assert stats["loaded"] == len(child["keys"]) == 6
    assert child["keys"] == compiled.runtime.entry.target_keys()


def test_two_processes_at_once_build_each_target_once(open_local, tmp_path):
    path = tmp_path / "store"
    env = {"STORE": str(path), "TOGETHER": "1"}
    procs = [models.start_python(CHILD, env=env, stdin=subprocess.PIPE) for _ in range(2)]
    for p in procs:  # both are ready before either builds
        assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [models.finish(p) for p in procs]
    keys = results[0]["keys"]
    assert results[1]["keys"] == keys and len(keys) == 6
    assert sum(r["stats"]["built"] for r in results) == len(keys)
    assert all(r["stats"]["failed"] == 0 for r in results)
    store = open_local(path)
    assert sorted(r.kind for r in store.records()) == ["entry"] + ["fx-graph"] * 6 + ["guards"]


# -- inductor (AOTInductor) ------------------------------------------------------------

@pytest.mark.slow
def test_aoti_matches_eager_and_loads_back(open_local):
    """AOTInductor pieces (weights as inputs: one artifact per unique piece) match eager;
    a second compile of the same model in this process loads the entry and builds nothing."""
    warmed = models.aoti_store()
    assert warmed["stats"]["built"] == warmed["stats"]["unique"] == 3
    assert warmed["stats"]["planned"] == 3
    assert warmed["kinds"] == ["aoti-cpu"]
    model = models.make(models.Decoder, layers=2, seed=5)
    compiled = cachebuild.compile(model, models.aoti_config(), DYN,
                                  store=open_local(warmed["path"]))
    before = cachebuild.stats()
    for size in models.AOTI_SIZES + (2, 17):
        models.assert_matches_eager(compiled, model, models.inputs(size))
    delta = models.counters_delta(before, cachebuild.stats())
    assert delta["built"] == 0 and delta["traced"] == 0 and delta["entries_loaded"] == 1
    assert compiled.runtime.entry.target_keys() == warmed["target_keys"]


def test_an_export_that_narrowed_the_range_is_refused():
    """The AOTI build's fallback export (for guards torch 2.11 cannot prove) is kept only if
    the program still takes every size of the range."""
    from torch.export import Dim

    from cachebuild.backends.inductor import _check_range_kept

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    x = torch.randn(8, 4)
    wide = torch.export.export(Double(), (x,), dynamic_shapes=({0: Dim("t", min=1, max=32)},))
    _check_range_kept(wide, [{0: "s0"}], (1, 32))
    narrow = torch.export.export(Double(), (x,), dynamic_shapes=({0: Dim("t", min=4, max=32)},))
    with pytest.raises(ValueError, match="narrowed the range 1-32"):
        _check_range_kept(narrow, [{0: "s0"}], (1, 32))
    fixed = torch.export.export(Double(), (x,))
    with pytest.raises(ValueError, match="fixed the range's size to 8"):
        _check_range_kept(fixed, [{0: "s0"}], (1, 32))


class Dropped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


def _seeded(fn, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` from ``seed``, and what torch draws next (the stream it left)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = fn(x)
    return out, torch.rand(4)


@pytest.mark.parametrize("backend", ["eager_fusion", "inductor"])
def test_a_piece_that_draws_random_numbers_draws_eagers(open_local, tmp_path, backend):
    """Dropout in train mode: a seeded caller gets eager's mask and leaves torch's
    generator where eager leaves it, cold and warm (Inductor built with eager's random
    ops); the targets are keyed by what they draw with. In eval() no piece draws."""
    torch.manual_seed(0)
    model = Dropped().train()
    store = open_local(tmp_path / "store")
    config = models.config(splitting_ops=(), compile_ranges=((1, 16),), backend=backend)
    x = torch.randn(4, 8)
    for start in ("cold", "warm"):
        with process_state.fresh():
            compiled = cachebuild.compile(model, config, {0: 0}, store=store)
            for seed in range(3):
                out, after = _seeded(compiled, x, seed)
                want, want_after = _seeded(model, x, seed)
                torch.testing.assert_close(out, want, **models.TOL)
                assert torch.equal(after, want_after), (start, seed)
    assert {tuple(r.manifest.get("random", ())) for r in store.records()
            if r.manifest and "graph" in r.manifest} == {("dropout",)}
    model.eval()
    compiled = cachebuild.compile(model, config, {0: 0}, store=store)
    models.assert_matches_eager(compiled, model, (x,))


def _dynamo_graph(fn, *args) -> torch.fx.Graph:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


def test_what_draws_random_numbers_is_read_off_the_arguments_too():
    """Dropout draws in training at a probability above 0 (Dynamo keeps an eval-mode
    dropout in the graph, with ``training=False``); attention draws where its dropout_p
    is not 0; a ``*_like`` random op always draws."""
    from cachebuild.graph.facts import random_ops

    x = torch.randn(2, 4, 8)
    drop = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
    assert random_ops(_dynamo_graph(drop.eval(), x)) == []
    assert random_ops(_dynamo_graph(drop.train(), x)) == ["dropout"]
    assert random_ops(_dynamo_graph(torch.nn.Dropout(0.0).train(), x)) == []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert random_ops(_dynamo_graph(lambda q: sdpa(q, q, q, dropout_p=0.5), x)) == [
        "scaled_dot_product_attention"]
    assert random_ops(_dynamo_graph(lambda q: sdpa(q, q, q), x)) == []
    alpha = torch.nn.functional.alpha_dropout
    assert random_ops(_dynamo_graph(lambda q: alpha(q, 0.3), x)) == []  # training=False
    assert random_ops(_dynamo_graph(lambda q: alpha(q, 0.3, True), x)) == ["alpha_dropout"]
    assert random_ops(_dynamo_graph(lambda q: q + torch.randn_like(q), x)) == ["randn_like"]
    # torch's own dropouts take ``train`` (once read by name only where it was a
    # random op's name: torch.feature_dropout was missed)
    assert random_ops(_dynamo_graph(lambda q: torch.feature_dropout(q, 0.3, True), x)) == [
        "feature_dropout"]
    assert random_ops(_dynamo_graph(lambda q: torch.feature_dropout(q, 0.3, False), x)) == []


NAMED_CHILD = """
import collections, json
import torch
import cachebuild

Out = collections.namedtuple("Out", "logits hidden")


class Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return Out(h * 2, h)


torch.manual_seed(0)
model = Named().eval()
compiled = cachebuild.compile(model, cachebuild.CompileConfig(
    backend="eager_fusion", compile_ranges=((1, 16),)), {0: 0})
with torch.no_grad():
    for size in (3, 1, 7):
        x = torch.randn(size, 8)
        out = compiled(x)
        assert type(out) is Out, type(out)
        torch.testing.assert_close(tuple(out), tuple(model(x)))
print(json.dumps({"stats": cachebuild.stats()}))
"""


def test_a_namedtuple_output_is_recorded_and_starts_warm(tmp_path):
    """Dynamo makes the namedtuple through globals it installs by id (the class, its
    generated ``__new__``'s namespace): recorded by the class's own name."""
    script = tmp_path / "named.py"  # a model file, as a server has
    script.write_text(NAMED_CHILD)
    env = {**os.environ, "CACHEBUILD_DIR": str(tmp_path / "store")}
    said = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                           text=True, timeout=600) for _ in range(2)]
    assert all(p.returncode == 0 for p in said), said[-1].stderr[-3000:]
    cold, warm = (json.loads(p.stdout.splitlines()[-1])["stats"] for p in said)
    assert cold["traced"] == 1 and warm["traced"] == 0 and warm["entries_loaded"] == 1
