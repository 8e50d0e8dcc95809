"""An entry's key: the factors computed from the live model and call, with no trace.

``entry_factors`` is the recipe ``Planner.lookup`` hashes: the model class (by its file,
or by its code where it has no file), the model's config where it offers one, the
CompileConfig, the backend and pass factors, parameter and buffer metadata (never values),
which of them are one tensor, the call's input metadata with the dynamic dims, and the
environment. What the trace reads besides is checked by the entry's guards, not keyed here.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from cachebuild.building.entry import ENTRY_FORMAT
from cachebuild.config import CompileConfig
from cachebuild.graph.facts import device_of, meta_of
from cachebuild.tracing.env import SCHEMA_VERSION, env_factors
from cachebuild.trust.codehash import class_hash, code_file, sourceless_classes
from cachebuild.trust.sources import digest_of

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def entry_factors(model: torch.nn.Module, args: tuple[Any, ...], dynamic_dims: dict[int, int],
                  config: CompileConfig, target_factors: dict[str, Any]) -> dict[str, Any]:
    """The factors of a model's entry key (no tracing needed to compute them)."""
    inputs = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            m = meta_of(a)
            shape = ["dyn" if dynamic_dims.get(i) == d else s for d, s in enumerate(m.shape)]
            found = {"dtype": m.dtype, "shape": shape, "device": m.device_type}
            if not a.is_contiguous():  # traced on another layout: another entry
                found["layout"] = sorted(range(a.dim()), key=lambda d: (-a.stride(d), d))
                if i not in dynamic_dims:  # traced with these very strides (_copy_as_is)
                    found["strides"] = list(a.stride())
            inputs.append(found)
        else:
            # An object's default repr holds its address, which the next process does not
            # share: left out (what the trace reads of the object is in its guards).
            inputs.append({"value": _ADDRESS.sub("", repr(a))})
    shared = shared_tensors(model)
    return {
        "schema": SCHEMA_VERSION,
        "entry_format": ENTRY_FORMAT,
        "model": model_factor(model),
        "model_config": config_factor(model),
        "config": config.factors(),
        "targets": target_factors,
        "params": _tensor_table(model.named_parameters(remove_duplicate=False)),
        "buffers": _tensor_table(model.named_buffers(remove_duplicate=False)),
        # Only where there is any, so that the keys of models sharing nothing stay as
        # they were.
        **({"shared": shared} if shared else {}),
        "inputs": inputs,
        "dynamic_dims": sorted([i, d] for i, d in dynamic_dims.items()),
        "env": env_factors(device_of([*args, *model.parameters()])),
    }


def _tensor_table(items: Any) -> list[list[Any]]:
    """Each weight's name, shape, dtype and device, and its strides where it is not
    contiguous (a column-major checkpoint's): the compiled pieces read each with the
    strides it was traced with, so another layout is another entry, not one refused."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch."), t.device.type,
             *([list(t.stride())] if not t.is_contiguous() else [])]
            for name, t in items]


def model_factor(model: torch.nn.Module) -> dict[str, Any]:
    """The model class by name and by the syntax tree of the source defining it (a file,
    or the text linecache holds for a notebook cell), and the code of every module class
    that has no source at all (defined in ``python -c``, or through an ``exec`` that
    registered no text), by what its code objects contain.

    Not by module name nor path: the same file is ``__main__`` in a server and something
    else when ``cachebuild warm`` imports it, in another folder in an image, and all must
    find one entry.
    """
    cls = type(model)
    filename = code_file(cls)
    factor: dict[str, Any] = {"class": cls.__qualname__,
                              "source": digest_of(filename) if filename else None}
    code = {c.__qualname__: class_hash(c) for c in sourceless_classes(model)}
    if code:
        factor["code"] = code
    return factor


#: Config fields that say where a config came from, not what the model computes.
_PROVENANCE = ("transformers_version", "_name_or_path", "name_or_path", "_commit_hash")


def config_factor(model: torch.nn.Module) -> dict[str, Any]:
    """Every config object the model's modules hold (a Hugging Face ``config``, anything
    with ``to_dict()``), by the module path holding it first: ``{"hf.config": {...}}``."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = module.__dict__.get("config")
        to_dict = getattr(config, "to_dict", None)
        if config is None or id(config) in seen or not callable(to_dict):
            continue
        seen.add(id(config))
        try:
            values = to_dict()
        except Exception:
            continue
        found[f"{name}.config" if name else "config"] = {
            k: _config_value(v) for k, v in sorted(values.items()) if k not in _PROVENANCE}
    return found


def _config_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _config_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_config_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return f"<{type(value).__qualname__}>"  # no repr: it may hold an address


def shared_tensors(model: torch.nn.Module) -> list[list[str]]:
    """The names of the model's parameters and buffers that are one tensor object, each
    group sorted: weights tied (an embedding and its head), a layer object used twice. A
    model built so traces to another graph than one built without (one input for both
    names), so it is another entry. By object, not by memory: views of one storage stay
    apart (a ``.to(device)`` or another loader may part them) and bind as two inputs;
    where the model writes one of them, the runtime refuses the other
    (``inputs.check_unshared_weights``)."""
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)
