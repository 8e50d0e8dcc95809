"""Graph capture logic on CPU: size selection, padding, static buffers, mode switching.

CPU has no graph API; ``ReplayCapture`` keeps the same static-buffer discipline, so the
logic around capture is exercised here and its effect on a GPU in test_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import cachebuild
from cachebuild.config import default_capture_sizes
from cachebuild.cudagraphs import (
    GraphedCallable,
    ReplayCapture,
    next_capture_size,
    pad_args,
    unpad_outputs,
)
from cachebuild.store import LocalStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import llama  # noqa: E402


def test_default_capture_sizes():
    sizes = default_capture_sizes()
    assert len(sizes) == 51
    assert sizes[:4] == (1, 2, 4, 8) and sizes[-1] == 512 and 248 in sizes and 256 in sizes


def test_next_capture_size():
    sizes = [1, 2, 4, 8, 16]
    assert next_capture_size(3, sizes) == 4
    assert next_capture_size(8, sizes) == 8
    assert next_capture_size(17, sizes) is None


def test_pad_and_unpad():
    ids = torch.arange(5)
    pos = torch.arange(5) + 10
    padded = pad_args((ids, pos), {0: 0, 1: 0}, 8)
    assert padded[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert padded[1].shape == (8,)
    out = unpad_outputs((torch.ones(8, 3), torch.ones(3)), 8, 5)
    assert out[0].shape == (5, 3) and out[1].shape == (3,)


def test_graphed_callable_copies_inputs_into_static_buffers():
    weight = torch.randn(4, 4)
    calls = []

    def fn(x, w):
        calls.append(x.data_ptr())
        return x @ w

    g = GraphedCallable(fn, lambda args: args[0].shape[0], [False, True], ReplayCapture())
    g.capturing = True
    x1 = torch.randn(3, 4)
    torch.testing.assert_close(g(x1, weight), x1 @ weight)
    g.capturing = False
    x2 = torch.randn(3, 4)
    torch.testing.assert_close(g(x2, weight), x2 @ weight)  # replay sees the new values
    assert calls[0] == calls[1] != x2.data_ptr()  # through the one static buffer
    assert g.replays == 1
    x3 = torch.randn(5, 4)  # a size never captured runs without a graph
    torch.testing.assert_close(g(x3, weight), x3 @ weight)
    assert g.replays == 1 and calls[-1] == x3.data_ptr()


class _PinningReplay(ReplayCapture):
    """ReplayCapture plus the address registry that CudaGraphCapture keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.static_ptrs: set[int] = set()


def test_inputs_with_fixed_addresses_are_read_in_place():
    # piecewise mode: the call's arguments get a buffer per size (outer), registered in the
    # pieces' capture; a piece (inner) then reads them in place instead of copying them
    inner_api = _PinningReplay()
    seen = []

    def piece(x):
        seen.append(x.data_ptr())
        return x * 2

    inner = GraphedCallable(piece, lambda args: args[0].shape[0], [False], inner_api)
    outer = GraphedCallable(inner, lambda args: args[0].shape[0], [False],
                            ReplayCapture(pin_into=inner_api.static_ptrs))
    inner.capturing = outer.capturing = True
    outer(torch.ones(3))
    inner.capturing = outer.capturing = False
    captured = inner.graphs[3]
    assert captured.copies == [] and [i for i, _ in captured.pinned] == [0]
    x = torch.arange(3.0)
    torch.testing.assert_close(outer(x), x * 2)
    assert inner.replays == 1 and seen[-1] == captured.pinned[0][1]
    # called directly with a tensor elsewhere, the piece runs without its graph, correctly
    torch.testing.assert_close(inner(x), x * 2)
    assert inner.replays == 1 and seen[-1] == x.data_ptr()


def test_load_threads_from_environment(monkeypatch):
    from cachebuild.build import LOAD_THREADS, load_threads

    monkeypatch.delenv("CACHEBUILD_LOAD_THREADS", raising=False)
    assert load_threads() == LOAD_THREADS
    monkeypatch.setenv("CACHEBUILD_LOAD_THREADS", "1")
    assert load_threads() == 1
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("CACHEBUILD_LOAD_THREADS", bad)
        with pytest.raises(cachebuild.errors.UsageError, match="CACHEBUILD_LOAD_THREADS"):
            load_threads()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return llama.make_model()


@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_modes_match_eager(model, mode, tmp_path):
    cfg = cachebuild.CompileConfig(
        splitting_ops=("cachebuild_examples::attention",), compile_ranges=((1, 64),),
        backend="eager_fusion", cudagraph_mode=mode, capture_sizes=(2, 4, 8, 16),
        pad_to_capture_size=True)
    compiled = cachebuild.compile(model, cfg, {0: 0, 1: 0}, store=LocalStore(tmp_path / "s"))
    with torch.no_grad():
        for tokens in (16, 4, 3, 9, 40):
            ids, pos = llama.example_inputs(model, tokens)
            out = compiled(ids, pos).clone()
            torch.testing.assert_close(out, model(ids, pos), rtol=1e-4, atol=1e-4)
    runtime = compiled.runtime
    if mode == "none":
        assert runtime.graphed == [] and runtime.captured_sizes == []
        return
    assert runtime.captured_sizes == [2, 4, 8, 16]
    # piecewise: one graphed callable per compiled piece (3 for 2 layers); full: one.
    assert len(runtime.graphed) == (3 if mode == "piecewise" else 1)
    # both modes give the call's arguments one buffer per captured size
    assert sorted(runtime.whole.graphs) == [2, 4, 8, 16]
    for g in runtime.graphed:
        assert sorted(g.graphs) == [2, 4, 8, 16]
        # 16 and 4 replay; 3 and 9 are padded to 4 and 16; 40 is beyond every capture size
        assert g.replays == 4


def test_capture_refused_without_graph_mode(model, tmp_path):
    cfg = cachebuild.CompileConfig(splitting_ops=("cachebuild_examples::attention",),
                                   compile_ranges=((1, 64),), backend="eager_fusion")
    compiled = cachebuild.compile(model, cfg, {0: 0, 1: 0}, store=LocalStore(tmp_path / "s"))
    compiled(*llama.example_inputs(model, 4))
    with pytest.raises(cachebuild.errors.UsageError):
        compiled.runtime.capture([4])
