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
import errno
import glob
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cachebuild import clock, compat, process_state
from cachebuild.backends import aoti, autotune, kernel_dir
from cachebuild.backends.pack import PackError, pack, unpack
from cachebuild.backends.probe import UntrustedCompiler, trusted_compiler
from cachebuild.backends.protocol import (
    Artifact,
    Backend,
    BuildRequest,
    DeviceBound,
    LoadNeeds,
    bucket_bounds,
    dynamic_dims_of,
    example_inputs,
    symbolic_fake_inputs,
)
from cachebuild.errors import ConfigError, causes, transient
from cachebuild.graph.facts import random_ops
from cachebuild.store.interface import ArtifactSource

log = logging.getLogger("cachebuild.inductor")

#: Parts of a ``TORCHINDUCTOR_*`` variable's name that mark one deciding where Inductor
#: keeps files or how many processes it uses, not the code it generates.
_NOT_CODEGEN = ("CACHE", "_DIR", "THREADS", "WORKER", "TRACE", "LOG", "PROFILE")


def inductor_environment() -> dict[str, str]:
    """The ``TORCHINDUCTOR_*`` variables set here that may change the code Inductor
    generates (``TORCHINDUCTOR_MAX_AUTOTUNE``, ``..._EMULATE_PRECISION_CASTS``, ...):
    Inductor reads them as it is imported, in every build worker too, so a target built
    under one is another target. Read from the environment, not from Inductor's config,
    which a warm start does not import (a second or more)."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("TORCHINDUCTOR_") and not any(p in k for p in _NOT_CODEGEN)}


#: 3: AOTI packages (.pt2) built with the probed compiler; 4: the edge pass; 5: a CUDA
#: package's kernel binaries linked into its library (``kernel_binaries_linked``)
VERSION = "5"


def _inductor_options(request: BuildRequest) -> dict[str, Any]:
    from cachebuild.backends.edges import EdgePass  # imports Inductor: builds only

    options = request.config.inductor_options_dict()
    passes = request.passes if request.passes is not None and request.passes.passes else None
    # Every piece gets the edge pass: a piece's outputs must not make Inductor choose
    # other kernels than compiling the whole model would (``edges.py``).
    options["post_grad_custom_post_pass"] = EdgePass(passes)
    if random_ops(request.gm.graph):
        # Eager's random ops, not Inductor's own kernels: a seeded caller gets eager's
        # numbers, and torch's generators are left as eager leaves them.
        options["fallback_random"] = True
    return options


def kernel_binaries_linked() -> dict[str, Any]:
    """AOTInductor's option that links each Triton kernel's binary into a CUDA package's
    library (``aot_inductor.embed_kernel_binary``), where no other user could replace the
    ``ld`` and ``objcopy`` torch then runs from ``PATH``; else none.

    Why: otherwise the wrapper names each kernel by the path of its binary, which holds the
    hash of the kernel's code, so an edit that changes one constant in one kernel changes
    the wrapper's source, and its object (seconds of C++ on CUDA) is compiled again. Linked,
    the wrapper names kernels by their names, which stay, and its object is reused
    (``compilers``)."""
    from cachebuild.backends.executables import replaceable

    for tool in ("ld", "objcopy"):
        found = shutil.which(tool)
        if found is None or replaceable(found) is not None:
            return {}
    return {"aot_inductor.embed_kernel_binary": True}


class InductorBackend(Backend):
    name = "inductor"

    def factors(self, config: Any) -> dict[str, Any]:
        settings = inductor_environment()
        return {"name": self.name, "version": VERSION, "flavour": config.flavour,
                "options": config.factors()["inductor_options"],
                # Only where there is any, so that the keys of the usual case stay as were.
                **({"environment": settings} if settings else {})}

    def toolchain(self, config: Any, device: str, probe_dir: Path | None) -> dict[str, Any]:
        """The C++ compiler builds use here, and whether AOTI libraries load (``aoti``).

        Probes once per environment (``probe.py``); while the probe ``start_toolchain``
        began still runs, what it presumes (``probe.presumed``: builds in workers begin
        with it; the callers call ``confirm_toolchain`` before they build or load
        anything keyed by it in this process). ``plan`` and ``explain``, which only
        look, may show keys of a presumed compiler. Raises ConfigError for flavour
        ``aoti`` where no compiler makes libraries that load.
        """
        from cachebuild.backends.probe import compiler_version, presumed, trusted_candidates

        found = presumed(device, probe_dir)
        if found.compiler is not None:
            return {"aoti": True, **found.compiler.factors()}
        if config.flavour == "aoti":
            raise ConfigError(f"flavour 'aoti' needs a C++ compiler whose AOTInductor "
                              f"libraries load here, and none does ({found.describe()}); "
                              "use flavour 'auto' or 'standalone'")
        # No compiler passes: standalone artifacts, built with the first candidate that no
        # other user could replace (Inductor's own default would be whatever PATH finds).
        trusted, _ = trusted_candidates()
        default = trusted[0] if trusted else None
        return {"aoti": False, "cxx": default,
                "cxx_version": compiler_version(default) if default else None}

    def start_toolchain(self, config: Any, device: str) -> None:
        """Start the probe for ``device`` on a thread of its own (``probe.start``): the
        trace that comes next runs beside it."""
        from cachebuild.backends.probe import start

        start(device)

    def confirm_toolchain(self, device: str) -> None:
        """Wait for the probe's verdict where builds began with what it presumed
        (``probe.confirm``); ToolchainRefuted where it chose otherwise."""
        from cachebuild.backends.probe import confirm

        confirm(device)

    def forget_refuted(self, device: str) -> None:
        """Before planning again after ToolchainRefuted (``probe.forget_refuted``)."""
        from cachebuild.backends.probe import forget_refuted

        forget_refuted(device)

    def toolchain_proven(self, device: str, toolchain: dict[str, Any], kind: str) -> None:
        """An AOTI package built with ``toolchain``'s compiler loaded and ran in a worker:
        the probe still running for ``device`` takes it (``probe.proven``)."""
        from cachebuild.backends.probe import proven

        if kind in ("aoti-cpu", "aoti-cuda") and toolchain.get("cxx"):
            proven(device, toolchain["cxx"])

    # -- compile -----------------------------------------------------------------------

    def compile(self, request: BuildRequest) -> Artifact:
        flavour = request.config.flavour
        device = request.input_metas[0].device if request.input_metas else "cpu"
        toolchain = request.toolchain
        if flavour == "auto":
            flavour = "aoti" if toolchain.get("aoti") else "standalone"
        compiler = toolchain.get("cxx")
        if compiler is not None:
            # Named by the target's manifest, which may come from a stored entry: run it
            # only if no other user could replace it.
            trusted_compiler(compiler)
        else:  # Inductor would run whatever `g++` PATH finds
            raise UntrustedCompiler("no C++ compiler here that only root or you can replace "
                                    "(see `cachebuild stats`); Inductor needs one to build")
        if not str(device).startswith("cpu"):
            autotune.share()  # one timing per kernel across this folder's builds
        if flavour == "aoti":
            try:
                return self._compile_aoti_checking_headers(request, device, compiler)
            except Exception as e:
                if request.config.flavour == "aoti" or transient(e):
                    raise
                _check_room(e)  # a compiler that ran out of disk says many things
                artifact = self._compile_standalone(request, compiler)
                artifact.fallback = f"AOTInductor cannot take it: {type(e).__name__}: {_first_line(e)}"
                return artifact
        return self._compile_standalone(request, compiler)

    def _compile_aoti_checking_headers(self, request: BuildRequest, device: str,
                                       compiler: str | None) -> Artifact:
        """``_compile_aoti``; where its C++ does not compile on a CPU, once more without
        the precompiled headers kept for the environment: if it compiles then, those
        were damaged (a disk's bit rot, a half-copied home folder) and every build of
        this environment would have failed on them, so they are removed, said once, and
        the next build that wants them precompiles them again."""
        try:
            return self._compile_aoti(request, device, compiler)
        except Exception as e:
            if not device.startswith("cpu") or transient(e) or not _cpp_compile_error(e):
                raise
            first = e
        artifact = self._compile_aoti(request, device, compiler, headers=False)
        removed = compat.drop_precompiled_headers()
        said = (f"a C++ build failed with the environment's precompiled headers and "
                f"compiled without them ({_first_line(first)}): they are taken as damaged, "
                f"{len(removed)} removed, precompiled again by the next build")
        if process_state.current().first_saying(said):
            log.warning("cachebuild: %s", said)
        return artifact

    def _compile_aoti(self, request: BuildRequest, device: str, compiler: str | None,
                      headers: bool = True) -> Artifact:
        from torch.export import Dim

        args = example_inputs(request.input_metas, request.bucket)
        if any(not isinstance(a, torch.Tensor) for a in args):
            raise ValueError("AOTInductor pieces take tensors only (the piece takes a "
                             "plain integer that no tensor input's size gives)")
        bounds = bucket_bounds(request.bucket)
        dynamic = dynamic_dims_of(request.input_metas)

        def export(dim: Callable[[str], Any], **options: Any) -> Any:
            dims: dict[str, Any] = {}
            shapes = []
            for per_input in dynamic:
                spec = {}
                if bounds is not None:
                    for d, sym in per_input.items():
                        spec[d] = dims.setdefault(sym, dim(sym))
                shapes.append(spec or None)
            return torch.export.export(request.gm, tuple(args), dynamic_shapes=tuple(shapes),
                                       strict=False, **options)

        def dim(sym: str) -> Any:
            return Dim(f"d_{sym}", min=bounds[0], max=bounds[1])

        with torch.no_grad():
            with clock.phase("export"):
                if bounds is None:
                    ep = export(dim)
                else:
                    ep, deferred = compat.export_keeping_unproven_guards(
                        lambda **options: export(dim, **options))
                    if deferred:  # guards kept as checks: the range accepted is checked here
                        _check_range_kept(ep, dynamic, bounds)
            options = _inductor_options(request)
            if device.startswith("cuda"):
                options.update(kernel_binaries_linked())
            if not headers:
                options["cpp_cache_precompile_headers"] = False
            with tempfile.TemporaryDirectory(prefix="cachebuild-aoti-") as tmp:
                path = aoti.build_package(ep, os.path.join(tmp, "piece.pt2"), options,
                                          compiler)
                with clock.phase("packaging"), open(path, "rb") as f:
                    payload = f.read()
        kind = "aoti-cuda" if device.startswith("cuda") else "aoti-cpu"
        return Artifact(kind, payload)

    def _compile_standalone(self, request: BuildRequest, compiler: str | None) -> Artifact:
        from torch._inductor import config, standalone_compile
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        from cachebuild.graph.facts import record_example_values

        fake_mode, fake_args = symbolic_fake_inputs(request.input_metas, request.bucket)
        record_example_values(request.gm, fake_args)
        options = {"config_patches": _inductor_options(request)}
        cpu = all(m.device_type == "cpu" for m in request.input_metas if m.kind == "tensor")
        device = gpu_of(request.input_metas)
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
            with clock.phase("packaging"), \
                    tempfile.TemporaryDirectory(prefix="cachebuild-sa-") as tmp:
                path = os.path.join(tmp, "artifact.bin")
                art.save(path=path, format="binary")
                with open(path, "rb") as f:
                    payload = f.read()
            with clock.phase("packaging"):
                if cpu:
                    # The compiler and the vector ISA (its name and its compiler flags)
                    # enter the kernels' cache keys: a loading process must use the same
                    # ones to find them, and takes the ISA from here rather than compiling
                    # Inductor's ISA checks (see kernel_dir).
                    build = json.dumps({"cxx": compiler, **compat.vec_isa()}).encode()
                    payload = pack({"artifact.bin": payload, "build.json": build,
                                    **_built_files(cache_dir())})
                elif device.type == "cuda":
                    # Inductor's Python wrapper names the GPU it was built on (its device
                    # guard, set_device, get_raw_stream, and the Triton kernels'
                    # DeviceProperties): the artifact says which, and loads on that index
                    # only (see load_standalone).
                    build = json.dumps({"device": str(device)}).encode()
                    payload = pack({"artifact.bin": payload, "build.json": build})
        return Artifact("standalone", payload)

    # -- load --------------------------------------------------------------------------

    def load(self, kind: str, key: str, source: ArtifactSource, device: str) -> Any:
        if kind in ("aoti-cpu", "aoti-cuda"):
            return _load_aoti(key, source, device)
        if kind == "standalone":
            return load_standalone(key, source, device)
        raise ValueError(f"inductor backend cannot load artifacts of kind {kind!r}")

    def load_needs(self, kind: str) -> LoadNeeds:
        """A ``standalone`` artifact initialises Inductor to load; an AOTI package loads
        through torch's C++ loader, without it."""
        return LoadNeeds(inductor=kind == "standalone")


def indexed(device: str | torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the current GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def gpu_of(metas: list[Any]) -> torch.device:
    """The device a piece's tensors are on, with its index."""
    return indexed(next((m.device for m in metas if m.kind == "tensor"), "cpu"))


def _built_files(root: str) -> dict[str, bytes]:
    """Libraries and object files under Inductor cache ``root``, by relative path:
    Inductor rebuilds any that is missing."""
    found = {}
    for built in glob.glob(os.path.join(root, "**", "*.[os]*"), recursive=True):
        if built.endswith((".so", ".o")):
            with open(built, "rb") as f:
                found[os.path.relpath(built, root)] = f.read()
    return found


def vanished(key: str, why: str) -> None:
    """Count and log a target that left the store while it was loaded: a miss."""
    from cachebuild.counters import COUNTERS

    COUNTERS.vanished += 1
    log.warning("target %s vanished from the store while it was loaded (%s); it is a miss "
                "and will be built again", key, why)


def _load_aoti(key: str, store: ArtifactSource, device: str) -> Any:
    path = store.materialize(key, ".pt2")
    if path is None:
        return None
    try:
        return aoti.load_package(path, device)
    except Exception:
        if os.path.exists(path):
            raise
        # GC removed the verified file between materialize() and the loader's read.
        vanished(key, "removed after it was materialized, most likely by gc")
        return None


def load_standalone(key: str, store: ArtifactSource, device: str | None = None) -> Any:
    """Load a standalone artifact from the store's verified bytes, and from nothing else.

    On CUDA the artifact runs on the GPU index it was built on only (Inductor's generated
    code names it; torch 2.11-2.13 has no index-free codegen): asked for another index
    (``device``), it raises ``DeviceBound`` before anything is written.

    Inductor is pointed, for the load, at a directory private to this process inside the
    store (``kernel_dir``), and the artifact and the kernels it carries (CPU) are written
    there, fsynced, from the verified payload: no file that someone planted in Inductor's
    usual cache directory is ever loaded. On CPU the build's C++ compiler and vector ISA
    are used, so the kernels are found under the keys they were built with and nothing is
    compiled. On a full disk the private directory is in memory. None on a miss.
    """
    data = store.get(key)  # verified, and read at once: GC can no longer take it away
    if data is None:
        return None
    parts = unpack(data)  # every name checked before any file is written (PackError)
    if parts is not None and "artifact.bin" not in parts:
        raise PackError(f"standalone artifact {key} holds no artifact.bin")
    built_for = _build_info(parts).get("device") if parts is not None else None
    if built_for is not None and device is not None and torch.device(device).type == "cuda" \
            and indexed(device) != torch.device(built_for):
        raise DeviceBound(key, built_for, str(indexed(device)))
    try:
        return _load_standalone(key, store, data, parts, in_memory=False)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.warning("no space to write the kernels of %s next to the store; loading them "
                    "from memory", key)
        return _load_standalone(key, store, data, parts, in_memory=True)


def _build_info(parts: dict[str, bytes]) -> dict[str, str]:
    try:
        build = json.loads(parts.get("build.json", b"{}"))
    except (ValueError, RecursionError):
        build = None
    if not isinstance(build, dict) or not all(
            isinstance(v, str) or v is None for v in build.values()):
        raise PackError("standalone artifact's build.json is not an object of names")
    return {k: v for k, v in build.items() if v}


def _load_standalone(key: str, store: ArtifactSource, data: bytes, parts: dict[str, bytes] | None, *,
                     in_memory: bool) -> Any:
    from torch._inductor import CompiledArtifact, config

    build = _build_info(parts) if parts is not None else {}
    with kernel_dir.private_cache_dir(store, in_memory=in_memory,
                                      vec_isa=(build.get("vec_isa"), build.get("vec_isa_flags"))
                                      ) as root:
        if parts is None:  # a plain artifact (GPU): Inductor writes what it needs itself
            artifact = kernel_dir.write_file(root, f"artifacts/{key}.bin", data)
            return CompiledArtifact.load(path=str(artifact), format="binary")
        for name, blob in parts.items():
            if name not in ("artifact.bin", "build.json"):
                kernel_dir.write_file(root, name, blob)
        artifact = kernel_dir.write_file(root, f"artifacts/{key}.bin", parts["artifact.bin"])
        # Inductor would first precompile a header for kernels it may build (it runs the
        # C++ preprocessor even when the kernel's library exists); every kernel is here.
        patches: dict[str, Any] = {"cpp_cache_precompile_headers": False}
        if build.get("cxx"):
            try:
                patches["cpp.cxx"] = (None, trusted_compiler(build["cxx"]))
            except UntrustedCompiler as e:
                raise PackError(f"standalone artifact {key} names a compiler that is not "
                                f"run here: {e}") from None
        with config.patch(patches):
            return CompiledArtifact.load(path=str(artifact), format="binary")


def _check_range_kept(ep: Any, dynamic: list[dict[int, str]], bounds: tuple[int, int]) -> None:
    """Raise ValueError unless every dynamic dim of the exported program's inputs is still
    a symbol whose range covers ``bounds``."""
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node, per_input in zip(placeholders, dynamic, strict=False):
        shape = getattr(node.meta.get("val"), "shape", ())
        for d in per_input:
            size = shape[d]
            if not isinstance(size, torch.SymInt):
                raise ValueError(f"export fixed the range's size to {size}")
            r = ep.range_constraints.get(size.node.expr)
            if r is None or not (bool(r.lower <= bounds[0]) and bool(r.upper >= bounds[1])):
                raise ValueError(f"export narrowed the range {bounds[0]}-{bounds[1]} to {r}")


#: Free bytes where the compilers write under which a failed AOTInductor build is the
#: disk's fault, not the piece's: a C++ compiler that runs out of room mid-file says
#: anything (a missing file, a syntax error in a truncated one).
LOW_DISK_BYTES = 256 * 1024 * 1024


def _check_room(error: BaseException) -> None:
    """Raise ENOSPC (from ``error``) where a compiler or a file failed (``error`` is or
    was caused by a C++ compile error, a compiler's exit, an OSError) and the folder
    Inductor's compilers write in has less than ``LOW_DISK_BYTES`` free: the build fails
    as the machine's fault, rather than storing a ``standalone`` artifact under the
    target's key for good."""
    import shutil
    import subprocess

    from torch._inductor.exc import CppCompileError

    if not any(isinstance(e, CppCompileError | subprocess.CalledProcessError | OSError)
               for e in causes(error)):
        return  # failed before it wrote anything: the piece's
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir()
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < LOW_DISK_BYTES:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise OSError(errno.ENOSPC, f"No space left on device: {free // 2**20} MiB free in "
                                    f"{folder}, where the compilers write, when an AOTInductor "
                                    f"build failed ({type(error).__name__}: {first})") from error


def _first_line(e: BaseException) -> str:
    """The first line of what ``e`` says (its type's name where it says nothing)."""
    said = str(e).strip()
    return said.splitlines()[0] if said else type(e).__name__


def _cpp_compile_error(e: BaseException) -> bool:
    """Whether ``e`` is, or was caused by, the C++ compiler refusing a source (Inductor's
    ``CppCompileError``)."""
    return any(type(c).__name__ == "CppCompileError" for c in causes(e))
