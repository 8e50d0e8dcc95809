"""Inputs are checked before compiled code reads them by pointer.

A call that does not fit what was traced (dynamic dims of different sizes, an expanded or
sliced view, a meta tensor, another dtype) gets a UsageError against AOTI pieces, in a
child process so that a crash would fail the test rather than end the run. A piece input
that comes from inside the model with other strides than the piece was compiled for is
copied to those strides (and counted).
"""

from __future__ import annotations

import models
import pytest
import torch

import cachebuild
from cachebuild.errors import UsageError
from cachebuild.graph.inputs import LayoutGuard, eval_dim
from cachebuild.tracing.trace import InputMeta

DYN = {0: 0, 1: 0}

BAD_CALLS_CHILD = """
import json, os
import torch
import cachebuild, models
from cachebuild.errors import UsageError
from cachebuild.store import LocalStore

model = models.make(models.Decoder, layers=2, seed=11)
compiled = cachebuild.compile(model, models.aoti_config(), {0: 0, 1: 0},
                              store=LocalStore(os.environ["STORE"]))
ids, pos = models.inputs(8)
models.assert_matches_eager(compiled, model, (ids, pos))  # loads the AOTI pieces
calls = {
    "fewer positions": (ids, pos[:4]),
    "expanded ids": (ids[:1].expand(8), pos),
    "strided positions": (torch.arange(16)[::2], pos),
    "meta ids": (ids.to("meta"), pos),
    "float ids": (ids.float(), pos),
    "static dim": (ids[None], pos),
}
said = {}
for name, args in calls.items():
    try:
        with torch.no_grad():
            compiled(*args)
        said[name] = None
    except UsageError as e:
        said[name] = str(e)
models.assert_matches_eager(compiled, model, models.inputs(5))  # still serves good calls
print(json.dumps({"said": said, "kinds": sorted({LocalStore(os.environ["STORE"]).get_record(k).kind
                                                 for k in compiled.runtime.entry.target_keys()})}))
"""


@pytest.mark.slow
def test_bad_calls_against_aoti_pieces_are_usage_errors():
    warmed = models.aoti_store()
    out = models.run_python(BAD_CALLS_CHILD, env={"STORE": str(warmed["path"])})
    assert out["kinds"] == ["aoti-cpu"]
    said = out["said"]
    assert "every dynamic dim must have the same size" in said["fewer positions"]
    assert "strides (0,)" in said["expanded ids"] and ".contiguous()" in said["expanded ids"]
    assert "strides (2,)" in said["strided positions"]
    assert "meta tensor" in said["meta ids"]
    assert "float32" in said["float ids"] and "int64" in said["float ids"]
    assert "2 dims" in said["static dim"]


def test_eval_dim_reads_symbolic_sizes_without_sympy():
    assert eval_dim(7, {}) == 7
    assert eval_dim("s0", {"s0": 5}) == 5
    assert eval_dim("64*s0", {"s0": 3}) == 192
    assert eval_dim("2*s0 + s1", {"s0": 3, "s1": 4}) == 10
    assert eval_dim("Max(1, s0)", {"s0": 0}) == 1
    assert eval_dim("FloorDiv(s0, 2)", {"s0": 7}) == 3
    with pytest.raises(ValueError):
        eval_dim("__import__('os')", {})
    with pytest.raises(ValueError):
        eval_dim("s0.real", {"s0": 1})


def test_layout_guard_copies_inputs_to_the_compiled_strides():
    meta = InputMeta("tensor", "float32", ("s0", 4), (4, 1))
    weight = InputMeta("tensor", "float32", (4, 4), (4, 1))
    guard = LayoutGuard([meta, weight], checked=[0])
    before = cachebuild.stats()["layout_copies"]
    x = torch.randn(4, 6).t()  # (6, 4) with strides (1, 6): not what the piece reads
    w = torch.randn(4, 4)
    fixed, same_w = guard((x, w))
    assert fixed.stride() == (4, 1) and torch.equal(fixed, x) and same_w is w
    assert cachebuild.stats()["layout_copies"] == before + 1
    good = torch.randn(6, 4)
    assert guard((good, w))[0] is good  # already right: no copy
    one = torch.randn(4, 1).t()  # (1, 4) strides (1, 1): a size-1 dim's stride never matters
    assert guard((one, w))[0] is one
    assert cachebuild.stats()["layout_copies"] == before + 1


def test_splitting_op_output_with_other_strides_is_copied_before_the_next_piece(open_local, tmp_path):
    """The splitting op's eager output is transposed in memory where its fake (traced)
    output is contiguous: the next piece gets a contiguous copy, once per call."""
    model = models.make(models.TransposedMix)
    config = models.config(splitting_ops=(models.TRANSPOSED,))
    compiled = cachebuild.compile(model, config, {0: 0}, store=open_local(tmp_path / "store"))
    before = cachebuild.stats()["layout_copies"]
    for tokens in (3, 9):
        models.assert_matches_eager(compiled, model, (torch.randn(tokens, models.HIDDEN),))
    assert cachebuild.stats()["layout_copies"] - before == 2


def test_weights_are_checked_when_bound(open_local, tmp_path):
    model = models.make(models.Decoder, layers=1)
    compiled = cachebuild.compile(model, models.config(), DYN, store=open_local(tmp_path / "s"))
    models.assert_matches_eager(compiled, model, models.inputs(4))
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().t().contiguous().t())
    with pytest.raises(UsageError, match="lm_head.weight has strides"):
        compiled.runtime.rebind()


