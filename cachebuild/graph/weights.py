"""A model's weights looked up by path (``lookup``), and noticed when replaced by other
tensor objects.

A compiled model holds its parameters and buffers by object (the pieces take them as
inputs). Copying new values into them in place (``load_state_dict``, ``p.copy_``) needs
nothing; replacing one (``module.weight = nn.Parameter(...)``,
``load_state_dict(assign=True)``, a new submodule) must be seen, or the old tensor would
be used silently. torch calls global hooks whenever a parameter, buffer or submodule is
registered; when the module is one a compiled model reads its weights through, the hook
bumps one counter that every compiled model compares on each call (one integer
comparison), looking its tensors up again when it moved. A weight set to None or deleted
calls no hook: the dicts that hold it are watched as well (``holders``, through
``dictwatch``: one more comparison on Python 3.12, a poll of their version tags on 3.11).

The hooks are hidden while a model is traced and while its guards are checked: Dynamo
guards the hook registries like any global, and the entry must describe the process
without cachebuild's own hooks (whose ids differ from process to process).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from cachebuild.errors import UsageError

_LOCK = threading.Lock()
#: (registry, handle id, hook) of the hooks this module installed.
_HOOKS: list[tuple[dict[int, Any], int, Any]] = []
#: Modules that some compiled model reads its weights through.
_WATCHED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
#: Bumped whenever a watched module registers a parameter, buffer or submodule.
GENERATION = [0]


def _bump(module: torch.nn.Module, name: str, value: Any) -> None:
    if torch.compiler.is_compiling():
        return None  # a traced forward building modules of its own (a sliced ModuleList)
    if module in _WATCHED:
        GENERATION[0] += 1
    return None


def install() -> None:
    """Register the global registration hooks (once per process)."""
    from torch.nn.modules import module

    with _LOCK:
        if _HOOKS:
            return
        for register, registry in (
                (module.register_module_parameter_registration_hook,
                 module._global_parameter_registration_hooks),
                (module.register_module_buffer_registration_hook,
                 module._global_buffer_registration_hooks),
                (module.register_module_module_registration_hook,
                 module._global_module_registration_hooks)):
            handle = register(_bump)
            _HOOKS.append((registry, handle.id, _bump))


def watch(model: torch.nn.Module, paths: list[str]) -> None:
    """Watch the modules along each dotted parameter or buffer path of ``model``, as far
    as each path leads (a submodule set to None or deleted ends it: ``lookup`` says so)."""
    install()
    for path in paths:
        module = model
        _WATCHED.add(module)
        for part in path.split(".")[:-1]:
            try:
                module = module.get_submodule(part)
            except AttributeError:
                break
            _WATCHED.add(module)


def lookup(model: torch.nn.Module, kind: str, path: str) -> torch.Tensor:
    """The model's parameter or buffer at ``path``; a UsageError where it is gone."""
    try:
        tensor = model.get_parameter(path) if kind == "param" else model.get_buffer(path)
    except AttributeError:
        tensor = None
    if tensor is None:  # get_buffer gives None for a buffer set to None
        raise UsageError(f"{kind} {path} was compiled as a {kind} of the model and is not "
                         "one now (set to None, deleted or made something else since): put "
                         "it back, or compile the model again")
    return tensor


def holders(model: torch.nn.Module, paths: list[str]) -> list[tuple[dict[str, Any], str]]:
    """The dicts that hold each dotted parameter or buffer path of ``model``, each with
    the key it is held at: every module's ``_modules`` at the next name, the last one's
    ``_parameters`` and ``_buffers`` at the weight's. Setting a weight to None or
    deleting it calls no registration hook; it changes one of these (``dictwatch``)."""
    pairs: list[tuple[dict[str, Any], str]] = []
    for path in paths:
        *parts, name = path.split(".")
        module: Any = model
        for part in parts:
            pairs.append((module._modules, part))
            module = module._modules.get(part)
            if not isinstance(module, torch.nn.Module):
                break  # gone already: the lookup that follows says so
        else:
            pairs += [(module._parameters, name), (module._buffers, name)]
    return pairs


def generation() -> int:
    return GENERATION[0]


def addresses(tensors: list[object]) -> list[int]:
    """Where each tensor's memory starts (0 for what is not a tensor)."""
    return [t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in tensors]


def unmoved(tensors: list[torch.Tensor], at: list[int]) -> bool:
    """Whether each of ``tensors`` still has its memory where ``at`` (``addresses`` of
    them) says: read every call, so tensors only, no type test. About 15 µs for 200 on a
    2-core CPU; torch's own batch comparison (``_tensors_data_ptrs_at_indices_equal``,
    CUDA builds only) was no faster to count on (200 CUDA tensors, 2026-12-05: 23 against
    16 µs on an H200's host, 14 against 18 µs on an H100's)."""
    return [t.data_ptr() for t in tensors] == at


def replaced(before: list[object], after: list[object], at: list[int]) -> list[int]:
    """Positions where ``after`` holds another tensor object than ``before``, or the same
    one whose memory no longer starts where it did (``at``: ``addresses(before)`` when it
    was bound; ``.data`` replaced)."""
    return [i for i, (a, b, p) in enumerate(zip(before, after, at, strict=True))
            if isinstance(a, torch.Tensor) and (a is not b or b.data_ptr() != p)]


@contextlib.contextmanager
def hooks_hidden() -> Iterator[None]:
    """Take cachebuild's hooks out of torch's registries for the duration."""
    with _LOCK:
        removed = [(registry, key, registry.pop(key)) for registry, key, _ in _HOOKS
                   if key in registry]
    try:
        yield
    finally:
        with _LOCK:
            for registry, key, hook in removed:
                registry[key] = hook
