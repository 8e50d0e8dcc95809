"""Targets proven before they are stored, and on first load with ``CACHEBUILD_VERIFY=load``:
the compiled artifact against its piece's graph run eagerly on the same random inputs, at
the bucket's hint and ends. A target that fails is a BuildError naming the piece, the
bucket and the sizes, and nothing is stored."""

from __future__ import annotations

import json
import operator

import models
import pytest
import torch
import torch.fx as fx

import cachebuild
from cachebuild.backends import BuildRequest, register_backend
from cachebuild.backends.eager_fusion import EagerFusionBackend
from cachebuild.building.verify import Mismatch, check, compare, verify_sizes
from cachebuild.errors import BuildError
from cachebuild.tracing.trace import InputMeta

DYN = {0: 0, 1: 0}


class SiluToGelu(EagerFusionBackend):
    """A compiler with a bug: its artifact computes GELU where the piece has SiLU."""

    name = "silu_to_gelu"

    def compile(self, request: BuildRequest):
        artifact = super().compile(request)
        artifact.payload = artifact.payload.replace(b'"op:aten::silu.default"',
                                                    b'"op:aten::gelu.default"')
        return artifact


class RightAtTheHintOnly(EagerFusionBackend):
    """A compiler with a bug: the artifact is right at the range's size hint only."""

    name = "hint_only"

    def load(self, kind, key, store, device):
        fn = super().load(kind, key, store, device)
        if fn is None:
            return None

        def run(*args):
            out = fn(*args)
            sizes = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()}
            return [o * 2 if 16 not in sizes and isinstance(o, torch.Tensor)
                    and o.is_floating_point() else o for o in out]

        return run


register_backend(SiluToGelu.name, SiluToGelu)
register_backend(RightAtTheHintOnly.name, RightAtTheHintOnly)


@pytest.mark.parametrize(("backend", "sizes"), [("silu_to_gelu", "1, 16, 32"),
                                                ("hint_only", "1, 16, 32")])
def test_a_wrong_artifact_is_a_build_error_and_is_not_stored(open_local, tmp_path, backend, sizes):
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=2)
    compiled = cachebuild.compile(model, models.config(backend=backend), DYN, store=store)
    before = cachebuild.stats()
    with pytest.raises(BuildError, match=rf"piece \d \(range 1-32, key \w+\) does not match its "
                                         rf"piece run eagerly at sizes {sizes}: .*not stored"):
        compiled(*models.inputs(5))
    assert models.counters_delta(before, cachebuild.stats())["failed"] == 1
    stored = [store.get(r.key) for r in store.records()]
    assert all(b"op:aten::gelu" not in payload for payload in stored)  # no wrong target
    if backend == "hint_only":
        assert stored == []  # the first target already fails


def test_verification_sizes():
    assert verify_sizes({"range": [1, 8192]}) == [1, 16, 8192]
    assert verify_sizes({"range": [17, 48]}) == [17, 48]
    assert verify_sizes({"size": 4}) == [4]
    assert verify_sizes({"static": True}) == [None]


def test_tolerance_follows_the_dtype():
    ref = torch.linspace(-4, 4, 64)
    compare(ref + 1e-4, ref, "out")
    with pytest.raises(Exception, match="differs by up to 0.1"):
        compare(ref + 0.1, ref, "out")
    compare((ref + 0.05).bfloat16(), ref.bfloat16(), "out")  # within bf16 rounding
    with pytest.raises(Exception, match="expected torch.float32"):
        compare(ref.double(), ref, "out")
    with pytest.raises(Exception, match="differs in 1 elements"):
        compare(torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]), "out")


