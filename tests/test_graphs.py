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
from cachebuild.graph.facts import InputMeta
from cachebuild.serving.cudagraphs import next_capture_size, pad_args, pad_plan, unpad_outputs

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
    # Cut where the traced outputs' dims are the token count, and only there.
    tokens = InputMeta(kind="tensor", dtype="float32", shape=("s0", 3), stride=(3, 1))
    outputs = [InputMeta(kind="tensor", dtype="float32", shape=("s0", 3), stride=(3, 1)),
               InputMeta(kind="tensor", dtype="float32", shape=(3, "s0"), stride=(1, 3)),
               InputMeta(kind="tensor", dtype="float32", shape=(8, 8), stride=(8, 1)),
               InputMeta(kind="symint", shape=("s0",))]
    plan = pad_plan(outputs, [tokens])
    assert plan == [(0,), (1,), (), "size"]
    out = unpad_outputs((torch.ones(8, 3), torch.ones(3, 8), torch.ones(8, 8), 8), plan, 5)
    assert [o.shape for o in out[:3]] == [(5, 3), (3, 5), (8, 8)] and out[3] == 5
    doubled = InputMeta(kind="tensor", dtype="float32", shape=("2*s0", 3), stride=(3, 1))
    assert "as 2*s0" in pad_plan([doubled], [tokens])
    assert "without a value" in pad_plan([None], [tokens])


class _Shapes(torch.nn.Module):
    """Outputs whose token dim is not the first, a weight-shaped one, a size; and with
    ``doubled``, one whose rows are twice the tokens (no call can be padded)."""

    def __init__(self, doubled: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.doubled = doubled

    def forward(self, x: torch.Tensor) -> object:
        y = self.lin(x)
        if self.doubled:
            return torch.cat([y, y]).relu()
        return y, y.t().contiguous(), self.w * 2, x.shape[0]


def _padding(model: torch.nn.Module, store) -> torch.nn.Module:
    """``model`` compiled with sizes 4 and 8 captured, other calls padded to them."""
    cfg = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),),
                                   cudagraph_mode="piecewise", capture="eager",
                                   capture_sizes=(4, 8), pad_to_capture_size=True)
    return cachebuild.compile(model, cfg, {0: 0}, store=store)


@pytest.mark.parametrize("doubled", [False, True])
def test_a_padded_call_returns_what_its_own_size_returns(module_store, doubled, caplog):
    torch.manual_seed(0)
    model = _Shapes(doubled).eval()
    compiled = _padding(model, module_store)
    with torch.no_grad():
        for n in (4, 8, 5, 3):  # 5 and 3 are padded to 8 and 4 where they can be
            x = torch.randn(n, 16)
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert ("not padded to a captured one" in caplog.text) == doubled
    replays = {s: r.replays for s, r in compiled.runtime.capturer.ready.items()}
    assert replays == ({4: 1, 8: 1} if doubled else {4: 2, 8: 2})


