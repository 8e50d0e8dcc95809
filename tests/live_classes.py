"""Classes that live changes swap an object's class between (``obj.__class__ = Other``).

In a module of their own, imported as a model's classes are: a class of the script that
``tests/live_changes.py`` runs as is named by its source instead.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class GateBase:
    """Gives ``level``, a class attribute the forward reads through ``Gate``."""

    level = 1.0


class Gate(GateBase):
    """A plain object the forward calls a method of."""

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        return y


class LoudGate(Gate):
    def apply(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2


class Scale(nn.Module):
    """A submodule whose class is swapped in place (as a LoRA wrapper may be)."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y


class Doubled(Scale):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2
