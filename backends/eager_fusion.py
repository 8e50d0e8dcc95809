"""The eager_fusion backend: fusion passes without code generation.

For hardware with no Inductor codegen. The piece is functionalised and lowered to aten
ops (AOT-autograd's ``make_fx`` + functionalization, with the dynamic dim symbolic so
one graph serves the whole bucket), the fusion passes rewrite it, and the rewritten
graph is the artifact, stored as data (``fxjson``). Loading it compiles nothing.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from cachebuild.backends.protocol import (
    Artifact,
    Backend,
    BuildRequest,
    check_kept_symbolic,
    range_symbols,
    symbolic_fake_inputs,
)
from cachebuild.graph.facts import device_of, unpin_device
from cachebuild.store.interface import ArtifactSource
from cachebuild.trust.fxjson import GraphFormatError, data_to_module, graph_to_data

VERSION = "2"  # 2: lowered to aten before functionalisation (sizes stay symbolic)


class EagerFusionBackend(Backend):
    name = "eager_fusion"
    generates_code = False  # graphs rewritten and stored as data: no compiler runs

    def factors(self, config: Any) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION}

    def toolchain(self, config: Any, device: str, probe_dir: Any) -> dict[str, Any]:
        return {}  # no code generation: nothing about the machine's compilers matters

    def compile(self, request: BuildRequest) -> Artifact:
        from torch.fx.experimental.proxy_tensor import make_fx

        fake_mode, fake_args = symbolic_fake_inputs(request.input_metas, request.bucket)
        symbols = range_symbols(fake_args, request.input_metas)  # before tracing can pin them
        with fake_mode, torch.no_grad():
            # Lower to aten first, then functionalise the aten graph: functionalising the
            # piece directly runs composite ops (a biased linear on a 3-D input) through
            # kernels that read concrete sizes, which pins the range's size to its hint.
            # Forwards, not modules: a module's __call__ would trace torch's global module
            # hooks (the caller's, for its own modules) into the piece.
            aten = make_fx(lambda *args: request.gm.forward(*args),
                           tracing_mode="symbolic")(*fake_args)
            fn = torch.func.functionalize(lambda *args: aten.forward(*args),
                                          remove="mutations_and_views")
            lowered = make_fx(fn, tracing_mode="symbolic")(*fake_args)
        check_kept_symbolic(fake_mode.shape_env, symbols, request.bucket)
        # Lowering writes the build's GPU into the ops it creates (full, arange...): name
        # it by type, so the graph runs on whichever GPU is current where it is loaded.
        unpin_device(lowered, device_of(request.input_metas))
        inline_constants(lowered)
        if request.passes is not None:
            request.passes(lowered.graph)
        lowered.graph.eliminate_dead_code()
        lowered.recompile()
        payload = json.dumps({"nodes": graph_to_data(lowered.graph)}).encode()
        return Artifact("fx-graph", payload)

    def load(self, kind: str, key: str, source: ArtifactSource, device: str) -> Any:
        if kind != "fx-graph":
            raise ValueError(f"eager_fusion cannot load artifacts of kind {kind!r}")
        data = source.get(key)
        if data is None:
            return None
        try:
            nodes = json.loads(data)["nodes"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise GraphFormatError(f"stored graph of target {key} is not graph data") from None
        try:
            # Its forward, not the module: a module's __call__ would run torch's global
            # module hooks (the caller's, for its own modules) on the piece and its weights.
            return data_to_module(nodes).forward
        except GraphFormatError as e:
            raise GraphFormatError(f"stored graph of target {key} was not loaded: {e}") from None


#: Tensor constants up to this many elements are written into the stored graph as data.
MAX_INLINE_ELEMENTS = 1024


def inline_constants(gm: torch.fx.GraphModule) -> None:
    """Replace the small tensor constants that tracing lifted into attributes (an empty
    cache tensor, a mask pattern) by ``torch.tensor(data, dtype=...)`` calls, so the graph
    can be stored as data. Larger constants stay attributes (and fail to store, with a
    message saying the piece reads an attribute)."""
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or value.numel() > MAX_INLINE_ELEMENTS:
            continue
        with gm.graph.inserting_before(node):
            const = gm.graph.call_function(
                torch.tensor, (value.tolist(),),
                {"dtype": value.dtype, "device": torch.device(value.device.type)})
        node.replace_all_uses_with(const)
        gm.graph.erase_node(node)
        delattr(gm, node.target)
