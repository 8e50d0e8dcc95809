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


def test_tensor_operator_methods_round_trip_and_other_dunders_are_refused():
    # Dynamo on torch 2.11 keeps `mask == 0` in a transformers model as x.__eq__(0).
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_method("__mul__", (graph.call_method("__eq__", (x, 0)), x)))
    module = data_to_module(graph_to_data(graph))
    x = torch.tensor([0.0, 2.0])
    torch.testing.assert_close(module(x), (x == 0) * x)
    for name in ("__reduce_ex__", "__setstate__", "_make_subclass"):
        graph = fx.Graph()
        graph.output(graph.call_method(name, (graph.placeholder("x"), 2)))
        with pytest.raises(GraphFormatError, match="not a public Tensor method"):
            data_to_module(graph_to_data(graph))