def _softmax_in_float32(x: torch.Tensor) -> tuple[torch.Tensor]:
    return (x.float().softmax(-1),)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_output_carries_the_error_of_the_inputs_it_came_from(dtype):
    """A float32 output computed from bfloat16 inputs (a router's softmax, float32 logits)
    is held to bfloat16's tolerance: a compiler's own rounding of those values there
    failed every build of such a piece. From float32 inputs, float32's still holds."""
    from cachebuild.trust.fxjson import graph_to_data

    graph = fx.symbolic_trace(_softmax_in_float32).graph  # x.float().softmax(-1)
    metas = [InputMeta("tensor", dtype, ("s0", 16), (16, 1))]

    def off_by_a_rounding(x):  # what Inductor's bf16 arithmetic may give
        (out,) = _softmax_in_float32(x)
        return (out * (1 + 4e-3),)

    if dtype == "bfloat16":
        check(off_by_a_rounding, graph_to_data(graph), metas, {"range": [1, 8]})
    else:
        with pytest.raises(Exception, match="differs by up to"):
            check(off_by_a_rounding, graph_to_data(graph), metas, {"range": [1, 8]})


def _scaled(x: torch.Tensor) -> tuple[torch.Tensor]:
    return (x * 2,)


def test_the_proof_refuses_an_artifact_that_draws_other_random_numbers():
    """An artifact with its piece's outputs that draws from torch's generator where its
    piece does not fails the proof: a seeded caller would draw other numbers after."""
    from cachebuild.trust.fxjson import graph_to_data

    nodes = graph_to_data(fx.symbolic_trace(_scaled).graph)
    metas = [InputMeta("tensor", "float32", ("s0", 4), (4, 1))]

    def drawing(x):
        torch.rand(1)
        return _scaled(x)

    assert check(_scaled, nodes, metas, {"range": [1, 8]}) == [1, 8]
    with pytest.raises(Exception, match="random number generator is left in another state"):
        check(drawing, nodes, metas, {"range": [1, 8]})


def _sum_rows(y: torch.Tensor) -> tuple[torch.Tensor]:
    return (y.sum(1, keepdim=True) * y[:, :1],)


@pytest.mark.parametrize("stride", [(1, 9), (1, 0), (16, 2)])
def test_the_proof_gives_the_artifact_inputs_with_the_strides_it_was_built_for(stride):
    """An input that is not dense (a slice of a wider tensor, an expanded one, every
    other column) reaches the artifact with the strides its piece was traced with: a
    clone() made them dense, and an artifact built for them read garbage (the torch.compile
    door failed every such build)."""
    from cachebuild.trust.fxjson import graph_to_data

    nodes = graph_to_data(fx.symbolic_trace(_sum_rows).graph)
    metas = [InputMeta("tensor", "float32", (4, 5), stride)]

    def built_for_those_strides(y):
        assert y.stride() == stride, y.stride()
        return _sum_rows(y)

    check(built_for_those_strides, nodes, metas, {"static": True})


def _pinned(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    # int() of a symbolic size: tracing pins it to the size it was traced at.
    return (x.reshape(int(x.shape[0]), -1) @ w,)


def test_eager_fusion_refuses_a_trace_that_specialises_the_range():
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(_pinned, (x, w)))
    request = BuildRequest(
        gm=fx.GraphModule(torch.nn.Module(), graph),
        input_metas=[InputMeta("tensor", "float32", ("s0", 8), (8, 1)),
                     InputMeta("tensor", "float32", (8, 4), (4, 1))],
        bucket={"range": [1, 32]}, config=models.config(), key="0" * 32, passes=None)
    with pytest.raises(ValueError, match="specialised the range's size to 16"):
        EagerFusionBackend().compile(request)


def test_check_skips_sizes_where_the_piece_rejects_random_inputs():
    graph = fx.Graph()
    x, i = graph.placeholder("x"), graph.placeholder("i")
    graph.output((graph.call_function(operator.getitem, (x, i)),))
    from cachebuild.trust.fxjson import graph_to_data

    nodes = graph_to_data(graph)
    metas = [InputMeta("tensor", "float32", ("s0", 4), (4, 1)),
             InputMeta("tensor", "int64", ("s0",), (1,))]
    # At size 1 the random indices (0 or 1) may point past the one row: that size proves
    # nothing and is skipped; the other sizes are checked.
    fn = fx.GraphModule(torch.nn.Module(), graph)
    assert check(fn, nodes, metas, {"range": [1, 8]}) == [1, 8]


