"""The Inductor backend, in two artifact flavours.

``aoti``: the piece is exported (weights are inputs, so one artifact serves every
identical layer) and compiled by AOTInductor into a package (``aoti.py``); it loads
through torch's C++ package loader, so a loading process imports neither Inductor nor
Dynamo and builds nothing, and on CUDA it can be captured into CUDA graphs.
``standalone``: ``torch._inductor.standalone_compile`` bytes; the fallback for machines
where no C++ compiler makes AOTI libraries that load (``probe.py``) and for a piece
AOTInductor rejects. ``auto`` picks per piece and records the choice in the artifact's
kind; a build that fails for want of disk or memory fails, it never changes the flavour.
Every build uses the compiler the probe chose (``toolchain``), which is a key factor.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from cachebuild.backends import aoti
from cachebuild.backends.base import (
    Artifact,
    BuildRequest,
    bucket_bounds,
    dynamic_dims_of,
    example_inputs,
    symbolic_fake_inputs,
)
from cachebuild.backends.pack import pack, read_packed
from cachebuild.errors import ConfigError, transient

log = logging.getLogger("cachebuild.inductor")

VERSION = "3"  # 3: AOTI packages (.pt2) built with the probed compiler


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

    def toolchain(self, config: Any, device: str, probe_dir: Path | None) -> dict[str, Any]:
        """The C++ compiler builds use here, and whether AOTI libraries load (``aoti``).

        Probes once per environment (``probe.py``). Raises ConfigError for flavour
        ``aoti`` where no compiler makes libraries that load.
        """
        from cachebuild.backends.probe import compiler_version, verdict

        found = verdict(device, probe_dir)
        if found.compiler is not None:
            return {"aoti": True, **found.compiler.factors()}
        if config.flavour == "aoti":
            raise ConfigError(f"flavour 'aoti' needs a C++ compiler whose AOTInductor "
                              f"libraries load here, and none does ({found.describe()}); "
                              "use flavour 'auto' or 'standalone'")
        # No compiler passes: standalone artifacts, built with Inductor's default compiler.
        default = os.environ.get("CXX") or "g++"
        return {"aoti": False, "cxx": shutil.which(default) or default,
                "cxx_version": compiler_version(default)}

    # -- compile -----------------------------------------------------------------------

    def compile(self, request: BuildRequest) -> Artifact:
        flavour = request.config.flavour
        device = request.input_metas[0].device if request.input_metas else "cpu"
        toolchain = request.toolchain
        if flavour == "auto":
            flavour = "aoti" if toolchain.get("aoti") else "standalone"
        compiler = toolchain.get("cxx")
        if flavour == "aoti":
            try:
                return self._compile_aoti(request, device, compiler)
            except Exception as e:
                if request.config.flavour == "aoti" or transient(e):
                    raise
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                artifact = self._compile_standalone(request, compiler)
                artifact.fallback = f"AOTInductor cannot take it: {type(e).__name__}: {reason}"
                return artifact
        return self._compile_standalone(request, compiler)

    def _compile_aoti(self, request: BuildRequest, device: str, compiler: str | None) -> Artifact:
        from torch.export import Dim

        args = example_inputs(request.input_metas, request.bucket)
        if any(not isinstance(a, torch.Tensor) for a in args):
            raise ValueError("AOTInductor pieces take tensors only (the piece takes a "
                             "plain integer that no tensor input's size gives)")
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
            with tempfile.TemporaryDirectory(prefix="cachebuild-aoti-") as tmp:
                path = aoti.build_package(ep, os.path.join(tmp, "piece.pt2"),
                                          _inductor_options(request), compiler)
                with open(path, "rb") as f:
                    payload = f.read()
        kind = "aoti-cuda" if device.startswith("cuda") else "aoti-cpu"
        return Artifact(kind, payload)

    def _compile_standalone(self, request: BuildRequest, compiler: str | None) -> Artifact:
        from torch._inductor import config, standalone_compile
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        from cachebuild import compat
        from cachebuild.facts import record_example_values

        fake_mode, fake_args = symbolic_fake_inputs(request.input_metas, request.bucket)
        record_example_values(request.gm, fake_args)
        options = {"config_patches": _inductor_options(request)}
        cpu = all(m.device_type == "cpu" for m in request.input_metas if m.kind == "tensor")
        # On CPU the artifact holds C++ source that a loading process would build again:
        # compile into an empty Inductor cache, so that the built kernels found there
        # afterwards are exactly this artifact's, and ship them with it.
        # No precompiled headers either: their path enters the kernels' cache keys, and a
        # loading process must find the kernels under the same keys (see load_standalone).
        patches: dict[str, Any] = {"cpp_cache_precompile_headers": not cpu}
        if compiler:
            patches["cpp.cxx"] = (None, compiler)
        with compat.fresh_inductor_cache() if cpu else contextlib.nullcontext(), \
                config.patch(patches):
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
                # The compiler enters the kernels' cache keys: a loading process must use
                # the same one to find them (else it would build them again).
                build = json.dumps({"cxx": compiler}).encode()
                payload = pack({"artifact.bin": payload, "build.json": build, **kernels})
        return Artifact("standalone", payload)

    # -- load --------------------------------------------------------------------------

    def load(self, kind: str, key: str, store: Any, device: str) -> Any:
        if kind in ("aoti-cpu", "aoti-cuda"):
            path = store.materialize(key, ".pt2")
            return None if path is None else aoti.load_package(path, device)
        if kind == "standalone":
            return load_standalone(key, store)
        raise ValueError(f"inductor backend cannot load artifacts of kind {kind!r}")


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
    build = json.loads(parts.pop("build.json", b"{}"))
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

    patches: dict[str, Any] = {"cpp_cache_precompile_headers": False}
    if build.get("cxx"):
        patches["cpp.cxx"] = (None, build["cxx"])
    with tempfile.TemporaryDirectory(prefix="cachebuild-sa-") as tmp, config.patch(patches):
        artifact = os.path.join(tmp, "artifact.bin")
        with open(artifact, "wb") as f:
            f.write(parts["artifact.bin"])
        return CompiledArtifact.load(path=artifact, format="binary")
