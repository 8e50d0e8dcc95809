"""The caller's random streams, kept: what cachebuild runs for itself draws from copies.

Tracing runs the forward once, a build makes random example inputs and proves the
artifact on more, capture runs the forward at every size: none of that is the caller's
computation, so none of it may advance torch's generators (CPU, and every CUDA device
already initialised). A seeded server then draws the same numbers cold and warm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run the block with torch's generators put back as they were afterwards."""
    devices = (list(range(torch.cuda.device_count()))
               if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
    with torch.random.fork_rng(devices=devices):
        yield