def test_a_size_that_only_repeated_write_indices_fit_proves_nothing():
    """A 4-row cache written at ``size`` positions: past 4 rows only repeated positions
    fit, and which write to a row lands is the kernel's choice (eager's too). An artifact
    that writes in the other order is right there, and still proven at the sizes where
    the positions can be distinct."""
    graph = fx.Graph()
    cache, pos, k = graph.placeholder("cache"), graph.placeholder("pos"), graph.placeholder("k")
    graph.call_method("index_copy_", (cache, 0, pos, k))
    graph.output((graph.call_method("sum", (k,)),))
    from cachebuild.trust.fxjson import graph_to_data

    nodes = graph_to_data(graph)
    metas = [InputMeta("tensor", "float32", (4, 3), (3, 1)),
             InputMeta("tensor", "int64", ("s0",), (1,)),
             InputMeta("tensor", "float32", ("s0", 3), (3, 1))]

    def last_first(cache, pos, k):  # the first write to a row lands, not the last
        for i in reversed(range(len(pos))):
            cache[pos[i]] = k[i]
        return (k.sum(),)

    assert check(last_first, nodes, metas, {"range": [2, 8]}) == [2, 8]

    def wrong(cache, pos, k):  # where positions are distinct, a wrong write is caught
        cache.index_copy_(0, pos, k * 2)
        return (k.sum(),)

    with pytest.raises(Mismatch, match="input 0 after the call"):
        check(wrong, nodes, metas, {"range": [2, 8]})


# -- on first load ---------------------------------------------------------------------

LOAD_CHILD = """
import json, os, sys
import cachebuild, models
from cachebuild.errors import BuildError
from cachebuild.store import LocalStore

model = models.make(models.Decoder, layers=2, seed=4)
compiled = cachebuild.compile(model, models.config(), {0: 0, 1: 0},
                              store=LocalStore(os.environ["STORE"]))
try:
    models.assert_matches_eager(compiled, model, models.inputs(7))
    error = None
except BuildError as e:
    error = str(e)
compilers = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
stats = cachebuild.stats()
print(json.dumps({"error": error, "compilers": compilers, "loaded": stats["loaded"],
                  "verify": stats["seconds"].get("verify", 0)}))
"""


def test_verify_on_load_catches_a_stored_artifact_that_does_not_match(open_local, tmp_path):
    store_path = tmp_path / "store"
    store = open_local(store_path)
    model = models.make(models.Decoder, layers=2)
    models.assert_matches_eager(cachebuild.compile(model, models.config(), DYN, store=store),
                                model, models.inputs(7))
    good = models.run_python(LOAD_CHILD, env={"STORE": str(store_path),
                                              "CACHEBUILD_VERIFY": "load"})
    assert good["error"] is None and good["loaded"] == 3 and good["verify"] > 0
    assert good["compilers"] == []  # the check runs the piece eagerly: no compiler

    # A stored target whose artifact computes something else (what a key missing a factor
    # would serve): verified on load, it is refused; unverified, it would be used.
    record = next(r for r in store.records() if r.kind == "fx-graph"
                  and b"op:aten::silu" in store.get(r.key))
    payload = store.get(record.key).replace(b'"op:aten::silu.default"',
                                        b'"op:aten::gelu.default"')
    store.delete(record.key)
    store.put(record.key, payload, kind=record.kind, manifest=record.manifest)
    bad = models.run_python(LOAD_CHILD, env={"STORE": str(store_path),
                                             "CACHEBUILD_VERIFY": "load"})
    assert bad["error"] and "loaded from the store does not match its piece" in bad["error"]
    assert record.key in bad["error"]
    json.dumps(bad)