class _TwoTokenInputs(torch.nn.Module):
    """Two inputs whose dim 0 is the token count; Dynamo gives each a symbol of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y).sum(0) + y.shape[0]


def test_dynamic_dims_of_other_sizes_are_refused_at_every_call(open_local):
    """Every dynamic dim is the token count: a later call whose dims differ is refused
    (not served by the target of one of the sizes, which would read the other wrong)."""
    torch.manual_seed(0)
    model = _TwoTokenInputs().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 8),),
                                      compile_sizes=(3,))
    compiled = cachebuild.compile(model, config, {0: 0, 1: 0}, store=open_local())
    with torch.no_grad():
        for n in (4, 3, 7):
            args = (torch.randn(n, 16), torch.randn(n, 8))
            torch.testing.assert_close(compiled(*args), model(*args))
        for x, y in ((3, 5), (4, 12), (5, 4)):
            with pytest.raises(UsageError, match="every dynamic dim must have the same size"):
                compiled(torch.randn(x, 16), torch.randn(y, 8))


class ColumnCache(torch.nn.Module):
    """Writes a cache argument in place: the caller's is a column slice of one allocation
    (a key half beside a value half)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(16, 16)

    def forward(self, x, pos, cache):
        cache.index_copy_(0, pos, self.k(x))
        return cache.sum(0) + x.sum(0)


def test_a_written_argument_with_gaps_is_traced_and_served_with_its_layout(open_local):
    """The first call's strides are traced, not a contiguous copy's: calls like it are
    served, writes reaching the caller's allocation; a call with another layout is refused
    without the advice of a copy, which would take the writes."""
    torch.manual_seed(0)
    model = ColumnCache().eval()
    config = cachebuild.CompileConfig(compile_ranges=((1, 32),), backend="eager_fusion")
    compiled = cachebuild.compile(model, config, dynamic_dims={0: 0, 1: 0},
                                  store=open_local())
    for n in (5, 3, 5):
        x, pos = torch.randn(n, 16), torch.randperm(48)[:n]
        mine, eager = torch.zeros(48, 32), torch.zeros(48, 32)
        with torch.no_grad():
            got = compiled(x, pos, mine[:, :16])
            want = model(x, pos, eager[:, :16])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine, eager, rtol=1e-5, atol=1e-5)
    with pytest.raises(UsageError, match="writes it in place") as refused, torch.no_grad():
        compiled(x, pos, torch.zeros(48, 16))
    assert ".contiguous()" not in str(refused.value)


class WritesItsTokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        cache[:, :8].copy_(h)
        return h


def test_a_written_argument_with_a_dynamic_dim_must_be_a_tensor_of_its_own(open_local):
    """An argument with a dynamic dim is compiled contiguous: a column slice of a larger
    tensor that the model writes is refused at the very first call, saying what to pass
    (not "the layout of the first call's", which is the one refused); a tensor of its own
    is served, its writes the caller's."""
    torch.manual_seed(0)
    model = WritesItsTokens().eval()
    config = cachebuild.CompileConfig(compile_ranges=((1, 32),), backend="eager_fusion")
    compiled = cachebuild.compile(model, config, dynamic_dims={0: 0, 1: 0}, store=open_local())
    x = torch.randn(5, 8)
    with pytest.raises(UsageError) as refused, torch.no_grad():
        compiled(x, torch.zeros(5, 24)[:, 4:20])
    said = str(refused.value)
    assert "a dynamic dim is compiled contiguous" in said and "tensor of its own" in said
    assert "first call" not in said
    mine, eager = torch.zeros(5, 16), torch.zeros(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, mine), model(x, eager), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine, eager, rtol=1e-5, atol=1e-5)


class Project(torch.nn.Module):
    def forward(self, x, w):
        return x @ w


def test_static_arguments_of_one_order_but_other_strides_find_entries_of_their_own(open_local):
    """A static argument is traced with its very strides: a start whose first call has
    other strides (a transposed tensor against an expanded one, both with the same order
    of dims) finds an entry of its own, not the other's, which would refuse every call."""
    config = cachebuild.CompileConfig(compile_ranges=((1, 32),), backend="eager_fusion")
    store = open_local()
    model = Project().eval()
    x = torch.randn(5, 16)
    views = [torch.randn(8).expand(16, 8), torch.randn(8, 16).t()]  # one order of dims
    traced = cachebuild.stats()["traced"]
    for w in views:
        compiled = cachebuild.compile(model, config, dynamic_dims={0: 0}, store=store)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, w), model(x, w), rtol=1e-5, atol=1e-5)
    assert cachebuild.stats()["traced"] == traced + 2
    with pytest.raises(UsageError, match=r"\(contiguous\), but the compiled model was traced "
                       r"with the first call's strides \(1, 16\)") as refused, torch.no_grad():
        compiled(x, torch.randn(16, 8))
    assert ".contiguous()" not in str(refused.value)


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(x)


def test_a_model_whose_weights_have_another_layout_finds_an_entry_of_its_own(open_local):
    """Weights in column-major order (as some checkpoint conversions leave them) are
    another entry than the same model's contiguous weights: each start finds its own and
    serves it, where one stored for the other layout would refuse every call."""
    config = cachebuild.CompileConfig(compile_ranges=((1, 32),), backend="eager_fusion")
    store = open_local()
    x = torch.randn(5, 16)
    traced = cachebuild.stats()["traced"]
    for column_major in (False, True, False):
        torch.manual_seed(0)
        model = Linear().eval()
        if column_major:
            with torch.no_grad():
                model.lin.weight = torch.nn.Parameter(model.lin.weight.t().contiguous().t())
        compiled = cachebuild.compile(model, config, dynamic_dims={0: 0}, store=store)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert cachebuild.stats()["traced"] == traced + 2  # the third found the first's
