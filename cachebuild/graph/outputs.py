"""What a compiled forward returns: the model's own output structure around the graph's
tensors, rebuilt on every call without Dynamo.

A plain structure (tensors in tuples, lists, dicts, registered pytree nodes) is kept as a
pytree spec. Anything else, such as a Hugging Face ``ModelOutput`` holding a
``DynamicCache`` object, is kept as a pickle of the traced output in which every tensor is
replaced by its position among the graph's outputs; each call unpickles it with the new
tensors in place. The pickle lives in the entry, which the store already trusts with code
that runs on load.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from cachebuild.errors import UsageError
from cachebuild.trust.sources import find_module, is_label, object_label

TREE, OBJECT = "tree:", "pickle:"
#: A class of the model's own code in a kept output, named by its source (``CLASS``,
#: label, file name, qualified name): a pickle names a class by its module, and one file
#: is a module of another name in each process (``cachebuild warm`` imports MODEL.py under
#: a name of its own, a server as ``__main__`` or as what it imported).
CLASS = "class"
ITEM = "item"  # a graph output's .item() in a kept output (``ReturnedItem``)
INPUT, ARG = "input", "arg"  # a graph input or a call's argument returned as it is


class Returned(int):
    """An int a traced graph returned: an object of its own, so that the output found
    holding it is told apart from an equal int the forward made (CPython keeps one object
    per small int)."""


class ReturnedItem(float):
    """A float the forward took from the graph's output ``position`` with ``.item()``:
    Dynamo returns a float computed from sizes (``x.shape[0] / 2``) as a 0-dim tensor
    of the graph and calls ``.item()`` on it after."""

    position: int


class _Itemized(torch.Tensor):
    """A graph output whose ``.item()`` says where it came from (``ReturnedItem``)."""

    position: int

    def item(self) -> Any:  # type: ignore[override]
        value = ReturnedItem(super().item())
        value.position = self.position
        return value


def item_outputs(gm: torch.fx.GraphModule) -> set[int]:
    """The positions of ``gm``'s outputs that Dynamo made to hand a float back through
    ``.item()`` (``torch.scalar_tensor`` of a value computed from sizes)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return {i for i, v in enumerate(out.args[0]) if isinstance(v, torch.fx.Node)
            and v.op == "call_function" and v.target is torch.scalar_tensor}


def returned(outputs: Sequence[Any], items: set[int] = frozenset()) -> tuple[Any, ...]:
    """``outputs`` with each int made a ``Returned`` and each output in ``items``
    (``item_outputs``) one whose ``.item()`` is a ``ReturnedItem`` (see ``output_recipe``)."""
    marked = []
    for i, v in enumerate(outputs):
        if type(v) is int:
            v = Returned(v)
        elif i in items and isinstance(v, torch.Tensor):
            v = v.as_subclass(_Itemized)
            v.position = i
        marked.append(v)
    return tuple(marked)


def output_recipe(output: Any, graph_outputs: Sequence[Any],
                  graph_inputs: Sequence[Any] = (), call_args: Sequence[Any] = ()) -> str:
    """How to rebuild ``output`` from the graph's outputs, as a string.

    A tensor returned as it is (Dynamo hands it back from the caller's frame, not through
    the graph) is taken, at each call, from the graph's inputs where the graph reads it
    (an argument, a weight), else from the call's arguments.

    Raises UsageError if the output holds a tensor that is none of these (a weight that
    the graph does not read, returned as it is) or an object that cannot be kept.
    """
    leaves, spec = pytree.tree_flatten(output)
    if len(leaves) == len(graph_outputs) and all(
            a is b for a, b in zip(leaves, graph_outputs, strict=True)):
        try:
            return TREE + pytree.treespec_dumps(spec)
        except Exception:
            pass  # a node type without a serialised name: keep it as an object
    # A size the graph returns (``x.shape[0]``) is a ``Returned`` int there (``returned``)
    # and the same object in the output: taken from the graph's outputs at each call, not
    # kept as the traced call's value; so is a float taken from one (``ReturnedItem``). A
    # number the forward made (a constant, equal or not) is another object and is kept.
    position = {id(t): i for i, t in enumerate(graph_outputs)
                if isinstance(t, (torch.Tensor, Returned))}
    passed = {id(t): (ARG, i) for i, t in enumerate(call_args) if isinstance(t, torch.Tensor)}
    passed |= {id(t): (INPUT, i) for i, t in enumerate(graph_inputs)
               if isinstance(t, torch.Tensor)}

    class Template(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, type):
                return _by_source(obj)
            if isinstance(obj, Returned) and id(obj) in position:
                return position[id(obj)]
            if isinstance(obj, ReturnedItem):
                return ITEM, obj.position
            if isinstance(obj, torch.Tensor):
                if id(obj) in position:
                    return position[id(obj)]
                if id(obj) in passed:
                    return passed[id(obj)]
                raise UsageError(
                    "the model's output holds a tensor its graph neither computes nor reads (a "
                    "weight returned as it is): return a computed tensor instead")
            return None

    buffer = io.BytesIO()
    try:
        Template(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(output)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise UsageError(f"the model's output ({type(output).__name__}) cannot be rebuilt without "
                         f"Dynamo: {e}") from e
    return OBJECT + base64.b64encode(buffer.getvalue()).decode()


Builder = Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], Any]


def _by_source(cls: type) -> tuple[str, str, str, str] | None:
    """How a kept output names ``cls``: by its source (``CLASS``) where it is a class of a
    file outside installed libraries that a process finds again that way (the module of
    that source, the qualified name in it); None (by module name, as pickle does) for
    anything else: installed code, a class made inside a function, one from a notebook
    cell (no module's file holds its source)."""
    if "<locals>" in cls.__qualname__:
        return None
    label = object_label(cls)
    if not is_label(label):
        return None
    module = sys.modules.get(cls.__module__)
    named = CLASS, label, os.path.basename(getattr(module, "__file__", "") or ""), \
        cls.__qualname__
    try:
        found = _class_of(*named[1:])
    except UsageError:
        return None
    return named if found is cls else None


def _class_of(label: str, file_name: str, qualname: str) -> type:
    """The class ``qualname`` of the loaded module whose source has ``label``."""
    module = find_module(label, file_name or None)
    found: Any = module
    for part in qualname.split(".") if module is not None else ():
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise UsageError(f"the model's output is a {qualname} of {file_name or 'its file'}, "
                         "and no module loaded in this process has that file's source as "
                         "it was traced: import the model's file before its first call")
    return found


def output_builder(recipe: str) -> Builder:
    """A function from a call's graph outputs, graph inputs and arguments to the model's
    output, for ``recipe``."""
    if recipe.startswith(OBJECT):
        data = base64.b64decode(recipe[len(OBJECT):])

        def build(outs: Sequence[Any], ins: Sequence[Any], args: Sequence[Any]) -> Any:
            def value(pid: Any) -> Any:
                if type(pid) is int:
                    return outs[pid]
                if pid[0] == CLASS:
                    return _class_of(*pid[1:])
                kind, i = pid
                return ins[i] if kind == INPUT else args[i] if kind == ARG else outs[i].item()

            unpickler = pickle.Unpickler(io.BytesIO(data))
            unpickler.persistent_load = value  # type: ignore[assignment]
            return unpickler.load()

        return build
    spec = pytree.treespec_loads(recipe.removeprefix(TREE))
    return lambda outs, ins, args: pytree.tree_unflatten(list(outs), spec)
