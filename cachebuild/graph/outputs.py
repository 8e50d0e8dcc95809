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
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from cachebuild.errors import UsageError

TREE, OBJECT = "tree:", "pickle:"


def output_recipe(output: Any, graph_outputs: Sequence[Any]) -> str:
    """How to rebuild ``output`` from the graph's outputs, as a string.

    Raises UsageError if the output holds a tensor that the graph does not return (an
    input or a parameter returned as it is) or an object that cannot be kept.
    """
    leaves, spec = pytree.tree_flatten(output)
    if len(leaves) == len(graph_outputs) and all(
            a is b for a, b in zip(leaves, graph_outputs, strict=True)):
        try:
            return TREE + pytree.treespec_dumps(spec)
        except Exception:
            pass  # a node type without a serialised name: keep it as an object
    position = {id(t): i for i, t in enumerate(graph_outputs) if isinstance(t, torch.Tensor)}
    # A size the graph returns (``x.shape[0]``) is an int there, and in the output an int
    # of the same value: taken from the graph's outputs at each call, as the tree above
    # takes it (where ``is`` finds CPython's one object for each small int), not kept as
    # the value of the traced call.
    sizes = {v: i for i, v in enumerate(graph_outputs) if type(v) is int}

    class Template(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if type(obj) is int and obj in sizes:
                return sizes[obj]
            if isinstance(obj, torch.Tensor):
                if id(obj) not in position:
                    raise UsageError(
                        "the model's output holds a tensor its graph does not compute (an input "
                        "or a parameter returned as it is): return a computed tensor instead")
                return position[id(obj)]
            return None

    buffer = io.BytesIO()
    try:
        Template(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(output)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise UsageError(f"the model's output ({type(output).__name__}) cannot be rebuilt without "
                         f"Dynamo: {e}") from e
    return OBJECT + base64.b64encode(buffer.getvalue()).decode()


def output_builder(recipe: str) -> Callable[[Sequence[Any]], Any]:
    """A function from the graph's outputs to the model's output, for ``recipe``."""
    if recipe.startswith(OBJECT):
        data = base64.b64decode(recipe[len(OBJECT):])

        def build(outs: Sequence[Any]) -> Any:
            unpickler = pickle.Unpickler(io.BytesIO(data))
            unpickler.persistent_load = outs.__getitem__  # type: ignore[assignment]
            return unpickler.load()

        return build
    spec = pytree.treespec_loads(recipe.removeprefix(TREE))
    return lambda outs: pytree.tree_unflatten(list(outs), spec)
