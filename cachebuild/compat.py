"""Every difference between the torch versions cachebuild supports (2.11 through 2.13).

Code elsewhere never tests ``torch.__version__``; it asks this module.
"""

from __future__ import annotations

from typing import Any

import torch


def torch_git_version() -> str:
    return getattr(torch.version, "git_version", "unknown") or "unknown"


def cuda_factors(device: torch.device) -> dict[str, Any]:
    """CUDA runtime, driver and the device's compute capability, for keys."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    driver = None
    try:
        driver = torch._C._cuda_getDriverVersion()  # type: ignore[attr-defined]
    except Exception:
        pass
    return {
        "cuda": torch.version.cuda,
        "cuda_driver": driver,
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
    }


def fp8_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` for e4m3 ``a`` (row-major) and ``b`` (column-major)
    with per-tensor float32 scales, on CUDA, through ``torch._scaled_mm`` (a private op
    whose signature is the same on torch 2.11 through 2.13)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def fresh_inductor_cache() -> Any:
    """A context with an empty, temporary Inductor cache directory (renamed in torch 2.8)."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh()


def vec_isa() -> str:
    """The vector ISA Inductor builds CPU kernels for here (e.g. ``avx512``); it enters
    every kernel's compile command, so the kernels' cache keys."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


def vec_isa_checks_off() -> Any:
    """Let Inductor take the vector ISAs the CPU reports without compiling a check
    program for each (seconds apiece); returns a function that undoes it.

    For loading kernels that were built already: the ISA they were built for is part of
    their cache keys. If this process had not checked the ISAs yet, their list is
    forgotten again on undo, so that a later build checks them for real.
    """
    from torch._inductor import config, cpu_vec_isa

    checked = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
    patch = config.patch({"cpp.vec_isa_ok": True})
    patch.__enter__()

    def undo() -> None:
        patch.__exit__(None, None, None)
        if not checked:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()

    return undo


def cuda_graph_for_capture() -> tuple[Any, bool]:
    """A ``torch.cuda.CUDAGraph`` and whether it must be instantiated by a call of its own:
    True where this torch has ``keep_graph`` (capture and instantiation then time apart),
    False where ``capture_end`` instantiates it."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        return torch.cuda.CUDAGraph(), False
