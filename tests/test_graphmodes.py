"""Full graphs for decode calls, piecewise graphs for the rest (``full_and_piecewise``,
``full_decode_only``): which kind serves which call, what a failed full capture leaves,
and that no policy changes an answer or a write.

Which graph serves a call is ``graphmodes.route``, a pure decision tested case by case;
then the in-place model with every pattern (caches passed in and buffers, written by pieces
and by a splitting op) is served under each capture policy with decode and prefill calls
interleaved, outputs and state equal to eager's after every call. CPU has no graph API:
``ReplayCapture`` keeps the static-buffer discipline, so the routing and capture logic run
here; their effect on a GPU is in test_generate_gpu.py.
"""

from __future__ import annotations

import logging
import threading

import inplace_models as im
import pytest
import torch

import cachebuild
from cachebuild.calls import decoding, is_decode
from cachebuild.errors import ConfigError
from cachebuild.serving.cudagraphs import ReplayCapture
from cachebuild.serving.graphmodes import (
    CAPTURE,
    EXACT,
    FULL,
    PIECEWISE,
    REPLAY,
    Route,
    route,
    sizes_for,
)
from cachebuild.serving.stitch import PieceRunner

CAPTURE_SIZES = (1, 4, 8)
DECODE_SIZES = (1, 4)


# -- the decision --------------------------------------------------------------------------

def test_each_mode_picks_its_kind_of_graph_per_call():
    both = sizes_for("full_and_piecewise", CAPTURE_SIZES, DECODE_SIZES)
    assert both.piecewise == {1, 4, 8} and both.full == {1, 4}
    everything = {(k, s) for k in (FULL, PIECEWISE) for s in CAPTURE_SIZES}

    def go(mode, size, decode, ready=everything, failed=(), lazy=False):
        sizes = sizes_for(mode, CAPTURE_SIZES, DECODE_SIZES)
        return route(mode, size, decode, sizes, ready, set(failed), lazy)

    # full_and_piecewise: decode calls at a decode size replay full graphs, the rest pieces
    assert go("full_and_piecewise", 4, True) == Route(REPLAY, FULL)
    assert go("full_and_piecewise", 4, False) == Route(REPLAY, PIECEWISE)
    assert go("full_and_piecewise", 8, True) == Route(REPLAY, PIECEWISE)  # not a decode size
    assert go("full_and_piecewise", 3, True) == Route(EXACT)  # not a capture size
    assert go("full_and_piecewise", None, True) == Route(EXACT)
    # full_decode_only: only marked decode calls have graphs
    assert go("full_decode_only", 4, True) == Route(REPLAY, FULL)
    assert go("full_decode_only", 4, False) == Route(EXACT)
    assert go("full_decode_only", 8, True) == Route(EXACT)
    # the older modes ignore the mark
    assert go("full", 8, False) == go("full", 8, True) == Route(REPLAY, FULL)
    assert go("piecewise", 4, True) == Route(REPLAY, PIECEWISE)
    # a full graph that failed at a size: its decode calls go piecewise, or without graphs
    assert go("full_and_piecewise", 4, True, failed=[(FULL, 4)]) == Route(REPLAY, PIECEWISE)
    assert go("full_decode_only", 4, True, failed=[(FULL, 4)]) == Route(EXACT)
    assert go("full_and_piecewise", 4, False, failed=[(PIECEWISE, 4)]) == Route(EXACT)
    # lazy: a missing graph is captured by the call; a decode call may also find only the
    # size's pieces (background capture not there yet) and replays those meanwhile
    assert go("full_and_piecewise", 4, True, ready=set(), lazy=True) == Route(CAPTURE, FULL)
    assert go("full_and_piecewise", 4, False, ready=set(), lazy=True) == Route(CAPTURE, PIECEWISE)
    assert go("full_and_piecewise", 4, True, ready={(PIECEWISE, 4)}) == Route(REPLAY, PIECEWISE)
    assert go("full_and_piecewise", 4, True, ready=set()) == Route(EXACT)


