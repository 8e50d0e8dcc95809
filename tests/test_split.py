"""Tracing a model into one graph and cutting it at splitting ops."""

from __future__ import annotations

import operator

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cachebuild
from cachebuild.errors import ConfigError, UsageError
from cachebuild.tracing.split import is_splitting, split_graph
from cachebuild.tracing.trace import trace_model


def flat_inputs(traced, model, args):
    """The traced graph's inputs for a live call, from its bindings."""
    out = []
    for b in traced.bindings:
        if b.kind == "param":
            out.append(model.get_parameter(b.path))
        elif b.kind == "buffer":
            out.append(model.get_buffer(b.path))
        elif b.kind == "arg":
            out.append(args[b.arg])
        elif b.kind == "size":
            out.append(args[b.arg].shape[b.dim])
        else:
            out.append(b.dim)
    return out


def runnable(plan):
    """``plan.stitch`` with each compiled piece's tuple unwrapped where the stitching graph
    expects a bare value (what the runtime's PieceRunner does)."""

    class Unwrap(nn.Module):
        def __init__(self, gm):
            super().__init__()
            self.gm = gm

        def forward(self, *args):
            return self.gm(*args)[0]

    for piece in plan.pieces:
        if piece.compiled and piece.single_output:
            setattr(plan.stitch, piece.name, Unwrap(piece.gm))
    return plan.stitch


def calls(gm, op_name):
    return sum(is_splitting(n, {op_name}) for n in gm.graph.nodes)


@pytest.fixture(scope="module")
def decoder():
    model = models.make(models.Decoder, layers=2)
    return model, trace_model(model, models.inputs(8), {0: 0, 1: 0})


def test_trace_binds_every_input(decoder):
    model, traced = decoder
    kinds = {b.kind for b in traced.bindings}
    assert kinds <= {"param", "buffer", "arg", "size"}
    params = {b.path for b in traced.bindings if b.kind == "param"}
    assert params == {name for name, _ in model.named_parameters()}
    assert {b.path for b in traced.bindings if b.kind == "buffer"} == {
        "layers.0.inv_freq", "layers.1.inv_freq"}
    assert {b.arg for b in traced.bindings if b.kind == "arg"} == {0, 1}
    # The file defining the model is among the traced sources, torch's own files are not.
    assert str(models.TESTS_DIR / "models.py") in traced.source_files
    assert not any("/torch/" in path for path in traced.source_files)


def test_pieces_alternate_compiled_and_splitting(decoder):
    _, traced = decoder
    plan = split_graph(traced, (models.ATTENTION,))
    assert [p.compiled for p in plan.pieces] == [True, False, True, False, True]
    for piece in plan.pieces:
        if piece.compiled:
            assert calls(piece.gm, models.ATTENTION) == 0
            # Compiled pieces take tensors only (weights included) and read no attributes.
            assert all(m.kind == "tensor" for m in piece.input_metas)
            assert not any(n.op == "get_attr" for n in piece.gm.graph.nodes)
            assert piece.size_input is not None
        else:
            assert calls(piece.gm, models.ATTENTION) == 1


def test_packet_and_overload_names_split_alike(decoder):
    _, traced = decoder
    by_packet = split_graph(traced, (models.ATTENTION,))
    by_overload = split_graph(traced, (models.ATTENTION + ".default",))
    assert [p.compiled for p in by_packet.pieces] == [p.compiled for p in by_overload.pieces]
    assert [str(p.gm.graph) for p in by_packet.pieces] == [
        str(p.gm.graph) for p in by_overload.pieces]


def test_no_splitting_op_gives_one_piece(decoder):
    _, traced = decoder
    plan = split_graph(traced, ())
    assert [p.compiled for p in plan.pieces] == [True]


@pytest.mark.parametrize("tokens", [1, 8, 13])
def test_stitched_split_computes_the_model(decoder, tokens):
    model, traced = decoder
    plan = split_graph(traced, (models.ATTENTION,))
    args = models.inputs(tokens)
    with torch.no_grad():
        out = runnable(plan)(*flat_inputs(traced, model, args))
        ref = model(*args)
    torch.testing.assert_close(out[0], ref, **models.TOL)


