"""Stored graphs are a closed language (issue 32, items 1, 6 and 7): the audit's attacks.

A stored graph that names ``aten::_reshape_alias`` (a view with no bounds check: it read
3,413 words past a 2-element input, overwrote a tensor it was never given, and with a
size of 2**40 killed the server), ``Tensor.new(cdata=...)`` with ``data_ptr`` (an integer
taken as a tensor's address), ``_sparse_coo_tensor_unsafe`` + ``to_dense`` with an index
of 2**33, or ``math.prod`` of a huge list, is refused before it runs, in one line; a
bundle carrying such a graph imports, but ``verify`` exits 1 naming the record and the
operator, and a server refuses it in one line rather than crash. Whatever could crash
runs in a child process, so that a regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import pytest
from test_trust_model import SERVE_EACH, SERVER, model_file, warm
from trust import assert_one_line_error, clean_env, cli, python

from cachebuild.trust.fxjson import GraphFormatError, data_to_module

pytestmark = pytest.mark.slow


def node(name: str, op: str, target: str, args: list, kwargs: dict | None = None) -> dict:
    """One stored node; a string in ``args`` or ``kwargs`` that starts with ``%`` refers
    to the node of that name."""
    def arg(a: object) -> object:
        if isinstance(a, str) and a.startswith("%"):
            return {"n": a[1:]}
        if isinstance(a, list):
            return [arg(v) for v in a]
        return a

    return {"name": name, "op": op, "target": target, "args": {"t": [arg(a) for a in args]},
            "kwargs": {"d": [[k, arg(v)] for k, v in (kwargs or {}).items()]}}


def graph(*nodes: dict) -> list[dict]:
    """A stored graph of input ``x`` returning the last node."""
    return [node("x", "placeholder", "x", []), *nodes,
            node("output", "output", "output", [{"t": [{"n": nodes[-1]["name"]}]}])]


#: The audit's graphs, with what the refusal must name.
ATTACKS = {
    "aten::_reshape_alias": graph(  # 3,413 words past a 2-element input, then 2**40
        node("a", "call_function", "op:aten::_reshape_alias.default", ["%x", [3415], [1]]),
        node("b", "call_function", "op:aten::_reshape_alias.default", ["%x", [1 << 40], [1]]),
        node("y", "call_function", "op:aten::sum.default", ["%b"])),
    "method new": graph(  # any integer, taken as a C++ tensor's address
        node("y", "call_method", "new", ["%x"], {"cdata": 0x4141414141})),
    "method data_ptr": graph(  # its own buffer's address, taken back as a C++ tensor
        node("p", "call_method", "data_ptr", ["%x"]),
        node("y", "call_method", "new", ["%x"], {"cdata": "%p"})),
    "aten::_sparse_coo_tensor_unsafe": graph(
        node("i", "call_function", "op:aten::full.default", [[1, 1], 1 << 33],
             {"dtype": {"dtype": "int64"}}),
        node("v", "call_function", "op:aten::ones.default", [[1]]),
        node("s", "call_function", "op:aten::_sparse_coo_tensor_unsafe.default",
             ["%i", "%v", [4]]),
        node("y", "call_method", "to_dense", ["%s"])),
    "aten::as_strided.default": None,  # admitted: checked against the storage (below)
}


#: Each attack loaded and run in this child, on a 2-element input beside a canary tensor:
#: prints, per graph, "refused: <error>" or "ran" (and whether the canary changed).
RUN_EACH = r"""
import json, sys
import torch
from cachebuild.errors import CachebuildError
from cachebuild.trust.fxjson import data_to_module

out = []
for nodes in json.loads(open(sys.argv[1]).read()):
    buffer = torch.full((64,), 7.0)
    x, canary = buffer[:2], buffer[2:]
    try:
        module = data_to_module(nodes)
    except CachebuildError as e:
        out.append("refused: " + str(e))
        continue
    try:
        module(x)
        out.append("ran")
    except Exception as e:
        out.append("raised: " + type(e).__name__ + ": " + str(e).splitlines()[0])
    if not bool((canary == 7.0).all()):
        out[-1] += " and changed the canary"