def test_config_names_the_modes_and_checks_decode_sizes():
    cfg = cachebuild.CompileConfig(cudagraph_mode="full_and_piecewise", capture_sizes=(1, 2, 300))
    assert cfg.full_decode_sizes() == (1, 2)  # capture sizes up to 256 by default
    cfg = cachebuild.CompileConfig(cudagraph_mode="full_decode_only", capture_sizes=(1, 2, 8),
                                   decode_sizes=[8, 1])
    assert cfg.decode_sizes == (1, 8) and cfg.full_decode_sizes() == (1, 8)
    assert cachebuild.CompileConfig(cudagraph_mode="piecewise").full_decode_sizes() == ()
    assert "decode_sizes" not in cfg.factors()  # a run-time choice: one warmed entry serves all
    with pytest.raises(ConfigError, match="full_and_piecewise"):
        cachebuild.CompileConfig(cudagraph_mode="decode")
    with pytest.raises(ConfigError, match="not capture sizes: add them"):
        cachebuild.CompileConfig(cudagraph_mode="full_and_piecewise", capture_sizes=(1, 2),
                                 decode_sizes=(4,))
    with pytest.raises(ConfigError, match="decode_sizes"):
        cachebuild.CompileConfig(decode_sizes=(1.5,))


def test_the_decode_mark_nests_and_stays_in_its_thread():
    seen = []
    assert not is_decode()
    with decoding():
        assert is_decode()
        with decoding(False):
            assert not is_decode()
        assert is_decode()
        t = threading.Thread(target=lambda: seen.append(is_decode()))
        t.start()
        t.join()
    assert not is_decode() and seen == [False]


# -- served, exactly -----------------------------------------------------------------------

#: (tokens, marked as decode): decode and prefill calls at the same sizes, interleaved
CALLS = ((5, False), (4, True), (1, True), (4, False), (4, True), (1, True), (8, False),
         (1, False), (4, True), (3, True), (4, False), (8, False))


def run_calls(fn, model, calls=CALLS):
    """``fn`` on ``calls`` in turn, the cache and accumulator carried from call to call;
    each call's outputs and the state after it, as copies."""
    cls = im.AllPatterns
    shared = im.call_args(cls, 8)
    results, start = [], 0
    with torch.no_grad():
        for tokens, decode in calls:
            args = im.with_state(im.call_args(cls, tokens, start), shared)
            with decoding(decode):
                out = fn(*args)
            results.append([t.clone() for t in im.flat(out)]
                           + [t.clone() for t in im.state(model, args)])
            start = (start + tokens) % (im.SLOTS - 8)  # slots again from the start: a ring
    return results


def compiled_all_patterns(store, mode, policy):
    config = im.config(cudagraph_mode=mode, capture=policy, capture_sizes=CAPTURE_SIZES,
                       decode_sizes=DECODE_SIZES)
    model = im.make(im.AllPatterns)
    return cachebuild.compile(model, config, im.dynamic_dims(im.AllPatterns), store=store), model


@pytest.fixture(scope="module")
def eager_results():
    eager = im.make(im.AllPatterns)
    return run_calls(eager, eager)


@pytest.mark.parametrize("policy", ["lazy", "eager", "background"])
def test_full_and_piecewise_is_exact_under_every_policy(module_store, eager_results, policy):
    compiled, model = compiled_all_patterns(module_store, "full_and_piecewise", policy)
    im.assert_same(run_calls(compiled, model), eager_results)
    capturer = compiled.runtime.capturer
    state = compiled.capture_state()
    # the model writes state: background passes on dummy inputs are not allowed beside it
    assert state.policy == ("eager" if policy == "eager" else "lazy")
    assert state.kinds == {PIECEWISE: [1, 4, 8], FULL: [1, 4]}, state.kinds
    assert state.failed == {} and state.full_failed == {}
    full = {s: r.replays for s, r in capturer.graphs[FULL].items()}
    pieces = {s: r.replays for s, r in capturer.graphs[PIECEWISE].items()}
    if policy == "eager":  # every graph was there before the first call
        assert full == {1: 2, 4: 3} and pieces == {1: 1, 4: 2, 8: 2}
        assert state.served == {FULL: 5, PIECEWISE: 5, "none": 2}
    else:  # each kind captured by its first call at a size, replayed by the next ones
        assert full == {1: 1, 4: 2} and pieces == {1: 0, 4: 1, 8: 1}
        assert state.served == {FULL: 3, PIECEWISE: 2, "none": 7}


