"""The caller's state, kept: what cachebuild runs for itself leaves it as it was.

Tracing runs the forward once, a build makes random example inputs and proves the
artifact on more, capture runs the forward at every size: none of that is the caller's
computation. So none of it may advance torch's generators (``rng``), and what it writes
in place into tensors that outlive it (a cache, a counter) is put back (``Tensors``), and
so is what importing torch's compilers writes into the process environment
(``environment``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from cachebuild import compat


@contextlib.contextmanager
def rng() -> Iterator[None]:
    """Run the block with torch's generators (the CPU's, and every CUDA device's already
    initialised) put back as they were afterwards: a seeded caller draws the same numbers
    whether its call compiled or not."""
    devices = (list(range(torch.cuda.device_count()))
               if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def environment() -> Iterator[None]:
    """Run the block with what importing torch's compilers writes into the process
    environment taken back afterwards: Inductor's ``cache_dir()`` sets
    ``TORCHINDUCTOR_CACHE_DIR`` to its default folder the first time it is asked (as
    importing Dynamo for a trace does). Only that value, and only where the variable was
    unset: a folder a build or a load on another thread points it at meanwhile
    (``backends.kernel_dir``) is theirs to put back."""
    name = "TORCHINDUCTOR_CACHE_DIR"
    unset = name not in os.environ
    try:
        yield
    finally:
        utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
        if unset and utils is not None and \
                os.environ.get(name) == os.path.abspath(utils.default_cache_dir()):
            os.environ.pop(name, None)


@contextlib.contextmanager
def default_dtype(name: str | None) -> Iterator[None]:
    """Run the block with torch's default dtype ``name`` (``"float64"``; None: float32, as
    a manifest without one was traced), put back afterwards: a target is built, and
    proven, under the default dtype its piece was traced with (``targets.DEFAULT_DTYPE``),
    which the process building it need not share."""
    wanted = getattr(torch, name) if name is not None else torch.float32
    before = torch.get_default_dtype()
    if wanted == before:
        yield
        return
    torch.set_default_dtype(wanted)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


#: The devices whose autocast a trace follows, and a build sets.
AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def autocast(state: dict[str, str] | None,
             devices: Iterable[str] = AUTOCAST_DEVICES) -> Iterator[None]:
    """Run the block with autocast on for exactly the devices ``state`` names (device →
    dtype name; None: off for every one of ``devices``), put back afterwards: a target is built,
    and proven, under the autocast its piece was traced with (``targets.AUTOCAST``), which
    the process building it (a worker, or the caller's thread inside its own autocast)
    need not share."""
    state = state or {}
    with contextlib.ExitStack() as stack:
        for device in devices:
            if device in state:
                stack.enter_context(torch.autocast(device, dtype=getattr(torch, state[device])))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def codegen_settings(settings: dict[str, Any] | None) -> Iterator[None]:
    """Run the block under the settings Inductor generates code under that ``settings``
    names (``compat.codegen_settings``' form; None or what it leaves out: torch's
    defaults), put back afterwards: a target is built, and proven, under those its piece
    was traced with (``targets.CODEGEN``), which the process building it need not share."""
    before, raw = compat.codegen_settings(), compat.raw_precisions()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    compat.set_codegen_settings(settings or {})
    try:
        yield
    finally:
        compat.set_codegen_settings(before)
        compat.set_raw_precisions(raw)  # what the older setters moved besides (cuDNN's RNNs)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
        if torch.is_deterministic_algorithms_warn_only_enabled() != warn_only:
            # Only then: the call imports Inductor's config (a warm load imports no compiler).
            torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled(),
                                               warn_only=warn_only)


class Tensors:
    """Copies of tensors, taken before they are written and put back by ``restore``.

    Copies live in host memory: the tensors kept are caches that fill a GPU. Each tensor
    is copied once, however often it is ``add``ed.
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.add(tensors)

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if id(t) not in self._saved:
                self._saved[id(t)] = (t, t.detach().to("cpu", copy=True))

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, copy in self._saved.values():
                tensor.copy_(copy)
