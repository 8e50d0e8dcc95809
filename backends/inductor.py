"""The Inductor backend, in two artifact flavours.

``aoti``: the piece is exported (weights are inputs, so one artifact serves every
identical layer) and compiled by AOTInductor into a shared library; it loads through
torch's C++ runner, so a loading process imports neither Inductor nor Dynamo and, on
CPU, builds nothing. ``standalone``: ``torch._inductor.standalone_compile`` bytes; the
fallback where AOTI packages cannot load (``probe.py``) or a piece AOTInductor rejects.
``auto`` picks per piece and records the choice in the artifact's kind.
"""

from __future__ import annotations

import contextlib
import glob
import json
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

VERSION = "2"  # 2: packed payloads (AOTI proxy JSON, CPU kernels of standalone)


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
                        payload = pack({"library": payload, "proxy.json": f.read()})
        kind = "aoti-cuda" if device.startswith("cuda") else "aoti-cpu"
        return Artifact(kind, payload, {"flavour": "aoti"})

    def _compile_standalone(self, request: BuildRequest) -> Artifact:
        from torch._inductor import standalone_compile
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        from cachebuild import compat
        from cachebuild.split import record_example_values

        fake_mode, fake_args = symbolic_fake_inputs(request.input_metas, request.bucket)
        record_example_values(request.gm, fake_args)
        options = {"config_patches": _inductor_options(request)}
        cpu = all(m.device_type == "cpu" for m in request.input_metas if m.kind == "tensor")
        # On CPU the artifact holds C++ source that a loading process would build again:
        # compile into an empty Inductor cache, so that the built kernels found there
        # afterwards are exactly this artifact's, and ship them with it.
        from torch._inductor import config

        # No precompiled headers either: their path enters the kernels' cache keys, and a
        # loading process must find the kernels under the same keys (see load_standalone).
        with compat.fresh_inductor_cache() if cpu else contextlib.nullcontext(), \
                config.patch(cpp_cache_precompile_headers=not cpu):
            with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
                art = standalone_compile(request.gm, fake_args,
                                         dynamic_shapes="from_tracing_context", options=options)
            with tempfile.TemporaryDirectory(prefix="cachebuild-sa-") as tmp:
                path = os.path.join(tmp, "artifact.bin")
                art.save(path=path, format="binary")
                with open(path, "rb") as f:
                    payload = f.read()
            if cpu:
                root = cache_dir()
                kernels = {}
                # Libraries and their object files: Inductor rebuilds any missing one.
                for built in glob.glob(os.path.join(root, "**", "*.[os]*"), recursive=True):
                    if built.endswith((".so", ".o")):
                        with open(built, "rb") as f:
                            kernels[os.path.relpath(built, root)] = f.read()
                payload = pack({"artifact.bin": payload, **kernels})
        return Artifact("standalone", payload, {"flavour": "standalone"})

    # -- load --------------------------------------------------------------------------

    def load(self, kind: str, key: str, store: Any) -> Any:
        if kind in ("aoti-cpu", "aoti-cuda"):
            return load_aoti(kind, key, store)
        if kind == "standalone":
            return load_standalone(key, store)
        raise ValueError(f"inductor backend cannot load artifacts of kind {kind!r}")


PACK_MAGIC = b"CBPACK\x01"


def pack(parts: dict[str, bytes]) -> bytes:
    """Several named files as one payload: magic, a JSON table of names and sizes, bytes."""
    table = json.dumps([[name, len(data)] for name, data in parts.items()]).encode()
    return PACK_MAGIC + len(table).to_bytes(8, "little") + table + b"".join(parts.values())


def unpack(data: bytes) -> dict[str, bytes] | None:
    """The files ``pack`` joined, or None if ``data`` is a single plain file."""
    if not data.startswith(PACK_MAGIC):
        return None
    start = len(PACK_MAGIC) + 8
    end = start + int.from_bytes(data[len(PACK_MAGIC):start], "little")
    parts, offset = {}, end
    for name, size in json.loads(data[start:end]):
        parts[name] = data[offset: offset + size]
        offset += size
    return parts


def read_packed(path: str | os.PathLike[str]) -> dict[str, bytes] | None:
    """The files packed in ``path``, or None (without reading it whole) for a plain file."""
    with open(path, "rb") as f:
        if f.read(len(PACK_MAGIC)) != PACK_MAGIC:
            return None
        f.seek(0)
        return unpack(f.read())


def _library_file(key: str, store: Any) -> tuple[str, str | None] | None:
    """A path to the artifact's library, with its JSON beside it where it has one, and
    the private folder to remove once the library is loaded (None for the store's file)."""
    path = store.materialize(key, ".so")
    if path is None:
        return None
    parts = read_packed(path)
    if parts is None:
        return str(path), None
    # A packed artifact is unpacked into a directory private to this process, from the
    # verified materialised file, so what is loaded is exactly what the store verified.
    folder = tempfile.mkdtemp(prefix="cachebuild-aoti-")
    for suffix, data in (("so", parts["library"]), ("json", parts["proxy.json"])):
        with open(os.path.join(folder, f"{key}.{suffix}"), "wb") as f:
            f.write(data)
    return os.path.join(folder, f"{key}.so"), folder


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
    """Load a standalone artifact; kernels built on CPU go into Inductor's cache first."""
    from torch._inductor import CompiledArtifact
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = store.materialize(key, ".bin")
    if path is None:
        return None
    parts = read_packed(path)
    if parts is None:  # a plain artifact (GPU): Inductor reads it itself
        return CompiledArtifact.load(path=str(path), format="binary")
    root = cache_dir()
    for name, data in parts.items():
        target = os.path.join(root, name)
        if name != "artifact.bin" and not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)  # atomic: a concurrent loader sees all or nothing
    # Inductor would first precompile a header for kernels it may build (it runs the C++
    # preprocessor even when the kernel's library exists); every kernel is here already.
    from torch._inductor import config

    with tempfile.TemporaryDirectory(prefix="cachebuild-sa-") as tmp, \
            config.patch(cpp_cache_precompile_headers=False):
        artifact = os.path.join(tmp, "artifact.bin")
        with open(artifact, "wb") as f:
            f.write(parts["artifact.bin"])
        return CompiledArtifact.load(path=artifact, format="binary")
