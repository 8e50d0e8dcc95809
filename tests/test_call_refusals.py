"""What a compiled forward cannot follow is refused in one line, never skipped.

``model(x)`` runs hooks on the model itself, torch's global module hooks, and an
instance's own ``forward``; the compiled forward runs what its trace saw, with the model's
weights looked up by path. A weight set to None or deleted, a hook added to the model, a
global module hook or a ``forward`` set on the instance would each make the compiled
output differ from eager's in silence: each is a UsageError on the call, for as long as
it lasts, and the compiled model answers as eager again once it is undone. A hook on the
module ``cachebuild.compile`` returned runs around the compiled forward.
"""

from __future__ import annotations

import contextlib
import logging
import random
import warnings

import pytest
import torch
import torch.nn as nn

import cachebuild
from cachebuild.errors import CompileFailed, UsageError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


def compiled_net(open_local, tmp_path):
    torch.manual_seed(0)
    net = Net().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    return net, cachebuild.compile(net, config, {0: 0}, store=open_local(tmp_path / "store"))


def matches(compiled, net, x) -> None:
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), net(x), rtol=1e-5, atol=1e-5)


def refused(compiled, x, match: str) -> None:
    for _ in range(2):  # and again at the next call: nothing was armed by the refusal
        with pytest.raises(UsageError, match=match), torch.no_grad():
            compiled(x)


def test_a_weight_set_to_none_or_deleted_is_refused_until_it_is_back(open_local, tmp_path):
    net, compiled = compiled_net(open_local, tmp_path)
    x = torch.randn(4, 8)
    matches(compiled, net, x)
    bias = net.lin.bias
    net.lin.bias = None  # no registration hook runs for None
    refused(compiled, x, "param lin.bias was compiled as a param of the model and is not one")
    net.lin.bias = bias
    matches(compiled, net, x)
    scale = net.scale
    net.scale = None
    refused(compiled, x, "buffer scale was compiled as a buffer of the model and is not one")
    del net.scale
    refused(compiled, x, "buffer scale was compiled as a buffer of the model")
    net.register_buffer("scale", scale * 2)  # a new tensor of the same layout: followed
    matches(compiled, net, x)


@pytest.mark.parametrize("hook", ["forward", "pre", "global forward", "global pre"])
def test_a_hook_the_compiled_forward_would_skip_is_refused(open_local, tmp_path, hook):
    net, compiled = compiled_net(open_local, tmp_path)
    x = torch.randn(4, 8)
    matches(compiled, net, x)
    module_hooks = torch.nn.modules.module
    handle = {
        "forward": lambda: net.register_forward_hook(lambda m, a, out: out * 3),
        "pre": lambda: net.register_forward_pre_hook(lambda m, a: (a[0] * 3,)),
        "global forward": lambda: module_hooks.register_module_forward_hook(
            lambda m, a, out: out * 3 if isinstance(m, nn.Linear) else None),
        "global pre": lambda: module_hooks.register_module_forward_pre_hook(
            lambda m, a: (a[0] * 2,)),
    }[hook]()
    try:
        refused(compiled, x, "global module hook" if hook.startswith("global")
                else "has a hook on the model itself")
    finally:
        handle.remove()
    matches(compiled, net, x)


def test_a_hook_on_the_compiled_module_runs_around_the_compiled_forward(open_local, tmp_path):
    net, compiled = compiled_net(open_local, tmp_path)
    x = torch.randn(4, 8)
    compiled.register_forward_hook(lambda m, a, out: out * 3)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), net(x) * 3, rtol=1e-5, atol=1e-5)


def test_a_forward_set_on_the_instance_is_refused(open_local, tmp_path):
    net, compiled = compiled_net(open_local, tmp_path)
    x = torch.randn(4, 8)
    matches(compiled, net, x)
    net.forward = lambda x: x * 3
    refused(compiled, x, "forward was set on the instance")
    del net.forward
    matches(compiled, net, x)


