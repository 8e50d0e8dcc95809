"""Stored graphs: what they may call, round-tripped through JSON."""

from __future__ import annotations

import builtins
import os

import pytest
import torch
import torch.fx as fx

from cachebuild.trust.fxjson import GraphFormatError, data_to_module, graph_to_data, resolve_target


def test_a_graph_that_builds_a_size_round_trips():
    # GPT-2's attention builds its output shape with torch.Size; Dynamo keeps the call.
    graph = fx.Graph()
    x = graph.placeholder("x")
    size = graph.call_function(torch.Size, ([2, 6],))
    graph.output(graph.call_method("reshape", (x, size)))
    module = data_to_module(graph_to_data(graph))
    x = torch.randn(3, 4)
    torch.testing.assert_close(module(x), x.reshape(2, 6))


def test_a_graph_that_switches_grad_mode_round_trips_and_other_c_functions_do_not():
    # Dynamo records ``with torch.no_grad():`` in a forward traced with autograd on (the
    # torch.compile door) as calls of torch._C._set_grad_enabled: named under torch._C,
    # which the table admits it from, not under torch.
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch._C._set_grad_enabled, (False,))
    y = graph.call_function(torch.mul, (x, 2))
    graph.call_function(torch._C._set_grad_enabled, (True,))
    graph.output(y)
    data = graph_to_data(graph)
    assert "fn:torch._C:_set_grad_enabled" in str(data)
    module = data_to_module(data)
    x = torch.randn(3, requires_grad=True)
    out = module(x)
    assert not out.requires_grad and torch.is_grad_enabled()
    torch.testing.assert_close(out, x.detach() * 2)
    # Another function of torch._C by the same way in: refused at load.
    forged = [dict(n, target="fn:torch._C:_set_default_dtype") if "_set_grad_enabled" in
              str(n.get("target")) else n for n in data]
    with pytest.raises(GraphFormatError, match="may not call"):
        data_to_module(forged)


#: torch's C function that takes a raw address (torch 2.13 binds it; 2.11 does not).
_FROM_BLOB = getattr(torch._C._VariableFunctions, "_from_blob", None)


@pytest.mark.parametrize("fn", [os.system, builtins.eval, torch.frombuffer, torch.from_file,
                                *filter(None, [_FROM_BLOB]), torch.save])
def test_a_graph_calling_anything_else_is_refused_at_save_and_load(fn):
    graph = fx.Graph()
    graph.output(graph.call_function(fn, (graph.placeholder("x"),)))
    with pytest.raises(GraphFormatError, match="may not call") as refused:
        graph_to_data(graph)
    # Named as code names it, not by its repr (``<built-in method ... at 0x...>``).
    assert f"graph calls {fn.__module__}.{fn.__name__}, " in str(refused.value)
    module = getattr(fn, "__module__", None) or "torch"
    for name in (f"fn:{module}:{fn.__name__}", f"fn:torch:{fn.__name__}"):
        with pytest.raises(GraphFormatError, match="may not call|no longer exists"):
            resolve_target(name)


def node_data(op: str, target: str, *args: object) -> list[dict]:
    """A stored graph of one input ``x`` and one node calling ``target`` on ``args``
    (``"x"`` stands for the input)."""
    encoded = [{"n": "x"} if a == "x" else a for a in args]
    return [
        {"name": "x", "op": "placeholder", "target": "x", "args": {"t": []}, "kwargs": {"d": []}},
        {"name": "y", "op": op, "target": target, "args": {"t": encoded}, "kwargs": {"d": []}},
        {"name": "output", "op": "output", "target": "output", "args": {"t": [{"n": "y"}]},
         "kwargs": {"d": []}},
    ]


