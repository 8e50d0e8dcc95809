"""Values a forward reads, changed after the first call: run as a process of its own.

``python tests/live_changes.py DOOR BACKEND [CASE...]`` compiles ``Net`` through ``DOOR``
(``compile``: cachebuild.compile, ``torch``: torch.compile with cachebuild's backend) into
the store ``CACHEBUILD_DIR`` names, then for each case of ``CASES``: a call, the change, a
call, the change undone, a call; every output compared with the live eager model's. Prints
one JSON line per call: the case, the step, the largest difference from eager and how many
traces this process has made so far.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from os import environ
from typing import Any

import torch
import torch.nn as nn
from live_classes import Doubled, Gate, LoudGate, Scale
from torch.utils._python_dispatch import TorchDispatchMode

import cachebuild

#: A module global the forward reads.
SCALE = 1.0


class Mode:
    """Objects compared by identity only: ``self.mode is QUADRUPLED``."""


PLAIN, QUADRUPLED = Mode(), Mode()
#: Sentinels by ``object()``, and objects held by a list and by another class's
#: attributes: told apart by identity alone, named by no global of their class's module.
UNSET, SET = object(), object()
MODES = [Mode(), Mode()]


class Kinds:
    FIRST, SECOND = Mode(), Mode()


@dataclass
class Config:
    act: str = "relu"
    eps: float = 0.0


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0


def tripled(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
            ) -> torch.Tensor:
    return output * 3


def finish(y: torch.Tensor) -> torch.Tensor:
    """A module-level helper the forward calls: its code is swapped in place."""
    return y


def _finish_tripled(y: torch.Tensor) -> torch.Tensor:
    return y * 3


class Tuned(nn.Module):
    """Gives ``gain``, a class attribute the forward reads through ``Net``."""

    gain = 1.0


class Sibling(Tuned):
    """Another subclass of ``Tuned``: Dynamo reads ``gain`` for both through one path."""


class Net(Tuned):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.use_b = False
        self.inner = Inner()
        self.config = Config()
        self.extra = ["a"]  # a list whose contents the forward reads
        self.mode = PLAIN
        self.state = UNSET
        self.picked = MODES[0]
        self.kind = Kinds.FIRST
        self.env_name = "LIVE_TRIPLE"  # a variable named by an attribute, not a constant
        self.env = os.environ  # the environment held by an attribute
        self.count = 1  # made True: equal to 1 in Python, yet another value
        self.gate = Gate()  # given another class in place
        self.scale = Scale()  # a submodule given another class in place
        self.table = {(1, "x"): 1.0}  # a dict read with a tuple key
        self.sibling = Sibling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(x) if self.use_b else self.a(x)
        y = y * self.inner.scale * SCALE
        if self.training:
            y = y + 1
        if os.environ.get("LIVE_DOUBLE") == "1":
            y = y * 2
        if os.environ.get(self.env_name) == "1":
            y = y * 3
        if os.getenv("live_quarter") == "1":  # os.getenv, a name not in capitals
            y = y * 1.25
        if environ.get("LV") == "1":  # `from os import environ`, a short name
            y = y * 1.75
        if self.env.get("LIVE_HELD") == "1":
            y = y * 2.25
        for name in self.extra:
            y = y + getattr(self, name)(x)
        if self.mode is QUADRUPLED:
            y = y * 4
        if self.state is SET:
            y = y * 6
        if self.picked is MODES[1]:
            y = y * 7
        if self.kind is Kinds.SECOND:
            y = y * 8
        if self.count is True:
            y = y * 5
        y = self.scale(self.gate.apply(y)) * self.gain * self.gate.level
        if not self.a.weight.requires_grad:  # frozen: read, as code choosing checkpoints does
            y = y - 1
        if x.requires_grad:
            y = y * 1.5
        if torch.is_grad_enabled():  # a training path and an inference path
            y = y * 0.5
        y = y * self.table[(1, "x")] * self.sibling.gain
        act = torch.relu if self.config.act == "relu" else torch.tanh
        # Made in the process's default dtype: float64 there makes the output float64.
        y = y + torch.full((y.shape[-1],), 0.125)
        return finish(self.post(act(y) + self.config.eps))

    def post(self, y: torch.Tensor) -> torch.Tensor:
        return y


def _tripled_post(self: Net, y: torch.Tensor) -> torch.Tensor:
    return y * 3


def _patch_method(net: Net) -> object:
    original, Net.post = Net.post, _tripled_post
    return original


def _swap_code(function: Callable[..., object], code: object) -> object:
    """Give ``function`` other code in place, as a reloader does (IPython's autoreload):
    the same function object, no name bound anew."""
    old, function.__code__ = function.__code__, code  # type: ignore[attr-defined]
    return old


def _swap_kinds() -> None:
    Kinds.FIRST, Kinds.SECOND = Kinds.SECOND, Kinds.FIRST


def _set_global(value: float) -> None:
    global SCALE
    SCALE = value


def _set_default_dtype(dtype: torch.dtype) -> torch.dtype:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    return old


def _set_env(value: str | None, name: str = "LIVE_DOUBLE") -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class DoubledMatmuls(TorchDispatchMode):
    """A caller's dispatch mode that changes results: every matmul doubled."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default) \
            else out


#: The modes each call runs under (the case below sets one).
MODE: list[TorchDispatchMode] = []
#: Whether each call's input requires grad (set by a case below: called under no_grad).
INPUT_GRAD: list[bool] = []
#: Calls made with autograd on while it holds an item (else under no_grad).
GRAD: list[bool] = []
AROUND_THE_CALL = "a dispatch mode around the call"
DEFAULT_DTYPE = "default dtype of the process"
#: A call with autograd on, to a forward that reads autograd's mode: run eagerly.
GRAD_ON = "autograd on around the call"


@dataclass
class Case:
    name: str
    change: Callable[[Net], object]
    undo: Callable[[Net, object], None]


def _replace_dict(obj: object, old: dict[str, Any] | None = None, **values: Any) -> object:
    """Give ``obj`` a new dict: ``old`` again, or a copy of its own with ``values`` set;
    returns the dict it had."""
    had = obj.__dict__
    obj.__dict__ = old if old is not None else {**had, **values}
    return had


_QUARTER = property(lambda self: 0.25)


def _hook(net: Net) -> object:
    return net.a.register_forward_hook(tripled)


#: Changes whose values an earlier case's change gave already: the forward made for those
#: serves them, nothing is traced.
SEEN_BEFORE = ("the list holding the object compared with reordered",
               "class attributes compared with swapped")

#: Each change and how it is undone.
CASES = [
    Case("attribute", lambda n: setattr(n, "use_b", True), lambda n, _: setattr(n, "use_b", False)),
    Case("nested attribute", lambda n: setattr(n.inner, "scale", 2.5),
         lambda n, _: setattr(n.inner, "scale", 1.0)),
    Case("train", lambda n: n.train(), lambda n, _: n.eval()),
    Case("global", lambda n: _set_global(3.0), lambda n, _: _set_global(1.0)),
    Case("config value", lambda n: setattr(n.config, "act", "tanh"),
         lambda n, _: setattr(n.config, "act", "relu")),
    Case("list contents", lambda n: n.extra.append("b"), lambda n, _: n.extra.pop()),
    Case("environment variable", lambda n: _set_env("1"), lambda n, _: _set_env(None)),
    Case("environment variable named by an attribute", lambda n: _set_env("1", n.env_name),
         lambda n, _: _set_env(None, n.env_name)),
    *[Case(f"environment variable {how}", lambda n, name=name: _set_env("1", name),
           lambda n, _, name=name: _set_env(None, name))
      for how, name in (("read by os.getenv, in lower case", "live_quarter"),
                        ("read through `from os import environ`", "LV"),
                        ("read through an attribute holding the environment", "LIVE_HELD"))],
    Case("forward hook", _hook, lambda n, handle: handle.remove()),
    Case("module-level object", lambda n: setattr(n, "mode", QUADRUPLED),
         lambda n, _: setattr(n, "mode", PLAIN)),
    Case("sentinel made by object()", lambda n: setattr(n, "state", SET),
         lambda n, _: setattr(n, "state", UNSET)),
    Case("object held by a list", lambda n: setattr(n, "picked", MODES[1]),
         lambda n, _: setattr(n, "picked", MODES[0])),
    Case("the list holding the object compared with reordered", lambda n: MODES.reverse(),
         lambda n, _: MODES.reverse()),
    Case("object held by another class's attribute", lambda n: setattr(n, "kind", Kinds.SECOND),
         lambda n, _: setattr(n, "kind", Kinds.FIRST)),
    Case("class attributes compared with swapped", lambda n: _swap_kinds(),
         lambda n, _: _swap_kinds()),
    Case("method of the class", _patch_method, lambda n, original: setattr(Net, "post", original)),
    Case("code of a function", lambda n: _swap_code(finish, _finish_tripled.__code__),
         lambda n, old: _swap_code(finish, old)),
    Case("code of a method", lambda n: _swap_code(Net.post, _tripled_post.__code__),
         lambda n, old: _swap_code(Net.post, old)),
    Case("an int made a bool", lambda n: setattr(n, "count", True),
         lambda n, _: setattr(n, "count", 1)),
    Case("class of an object", lambda n: setattr(n.gate, "__class__", LoudGate),
         lambda n, _: setattr(n.gate, "__class__", Gate)),
    Case("class of a submodule", lambda n: setattr(n.scale, "__class__", Doubled),
         lambda n, _: setattr(n.scale, "__class__", Scale)),
    # Set on the model's class, shadowing what its base class gives (and on a plain
    # object's class): the value read moves to another class of the MRO.
    Case("class attribute shadowed", lambda n: setattr(Net, "gain", 2.0),
         lambda n, _: delattr(Net, "gain")),
    Case("class attribute of an object shadowed", lambda n: setattr(Gate, "level", 3.0),
         lambda n, _: delattr(Gate, "level")),
    Case("class attribute shadowed on a sibling class", lambda n: setattr(Sibling, "gain", 4.0),
         lambda n, _: delattr(Sibling, "gain")),
    # An object given another dict (``__setstate__``-style code, a config reloaded in
    # place): no dict the trace read changes, the object's dict is another one.
    Case("dict of an object replaced", lambda n: _replace_dict(n.config, eps=0.5),
         lambda n, old: _replace_dict(n.config, old)),
    Case("dict of a submodule replaced", lambda n: _replace_dict(n.inner, scale=3.5),
         lambda n, old: _replace_dict(n.inner, old)),
    # A property set on the class later wins over the value in the instance's dict.
    Case("property over an instance value", lambda n: setattr(Config, "eps", _QUARTER),
         lambda n, _: setattr(Config, "eps", 0.0)),
    Case("value under a tuple key", lambda n: n.table.update({(1, "x"): 2.0}),
         lambda n, _: n.table.update({(1, "x"): 1.0})),
    Case("requires_grad of a weight", lambda n: n.a.requires_grad_(False),
         lambda n, _: n.a.requires_grad_(True)),
    Case("an input that requires grad", lambda n: INPUT_GRAD.append(True),
         lambda n, _: INPUT_GRAD.clear()),
    # Not a value the forward reads: a mode of the caller's around the call, which
    # compiled code would run past. The model runs eagerly under it (nothing traced).
    Case(AROUND_THE_CALL, lambda n: MODE.append(DoubledMatmuls()), lambda n, _: MODE.clear()),
    Case(GRAD_ON, lambda n: GRAD.append(True), lambda n, _: GRAD.clear()),
    # Process state a forward's graph takes without naming it: a tensor made without a
    # dtype (a build worker's default dtype is float32 whatever the caller's is).
    Case(DEFAULT_DTYPE, lambda n: _set_default_dtype(torch.float64),
         lambda n, old: _set_default_dtype(old)),
]


def main(door: str, backend: str, cases: list[str]) -> None:
    torch.manual_seed(0)
    net = Net().eval()
    config = cachebuild.CompileConfig(backend=backend, compile_ranges=((1, 16),))
    if door == "compile":
        compiled = cachebuild.compile(net, config=config, dynamic_dims={0: 0})
    else:
        compiled = torch.compile(net, backend=cachebuild.backend(config), dynamic=False)
    x = torch.randn(4, 8)

    def call(case: str, step: str) -> None:
        with torch.set_grad_enabled(bool(GRAD)), contextlib.ExitStack() as modes:
            for mode in MODE:
                modes.enter_context(mode)
            given = x.detach().requires_grad_(bool(INPUT_GRAD))
            out = compiled(given).detach()
            want = net(given).detach()
        error = float((out - want).abs().max()) if out.dtype == want.dtype else float("inf")
        print(json.dumps({"case": case, "step": step, "error": error,
                          "traced": cachebuild.stats()["traced"]}), flush=True)

    for case in [c for c in CASES if not cases or c.name in cases]:
        call(case.name, "before")
        undo = case.change(net)
        call(case.name, "changed")
        case.undo(net, undo)
        call(case.name, "undone")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
