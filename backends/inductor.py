"""The Inductor backend, in two artifact flavours.

``aoti``: the piece is exported (weights are inputs, so one artifact serves every
identical layer) and compiled by AOTInductor into a shared library; it loads through
torch's C++ runner, so a loading process imports neither Inductor nor Dynamo and, on
CPU, builds nothing. ``standalone``: ``torch._inductor.standalone_compile`` bytes; the
fallback where AOTI packages cannot load (``probe.py``) or a piece AOTInductor rejects.
``auto`` picks per piece and records the choice in the artifact's kind.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
from typing import Any

import torch

from cachebuild.backends.base import (
    Artifact,
    BuildRequest,
    bucket_bounds,
    dynamic_dims_of,
    example_inputs,
    symbolic_fake_inputs,
)

log = logging.getLogger("cachebuild.inductor")

VERSION = "1"


def _inductor_options(request: BuildRequest) -> dict[str, Any]:
    options = request.config.inductor_options_dict()
    if request.passes is not None and request.passes.passes:
        options["post_grad_custom_post_pass"] = request.passes.as_inductor_pass()
    return options


class InductorBackend:
    name = "inductor"

    def factors(self, config: Any) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION, "flavour": config.flavour,
                "options": config.factors()["inductor_options"]}

    # -- compile -----------------------------------------------------------------------

    def compile(self, request: BuildRequest) -> Artifact:
        flavour = request.config.flavour
        device = request.input_metas[0].device if request.input_metas else "cpu"
        if flavour == "auto":
            from cachebuild.backends.probe import aoti_loads

            flavour = "aoti" if aoti_loads(device) else "standalone"
        if flavour == "aoti":
            try:
                return self._compile_aoti(request, device)
            except Exception as e:
                if request.config.flavour == "aoti":
                    raise
                log.info("AOTInductor rejected piece %s (%s); using standalone",
                         request.key[:12], str(e).splitlines()[0] if str(e) else type(e).__name__)
        return self._compile_standalone(request)

    def _compile_aoti(self, request: BuildRequest, device: str) -> Artifact:
        from torch.export import Dim

        from cachebuild import compat

        args = example_inputs(request.input_metas, request.bucket)
        if any(not isinstance(a, torch.Tensor) for a in args):
            raise ValueError("AOTInductor pieces take tensors only")
        bounds = bucket_bounds(request.bucket)
        dims: dict[str, Any] = {}
        shapes = []
        for per_input in dynamic_dims_of(request.input_metas):
            spec = {}
            if bounds is not None:
                for d, sym in per_input.items():
                    if sym not in dims:
                        dims[sym] = Dim(f"d_{sym}", min=bounds[0], max=bounds[1])
                    spec[d] = dims[sym]
            shapes.append(spec or None)
        with torch.no_grad():
            ep = torch.export.export(request.gm, tuple(args), dynamic_shapes=tuple(shapes),
                                     strict=False)
            options = _inductor_options(request)
            options.update(compat.aoti_single_file_options(device))
            with tempfile.TemporaryDirectory(prefix="cachebuild-aoti-") as tmp:
                options["aot_inductor.output_path"] = os.path.join(tmp, "piece.so")
                so_path = torch._inductor.aot_compile(ep.module(), tuple(args), options=options)
                with open(so_path, "rb") as f:
                    payload = f.read()
                # Custom ops run through a proxy executor described by a JSON file that the
                # runner looks for beside the library: then both travel as one artifact.
                proxy = [p for p in glob.glob(os.path.join(os.path.dirname(so_path), "*.json"))
                         if not p.endswith("_metadata.json")]
                if proxy:
                    with open(proxy[0], "rb") as f:
                        payload = pack_library(payload, f.read())
        kind = "aoti-cuda" if device.startswith("cuda") else "aoti-cpu"
        return Artifact(kind, payload, {"flavour": "aoti"})

    def _compile_standalone(self, request: BuildRequest) -> Artifact:
        from torch._inductor import standalone_compile

        from cachebuild.split import record_example_values

        fake_mode, fake_args = symbolic_fake_inputs(request.input_metas, request.bucket)
        record_example_values(request.gm, fake_args)
        options = {"config_patches": _inductor_options(request)}
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            art = standalone_compile(request.gm, fake_args, dynamic_shapes="from_tracing_context",
                                     options=options)
        with tempfile.TemporaryDirectory(prefix="cachebuild-sa-") as tmp:
            path = os.path.join(tmp, "artifact.bin")
            art.save(path=path, format="binary")
            with open(path, "rb") as f:
                payload = f.read()
        return Artifact("standalone", payload, {"flavour": "standalone"})

    # -- load --------------------------------------------------------------------------

    def load(self, kind: str, key: str, store: Any) -> Any:
        if kind in ("aoti-cpu", "aoti-cuda"):
            return load_aoti(kind, key, store)
        if kind == "standalone":
            return load_standalone(key, store)
        raise ValueError(f"inductor backend cannot load artifacts of kind {kind!r}")


PACK_MAGIC = b"CBAOTI\x01"


def pack_library(library: bytes, proxy_json: bytes) -> bytes:
    """One payload holding an AOTI library and its custom-op JSON."""
    return PACK_MAGIC + len(library).to_bytes(8, "little") + library + proxy_json


def _library_file(key: str, store: Any) -> tuple[str, str | None] | None:
    """A path to the artifact's library, with its JSON beside it where it has one, and
    the private folder to remove once the library is loaded (None for the store's file)."""
    path = store.materialize(key, ".so")
    if path is None:
        return None
    with open(path, "rb") as f:
        head = f.read(len(PACK_MAGIC) + 8)
    if not head.startswith(PACK_MAGIC):
        return str(path), None
    # A packed artifact is unpacked into a directory private to this process, from the
    # verified materialised file, so what is loaded is exactly what the store verified.
    n = int.from_bytes(head[len(PACK_MAGIC):], "little")
    with open(path, "rb") as f:
        data = f.read()
    folder = tempfile.mkdtemp(prefix="cachebuild-aoti-")
    lib = os.path.join(folder, f"{key}.so")
    with open(lib, "wb") as f:
        f.write(data[len(head): len(head) + n])
    with open(os.path.join(folder, f"{key}.json"), "wb") as f:
        f.write(data[len(head) + n:])
    return lib, folder


def load_aoti(kind: str, key: str, store: Any) -> Any:
    """Load an AOTI shared library through torch's C++ runner (no Inductor import)."""
    found = _library_file(key, store)
    if found is None:
        return None
    path, private = found
    try:
        if kind == "aoti-cpu":
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(path, 1)
        else:
            runner = torch._C._aoti.AOTIModelContainerRunnerCuda(path, 1)
    finally:
        if private is not None:  # loaded (the JSON is read at load): the files can go
            shutil.rmtree(private, ignore_errors=True)

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        return runner.run(list(args))

    run.runner = runner  # type: ignore[attr-defined]  # keeps the library loaded
    return run


def load_standalone(key: str, store: Any) -> Any:
    from torch._inductor import CompiledArtifact

    path = store.materialize(key, ".bin")
    if path is None:
        return None
    art = CompiledArtifact.load(path=str(path), format="binary")
    return art