print(json.dumps(out))
"""


def test_the_audits_graphs_are_refused_before_they_run(tmp_path):
    attacks = {k: v for k, v in ATTACKS.items() if v is not None}
    (tmp_path / "graphs.json").write_text(json.dumps(list(attacks.values())))
    proc = python(RUN_EACH, str(tmp_path / "graphs.json"), timeout=120)
    assert proc.returncode == 0, f"the child died ({proc.returncode}): {proc.stderr[-3000:]}"
    for what, result in zip(attacks, json.loads(proc.stdout.splitlines()[-1]), strict=True):
        assert result.startswith("refused: "), (what, result)
        assert "\n" not in result and what in result, (what, result)


def test_as_strided_is_checked_against_the_storage(tmp_path):
    # as_strided is admitted: its sizes, strides and offset are checked against the base's
    # storage before the view exists. Past the storage it raises; nothing outside changes.
    reads = [graph(node("y", "call_function", "op:aten::as_strided.default",
                        ["%x", [size], [stride], offset]))
             for size, stride, offset in ((3415, 1, 0), (1 << 40, 1, 0), (2, 1, 1 << 33),
                                          (2, 1 << 40, 0), (2, -1, 0))]
    (tmp_path / "graphs.json").write_text(json.dumps(reads))
    proc = python(RUN_EACH, str(tmp_path / "graphs.json"), timeout=120)
    assert proc.returncode == 0, f"the child died ({proc.returncode}): {proc.stderr[-3000:]}"
    for result in json.loads(proc.stdout.splitlines()[-1]):
        assert result.startswith("raised: RuntimeError"), result
        assert "canary" not in result, result


def test_math_prod_of_a_huge_list_stops_at_once():
    # A 6 MiB graph kept the loader computing for over 60 s.
    nodes = graph(node("y", "call_function", "fn:math:prod", [[(1 << 62) + 1] * 200_000]))
    module = data_to_module(nodes)
    from cachebuild.trust.purity import Impure

    # Refused by its operands' size before anything is multiplied.
    with pytest.raises(Impure, match="past its bounds"):
        module(0)
    # math functions that could compute without end and have no bound are refused.
    for name in ("factorial", "comb", "perm", "fsum"):
        with pytest.raises(GraphFormatError, match="may not call"):
            data_to_module(graph(node("y", "call_function", f"fn:math:{name}", ["%x"])))


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A keyless store with the tiny model warmed (two ``eager_fusion`` targets)."""
    base = tmp_path_factory.mktemp("language")
    model = model_file(base)
    store = base / "store"
    assert warm(model, clean_env(CACHEBUILD_DIR=str(store)))[2] == 2
    return model, store


def test_a_server_refuses_each_attack_in_one_line(warmed, tmp_path):
    model, golden = warmed
    store = tmp_path / "store"
    shutil.copytree(golden, store)
    attacks = {k: v for k, v in ATTACKS.items() if v is not None}
    (tmp_path / "attacks.json").write_text(json.dumps(list(attacks.values())))
    proc = python(SERVE_EACH, str(model), str(tmp_path / "attacks.json"),
                  env=clean_env(CACHEBUILD_DIR=str(store)))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, \
        f"the server died ({proc.returncode}): {proc.stderr[-3000:]}"
    for what, error in zip(attacks, json.loads(proc.stdout.splitlines()[-1]), strict=True):
        assert re.search(r"stored graph of target [0-9a-f]+ was not loaded: graph calls", error)
        assert what in error and "\n" not in error, error


