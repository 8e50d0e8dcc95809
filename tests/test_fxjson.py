"""Stored graphs: what they may call, round-tripped through JSON."""

from __future__ import annotations

import builtins
import os

import pytest
import torch
import torch.fx as fx

from cachebuild.fxjson import GraphFormatError, data_to_module, graph_to_data, resolve_target


def test_a_graph_that_builds_a_size_round_trips():
    # GPT-2's attention builds its output shape with torch.Size; Dynamo keeps the call.
    graph = fx.Graph()
    x = graph.placeholder("x")
    size = graph.call_function(torch.Size, ([2, 6],))
    graph.output(graph.call_method("reshape", (x, size)))
    module = data_to_module(graph_to_data(graph))
    x = torch.randn(3, 4)
    torch.testing.assert_close(module(x), x.reshape(2, 6))


@pytest.mark.parametrize("fn", [os.system, builtins.eval, builtins.getattr])
def test_a_graph_calling_anything_else_is_refused_at_save_and_load(fn):
    graph = fx.Graph()
    graph.output(graph.call_function(fn, (graph.placeholder("x"),)))
    with pytest.raises(GraphFormatError, match="may not call"):
        graph_to_data(graph)
    with pytest.raises(GraphFormatError, match="may not call"):
        resolve_target(f"fn:{fn.__module__ or 'builtins'}:{fn.__name__}")
