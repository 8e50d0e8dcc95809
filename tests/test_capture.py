"""When sizes are captured (the ``capture`` policy) and that no policy changes an answer.

CPU has no graph API: ``ReplayCapture`` keeps the static-buffer discipline and runs the
function at replay, so the logic around capture (which size is served from graphs, when a
size is captured, what a capture pass may touch, what a failed capture leaves behind) is
exercised here; its effect on a GPU in test_gpu.py.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import inplace_models as im
import pytest
import torch

import cachebuild
from cachebuild.errors import ConfigError
from cachebuild.serving.capture import capture_order, resolve_policy
from cachebuild.serving.cudagraphs import Arena, ReplayCapture, Replayer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import llama  # noqa: E402

SIZES = (2, 4, 8, 16)


def compiled_llama(model, store, mode="piecewise", policy="auto", **extra):
    cfg = cachebuild.CompileConfig(
        splitting_ops=("cachebuild_examples::attention",), compile_ranges=((1, 64),),
        backend="eager_fusion", cudagraph_mode=mode, capture=policy, capture_sizes=SIZES,
        **extra)
    return cachebuild.compile(model, cfg, {0: 0, 1: 0}, store=store)


def check(compiled, model, tokens):
    ids, pos = llama.example_inputs(model, tokens)
    with torch.no_grad():
        out = compiled(ids, pos).clone()
        torch.testing.assert_close(out, model(ids, pos), rtol=1e-4, atol=1e-4)


def test_policy_resolution_and_order():
    assert resolve_policy("auto", torch.device("cuda", 0)) == "background"
    assert resolve_policy("auto", torch.device("cpu")) == "lazy"
    assert resolve_policy("eager", torch.device("cpu")) == "eager"
    # the largest first (the pool grows once), then from the smallest up
    assert capture_order([8, 1, 512, 2, 4]) == [512, 1, 2, 4, 8]
    with pytest.raises(ConfigError, match="capture policy"):
        cachebuild.CompileConfig(capture="soon")


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_lazy_captures_a_size_at_its_first_call_and_replays_it_after(example_llama, module_store, mode):
    compiled = compiled_llama(example_llama, module_store, mode, "lazy")
    check(compiled, example_llama, 4)  # loads, then captures 4 beside this exact call
    capturer = compiled.runtime.capturer
    assert capturer.captured_sizes == [4] and capturer.ready[4].replays == 0
    check(compiled, example_llama, 4)
    check(compiled, example_llama, 3)  # not a capture size: runs the pieces directly
    assert capturer.captured_sizes == [4] and capturer.ready[4].replays == 1
    for tokens in SIZES:
        check(compiled, example_llama, tokens)
    assert capturer.captured_sizes == list(SIZES) and capturer.failed == {}
    state = compiled.capture_state()
    assert state.policy == "lazy" and state.pending == [] and set(state.per_size) == set(SIZES)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_background_captures_every_size_after_the_first_output(example_llama, module_store, mode):
    compiled = compiled_llama(example_llama, module_store, mode, "background")
    check(compiled, example_llama, 5)  # the first output: no graph needed, none waited for
    assert compiled.runtime.capturer.policy == "background"
    # served while the thread captures: every answer exact, from graphs or not
    for tokens in (2, 16, 7, 4, 8, 2):
        check(compiled, example_llama, tokens)
    assert compiled.wait_captured(timeout=600)
    state = compiled.capture_state()
    assert state.captured == list(SIZES) and state.pending == [] and state.failed == {}
    ready = compiled.runtime.capturer.ready
    before = {s: r.replays for s, r in ready.items()}
    for tokens in SIZES:
        check(compiled, example_llama, tokens)
    assert {s: r.replays - before[s] for s, r in ready.items()} == dict.fromkeys(SIZES, 1)
    names = [t.name for t in threading.enumerate()]
    assert "cachebuild-capture" not in names  # the thread ends when every size is done


def sequence_matches_eager(cls, policy, sizes, store):
    """``cls`` (an in-place pattern) compiled piecewise with ``policy``, called on ``sizes``
    in turn: outputs and state after each call equal eager's. The compiled module."""
    config = im.config(cudagraph_mode="piecewise", capture=policy, capture_sizes=(1, 4))
    model = im.make(cls)
    compiled = cachebuild.compile(model, config, im.dynamic_dims(cls), store=store)
    eager = im.make(cls)
    im.assert_same(im.run_sequence(compiled, model, cls, sizes),
                   im.run_sequence(eager, eager, cls, sizes))
    return compiled