def test_an_imported_bundle_with_an_out_of_bounds_node_fails_verify_and_is_refused(
        warmed, tmp_path):
    """The audit end to end: the OOB node added to one graph of an exported bundle,
    ``cachebuild import`` into a keyless store, then ``verify`` (it said "ok") and a
    server start (it died of SIGSEGV)."""
    model, golden = warmed
    # Someone with the bundle adds the node (an unsigned blob, its checksum right).
    tampered = tmp_path / "tampered"
    shutil.copytree(golden, tampered)
    edit = r"""
import json, sys
from cachebuild.store import LocalStore, export_bundle
with LocalStore(sys.argv[1]) as store:
    record = next(r for r in store.records() if r.kind == "fx-graph")
    doc = json.loads(store.get(record.key))
    nodes = doc["nodes"]
    x = next(n["name"] for n in nodes if n["op"] == "placeholder")
    nodes.insert(len(nodes) - 1, {"name": "oob", "op": "call_function",
        "target": "op:aten::_reshape_alias.default",
        "args": {"t": [{"n": x}, [1 << 40], [1]]}, "kwargs": {"d": []}})
    store.delete(record.key)
    store.put(record.key, json.dumps(doc).encode(), kind=record.kind,
              manifest=record.manifest)
    export_bundle(store, sys.argv[2])
print(record.key)
"""
    bundle = tmp_path / "bundle.tar"
    proc = python(edit, str(tampered), str(bundle))
    assert proc.returncode == 0, proc.stderr[-3000:]
    key = proc.stdout.split()[-1]
    env = clean_env(CACHEBUILD_DIR=str(tmp_path / "imported"))
    imported = cli("import", str(bundle), env=env)
    assert imported.returncode == 0, imported.stderr[-3000:]
    # Unsigned and not trusted: not served, and not called "ok".
    verified = cli("verify", env=env)
    assert verified.returncode == 0 and ": 0 ok, 0 damaged" in verified.stdout, verified.stdout
    # Trusted by name, it is served: a load checks its graphs, and so does verify.
    assert cli("trust", "bundle bundle.tar", env=env).returncode == 0
    verified = cli("verify", env=env)
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert re.search(rf"refused {key}: graph: graph calls operator aten::_reshape_alias"
                     r"\.default, which stored graphs may not call", verified.stderr), \
        verified.stderr
    assert "1 holding graphs a load refuses" in verified.stdout, verified.stdout
    served = python(SERVER, str(model), env=env)
    assert served.returncode != -signal.SIGSEGV, "the server crashed"
    assert_one_line_error(served, 1, rf"target {key} was not loaded: graph calls operator "
                                     r"aten::_reshape_alias\.default")
    # --repair removes it; the next start rebuilds it.
    assert cli("verify", "--repair", env=env).returncode == 0
    assert cli("verify", env=env).returncode == 0
    assert python(SERVER, str(model), env=env).returncode == 0
    assert Path(tmp_path / "imported").exists()


# -- the table itself ------------------------------------------------------------------------

def test_every_row_is_a_registered_overload_and_none_skips_its_checks():
    import torch

    from cachebuild.trust import allowed

    for row in allowed.ATEN:
        name, overload = row.split(".")
        # TorchScript's list and string overloads (slice.t) have schemas, no kernel.
        script = {s.overload_name for s in torch._C._jit_get_schemas_for_operator(f"aten::{name}")
                  if s.overload_name not in allowed.dispatcher_overloads(f"aten::{name}")}
        assert overload in allowed.dispatcher_overloads(f"aten::{name}") or (
            overload in script and row in allowed._SCRIPT), row
        if overload in script:
            schema = next(s for s in torch._C._jit_get_schemas_for_operator(f"aten::{name}")
                          if s.overload_name == overload)
            assert "Tensor" not in str(schema), row
            continue
        assert not allowed.is_out_variant(f"aten::{row}"), row
        # The names of kernels that skip their checks or take raw memory: never rows
        # (_unsafe_view is view without autograd's alias record, its shape checked;
        # sym_storage_offset reads a number).
        assert not re.search(r"_reshape_alias|unsafe|^set_|from_blob|^_make_|storage|"
                             r"data_ptr|^_sparse", name) or name in (
            "_unsafe_view", "sym_storage_offset"), row
        schema = getattr(getattr(torch.ops.aten, name), overload)._schema
        assert not any("Storage" in str(a.real_type) for a in schema.arguments), row


