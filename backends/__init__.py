"""Backends: compilers that turn one piece into an artifact and back.

A backend is registered by name. The built-in ones (``inductor``, ``eager_fusion``) are
imported only when used, so importing cachebuild never imports Inductor; others (a
vendor graph compiler, say) register through the ``cachebuild.backends`` entry-point
group, whose entry points name a zero-argument factory returning a ``Backend``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from cachebuild.errors import ConfigError

if TYPE_CHECKING:
    from cachebuild.backends.protocol import Artifact, Backend, BuildRequest

__all__ = ["Artifact", "Backend", "BuildRequest", "get_backend", "register_backend",
           "registered_backends"]

_BUILTIN = {
    "inductor": "cachebuild.backends.inductor:InductorBackend",
    "eager_fusion": "cachebuild.backends.eager_fusion:EagerFusionBackend",
}

#: The explicit registry of backends added at run time: name → factory.
_REGISTRY: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make ``factory()`` available as backend ``name`` in this process."""
    _REGISTRY[name] = factory


def _plugins() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="cachebuild.backends")}


def registered_backends() -> set[str]:
    return set(_BUILTIN) | set(_REGISTRY) | set(_plugins())


def get_backend(name: str) -> Backend:
    """A fresh instance of backend ``name``."""
    if name in _REGISTRY:
        return _REGISTRY[name]()
    spec = _BUILTIN.get(name) or _plugins().get(name)
    if spec is None:
        raise ConfigError(f"unknown backend {name!r}: choose one of {sorted(registered_backends())}")
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)()


def __getattr__(name: str) -> Any:
    # The protocol and records import torch; the registry (and ``probe``) do not, so the
    # store commands can read probe verdicts without importing torch.
    if name in ("Artifact", "Backend", "BuildRequest"):
        from cachebuild.backends import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
