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
from collections.abc import Iterable, Iterator

import torch


@contextlib.contextmanager
def rng() -> Iterator[None]:
    """Run the block with torch's generators (the CPU's, and every CUDA device's already
    initialised) put back as they were afterwards: a seeded caller draws the same numbers
    whether its call compiled or not."""
    devices = (list(range(torch.cuda.device_count()))
               if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
    with torch.random.fork_rng(devices=devices):
        yield


#: Variables torch writes into the process environment as it imports its compilers
#: (Inductor's ``cache_dir()`` sets its default folder there the first time it is asked).
TORCH_WRITES = ("TORCHINDUCTOR_CACHE_DIR",)


@contextlib.contextmanager
def environment(names: Iterable[str] = TORCH_WRITES) -> Iterator[None]:
    """Run the block with the environment variables ``names`` put back afterwards as they
    were (unset where they were unset): importing Dynamo for a trace sets one."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
