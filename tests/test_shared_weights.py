"""Weights tied and layers shared: a model built with them traces to another graph than
one built without (one input for both names), so its entry is another, in every process
(the entry key says which names are one tensor, or views of one memory)."""

from __future__ import annotations

import torch
import torch.nn as nn

import cachebuild
from cachebuild.building.entry_key import shared_tensors


class Tied(nn.Module):
    def __init__(self, tie: bool, share: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        first = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([first, first if share else nn.Linear(8, 8)])
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.softmax(self.embed(ids), -1)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def _config(**overrides) -> cachebuild.CompileConfig:
    return cachebuild.CompileConfig(splitting_ops=("aten::softmax",),
                                    compile_ranges=((1, 16),), backend="eager_fusion",
                                    **overrides)


def _served(model: nn.Module, store) -> int:
    """Compile ``model`` from ``store`` and check it against eager; how many traces that
    took."""
    before = cachebuild.stats()["traced"]
    compiled = cachebuild.compile(model, _config(), {0: 0}, store=store)
    for n in (5, 11):
        ids = torch.randint(0, 16, (n,))
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    return cachebuild.stats()["traced"] - before


def test_a_model_with_weights_tied_and_one_without_are_other_entries(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    torch.manual_seed(0)
    assert _served(Tied(tie=True).eval(), store) == 1
    torch.manual_seed(1)
    assert _served(Tied(tie=True).eval(), store) == 0  # the same model: warm
    assert _served(Tied(tie=False).eval(), store) == 1
    assert _served(Tied(tie=False, share=True).eval(), store) == 1
    assert _served(Tied(tie=True, share=True).eval(), store) == 1


def test_the_names_that_are_one_tensor_are_told():
    assert shared_tensors(Tied(tie=False)) == []
    assert shared_tensors(Tied(tie=True)) == [["embed.weight", "head.weight"]]
    assert shared_tensors(Tied(tie=False, share=True)) == [
        ["blocks.0.bias", "blocks.1.bias"], ["blocks.0.weight", "blocks.1.weight"]]
    views = nn.Module()  # views of one memory are two inputs (a write between is refused)
    views.register_buffer("a", torch.zeros(8))
    views.register_buffer("b", views.a[:4])
    assert shared_tensors(views) == []


def test_a_tying_undone_or_made_after_the_first_call_gets_its_own_forward(open_local,
                                                                         tmp_path):
    """A compiled forward binds a tied weight once: a new head weight set after the first
    call (or a shared layer replaced, or weights tied then) is another forward, traced or
    found, never the old one reading the old tensor; tied back, the first runs again."""
    store = open_local(tmp_path / "store")
    torch.manual_seed(0)
    model = Tied(tie=True).eval()
    compiled = cachebuild.compile(model, _config(), {0: 0}, store=store)
    ids = torch.randint(0, 16, (5,))

    def same() -> None:
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)

    same()
    traced = cachebuild.stats()["traced"]
    tied = model.head.weight
    model.head.weight = nn.Parameter(torch.randn(16, 8))  # untied
    same()
    assert cachebuild.stats()["traced"] == traced + 1
    model.head.weight = tied  # tied again: the first forward, found in this process
    same()
    assert cachebuild.stats()["traced"] == traced + 1
    model.blocks[1] = model.blocks[0]  # a layer shared from now on
    same()
    assert cachebuild.stats()["traced"] == traced + 2
    model.blocks[1] = nn.Linear(8, 8)  # unshared: tied as at first, that forward again
    same()
    assert cachebuild.stats()["traced"] == traced + 2
    # Untied by a write that skips torch's registration (as accelerate's loaders do).
    model.head._parameters["weight"] = nn.Parameter(torch.randn(16, 8))
    same()


class Counting(nn.Module):
    """Writes a buffer of its own in place at every call (a cache, a counter)."""

    def __init__(self, view: bool = False) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16))
        if view:  # a second buffer that is a view of the first
            self.register_buffer("window", self.state[:8])
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state.add_(1)
        seen = self.window if hasattr(self, "window") else self.state[:8]
        return torch.softmax(self.lin(x), -1) + seen


def test_an_argument_that_is_memory_the_model_writes_is_refused(open_local, tmp_path):
    """Compiled code reads each input as if it were alone: an argument sharing memory with
    a buffer the model writes in place would be read as it was before the write. Refused
    in one line; other calls match eager, the buffer's writes too."""
    import copy

    import pytest

    from cachebuild.errors import UsageError

    torch.manual_seed(0)
    model = Counting().eval()
    eager = copy.deepcopy(model)
    compiled = cachebuild.compile(model, _config(), {0: 0}, store=open_local(tmp_path / "s"))
    for n in (3, 7):
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x), eager(x))
        torch.testing.assert_close(model.state, eager.state)
    with pytest.raises(UsageError, match=r"argument 0 shares memory with buffer state, which "
                       r"the compiled model writes in place"):
        compiled(model.state[:8].view(1, 8))


def test_a_buffer_viewing_one_the_model_writes_is_refused(open_local, tmp_path):
    """Refused in one line, as a start's failure: with ``on_failure="eager"`` the model
    runs eagerly instead (its writes too)."""
    import copy

    import pytest

    from cachebuild.errors import UsageError

    model = Counting(view=True).eval()
    compiled = cachebuild.compile(model, _config(), {0: 0}, store=open_local(tmp_path / "s"))
    with pytest.raises(UsageError, match=r"buffer window shares memory with buffer state, "
                       r"which the model writes in place"):
        compiled(torch.randn(3, 8))
    model = Counting(view=True).eval()
    eager = copy.deepcopy(model)
    compiled = cachebuild.compile(model, _config(on_failure="eager"), {0: 0},
                                  store=open_local(tmp_path / "s2"))
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), eager(x))
    torch.testing.assert_close(model.state, eager.state)


class Adapted(nn.Module):
    """A base layer and a low-rank adapter beside it (LoRA's shape)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.down = nn.Linear(8, rank, bias=False)
        self.up = nn.Linear(rank, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.base(x) + self.up(self.down(x)), -1)


def test_an_adapter_of_another_rank_swapped_in_after_the_first_call_is_compiled(open_local,
                                                                              tmp_path):
    """Weights of another shape are another forward (found or traced), as eager runs
    them; the first rank's forward serves again once it is back."""
    torch.manual_seed(0)
    model = Adapted(rank=4).eval()
    compiled = cachebuild.compile(model, _config(), {0: 0}, store=open_local(tmp_path / "s"))
    x = torch.randn(5, 8)
    torch.testing.assert_close(compiled(x), model(x))
    traced = cachebuild.stats()["traced"]
    first = (model.down, model.up)
    model.down, model.up = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
    torch.testing.assert_close(compiled(x), model(x))
    assert cachebuild.stats()["traced"] == traced + 1
    model.down, model.up = first
    torch.testing.assert_close(compiled(x), model(x))
    assert cachebuild.stats()["traced"] == traced + 1