class _Centred(torch.nn.Module):
    """Tokens that mix outside attention: each row less the mean over the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h - h.mean(0)


def test_a_model_whose_tokens_mix_is_not_padded(module_store, caplog):
    """Padding rows would enter the mean: the first padded call, compared with one at its
    own size, says so; that call and every later one answer at their own size."""
    torch.manual_seed(0)
    model = _Centred().eval()
    compiled = _padding(model, module_store)
    with torch.no_grad():
        for n in (4, 5, 3, 5, 8):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert caplog.text.count("its tokens mix outside attention") == 1
    replays = {s: r.replays for s, r in compiled.runtime.capturer.ready.items()}
    assert replays == {4: 1, 8: 2}  # 4 and 8 themselves, and the first padded call


class _Gated(torch.nn.Module):
    """Tokens mix only through a gate that starts at zero (a warm-up on dummy weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.gate = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + self.gate * h.mean(0)


def test_padding_is_compared_again_after_the_weights_are_loaded(module_store, caplog):
    """With the gate at zero padded calls are right; once load_state_dict sets it, the next
    padded call is compared again, found to differ, and answers at its own size."""
    torch.manual_seed(0)
    model = _Gated().eval()
    compiled = _padding(model, module_store)
    with torch.no_grad():
        for n in (4, 3, 3):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        assert "its tokens mix outside attention" not in caplog.text
        model.load_state_dict({"gate": torch.tensor(0.7)}, strict=False)
        for n in (3, 3, 5):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert caplog.text.count("its tokens mix outside attention") == 1


def test_load_threads_from_environment(monkeypatch):
    from cachebuild.building.build import LOAD_THREADS, load_threads

    monkeypatch.delenv("CACHEBUILD_LOAD_THREADS", raising=False)
    assert load_threads() == LOAD_THREADS
    monkeypatch.setenv("CACHEBUILD_LOAD_THREADS", "1")
    assert load_threads() == 1
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("CACHEBUILD_LOAD_THREADS", bad)
        with pytest.raises(cachebuild.errors.UsageError, match="CACHEBUILD_LOAD_THREADS"):
            load_threads()


@pytest.mark.parametrize("name,bad", [("CACHEBUILD_BUILD_JOBS", "abc"),
                                      ("CACHEBUILD_BUILD_MEMORY", "lots"),
                                      ("CACHEBUILD_LOAD_THREADS", "zero"),
                                      ("CACHEBUILD_VERIFY", "yes"),
                                      ("CACHEBUILD_BUILD_MEMORY", "1.5"),
                                      ("TORCHINDUCTOR_COMPILE_THREADS", "abc"),
                                      ("TORCHINDUCTOR_COMPILE_THREADS", "0"),
                                      ("TORCHINDUCTOR_COMPILE_THREADS", "\u00b2")])
def test_a_bad_building_variable_is_refused_when_a_compile_starts(monkeypatch, tmp_path,
                                                                 name, bad):
    """Refused at the compile call, even where everything is stored and the variable would
    never be read: not in silence until the day a build happens."""
    monkeypatch.setenv(name, bad)
    with pytest.raises(cachebuild.errors.UsageError, match=name):
        cachebuild.compile(torch.nn.Linear(2, 2), store=None)
    monkeypatch.delenv(name)
    cachebuild.compile(torch.nn.Linear(2, 2), store=None)  # opens nothing yet


@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_modes_match_eager(example_llama, mode, module_store):
    cfg = cachebuild.CompileConfig(
        splitting_ops=("cachebuild_examples::attention",), compile_ranges=((1, 64),),
        backend="eager_fusion", cudagraph_mode=mode, capture="eager",
        capture_sizes=(2, 4, 8, 16), pad_to_capture_size=True)
    compiled = cachebuild.compile(example_llama, cfg, {0: 0, 1: 0}, store=module_store)
    with torch.no_grad():
        for tokens in (16, 4, 3, 9, 40):
            ids, pos = llama.example_inputs(example_llama, tokens)
            out = compiled(ids, pos).clone()
            torch.testing.assert_close(out, example_llama(ids, pos), rtol=1e-4, atol=1e-4)
    runtime = compiled.runtime
    if mode == "none":
        assert runtime.replayers() == [] and runtime.captured_sizes == []
        return
    assert runtime.captured_sizes == [2, 4, 8, 16]
    capturer = runtime.capturer
    # 16 and 4 replay; 3 and 9 are padded to 4 and 16; 40 is beyond every capture size
    assert {s: r.replays for s, r in capturer.ready.items()} == {2: 0, 4: 2, 8: 0, 16: 2}
    # piecewise: each size replays the 3 compiled pieces of 2 layers; full: the forward
    pieces = {s: len(p) for s, p in capturer.pieces_at.items()}
    assert pieces == ({2: 3, 4: 3, 8: 3, 16: 3} if mode == "piecewise" else {s: 0 for s in pieces})
    assert all(r.misses == 0 for r in runtime.replayers())


def test_capture_refused_without_graph_mode(example_llama, module_store):
    cfg = cachebuild.CompileConfig(splitting_ops=("cachebuild_examples::attention",),
                                   compile_ranges=((1, 64),), backend="eager_fusion")
    compiled = cachebuild.compile(example_llama, cfg, {0: 0, 1: 0}, store=module_store)
    compiled(*llama.example_inputs(example_llama, 4))
    with pytest.raises(cachebuild.errors.UsageError):
        compiled.runtime.capture([4])