def test_unknown_splitting_op_lists_the_ops_the_graph_contains(decoder):
    _, traced = decoder
    with pytest.raises(UsageError) as info:
        split_graph(traced, ("mylib::attn", models.ATTENTION))
    message = str(info.value)
    assert "['mylib::attn'] not found in the traced graph" in message
    for op in (models.ATTENTION, "aten::linear", "aten::embedding", "aten::rms_norm"):
        assert op in message


def test_unknown_splitting_op_through_compile(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    model = models.make(models.Decoder, layers=1)
    # An op registered nowhere is refused before tracing.
    compiled = cachebuild.compile(model, models.config(splitting_ops=("mylib::attn",)),
                                  {0: 0, 1: 0}, store=store)
    with pytest.raises(ConfigError, match=r"splitting op mylib::attn is not a registered"):
        compiled(*models.inputs(8))
    # A registered op the model never calls is named with the ops its graph holds.
    compiled = cachebuild.compile(model, models.config(splitting_ops=("aten::cumsum",)),
                                  {0: 0, 1: 0}, store=store)
    with pytest.raises(UsageError, match=r"aten::cumsum.*it contains: .*cachebuild_tests::attention"):
        compiled(*models.inputs(8))
    assert list(store.records()) == []


class SdpaModel(nn.Module):
    """Multi-head self-attention through F.scaled_dot_product_attention, one sequence."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, -1).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(0, 1).reshape(t, -1)).relu()


def test_split_at_an_aten_op():
    torch.manual_seed(0)
    model = SdpaModel().eval()
    traced = trace_model(model, (torch.randn(6, 16),), {0: 0})
    plan = split_graph(traced, ("aten::scaled_dot_product_attention",))
    assert [p.compiled for p in plan.pieces] == [True, False, True]
    x = torch.randn(9, 16)
    with torch.no_grad():
        out = runnable(plan)(*flat_inputs(traced, model, (x,)))
    torch.testing.assert_close(out[0], model(x), **models.TOL)


@torch.library.custom_op("cachebuild_tests::attend_lse", mutates_args=())
def attend_lse(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention returning its output and a log-sum-exp, as flash attention's ops do."""
    scores = (q @ k.T).tril()
    return scores.softmax(-1) @ k, scores.logsumexp(-1)


@attend_lse.register_fake
def _(q, k):
    return torch.empty_like(q), q.new_empty(q.shape[:-1])


class TupleAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, lse = torch.ops.cachebuild_tests.attend_lse(self.q(x), self.k(x))
        return self.o(out) + lse[:, None]


@pytest.mark.parametrize("door", ["compile", "torch"])
def test_a_splitting_op_that_returns_a_tuple_hands_over_its_items(open_local, door):
    """Its items are taken beside it, so the next piece receives tensors (it was refused:
    'unsupported graph input of type tuple')."""
    torch.manual_seed(0)
    model = TupleAttention().eval()
    config = models.config(splitting_ops=("cachebuild_tests::attend_lse",))
    compiled = (cachebuild.compile(model, config, {0: 0}, store=open_local()) if door == "compile"
                else torch.compile(model, backend=cachebuild.backend(config, store=open_local()),
                                   dynamic=True))
    for tokens in (6, 3, 9):
        x = torch.randn(tokens, 16)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), **models.TOL)