def test_a_cold_start_with_a_hook_on_the_model_says_so_before_tracing(open_local, tmp_path):
    torch.manual_seed(0)
    net = Net().eval()
    net.register_forward_hook(lambda m, a, out: out * 3)
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(net, config, {0: 0}, store=open_local(tmp_path / "store"))
    before = cachebuild.stats()["traced"]
    refused(compiled, torch.randn(4, 8), "has a hook on the model itself")
    assert cachebuild.stats()["traced"] == before


def test_keyword_inputs_and_inputs_an_op_refuses_are_one_line_errors(open_local, tmp_path,
                                                                     caplog):
    net, compiled = compiled_net(open_local, tmp_path)
    with pytest.raises(UsageError, match="takes its inputs by position only; pass x "):
        compiled(x=torch.randn(4, 8))

    class Scaled(torch.nn.Module):  # a parameter that takes a keyword only
        def forward(self, x, *, scale=1.0):
            return x * scale

    keyword_only = cachebuild.compile(Scaled(), compiled.compile_config, {0: 0})
    with pytest.raises(UsageError, match="takes scale by keyword only: serve it through "
                                         r"torch.compile\(model, backend=cachebuild.backend"):
        keyword_only(torch.randn(4, 8), scale=2.0)
    # A wrong feature size: the op's own error, not Dynamo's page about fake tensors, nor
    # the traceback torch logs as the op's meta kernel refuses the shapes.
    with caplog.at_level(logging.DEBUG, logger="torch._subclasses.fake_tensor"), \
            pytest.raises(UsageError, match=r"fails on these inputs \(check that the same "
                          r"call runs eagerly\): RuntimeError: a and b must have same "
                          r"reduction dim"):
        compiled(torch.randn(4, 9))
    assert "failed while attempting to run meta" not in caplog.text
    assert not logging.getLogger("torch._subclasses.fake_tensor").filters
    # An op that fake tensors let through and the real ones do not (integers into a float
    # matmul), and one input too many: one line each, not a traceback.
    with pytest.raises(UsageError, match=r"fails on these inputs \(check that the same "
                       r"call runs eagerly\): RuntimeError: .*dtype"):
        cachebuild.compile(Net().eval(), compiled.compile_config, {0: 0})(
            torch.randint(0, 5, (4, 8)))
    # A builtin Dynamo cannot trace: the graph break in one line, without Dynamo's warning
    # page before it; the caller's warning filters as they were.

    class Draws(torch.nn.Module):
        def forward(self, x):
            return x * random.random()

    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen, \
            pytest.raises(UsageError, match="does not trace as one graph: .*Random.random"):
        warnings.simplefilter("always")
        cachebuild.compile(Draws(), compiled.compile_config, {0: 0})(torch.randn(4, 8))
    assert not [w for w in seen if "Dynamo does not know" in str(w.message)]
    assert warnings.filters == filters
    with pytest.raises(UsageError, match=r"cannot take these 2 inputs as its positional "
                       r"arguments \(too many positional arguments\)"):
        cachebuild.compile(Net().eval(), compiled.compile_config, {0: 0})(torch.randn(4, 8),
                                                                  torch.randn(4, 8))


def test_with_on_failure_eager_a_hook_on_the_model_runs_eagerly_while_it_is_there(open_local,
                                                                                   tmp_path):
    torch.manual_seed(0)
    net = Net().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),),
                                      on_failure="eager")
    compiled = cachebuild.compile(net, config, {0: 0}, store=open_local(tmp_path / "store"))
    x = torch.randn(4, 8)
    matches(compiled, net, x)
    handle = net.register_forward_hook(lambda m, a, out: out * 3)
    matches(compiled, net, x)  # eager, hook and all
    handle.remove()
    traced = cachebuild.stats()["traced"]
    matches(compiled, net, x)  # compiled again, on the forward it had
    assert cachebuild.stats()["traced"] == traced


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1 = Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b1(self.b0(x))


