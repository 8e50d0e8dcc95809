"""Noticing that a model's weights were replaced by other tensor objects.

A compiled model holds its parameters and buffers by object (the pieces take them as
inputs). Copying new values into them in place (``load_state_dict``, ``p.copy_``) needs
nothing; replacing one (``module.weight = nn.Parameter(...)``,
``load_state_dict(assign=True)``, a new submodule) must be seen, or the old tensor would
be used silently. torch calls global hooks whenever a parameter, buffer or submodule is
registered; they bump one counter that every compiled model compares on each call
(one integer comparison), looking its tensors up again when it moved.
"""

from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_INSTALLED = False
#: Bumped whenever any module in the process registers a parameter, buffer or submodule.
GENERATION = [0]


def _bump(*_: object) -> None:
    GENERATION[0] += 1


def install() -> None:
    """Register the global registration hooks (once per process)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from torch.nn.modules import module

        module.register_module_parameter_registration_hook(_bump)
        module.register_module_buffer_registration_hook(_bump)
        module.register_module_module_registration_hook(_bump)
        _INSTALLED = True


def generation() -> int:
    return GENERATION[0]


def replaced(before: list[object], after: list[object]) -> list[int]:
    """Positions where ``after`` holds another tensor object than ``before``."""
    return [i for i, (a, b) in enumerate(zip(before, after, strict=True))
            if isinstance(a, torch.Tensor) and a is not b]
