"""Targets: (compiled piece × shape bucket), each with a key and a manifest.

The key covers everything that decides the compiled output, named as factors:

- ``graph``: the piece in canonical form: its nodes in order with every name replaced by
  its position (``i0`` for the first input, ``v3`` for the fourth node), so layers that
  compute the same thing on different weights give the same graph; plus each input's
  metadata (dtype, shape and stride with symbols renamed in order of appearance, device
  type).
- ``bucket``: ``{"range": [lo, hi]}`` or ``{"size": n}``.
- ``backend``: the backend's name, version and options (``Backend.factors``).
- ``passes``: each enabled pass's name and uuid, and the pass config.
- ``env``: torch, triton, CUDA, device, Python and schema versions (``env.py``).
- ``recipe``: this recipe's version (``RECIPE``).
- ``distributed`` (only for a piece that calls collectives): the world size and the layout
  of the process groups it names (``distributed.layout_factors``). No rank and no device
  index enter a key (inputs keep the device *type*), so ranks whose shards are equal
  share every target, on whichever GPU each one runs.

Weights never enter a key: they are inputs of the piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachebuild import compat, keep
from cachebuild.graph.facts import (
    SYMBOL,
    InputMeta,
    random_ops,
    torch_dir,
    user_op_files,
    user_op_state,
)
from cachebuild.graph.graphdiff import user_frame
from cachebuild.keys import make_key
from cachebuild.tracing.distributed import layout_factors
from cachebuild.tracing.split import Piece
from cachebuild.trust.fxjson import graph_to_data
from cachebuild.trust.sources import digest_of

if TYPE_CHECKING:
    from cachebuild.config import CompileConfig


@dataclass(frozen=True)
class Target:
    """One thing to build: piece ``piece`` of a split, specialised to ``bucket``.

    ``sources``: per node of the piece's graph, where the trace recorded it (``file:line``
    of the model's code, or None); for ``explain``, never part of the key.
    """

    key: str
    piece: int
    bucket: dict[str, Any]
    manifest: dict[str, Any]
    sources: tuple[str | None, ...] = ()


@dataclass
class BuildJob:
    """A target plus what is needed to compile it anywhere (picklable, no live graph): what
    ``build.Builder`` builds, here or in a worker process (``workers``)."""

    target: Target
    nodes: list[dict[str, Any]]
    input_metas: list[InputMeta]
    config: CompileConfig


def bucket_label(bucket: dict[str, Any]) -> str:
    if "size" in bucket:
        return f"size {bucket['size']}"
    if "range" not in bucket:
        return "static shapes"
    lo, hi = bucket["range"]
    return f"range {lo}-{hi}"


def _rename_refs(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, list):
        return [_rename_refs(v, names) for v in value]
    if isinstance(value, dict):
        if set(value) == {"n"}:
            return {"n": names[value["n"]]}
        return {k: _rename_refs(v, names) for k, v in value.items()}
    return value


def canonical_graph(nodes: list[dict[str, Any]], metas: list[InputMeta]) -> dict[str, Any]:
    """The canonical form of a piece: positional names, canonical symbols."""
    names: dict[str, str] = {}
    inputs = 0
    for i, node in enumerate(nodes):
        if node["op"] == "placeholder":
            names[node["name"]] = f"i{inputs}"
            inputs += 1
        else:
            names[node["name"]] = f"v{i}"
    canon_nodes = []
    for node in nodes:
        target = node["target"] if node["op"] != "placeholder" else ""
        canon_nodes.append([node["op"], target, _rename_refs(node["args"], names),
                            _rename_refs(node["kwargs"], names)])
    symbols: dict[str, str] = {}

    def canon(dim: int | str) -> int | str:
        if isinstance(dim, int):
            return dim
        return SYMBOL.sub(lambda m: symbols.setdefault(m.group(), f"s{len(symbols)}"), dim)

    inputs_meta = [
        {"kind": m.kind, "dtype": m.dtype, "shape": [canon(d) for d in m.shape],
         "stride": [canon(s) for s in m.stride], "device": m.device_type}
        for m in metas
    ]
    return {"nodes": canon_nodes, "inputs": inputs_meta}


def piece_data(piece: Piece) -> list[dict[str, Any]]:
    """A piece's graph as stored data (``fxjson``)."""
    return graph_to_data(piece.gm.graph)


def op_sources(graph: Any) -> dict[str, list[str | None]]:
    """The source hashes of the files that registered each operator ``graph`` calls beyond
    torch's and cachebuild's (``facts.op_files``): a build may inline their kernels (a
    ``CompositeImplicitAutograd`` decomposition), which the graph names only by the op's
    name, so an edit of them is another target; then what those kernels read besides
    their code (``facts.user_op_state``: environment variables, module constants), which
    the build bakes in. Empty where there is none (other keys stay as they were)."""
    state = user_op_state(graph)
    out: dict[str, list[str | None]] = {
        qualname: [digest_of(f) for f in files]
        for qualname, files in user_op_files(graph).items()}
    for qualname, said in state.items():
        out.setdefault(qualname, []).extend(said)
    return out


