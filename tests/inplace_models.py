"""Tiny models that write tensors in place, one per pattern, and a model with all of them.

Every forward takes ``x [T, HIDDEN]`` first (the token dim is dynamic) and is split at
``models.ATTENTION``; ``WRITE`` is a splitting op that writes a cache through a slot
index (as vLLM's cache update does). ``state(model, args)`` lists every tensor a call
may change, so a test compares outputs *and* state with eager's.

Imported by tests and, by name (``import inplace_models``), by the child processes
they start.
"""

from __future__ import annotations

from typing import Any

import models
import torch
import torch.nn as nn

import cachebuild

H = 16  # hidden size
SLOTS = 40  # cache rows: more than the compile range's largest size
WRITE = "cachebuild_tests::write_cache"

_LIB = torch.library.Library("cachebuild_tests", "FRAGMENT")
_LIB.define("write_cache(Tensor k, Tensor(a!) cache, Tensor slots) -> ()")


def _write_cache(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    cache.index_copy_(0, slots, k)


_LIB.impl("write_cache", _write_cache, "CompositeExplicitAutograd")


@torch.library.register_fake(WRITE, lib=_LIB)
def _(k: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The test attention op over [T, 2, H/2] heads, back to [T, H]."""
    t = q.shape[0]
    shape = (t, 2, H // 2)
    return torch.ops.cachebuild_tests.attention(
        q.reshape(shape), k.reshape(-1, 2, H // 2)[:t], v.reshape(-1, 2, H // 2)[:t]
    ).reshape(t, H)


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(H, H)
        self.k = nn.Linear(H, H)
        self.o = nn.Linear(H, H)


class MutatedInput(Base):
    """A cache passed in is written by ``index_copy_`` in the piece before attention."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        k = self.k(x)
        cache.index_copy_(0, slots, k)
        return self.o(attend(self.q(x), k, k))


class MutatedBuffer(Base):
    """A buffer written by slice assignment, a counter bumped in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(SLOTS, H))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> Any:
        k = self.k(x)
        self.cache[slots] = k
        self.calls += 1
        return self.o(attend(self.q(x), k, k)) + self.calls


class WritesAWeight(Base):
    """A weight that requires grad, scaled in place (called under no_grad, as eager
    allows): a parameter written, as code normalising its weights does."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> Any:
        self.k.weight.mul_(0.5)
        k = self.k(x)
        return self.o(attend(self.q(x), k, k))


class BumpedAroundTheSplit(Base):
    """A buffer bumped with ``+=`` in the pieces on both sides of attention (a layer's
    step counter), read after: each ``+=`` returns the tensor the one before returned."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        self.steps += 1
        k = self.k(x)
        a = attend(self.q(x), k, k)
        self.steps += 1
        return self.o(a) * self.steps + cache[slots]


class ViewReadLater(Base):
    """A view of an input taken before the input is written, read after, in one piece."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        head = cache[:4]
        cache.mul_(0.5)
        cache.index_add_(0, slots, self.k(x))
        y = self.q(x) + head.sum()
        return self.o(attend(y, y, y))


class ReadBySplittingOp(Base):
    """Written in the piece, then read by the attention op through a view of the cache
    (Hugging Face's static cache)."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        cache.index_copy_(0, slots, self.k(x))
        return self.o(attend(self.q(x), cache, cache))


class ReadInNextPiece(Base):
    """Written in one piece, read in the next."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        k = self.k(x)
        cache[:, :4].add_(1.0)  # a write through a view of the input
        cache.index_copy_(0, slots, k)
        a = attend(self.q(x), k, k)
        return self.o(a) + cache[:8].mean()


class WrittenBySplittingOp(Base):
    """The splitting op writes the cache (through a view the piece before made); the
    piece after reads it."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        k = self.k(x)
        torch.ops.cachebuild_tests.write_cache(k, cache.view(SLOTS, H), slots)
        return self.o(cache[:8].sum(0) + x)


class WritesAnOpsOutput(Base):
    """A compiled piece writes the attention op's output in place; the splitting op after
    it and the piece after that read it."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        a = attend(self.q(x), x, x)
        a.mul_(2.0)
        b = attend(a, a, a)
        return self.o(b) + a + cache[slots]


class AliasingOutputs(Base):
    """Returns a view of an input it wrote and two outputs that share memory."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        k = self.k(x)
        cache.index_copy_(0, slots, k)
        out = self.o(attend(self.q(x), k, k))
        return out, out.view(-1), cache[:4]


class ReturnsArguments(Base):
    """Returns arguments as they are (one written, one not) and views of one it does not
    write (transposed, its bytes as int32): Dynamo hands them back from the caller's
    frame, outside the graph."""

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> Any:
        k = self.k(x)
        cache.index_copy_(0, slots, k)
        out = self.o(attend(self.q(x), k, k))
        return out, x, x.t(), cache, x.view(torch.int32)


class AllPatterns(Base):
    """Every pattern above in one model of three compiled pieces: what the compiler
    flavours that take long to build are tested with."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                acc: torch.Tensor) -> Any:
        k = self.k(x)
        head = cache[:4]
        cache[:, :4].mul_(0.5)
        cache.index_copy_(0, slots, k)
        self.calls += 1
        a = attend(self.q(x) + head.mean(), cache, cache)
        h = self.o(a)
        acc += h.sum(0)
        torch.ops.cachebuild_tests.write_cache(h, cache, slots)
        out = self.o(cache[:8].sum(0) + h) + self.calls
        return out, cache[:4]


PATTERNS = [MutatedInput, MutatedBuffer, WritesAWeight, BumpedAroundTheSplit, ViewReadLater, ReadBySplittingOp,
            ReadInNextPiece, WrittenBySplittingOp, WritesAnOpsOutput, AliasingOutputs,
            ReturnsArguments]


def make(cls: type[nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls().eval()


def call_args(cls: type[nn.Module], tokens: int, start: int = 0, seed: int = 1
              ) -> tuple[Any, ...]:
    """Arguments for ``tokens`` tokens written at slots ``start..`` (fresh state tensors:
    keep the ones a sequence of calls should share, see ``state_args``)."""
    g = torch.Generator().manual_seed(seed + tokens)
    x = torch.randn(tokens, H, generator=g)
    slots = torch.arange(start, start + tokens)
    if cls in (MutatedBuffer, WritesAWeight):
        return x, slots
    return x, slots, torch.randn(SLOTS, H, generator=g), torch.zeros(H)


def with_state(args: tuple[Any, ...], state: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with the state tensors (cache, accumulator) replaced by ``state``'s."""
    return (*args[:2], *state[2:len(args)])


def arity(cls: type[nn.Module]) -> int:
    return {MutatedBuffer: 2, WritesAWeight: 2, AllPatterns: 4}.get(cls, 3)


def dynamic_dims(cls: type[nn.Module]) -> dict[int, int]:
    return {0: 0, 1: 0}


def config(**overrides: Any) -> cachebuild.CompileConfig:
    values: dict[str, Any] = {"splitting_ops": (models.ATTENTION, WRITE),
                              "compile_ranges": ((1, 16),), "backend": "eager_fusion"}
    values.update(overrides)
    return cachebuild.CompileConfig(**values)


def state(model: nn.Module, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """Every tensor a call may change: the tensor arguments and the model's buffers and
    parameters."""
    return [a for a in args if isinstance(a, torch.Tensor)] + [b for _, b in
                                                               model.named_buffers()] + \
        [p.detach() for p in model.parameters()]


def flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_sequence(fn: Any, model: nn.Module, cls: type[nn.Module],
                 sizes: tuple[int, ...] = (5, 3, 1)) -> list[list[torch.Tensor]]:
    """Call ``fn`` on ``sizes`` tokens in turn, the state carried from call to call (a
    cache filled step by step); return each call's outputs and the state after it, as
    copies."""
    shared = call_args(cls, sizes[0])
    results = []
    start = 0
    with torch.no_grad():
        for size in sizes:
            args = with_state(call_args(cls, size, start), shared)
            before = versions(model, args[:arity(cls)])
            out = fn(*args[:arity(cls)])
            moved = [int(a != b) for a, b in zip(versions(model, args[:arity(cls)]), before,
                                                    strict=True)]
            results.append([t.clone() for t in flat(out)]
                           + [t.clone() for t in state(model, args[:arity(cls)])]
                           + [aliasing(flat(out), args[:arity(cls)]), torch.tensor(moved)])
            start += size
    return results


def versions(model: nn.Module, args: tuple[Any, ...]) -> list[int]:
    """The version counters of the tensor arguments and the model's buffers: each write
    in place moves its tensor's (autograd refuses a backward through a tensor saved before
    one), compiled or not."""
    return [t._version for t in [*args, *model.buffers(), *model.parameters()]
            if isinstance(t, torch.Tensor)]


def aliasing(outputs: list[Any], args: tuple[Any, ...]) -> torch.Tensor:
    """For each output, the argument whose memory it lies in (-1: none), and whether it
    is that argument itself: what a later write into an argument shows in."""
    found = []
    for out in outputs:
        where = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                      and a.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()),
                     -1)
        found += [where, int(where >= 0 and out is args[where])]
    return torch.tensor(found)


def assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w), f"call {step}: {len(g)} values, expected {len(w)}"
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, s=step, i=i: f"call {s}, value {i}: {m}")
