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

from cachebuild.backends.base import Artifact, BuildRequest, symbolic_fake_inputs
from cachebuild.fxjson import GraphFormatError, data_to_module, graph_to_data

VERSION = "1"


class EagerFusionBackend:
    name = "eager_fusion"

    def factors(self, config: Any) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION}

    def toolchain(self, config: Any, device: str, probe_dir: Any) -> dict[str, Any]:
        return {}  # no code generation: nothing about the machine's compilers matters

    def compile(self, request: BuildRequest) -> Artifact:
        from torch.fx.experimental.proxy_tensor import make_fx

        fake_mode, fake_args = symbolic_fake_inputs(request.input_metas, request.bucket)
        fn = torch.func.functionalize(request.gm, remove="mutations_and_views")
        with fake_mode, torch.no_grad():
            lowered = make_fx(fn, tracing_mode="symbolic")(*fake_args)
        if request.passes is not None:
            request.passes(lowered.graph)
        lowered.graph.eliminate_dead_code()
        lowered.recompile()
        payload = json.dumps({"nodes": graph_to_data(lowered.graph)}).encode()
        return Artifact("fx-graph", payload)

    def load(self, kind: str, key: str, store: Any, device: str) -> Any:
        if kind != "fx-graph":
            raise ValueError(f"eager_fusion cannot load artifacts of kind {kind!r}")
        data = store.get(key)
        if data is None:
            return None
        try:
            nodes = json.loads(data)["nodes"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise GraphFormatError(f"stored graph of target {key} is not graph data") from None
        try:
            return data_to_module(nodes)
        except GraphFormatError as e:
            raise GraphFormatError(f"stored graph of target {key} was not loaded: {e}") from None
