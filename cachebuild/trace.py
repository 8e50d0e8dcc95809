"""Tracing a model once with Dynamo into a TracedGraph.

The graph's placeholders are bound *by identity* at trace time: Dynamo hands the backend
the live tensors in placeholder order, so each one is either a parameter or buffer of
the model (bound by its path), a call argument (by position), or, for a SymInt, the size
of a dynamic dim of a call argument. That binding is all a warm process needs to feed a
stored graph from a live model, with no Dynamo.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import xxhash

from cachebuild.errors import UsageError
from cachebuild.facts import SYMBOL, InputMeta, meta_of, torch_dir

__all__ = ["Binding", "InputMeta", "TracedGraph", "ast_hash", "check_dynamic_dims", "meta_of",
           "trace_model"]

@dataclass(frozen=True)
class Binding:
    """Where a graph input comes from in a live call.

    kind ``param``/``buffer``: the model's tensor at ``path``; ``arg``: positional call
    argument ``arg``; ``size``: ``args[arg].shape[dim]``; ``const``: the int ``dim``.
    """

    kind: str
    path: str | None = None
    arg: int | None = None
    dim: int | None = None

    def to_data(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "arg": self.arg, "dim": self.dim}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Binding:
        return cls(**data)


@dataclass
class TracedGraph:
    """A model's forward as one FX graph plus how to feed it."""

    gm: fx.GraphModule
    bindings: list[Binding]
    input_metas: list[InputMeta]
    source_files: dict[str, str]
    out_spec: str
    num_outputs: int
    fake_inputs: list[Any] = field(default_factory=list)


def ast_hash(path: str) -> str | None:
    """Hash of a Python file's syntax tree: comments and blank lines do not change it."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    return xxhash.xxh3_128_hexdigest(
        ast.dump(tree, annotate_fields=False, include_attributes=False).encode())


def _traced_files(code_objects: list[Any]) -> dict[str, str]:
    """Files whose code Dynamo traced, outside torch itself (its version is in every key)."""
    files: dict[str, str] = {}
    for code in code_objects:
        path = os.path.abspath(code.co_filename)
        if path in files or path.startswith(torch_dir()) or not os.path.isfile(path):
            continue
        digest = ast_hash(path)
        if digest is not None:
            files[path] = digest
    return dict(sorted(files.items()))


def _bind(model: torch.nn.Module, args: list[Any], inputs: list[Any],
          dynamic_dims: dict[int, int]) -> list[Binding]:
    by_id: dict[int, Binding] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), Binding("param", path=name))
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), Binding("buffer", path=name))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            by_id[id(a)] = Binding("arg", arg=i)
    bindings = []
    for value in inputs:
        if isinstance(value, torch.SymInt):
            bindings.append(_bind_symint(value, args, dynamic_dims))
        elif isinstance(value, int):
            bindings.append(Binding("const", dim=value))
        elif id(value) in by_id:
            bindings.append(by_id[id(value)])
        else:
            raise UsageError(
                "the traced graph reads a tensor that is neither a parameter, a buffer nor a "
                "call argument of the model (a plain tensor attribute or a global?): register "
                "it with register_buffer so it can be bound in a warm process"
            )
    return bindings


def _bind_symint(value: torch.SymInt, args: list[Any], dynamic_dims: dict[int, int]) -> Binding:
    # All dynamic dims have one size (check_dynamic_dims), so Dynamo's duck sizing gives
    # them one symbol: any SymInt input is that symbol, read off the first dynamic dim.
    expr = str(value.node.expr)
    if not dynamic_dims or not SYMBOL.fullmatch(expr):
        raise UsageError(f"graph takes a symbolic size {expr} that no dynamic dim explains")
    i, d = min(dynamic_dims.items())
    return Binding("size", arg=i, dim=d)


def check_dynamic_dims(args: list[Any], dynamic_dims: dict[int, int]) -> None:
    """Dynamic dims must name tensor arguments and be equal in size (one token count)."""
    sizes = set()
    for i, d in dynamic_dims.items():
        if i >= len(args) or not isinstance(args[i], torch.Tensor):
            raise UsageError(f"dynamic_dims names argument {i}, which is not a tensor argument")
        if d >= args[i].dim() or d < -args[i].dim():
            raise UsageError(f"dynamic_dims names dim {d} of argument {i}, which has {args[i].dim()} dims")
        sizes.add(args[i].shape[d])
    if len(sizes) > 1:
        raise UsageError(f"dynamic dims must have one size (the token count); got sizes {sorted(sizes)}")
    if sizes and min(sizes) < 1:
        raise UsageError("a dynamic dim of size 0 cannot be traced: call with at least one token")


def trace_model(model: torch.nn.Module, args: tuple[Any, ...] | list[Any],
                dynamic_dims: dict[int, int]) -> TracedGraph:
    """Run Dynamo once over ``model(*args)`` and capture its whole forward as one graph.

    The dims in ``dynamic_dims`` (argument index → dim) are traced symbolically. Raises
    UsageError if the forward does not trace into one graph.
    """
    import torch._dynamo
    import torch.utils._pytree as pytree

    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    check_dynamic_dims(args, dynamic_dims)
    for i, d in dynamic_dims.items():
        if args[i].shape[d] == 1:
            # Torch specialises a size of 1; the graph is the same for every size, so a
            # first call with one token is traced with it repeated.
            args[i] = torch.cat([args[i], args[i]], dim=d)
        torch._dynamo.mark_dynamic(args[i], d)

    captured: dict[str, Any] = {}

    def capture(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        if "gm" in captured:
            raise UsageError("the model's forward traced into more than one graph")
        captured["gm"] = gm
        captured["inputs"] = list(example_inputs)
        context = torch._guards.TracingContext.try_get()
        captured["code"] = list(context.traced_code) if context is not None else []
        return gm.forward

    # A fresh Dynamo state: an earlier trace of the same code would otherwise be reused
    # from Dynamo's own cache and never reach our backend.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture, fullgraph=True, dynamic=False)
    try:
        with torch.no_grad():
            output = compiled(*args)
    except torch._dynamo.exc.Unsupported as e:
        raise UsageError(f"the model's forward does not trace as one graph: {str(e).splitlines()[0]}") from e
    finally:
        torch._dynamo.reset()

    gm: fx.GraphModule = captured["gm"]
    inputs = captured["inputs"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    metas = [meta_of(n.meta.get("example_value", v)) for n, v in zip(placeholders, inputs, strict=True)]
    leaves, spec = pytree.tree_flatten(output)
    num_outputs = len(next(iter(n for n in gm.graph.nodes if n.op == "output")).args[0])
    if len(leaves) != num_outputs:
        raise UsageError("the model's output is not a plain structure of the graph's outputs")
    return TracedGraph(
        gm=gm,
        bindings=_bind(model, args, inputs, dynamic_dims),
        input_metas=metas,
        source_files=_traced_files(captured["code"]),
        out_spec=pytree.treespec_dumps(spec),
        num_outputs=num_outputs,
        fake_inputs=[n.meta.get("example_value") for n in placeholders],
    )
