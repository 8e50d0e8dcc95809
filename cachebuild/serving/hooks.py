"""What calling a model runs besides its traced code, which a compiled forward cannot run.

``model(x)`` runs the hooks on the model itself and torch's global module hooks around
its ``forward``, and an instance's own ``forward`` where one was set on it. A compiled
forward runs the code its trace saw: the hooks of submodules are in it, the ones around
the model's own call are not. A hook added to the model, a global module hook, or a
``forward`` set on the instance would be skipped in silence, so ``not_run`` names any of
them before every call (a handful of dict reads while there are none), and the call is
refused with what to do. Backward hooks count only where a call records gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as _module

#: The model's own hook dicts that ``model(x)`` runs, with the method that adds each.
_OWN = (("_forward_pre_hooks", "register_forward_pre_hook"),
        ("_forward_hooks", "register_forward_hook"))
_OWN_BACKWARD = (("_backward_pre_hooks", "register_full_backward_pre_hook"),
                 ("_backward_hooks", "register_full_backward_hook"))

#: torch's global module hooks (every module's call runs them), with what adds each.
_GLOBAL = (("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
           ("_global_forward_hooks", "register_module_forward_hook"))
_GLOBAL_BACKWARD = (("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
                    ("_global_backward_hooks", "register_module_full_backward_hook"))

_FIX = ("register it on the module cachebuild.compile returned (its call runs it around "
        "the compiled forward), or on a submodule")


def own_forward(model: torch.nn.Module) -> Any:
    """The ``forward`` set on the instance itself (not its class's), or None."""
    return model.__dict__.get("forward")


def global_hooks() -> str | None:
    """Why a call would skip torch's global module hooks, in one line, or None."""
    if not (_module._global_forward_pre_hooks or _module._global_forward_hooks or
            (torch.is_grad_enabled() and (_module._global_backward_pre_hooks or
                                          _module._global_backward_hooks))):
        return None
    for name, register in _GLOBAL + (_GLOBAL_BACKWARD if torch.is_grad_enabled() else ()):
        if getattr(_module, name):
            return (f"a global module hook is registered (torch.nn.modules.module."
                    f"{register}); cachebuild's compiled forward does not run it: remove "
                    "it while the compiled model serves, or run the model without cachebuild")
    return None


def not_run(model: torch.nn.Module, forward: Any) -> str | None:
    """Why ``model(x)`` would run code the compiled forward does not, in one line, or
    None. ``forward``: the instance's own ``forward`` when the model was compiled
    (``own_forward``)."""
    own = model.__dict__
    if not (own.get("_forward_pre_hooks") or own.get("_forward_hooks") or
            own.get("forward") is not forward or
            (torch.is_grad_enabled() and (own.get("_backward_pre_hooks") or
                                          own.get("_backward_hooks")))):
        return global_hooks()
    for name, register in _OWN + (_OWN_BACKWARD if torch.is_grad_enabled() else ()):
        if own.get(name):
            return (f"{type(model).__name__} has a hook on the model itself ({register}), "
                    f"which cachebuild's compiled forward does not run: {_FIX}")
    return (f"{type(model).__name__}'s forward was set on the instance (model.forward = "
            "...) since it was compiled, so the compiled forward is not what it runs: "
            "compile the model again")