def blocks_with_own_forward(open_local, tmp_path, bind):
    """``Blocks`` whose first block has its class's forward bound on the instance with
    ``bind``, compiled and called once (checked against eager)."""
    torch.manual_seed(0)
    net = Blocks().eval()
    net.b0.forward = bind(Block.forward, net.b0)
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(net, config, {0: 0}, store=open_local(tmp_path / "store"))
    x = torch.randn(4, 8)
    matches(compiled, net, x)
    return net, compiled, x


def test_a_method_replaced_on_a_class_is_seen_when_one_instance_shadows_it(open_local,
                                                                          tmp_path):
    """The first Block's forward is its own (bound on the instance); the second one's is
    the class's, which is replaced after the first call: the next call traces again."""
    import types

    net, compiled, x = blocks_with_own_forward(open_local, tmp_path, types.MethodType)
    original = Block.forward
    Block.forward = lambda self, x: torch.relu(self.lin(x)) * 3
    try:
        matches(compiled, net, x)
    finally:
        Block.forward = original


def test_a_global_hook_is_refused_where_dynamo_serves_the_model(open_local, tmp_path):
    """A forward bound with functools.partial is a value no record can check: the model
    is served through torch.compile, whose guards do not follow global module hooks."""
    import functools

    net, compiled, x = blocks_with_own_forward(open_local, tmp_path, functools.partial)
    assert compiled._dynamo is not None  # served through torch.compile
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out * 3 if isinstance(m, nn.Linear) else None)
    try:
        refused(compiled, x, "global module hook")
    finally:
        handle.remove()
    matches(compiled, net, x)


def test_a_hook_added_to_a_submodule_is_run_where_dynamo_serves_the_model(open_local,
                                                                          tmp_path):
    """Served through torch.compile (a forward no record can check), a first hook set on
    a submodule after the first call is run: torch.compile by default builds no guard on
    a module's empty hook dicts, so without cachebuild asking for them it would not be."""
    import functools

    net, compiled, x = blocks_with_own_forward(open_local, tmp_path, functools.partial)
    assert compiled._dynamo is not None
    handle = net.b1.lin.register_forward_hook(lambda m, a, out: out * 3)
    try:
        matches(compiled, net, x)
    finally:
        handle.remove()
    matches(compiled, net, x)


