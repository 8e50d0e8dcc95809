"""The edge pass: an ``addmm`` that only a piece's output made one becomes ``add(x, mm)``
again, as compiling the whole model would have it, and nothing else changes.

``edges`` imports Inductor, which imports Triton: it is imported inside the tests, so that
collecting this file does not import Triton before ``test_kernels.py`` has asked for its
interpreter (Triton reads that when it decorates the kernels)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten


def residual_piece(x, a, w_o, w_up, w_down, norm_w):
    """A decoder layer's tail as Inductor's patterns leave a piece of it: both residual sums
    are ``addmm``, the second handed on as the piece's output."""
    x1 = torch.addmm(x, a, w_o)  # users: the norm (a dtype cast), the next addmm
    h = x1.to(torch.float64)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * norm_w
    x2 = torch.addmm(x1, torch.nn.functional.silu(h @ w_up), w_down)
    return x2, (x2 * 2).sum(-1)  # x2: the output and a pointwise consumer


def trace(fn, *args):
    return make_fx(fn, tracing_mode="symbolic")(*args)


def count(gm, target):
    return len(gm.graph.find_nodes(op="call_function", target=target))


def args(t=6, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in
            ((t, d), (t, d), (d, d), (d, d), (d, d), (d,))]


def test_residual_sums_at_a_piece_edge_are_added_again_and_agree_with_eager():
    from cachebuild.backends.edges import unfuse_edge_addmm

    inputs = args()
    gm = trace(residual_piece, *inputs)
    assert count(gm, aten.addmm.default) == 2
    assert unfuse_edge_addmm(gm.graph, gpu_only=False) == 2
    gm.graph.lint()
    gm.recompile()
    assert count(gm, aten.addmm.default) == 0 and count(gm, aten.mm.default) == 3
    for got, want in zip(gm(*inputs), residual_piece(*inputs), strict=True):
        torch.testing.assert_close(got, want)
    # a second run finds nothing more to do
    assert unfuse_edge_addmm(gm.graph, gpu_only=False) == 0


def test_a_bias_an_output_only_sum_and_a_matmul_consumer_keep_their_addmm():
    from cachebuild.backends.edges import unfuse_edge_addmm

    def kept(x, a, w, bias):
        y = torch.addmm(bias, a, w)  # a bias row: cuBLAS's epilogue, no copy
        only_out = torch.addmm(x, a, w)  # nothing to fuse the add into
        into_mm = torch.addmm(x, a, w)  # its only user is a matmul
        return y, only_out, into_mm @ w

    x, a, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8)
    gm = trace(kept, x, a, w, torch.randn(8))
    shape_env = next(iter(gm.graph.nodes)).meta["val"].fake_mode.shape_env
    guards = len(shape_env.guards)
    assert unfuse_edge_addmm(gm.graph, gpu_only=False) == 0
    assert count(gm, aten.addmm.default) == 3
    # deciding added no guard: the piece's sizes stay as dynamic as they were traced
    assert len(shape_env.guards) == guards


def test_cpu_graphs_are_left_to_inductor_by_default():
    from cachebuild.backends.edges import unfuse_edge_addmm

    gm = trace(residual_piece, *args())
    assert unfuse_edge_addmm(gm.graph) == 0  # CPU values: Inductor prefers addmm there
    assert count(gm, aten.addmm.default) == 2


class Recorder:
    def __init__(self):
        self.graphs = 0

    def __call__(self, graph):
        self.graphs += 1

    def uuid(self):
        return "recorder-1"


def test_the_edge_pass_runs_the_fusion_passes_after_it_and_keys_by_both():
    from cachebuild.backends.edges import EdgePass

    then = Recorder()
    edge = EdgePass(then)
    gm = trace(residual_piece, *args())
    edge(gm.graph)
    assert then.graphs == 1
    assert edge.uuid().endswith("+recorder-1") and EdgePass().uuid() != edge.uuid()
    assert EdgePass().uuid() == EdgePass().uuid()