#: The version of this recipe, a factor of every key: bumped where a factor is added that
#: only some keys carry, whose absence meant any value before. 2: ``default_dtype`` and
#: ``codegen``: a version before them built a target under a float64 default dtype or
#: TF32 matmuls with the key a default process's target now has, so no target of an
#: older version is found (each is built again once).
RECIPE = 2

#: The manifest factor naming the default dtype a piece was traced under, where it is not
#: float32: a graph's ``torch.ones(n)``, or an integer tensor times a Python float, takes
#: it, and the graph does not say which it was (other keys stay as they were).
DEFAULT_DTYPE = "default_dtype"


def traced_default_dtype() -> str | None:
    """The default dtype a trace in this process runs under, by name, where it is not
    float32 (see ``DEFAULT_DTYPE``)."""
    import torch

    dtype = torch.get_default_dtype()
    return None if dtype == torch.float32 else str(dtype).removeprefix("torch.")


#: The manifest factor naming the settings Inductor generates other code under, where the
#: tracing process set them otherwise than torch's defaults (``compat.codegen_settings``:
#: TF32 or bfloat16 matmuls, deterministic algorithms): a build worker has the defaults
#: (other keys stay as they were).
CODEGEN = "codegen"


#: The manifest factor naming the autocast a piece was traced under, where it was on
#: (``{"cpu": "bfloat16"}``): only ``eager_fusion`` serves such calls, its pieces lowered
#: under it, with its casts in the graph (other keys stay as they were).
AUTOCAST = "autocast"


def traced_autocast() -> dict[str, str] | None:
    """The devices autocast is on for in this thread, with the dtype it casts to (see
    ``AUTOCAST``); None where it is off."""
    import torch

    on = {d: str(torch.get_autocast_dtype(d)).removeprefix("torch.")
          for d in keep.AUTOCAST_DEVICES if torch.is_autocast_enabled(d)}
    return on or None


#: The manifest factor naming the ops a piece draws random numbers with, where it has any:
#: its code draws them as eager does (Inductor's ``fallback_random``), which code built
#: before it did not (other keys stay as they were).
RANDOM = "random"


@contextlib.contextmanager
def traced_settings(manifest: dict[str, Any]) -> Iterator[None]:
    """Run the block under the process-wide settings ``manifest``'s piece was traced under
    (``DEFAULT_DTYPE``, ``CODEGEN``, ``AUTOCAST``; torch's defaults where it names none), put back
    afterwards: a target is built and proven as its tracing process would have built it."""
    with keep.default_dtype(manifest.get(DEFAULT_DTYPE)), \
            keep.codegen_settings(manifest.get(CODEGEN)), \
            keep.autocast(manifest.get(AUTOCAST)):
        yield


def make_targets(pieces: list[Piece], buckets: list[dict[str, Any]], *, backend: dict[str, Any],
                 passes: dict[str, Any], env: dict[str, Any]) -> dict[int, list[Target]]:
    """Every target of every compiled piece, keyed by the factors above.

    Returns piece index → its targets in bucket order. Identical pieces share keys.
    """
    out: dict[int, list[Target]] = {}
    dtype = traced_default_dtype()
    settings = compat.codegen_settings()
    autocast = traced_autocast()
    for piece in pieces:
        if not piece.compiled:
            continue
        nodes = piece_data(piece)
        graph = canonical_graph(nodes, piece.input_metas)
        layout = layout_factors(nodes)
        sources = tuple(user_frame(n.meta.get("stack_trace"), torch_dir())
                        for n in piece.gm.graph.nodes)
        ops = op_sources(piece.gm.graph)
        drawn = random_ops(piece.gm.graph)
        targets = []
        for bucket in buckets if piece.size_input is not None else [{"static": True}]:
            manifest = {"graph": graph, "bucket": bucket, "backend": backend,
                        "passes": passes, "env": env, "recipe": RECIPE}
            if layout is not None:
                manifest["distributed"] = layout
            if ops:
                manifest["ops"] = ops
            if dtype is not None:
                manifest[DEFAULT_DTYPE] = dtype
            if settings:
                manifest[CODEGEN] = settings
            if drawn:
                manifest[RANDOM] = drawn
            if autocast:
                manifest[AUTOCAST] = autocast
            targets.append(Target(make_key(manifest), piece.index, bucket, manifest, sources))
        out[piece.index] = targets
    return out