def test_torch_registers_no_namespace_the_table_does_not_know():
    # A new torch that adds an operator namespace fails here until it is reviewed.
    proc = python("import json, torch, cachebuild.passes.ops; "
                  "print(json.dumps(sorted({n.split('::')[0] for n in "
                  "torch._C._dispatch_get_all_op_names()})))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from cachebuild.trust import allowed

    unknown = set(json.loads(proc.stdout.splitlines()[-1])) - allowed.TORCH_NAMESPACES
    assert unknown == {allowed.CACHEBUILD_NAMESPACE}, unknown


def test_out_tensors_are_refused_and_uninitialised_memory_is_zeroed():
    import torch

    with pytest.raises(GraphFormatError, match="out="):
        data_to_module(graph(node("y", "call_function", "fn:torch:add", ["%x", "%x"],
                                  {"out": "%x"})))
    with pytest.raises(GraphFormatError, match="aten::add.out"):
        data_to_module(graph(node("y", "call_function", "op:aten::add.out", ["%x", "%x"])))
    secret = torch.full((4096,), 12345.0)
    del secret  # freed: an uninitialised tensor may get its memory
    for target in ("op:aten::empty.memory_format", "fn:torch:empty"):
        module = data_to_module(graph(node("y", "call_function", target, [[4096]])))
        assert bool((module(torch.zeros(1))[0] == 0).all()), target
    with pytest.raises(GraphFormatError, match="new_empty"):
        data_to_module(graph(node("y", "call_method", "new_empty", ["%x", [4096]])))


def test_no_node_reaches_a_named_tensor_overload():
    """Named-tensor overloads (``size.Dimname``, ``zeros.names``, torch 2.11's
    ``flatten.named_out_dim``) are not judged with the positional ones a method or binding
    is admitted by; so no node may pass a string where no judged overload takes one (a
    dimension by name, ``names``), and then none is ever reached (torch 2.13 registers
    none at all). Strings where they belong (a device, a rounding mode) pass."""
    import torch

    for refused in (
            node("y", "call_method", "flatten", ["%x", 0, 1, "named"]),
            node("y", "call_method", "size", ["%x", "a"]),
            node("y", "call_method", "sum", ["%x"], {"dim": ["a"]}),
            node("y", "call_function", "fn:torch:zeros", [[2]], {"names": ["a"]}),
            node("y", "call_function", "fn:torch.nn.functional:softmax", ["%x", "a"])):
        with pytest.raises(GraphFormatError, match="name"):
            data_to_module(graph(refused))
    x = torch.randn(2, 3)
    for admitted, want in (
            (node("y", "call_method", "flatten", ["%x", 0, 1]), x.flatten(0, 1)),
            (node("y", "call_method", "sum", ["%x"], {"dim": [1]}), x.sum(dim=[1])),
            (node("y", "call_method", "to", ["%x"], {"device": "cpu"}), x),
            (node("y", "call_function", "fn:torch:div", ["%x", 2],
                  {"rounding_mode": "floor"}), torch.div(x, 2, rounding_mode="floor")),
            (node("y", "call_function", "fn:torch.nn.functional:softmax", ["%x", -1]),
             x.softmax(-1))):
        torch.testing.assert_close(data_to_module(graph(admitted))(x)[0], want)


def test_packets_are_judged_by_what_a_call_without_out_can_reach():
    # torch's associative_scan (Mamba) calls torch.ops.aten.slice: its tensor overload
    # and TorchScript's list and string ones are admitted, its out= variants never
    # reached (no node passes out=).
    import torch

    x = torch.randn(6, 2)
    module = data_to_module(graph(node("y", "call_function", "op:aten::slice",
                                       ["%x", 0, 1, None, 2])))
    torch.testing.assert_close(module(x)[0], x[1::2])
    for name in ("clone", "cat", "select"):
        from cachebuild.trust import allowed

        assert allowed.op_refusal(getattr(torch.ops.aten, name)) is None, name
    with pytest.raises(GraphFormatError, match="may not call"):
        data_to_module(graph(node("y", "call_function", "op:aten::_reshape_alias", ["%x"])))


@pytest.mark.parametrize("method", ["size", "stride", "flatten", "unflatten", "index_copy_",
                                    "index_select", "sum", "mean", "softmax", "transpose",
                                    "squeeze", "select", "gather", "scatter", "cumsum", "sort"])
def test_methods_models_call_are_admitted_whatever_named_overloads_torch_registers(method):
    # torch 2.11 registers named-tensor overloads beside most of these (size.Dimname,
    # index_copy_.dimname, flatten.named_out_dim); they are judged by the others.
    from cachebuild.trust import allowed

    assert allowed.method_refusal(method) is None