class Scaled(Block):
    def post(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Block.post(self, torch.relu(self.lin(x)))


Block.post = lambda self, y: y + 1  # type: ignore[attr-defined]  # a method Scaled overrides


def test_a_method_is_recorded_as_the_class_resolves_it(open_local, tmp_path):
    """Scaled's forward calls its base's post explicitly; Scaled overrides post with code
    the trace never ran. What the class gives for post is its own, so nothing is recorded
    for it: the forward is served without Dynamo (a record that failed right after the
    trace would send it through torch.compile) and later calls trace nothing again."""
    torch.manual_seed(0)
    net = Scaled().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(net, config, {0: 0}, store=open_local(tmp_path / "store"))
    x = torch.randn(4, 8)
    matches(compiled, net, x)
    assert compiled._dynamo is None
    traced = cachebuild.stats()["traced"]
    for _ in range(2):
        matches(compiled, net, x)
    assert cachebuild.stats()["traced"] == traced


class WithExtras(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, extras: dict) -> torch.Tensor:
        return self.lin(x) + extras["bias"]


def test_tensors_held_in_a_container_argument_are_refused_as_such(open_local, tmp_path):
    """Not "a tensor that is neither a parameter nor a call argument: register it as a
    buffer", which is no fix for per-call data."""
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(WithExtras().eval(), config, {0: 0},
                                  store=open_local(tmp_path / "store"))
    with pytest.raises(UsageError, match="argument 1 holds tensors in a dict") as refused, \
            torch.no_grad():
        compiled(torch.randn(4, 8), {"bias": torch.randn(8)})
    assert "register_buffer" not in str(refused.value)


@pytest.mark.parametrize("held", ["buffer", "argument"])
def test_a_held_tensor_that_is_also_a_buffer_or_an_argument_is_refused(open_local, tmp_path,
                                                                     held):
    """A container's tensor is the container's at each call, even where the first call's
    is also a weight or another argument: bound as that, later calls would read it and
    not what the container holds."""
    net = WithExtras().eval()
    net.register_buffer("shift", torch.randn(8))
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    compiled = cachebuild.compile(net, config, {}, store=open_local(tmp_path / "store"))
    x = torch.randn(4, 8)
    with pytest.raises(UsageError, match="argument 1 holds tensors in a dict"), \
            torch.no_grad():
        compiled(x, {"bias": net.shift if held == "buffer" else x})


def test_a_callers_torch_function_mode_is_run_eagerly_as_a_dispatch_mode_is(open_local,
                                                                           tmp_path):
    """A mode that changes what ``F.linear`` returns, around a call: compiled code traced
    without it (or under another) would answer as if it were not there; a trace under it
    was refused as a branch at one token."""
    from torch.overrides import TorchFunctionMode

    class Scaled(TorchFunctionMode):
        def __init__(self, k: float) -> None:
            super().__init__()
            self.k = k

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * self.k if func is torch._C._nn.linear else out

    net, compiled = compiled_net(open_local, tmp_path)
    x = torch.randn(5, 8)
    with torch.no_grad():
        for mode in (Scaled(2.0), None, Scaled(3.0), None):  # the first call under one
            with mode or contextlib.nullcontext():
                got = compiled(x)
            with mode or contextlib.nullcontext():
                want = net(x)
            torch.testing.assert_close(got, want)
    assert cachebuild.stats()["traced"] >= 1  # calls without a mode were compiled


class Optional(nn.Module):
    """A forward with a parameter the call may leave out, and one given by keyword only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, *,
                scale: float = 2.0) -> torch.Tensor:
        y = self.lin(x) * scale
        return y if bias is None else y + bias


def test_a_call_with_another_count_of_arguments_is_another_call(open_local, tmp_path):
    """The entry records how many arguments its trace was given and reads a parameter left
    out at its default: a later call that gives that argument (or one too many, or one too
    few) is never served the forward traced without it, in this process or a new one."""
    torch.manual_seed(0)
    net = Optional().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    store = open_local(tmp_path / "store")
    compiled = cachebuild.compile(net, config, {0: 0}, store=store)
    x, bias = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), net(x))
        assert compiled._dynamo is None  # recorded: the defaults have plain paths
        torch.testing.assert_close(compiled(x, bias), net(x, bias))
        torch.testing.assert_close(compiled(x), net(x))
        with pytest.raises(UsageError, match="cannot take these 3 inputs"):
            compiled(x, bias, bias)
        # A new compile of a new instance finds the one-argument entry and is not served
        # it for a call that gives the bias.
        again = Optional().eval()
        again.load_state_dict(net.state_dict())
        started = cachebuild.compile(again, config, {0: 0}, store=store)
        torch.testing.assert_close(started(x), net(x))
        torch.testing.assert_close(started(x, bias), net(x, bias))
        # A subclass's own __call__ is the frame Dynamo traces: its parameter of the same
        # name is not forward's default (served through Dynamo, as eager answers).
        class Called(Optional):
            def __call__(self, x, scale=2.0):
                return nn.Module.__call__(self, x, None, scale=scale) + 1

        called = Called().eval()
        via_call = cachebuild.compile(called, config, {0: 0}, store=store)
        torch.testing.assert_close(via_call(x), called(x))
        Called.__call__.__defaults__ = (7.0,)
        torch.testing.assert_close(via_call(x), called(x))
        # A default changed on the function is a changed value, as in eager.
        Optional.forward.__kwdefaults__ = {"scale": 3.0}
        try:
            torch.testing.assert_close(compiled(x), net(x))
        finally:
            Optional.forward.__kwdefaults__ = {"scale": 2.0}
        torch.testing.assert_close(compiled(x), net(x))


class Relu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def test_a_tensor_method_replaced_in_the_process_is_refused_not_served(open_local, tmp_path,
                                                                        monkeypatch):
    """The graph calls ``.relu()`` by name, so it is looked up wherever the graph is built
    or run: a process that replaced torch.Tensor.relu (a library's patch) is refused, in
    one line, whether the entry is stored already, made earlier in the process, or new;
    without the patch the same store serves again."""
    torch.manual_seed(0)
    net = Relu().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    store = open_local(tmp_path / "store")
    compiled = cachebuild.compile(net, config, {0: 0}, store=store)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), net(x))
        monkeypatch.setattr(torch.Tensor, "relu", lambda self: self.abs() * 3.0)
        # (a second model of the class meets the first one's failure, remembered)
        for model in (compiled, cachebuild.compile(Relu().eval(), config, {0: 0}, store=store)):
            with pytest.raises((UsageError, CompileFailed), match=r"torch.Tensor.relu is replaced in this "
                               r"process \(by .*<lambda> from (tests\.)?test_call_refusals\)"):
                model(x)
        # Another method of torch's C tensor type, or a function torch defines elsewhere.
        for other in (torch.Tensor.sigmoid, torch.nn.functional.silu):
            monkeypatch.setattr(torch.Tensor, "relu", other)
            with pytest.raises((UsageError, CompileFailed),
                               match=rf"torch.Tensor.relu is replaced .*{other.__name__}"):
                compiled(x)
        monkeypatch.undo()
        torch.testing.assert_close(compiled(x), net(x))
        # A new instance finds the entry again: it was stored without the patch.
        traced = cachebuild.stats()["traced"]
        again = Relu().eval()
        again.load_state_dict(net.state_dict())
        torch.testing.assert_close(cachebuild.compile(again, config, {0: 0}, store=store)(x),
                                   net(x))
        assert cachebuild.stats()["traced"] == traced


class Loud(torch.Tensor):
    """A tensor subclass that changes what F.linear returns."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out + 1.0 if func is torch.nn.functional.linear else out


def test_a_tensor_subclass_argument_is_refused_not_served_as_a_plain_tensor(open_local,
                                                                           tmp_path):
    """Eager runs a subclass's own code around each op and returns the subclass; compiled
    code would return plain results. Refused in one line, at a first call and after one."""
    net, compiled = compiled_net(open_local, tmp_path)
    x = torch.randn(4, 8)
    loud = x.as_subclass(Loud)
    with torch.no_grad():
        assert not torch.equal(net(loud).as_subclass(torch.Tensor), net(x))
        with pytest.raises(UsageError, match=r"argument 0 is a .*Loud, a subclass of "
                           r"torch.Tensor: a compiled forward takes plain tensors"):
            cachebuild.compile(Net().eval(), compiled.compile_config, {0: 0})(loud)
        matches(compiled, net, x)
        with pytest.raises(UsageError, match="argument 0 is a .*Loud, a subclass"):
            compiled(loud)
        matches(compiled, net, nn.Parameter(x, requires_grad=False))  # a plain tensor


def test_a_number_drawn_in_python_at_each_call_is_named_as_such(open_local, tmp_path):
    """Dynamo hands the graph a ``random.randint`` draw as a 0-d tensor of its own: the
    refusal says what it may be, not only 'a tensor attribute'."""

    class Draws(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * random.randint(1, 3)

    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),))
    with pytest.raises(UsageError, match=r"a number the forward draws in Python at each call "
                       r"\(random.randint"), torch.no_grad():
        cachebuild.compile(Draws().eval(), config, {0: 0})(torch.randn(4, 8))

    class Shifted(nn.Module):  # a tensor as a parameter's default
        def forward(self, x, shift=torch.ones(8)):
            return x + shift

    with pytest.raises(UsageError, match="is the default of a parameter of forward"), \
            torch.no_grad():
        cachebuild.compile(Shifted(), config, {0: 0})(torch.randn(4, 8))