def test_full_decode_only_serves_only_decode_calls_from_graphs(module_store, eager_results):
    compiled, model = compiled_all_patterns(module_store, "full_decode_only", "eager")
    im.assert_same(run_calls(compiled, model), eager_results)
    state = compiled.capture_state()
    assert state.kinds == {FULL: [1, 4]} and state.captured == [1, 4]
    assert state.served == {FULL: 5, PIECEWISE: 0, "none": 7}


def test_a_full_graph_that_cannot_be_captured_leaves_its_size_piecewise(
        module_store, eager_results, monkeypatch, caplog):
    """Recording the whole forward fails at size 4 (as a splitting op that refuses capture
    there would): decode calls of 4 are served by its piecewise graphs, said once; size 1
    keeps its full graph, and every answer and write is eager's."""
    real = ReplayCapture.capture

    def refuse_whole_at_4(self, fn, inputs):
        whole = not isinstance(fn, PieceRunner)
        if whole and any(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 4
                         for t in inputs):
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(self, fn, inputs)

    monkeypatch.setattr(ReplayCapture, "capture", refuse_whole_at_4)
    compiled, model = compiled_all_patterns(module_store, "full_and_piecewise", "lazy")
    with caplog.at_level(logging.WARNING, logger="cachebuild"):
        im.assert_same(run_calls(compiled, model), eager_results)
    told = [r.getMessage() for r in caplog.records if "no full graph" in r.getMessage()]
    assert len(told) == 1 and "size 4" in told[0] and "piecewise" in told[0], told
    state = compiled.capture_state()
    assert list(state.full_failed) == [4] and state.failed == {}
    assert state.kinds == {PIECEWISE: [1, 4, 8], FULL: [1]}
    capturer = compiled.runtime.capturer
    # 4's decode calls after the failed one: its pieces (captured by the prefill of 4)
    assert capturer.graphs[PIECEWISE][4].replays == 3 and capturer.graphs[FULL][1].replays == 1


def test_background_captures_both_kinds_beside_the_server(example_llama, module_store):
    """A model that writes no state: a thread captures the piecewise sizes, then the full
    decode ones; decode calls then replay full graphs, prefills piecewise ones."""
    import llama

    cfg = cachebuild.CompileConfig(
        splitting_ops=("cachebuild_examples::attention",), compile_ranges=((1, 64),),
        backend="eager_fusion", cudagraph_mode="full_and_piecewise", capture="background",
        capture_sizes=(2, 4, 8), decode_sizes=(2, 4))
    compiled = cachebuild.compile(example_llama, cfg, {0: 0, 1: 0}, store=module_store)

    def check(tokens, decode):
        ids, pos = llama.example_inputs(example_llama, tokens)
        with torch.no_grad(), decoding(decode):
            out = compiled(ids, pos).clone()
        torch.testing.assert_close(out, example_llama(ids, pos), rtol=1e-4, atol=1e-4)

    check(5, False)
    assert compiled.wait_captured(timeout=600)
    state = compiled.capture_state()
    assert state.policy == "background" and state.pending == []
    assert state.kinds == {PIECEWISE: [2, 4, 8], FULL: [2, 4]}
    before = compiled.capture_state().served
    for tokens, decode in ((4, True), (4, False), (8, True), (2, True), (3, True)):
        check(tokens, decode)
    after = compiled.capture_state().served
    assert {k: after[k] - before[k] for k in after} == {FULL: 2, PIECEWISE: 2, "none": 1}
