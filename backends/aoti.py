"""AOTInductor packages: built with a chosen C++ compiler, loaded without Inductor.

A piece's artifact is the ``.pt2`` package AOTInductor writes (the shared library, its
kernels' binaries on CUDA, and the proxy-executor description of any custom op). It loads
through torch's C++ package loader with ``run_single_threaded``: the runner that can be
captured into a CUDA graph (the multi-threaded container runner fails inside stream
capture), on the device index the model lives on, on the caller's current stream. That
runner is not thread-safe, so calls on one loaded package are serialised.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch


def build_package(exported: Any, path: str, options: dict[str, Any],
                  compiler: str | None) -> str:
    """Compile an ExportedProgram into an AOTI package at ``path``; returns its path.

    ``compiler``: the C++ compiler to build with (Inductor's ``cpp.cxx``), or None for
    Inductor's default. Only this build sees the setting.
    """
    from torch._inductor import aoti_compile_and_package

    with compiling_with(compiler):
        return aoti_compile_and_package(exported, package_path=path,
                                        inductor_configs=dict(options))


def compiling_with(compiler: str | None) -> Any:
    """A context in which Inductor's ``cpp.cxx`` names ``compiler`` (None: its default)."""
    from torch._inductor import config

    return config.patch({"cpp.cxx": (None, compiler)} if compiler else {})


def device_index(device: str | torch.device) -> int:
    """The device index a package loader takes: the CUDA device's (current if unset), or -1."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return -1
    return dev.index if dev.index is not None else torch.cuda.current_device()


def load_package(path: str | os.PathLike[str], device: str | torch.device) -> Callable[..., Any]:
    """A callable running the package at ``path`` on ``device``: ``fn(*tensors) -> list``.

    Imports neither Inductor nor Dynamo: the loader is torch's C++ one.
    """
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1,
                                                   device_index(device))
    lock = threading.Lock()
    run_loader = loader.run

    def run(*args: torch.Tensor) -> list[torch.Tensor]:
        with lock:
            return run_loader(list(args))

    run.loader = loader  # type: ignore[attr-defined]  # keeps the library loaded
    return run