#: Operators a stored graph may not call (none is in the table), by the rule of their
#: schema that would refuse them in a library's namespace too.
IMPURE_OPS = {
    "aten::from_file": "names a location",  # maps a file (shared=True writes it)
    "aten::from_file.out": "names a location",
    "aten::save": "returns nothing",  # writes a file
    "aten::_print": "returns nothing",
    "aten::manual_seed": "returns nothing",  # sets global state
    "aten::set_": "Storage",  # some overloads take a storage
    "aten::set_.source_Storage": "Storage",
    "aten::record_stream": "Stream",
    "debugprims::load_tensor": "makes a tensor from a string",  # reads a file
    "profiler::_record_function_enter_new": "returns a",
}


@pytest.mark.parametrize("qualified", sorted(IMPURE_OPS))
def test_operators_that_reach_outside_tensors_are_refused_at_save_and_load(qualified, tmp_path):
    why = IMPURE_OPS[qualified]
    ns, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    op = getattr(getattr(torch.ops, ns), name)
    op = getattr(op, overload) if overload else op
    graph = fx.Graph()
    graph.output(graph.call_function(op, (graph.placeholder("x"),)))
    with pytest.raises(GraphFormatError, match="may not call.*not in the table"):
        graph_to_data(graph)
    canary = tmp_path / "written.pth"
    with pytest.raises(GraphFormatError, match="may not call.*not in the table"):
        data_to_module(node_data("call_function", f"op:{qualified}", "x", str(canary), True, 8))
    assert not canary.exists()
    from cachebuild.trust.purity import operator_impurity

    assert why in (operator_impurity(qualified) or "")


@pytest.mark.parametrize("qualified", [
    "aten::index_copy_.default", "aten::copy_.default", "aten::div.Tensor",
    "aten::einsum.default", "aten::randn.default", "_c10d_functional::all_reduce.default",
    "aten::scatter_.src", "cachebuild_tests::attention", "aten::__lshift__.Scalar",
    "aten::diagonal_scatter.default"])
def test_admitted_operators_and_tensor_writes_are_allowed(qualified):
    import models  # noqa: F401  (registers cachebuild_tests::attention)

    from cachebuild.trust.fxjson import callable_impurity

    assert callable_impurity(resolve_target(f"op:{qualified}")) is None


@pytest.mark.parametrize("name", ["aten::__class__", "aten::__init__", "aten::__lshift__",
                                  "aten::__lshift__.int", "aten::__and__.Tensor",
                                  "aten::__lshift__.__x__", "x__y::add.Tensor"])
def test_a_dunder_operator_name_loads_only_as_one_the_table_admits(name):
    """``aten::__lshift__.Scalar`` is an operator; no other ``__`` name is looked up."""
    with pytest.raises(GraphFormatError, match="is not an operator name"):
        resolve_target(f"op:{name}")


@pytest.mark.parametrize("method", ["untyped_storage", "storage", "numpy", "share_memory_",
                                    "register_hook", "apply_", "set_", "__reduce_ex__"])
def test_tensor_methods_that_reach_outside_tensors_are_refused(method):
    with pytest.raises(GraphFormatError, match="may not call|not a public Tensor method"):
        data_to_module(node_data("call_method", method, "x"))
    graph = fx.Graph()
    graph.output(graph.call_method(method, (graph.placeholder("x"),)))
    with pytest.raises(GraphFormatError, match="may not call|not a public Tensor method"):
        graph_to_data(graph)


def test_getattr_reads_tensor_data_attributes_and_nothing_else():
    # Dynamo records `x @ w.T` as matmul(x, getattr(w, 'T')).
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(torch.matmul,
                                     (x, graph.call_function(builtins.getattr, (w, "T")))))
    module = data_to_module(graph_to_data(graph))
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    torch.testing.assert_close(module(x, w), x @ w.T)
    for attr in ("__class__", "grad_fn", "__dict__", "untyped_storage", "_base"):
        with pytest.raises(GraphFormatError, match="only a tensor's data attributes"):
            data_to_module(node_data("call_function", "fn:builtins:getattr", "x", attr))
    with pytest.raises(GraphFormatError, match="only a tensor's data attributes"):
        data_to_module(node_data("call_function", "fn:builtins:getattr", "x"))