def test_background_on_a_model_that_writes_state_captures_lazily(store):
    """A pass on dummy inputs beside the caller would write its cache: not in the
    background, then; each size rides along its first real call instead."""
    compiled = sequence_matches_eager(im.MutatedBuffer, "background", (5, 4, 1, 4, 1),
                                      store)
    capturer = compiled.runtime.capturer
    assert capturer.policy == "lazy" and not capturer.in_background
    assert capturer.captured_sizes == [1, 4]
    assert all(r.replays == 1 for r in capturer.ready.values())


class Noisy(torch.nn.Module):
    """A forward that draws random numbers (and then ignores them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + 0 * torch.rand_like(x)


def test_background_on_a_model_that_draws_random_numbers_captures_lazily(open_local, tmp_path):
    torch.manual_seed(0)
    model = Noisy().eval()
    cfg = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),),
                                   cudagraph_mode="full", capture="background",
                                   capture_sizes=(2, 4))
    compiled = cachebuild.compile(model, cfg, {0: 0}, store=open_local(tmp_path / "store"))
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.runtime.capturer.policy == "lazy"
    assert not compiled.runtime.capturer.in_background


def test_eager_policy_captures_every_size_before_the_first_call_returns(example_llama, module_store):
    compiled = compiled_llama(example_llama, module_store, "piecewise", "eager")
    check(compiled, example_llama, 5)
    assert compiled.runtime.captured_sizes == list(SIZES)
    assert compiled.capture_report.sizes == sorted(SIZES, reverse=True)


def test_a_failed_capture_leaves_the_call_exact_and_its_size_without_graphs(store, monkeypatch):
    """Recording fails at size 4 (as a device refusing a capture would): the call that
    rode along still writes its state exactly once and answers as eager does; 4 then runs
    without graphs, said once, and other sizes are captured as usual."""
    real = ReplayCapture.capture

    def refuse_at_4(self, fn, inputs):
        if any(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 4 for t in inputs):
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(self, fn, inputs)

    monkeypatch.setattr(ReplayCapture, "capture", refuse_at_4)
    compiled = sequence_matches_eager(im.AllPatterns, "lazy", (5, 4, 1, 4, 1, 3),
                                      store)
    capturer = compiled.runtime.capturer
    assert capturer.captured_sizes == [1] and list(capturer.failed) == [4]
    assert "not permitted" in capturer.failed[4]


def test_replayer_copies_pins_and_falls_back():
    calls = []

    def fn(x, w):
        calls.append(x.data_ptr())
        return x @ w

    w = torch.randn(4, 4)
    static = torch.empty(3, 4)
    cache = torch.zeros(3)
    api = ReplayCapture()
    graph, _ = api.capture(fn, [static, w])
    r = Replayer(api, graph, None, lambda *a: fn(*a), copies=[(0, static)])
    x = torch.randn(3, 4)
    torch.testing.assert_close(r(x, w), x @ w)
    assert calls[-1] == static.data_ptr() and r.replays == 1
    pinned = Replayer(api, api.capture(lambda c: c + 1, [cache])[0], None,
                      lambda c: c - 1, pinned=[(0, cache.data_ptr())])
    torch.testing.assert_close(pinned(cache), cache + 1)
    other = torch.zeros(3)  # another tensor where the graph reads a fixed address
    torch.testing.assert_close(pinned(other), other - 1)
    assert pinned.misses == 1 and pinned.replays == 1
    # the closure a piecewise size calls per piece does the same, counted on the replayer
    fast = pinned.fast()
    torch.testing.assert_close(fast(cache), cache + 1)
    torch.testing.assert_close(fast(other), other - 1)
    assert pinned.misses == 2 and pinned.replays == 2
    bare = Replayer(api, api.capture(lambda c: c * 2, [cache])[0], None, lambda c: c).fast()
    torch.testing.assert_close(bare(cache), cache * 2)


def test_arena_hands_out_one_buffer_per_slot_and_grows_it():
    arena = Arena()
    a = arena.buffer(("in", 0), torch.empty(8, 4))
    b = arena.buffer(("in", 0), torch.empty(2, 4))
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 4)
    c = arena.buffer(("in", 1), torch.empty(2, 4))
    assert c.data_ptr() != a.data_ptr()
    d = arena.buffer(("in", 0), torch.empty(16, 4))  # larger: a new buffer, twice the old
    assert d.data_ptr() != a.data_ptr() and arena.nbytes == (32 + 8 + 64) * 4
    e = arena.buffer(("in", 0), torch.empty(4, 2).t())  # strides kept
    assert e.stride() == (1, 2) and e.data_ptr() == d.data_ptr()


CUSTOM_OP_MODEL = '''
import torch
import torch.nn.functional as F


@torch.library.custom_op("cbtest_capture::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return F.softmax(q @ k.t(), dim=-1) @ k


@attend.register_fake
def _(q, k):
    return torch.empty_like(q)


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        return self.b(attend(h, h)) + x
'''

CUSTOM_OP_CHILD = """
import json, os, sys
import torch
import cachebuild
from cachebuild.store import LocalStore
import cbtest_model