class GraphBreak(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return x + 1
        return x - 1


class PlainTensorAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(4)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_forward_that_does_not_trace_as_one_graph():
    with pytest.raises(UsageError, match="does not trace as one graph"):
        trace_model(GraphBreak(), (torch.randn(4, 4),), {0: 0})


class RaisesInForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("no weights loaded")


def test_a_forward_that_raises_is_said_with_its_exception_and_where():
    with pytest.raises(UsageError) as e:
        trace_model(RaisesInForward(), (torch.randn(4, 4),), {0: 0})
    said = str(e.value)
    assert "\n" not in said and "no weights loaded" in said and "ValueError" in said
    assert "test_split.py:" in said and "in forward" in said
    # The forward's own error, not a graph break.
    assert "raises on these inputs" in said and "one graph" not in said


class IndexedByArgmax(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x[ids.argmax()]


def test_a_tensors_value_used_as_an_index_is_said_in_one_line():
    """Dynamo's page about a data-dependent index (24 lines, links and logging variables)
    is one line: what, where in the forward, and what to write instead."""
    with pytest.raises(UsageError) as e:
        trace_model(IndexedByArgmax(), (torch.randn(5, 4), torch.arange(5)), {0: 0, 1: 0})
    said = str(e.value)
    assert "\n" not in said and "data-dependent" in said and "x[ids.argmax()]" in said
    assert "torch.index_select" in said


class OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape, generator=self.g)


class NumpyRandom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        return x * float(np.random.rand())


def test_random_numbers_a_graph_cannot_draw_are_said_with_what_to_do():
    with pytest.raises(UsageError) as e:
        trace_model(OwnGenerator(), (torch.randn(5, 4),), {0: 0})
    assert "\n" not in str(e.value) and "draw from torch's global generator" in str(e.value)
    with pytest.raises(UsageError) as e:
        trace_model(NumpyRandom(), (torch.randn(5, 4),), {0: 0})
    assert "\n" not in str(e.value) and "NumPy's random numbers" in str(e.value)


def test_plain_tensor_attribute_is_refused():
    with pytest.raises(UsageError, match="register_buffer"):
        trace_model(PlainTensorAttribute(), (torch.randn(3, 4),), {0: 0})


@pytest.mark.parametrize("dynamic_dims,message", [
    ({2: 0}, "expected at least 3 arguments, got 2"),
    ({0: 3}, "names dim 3 of argument 0"),
])
def test_bad_dynamic_dims(dynamic_dims, message):
    with pytest.raises(UsageError, match=message):
        trace_model(models.make(models.Decoder, layers=1), models.inputs(4), dynamic_dims)


def test_dynamic_dims_of_different_sizes():
    ids, _ = models.inputs(4)
    with pytest.raises(UsageError, match="must have one size"):
        trace_model(models.make(models.Decoder, layers=1), (ids, torch.arange(5)), {0: 0, 1: 0})


class TokensTimesTwo(nn.Module):
    """A size computed before the splitting op and used after it (as a mixture of experts
    computes tokens × top-k): the last piece would take ``2*s0`` as a plain integer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(models.HIDDEN, models.HIDDEN)
        self.out = nn.Linear(models.HIDDEN, models.HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        doubled = tokens * 2
        h = self.lin(x).view(tokens, models.HEADS, -1)
        a = torch.ops.cachebuild_tests.attention(h, h[:, :2], h[:, :2])
        y = a.reshape(tokens, -1).repeat(2, 1).view(doubled, models.HIDDEN)
        return self.out(y).view(2, tokens, -1).sum(0)


def test_size_expressions_are_recomputed_inside_the_piece(open_local, tmp_path):
    model = models.make(TokensTimesTwo)
    x = torch.randn(8, models.HIDDEN)
    traced = trace_model(model, (x,), {0: 0})
    plan = split_graph(traced, (models.ATTENTION,))
    last = plan.compiled_pieces[-1]
    # Before: the last piece took the symbolic integer 2*s0; now only tensors.
    assert [m.kind for m in last.input_metas] == ["tensor"] * len(last.input_metas)
    assert any(n.target is operator.mul for n in last.gm.graph.nodes)
    compiled = cachebuild.compile(model, models.config(), {0: 0},
                                  store=open_local(tmp_path / "store"))
    for tokens in (3, 8, 17):
        models.assert_matches_eager(compiled, model, (torch.randn(tokens, models.HIDDEN),))


class SaysPrefill(nn.Module):
    """After its last splitting op, returns a bool of the token count alone: a piece
    whose only dynamic input is the size itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        heads = self.lin(x).reshape(x.shape[0], 2, 8)
        y = torch.ops.cachebuild_tests.attention(heads, heads, heads)  # returned as it is
        return y, x.shape[0] > 3


def test_a_piece_that_computes_from_the_token_count_alone_follows_it(open_local):
    import inplace_models as im

    model = SaysPrefill().eval()
    compiled = cachebuild.compile(model, im.config(), {0: 0}, store=open_local())
    with torch.no_grad():
        for n in (5, 2, 4, 1):
            x = torch.randn(n, 16)
            out, prefill = compiled(x)
            assert prefill is (n > 3)
            torch.testing.assert_close(out, model(x)[0])