@pytest.mark.parametrize("target, args, value", [
    ("fn:operator:pow", ("x", 1 << 40), 12345), ("fn:builtins:pow", ("x", 1 << 40), 12345),
    ("fn:builtins:pow", ("x", 1 << 62, "x"), (1 << 65535) - 1),
    ("fn:operator:lshift", ("x", 1 << 40), 12345), ("fn:operator:mul", ("x", 1 << 40), [0]),
    ("fn:math:prod", ("x",), [(1 << 62) + 1] * 100_000),
    ("fn:math:lcm", ("x", (1 << 62) + 1), (1 << 65535) - 1),
    ("fn:builtins:round", ("x", -(1 << 40)), 12345),
    ("fn:builtins:int", ("x", 16), "f" * 100_000),
    ("fn:operator:mod", ("x", {"t": [1 << 30, 1]}), "%0*d")], ids=str.__str__ and (lambda v: (
        v if isinstance(v, str) and len(v) < 20 else type(v).__name__)))
def test_python_arithmetic_in_a_loaded_graph_is_bounded(target, args, value):
    from cachebuild.trust.purity import Impure

    module = data_to_module(node_data("call_function", target, *args))
    with pytest.raises(Impure, match="past its bounds"):
        module(value)
    # A graph handed to a compiler keeps the function itself (compilers check by name).
    unbounded = data_to_module(node_data("call_function", target, "x", 3), bounded=False)
    assert [n.target for n in unbounded.graph.nodes][1] is resolve_target(target,
                                                                          bounded=False)
    assert graph_to_data(unbounded.graph) == graph_to_data(
        data_to_module(node_data("call_function", target, "x", 3)).graph)


def test_integer_constants_beyond_64_bits_and_huge_graphs_are_refused():
    with pytest.raises(GraphFormatError, match="64 bits"):
        data_to_module(node_data("call_function", "fn:operator:add", "x", 1 << 70))
    from cachebuild.trust import fxjson

    with pytest.raises(GraphFormatError, match="at most"):
        fxjson.data_to_graph([{}] * (fxjson.MAX_NODES + 1))


def test_tensor_operator_methods_round_trip_and_other_dunders_are_refused():
    # Dynamo on torch 2.11 keeps `mask == 0` in a transformers model as x.__eq__(0).
    graph = fx.Graph()
    x = graph.placeholder("x")
    mask = graph.call_method("__eq__", (x, 0))
    graph.output(graph.call_method("__and__", (mask, graph.call_method("__ne__", (x, 2)))))
    module = data_to_module(graph_to_data(graph))
    x = torch.tensor([0.0, 2.0])
    torch.testing.assert_close(module(x), (x == 0) & (x != 2))
    # On a number or a list these compute or allocate without end, unbounded: refused
    # (their operator functions are admitted, bounded).
    for name in ("__mul__", "__rmul__", "__pow__", "__lshift__", "__add__", "__mod__"):
        with pytest.raises(GraphFormatError, match="may not call|not a public Tensor method"):
            data_to_module(node_data("call_method", name, "x", 1 << 40))
    for name in ("__reduce_ex__", "__setstate__", "_make_subclass"):
        graph = fx.Graph()
        graph.output(graph.call_method(name, (graph.placeholder("x"), 2)))
        with pytest.raises(GraphFormatError, match="not a public Tensor method"):
            data_to_module(graph_to_data(graph))


def test_nodes_of_any_shape_are_refused_in_one_line():
    # Found by the store fuzzer: an op or a name that is a list or an object.
    for node in ({"name": "y", "op": ["call_function"], "target": "x"},
                 {"name": {"a": 1}, "op": "placeholder", "target": "x"}):
        with pytest.raises(GraphFormatError, match="not a stored graph node"):
            data_to_module([node])