torch.manual_seed(0)
model = cbtest_model.M().eval()
cfg = cachebuild.CompileConfig(splitting_ops=("cbtest_capture::attend",),
                               compile_ranges=((1, 32),), backend="eager_fusion",
                               cudagraph_mode="piecewise", capture="lazy", capture_sizes=(4,))
compiled = cachebuild.compile(model, cfg, {0: 0}, store=LocalStore(os.environ["STORE"]))
with torch.no_grad():
    for n in (4, 4, 3):
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x), model(x))
print(json.dumps({"stats": cachebuild.stats(),
                  "dynamo": "torch._dynamo" in sys.modules,
                  "replays": [r.replays for r in compiled.runtime.replayers()]}))
"""


def test_a_warm_process_calls_a_custom_op_splitting_op_without_importing_dynamo(tmp_path):
    """``torch.library.custom_op`` wraps its kernels in a decorator that imports Dynamo on
    the first call; a warm process that only loads and replays must not pay that."""
    import models

    (tmp_path / "cbtest_model.py").write_text(CUSTOM_OP_MODEL)
    env = {"STORE": str(tmp_path / "store"), "PYTHONPATH": str(tmp_path)}
    cold = models.run_python(CUSTOM_OP_CHILD, env=env)
    assert cold["stats"]["traced"] == 1
    warm = models.run_python(CUSTOM_OP_CHILD, env=env)
    assert warm["stats"]["traced"] == 0 and warm["stats"]["built"] == 0
    assert warm["replays"][0] == 1  # size 4: captured by its first call, replayed by the next
    assert warm["dynamo"] is False


def test_a_background_pass_that_fails_hands_the_rest_to_lazy_capture(example_llama, module_store, monkeypatch):
    """Dummy inputs this example_llama cannot run on (as an index past a table would be): the
    first background pass fails, nothing is left pending, and sizes are then captured at
    their first real call."""
    from cachebuild.serving.runtime import ModelRuntime

    def unusable(self, size, like=None):
        raise IndexError("index 0 is out of bounds for dimension 0 with size 0")

    monkeypatch.setattr(ModelRuntime, "dummy_args", unusable)
    compiled = compiled_llama(example_llama, module_store, "piecewise", "background")
    check(compiled, example_llama, 5)
    assert compiled.wait_captured(timeout=600)
    capturer = compiled.runtime.capturer
    assert capturer.policy == "lazy" and capturer.pending == [] and capturer.ready == {}
    check(compiled, example_llama, 4)
    check(compiled, example_llama, 4)
    assert capturer.captured_sizes == [4] and capturer.ready[4].replays == 1
