"""Triton autotuning shared by the processes that build in one work folder.

Pieces built at once (a cold ``warm``'s workers) hold the same kernels: every layer's
MLP, say. Each process timed its own copy and kept the winner of its own, noisy, timings
in its wrapper, while the result kept in the work folder was the last writer's; a later
build of one of those pieces (after an edit elsewhere in it) took that kept result:
another launch configuration than its wrapper had, so the wrapper (seconds of C++)
compiled again. ``share()`` (called by the Inductor backend for a GPU build) makes a
kernel timed by one process at a time (a lock beside its kept result); one that finds a
result kept meanwhile takes it without timing, and so does a kernel that differs from one
already tuned in float constants only (an edited epsilon): its twin's result, among its
own candidates. Where Inductor's autotuner is patched is torch's business
(``compat.hook_autotuning``); what the patch does is this module's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachebuild import compat
from cachebuild.store import write_whole


def share() -> None:
    """Share this process's Triton autotuning with the other builds of its work folder
    (see the module doc; once per process)."""
    compat.hook_autotuning(tune_once)


def tune_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (an ``autotune_to_one_config``) run under a lock on the kernel's kept
    result, and made to pick that result where one is kept, else the result kept for its
    twin: a kernel whose code differs from it in float constants only (an edited epsilon),
    whose candidates are this kernel's own (see the module doc). The configuration is
    only ever one of the kernel's own candidates: what it computes does not depend on it."""

    def autotune_to_one_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        kept = getattr(getattr(self, "save_cache_hook", None), "__self__", None)
        local = getattr(kept, "local_cache", None)
        if not local or not isinstance(local[1], str):
            return original(self, *args, **kwargs)
        try:
            fd = os.open(local[1] + ".lock",
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError:  # a folder it cannot write: timed as Inductor would alone
            return original(self, *args, **kwargs)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            launchers = list(self.launchers)
            try:
                best = kept.read_best(self.inductor_meta,
                                      [launcher.config for launcher in launchers])
            except Exception:  # noqa: BLE001 - a kept result that cannot be read: time again
                best = None
            chosen = next((launcher for launcher in launchers if launcher.config is best), None)
            # Kept results lie in ``<root>/<2 hex>/<name>``; twins' notes in ``<root>/twins``.
            root = os.path.dirname(os.path.dirname(local[1]))
            twin = _twin_path(self, root)
            if chosen is None and twin is not None:
                chosen = _kept_by_twin(twin, root, getattr(kept, "configs_hash", None),
                                       launchers)
            if chosen is None:
                result = original(self, *args, **kwargs)
                if twin is not None and os.path.exists(local[1]):
                    with contextlib.suppress(OSError):
                        write_whole(Path(twin), os.path.relpath(local[1], root).encode())
                return result

            def timings(*_: Any, **__: Any) -> dict[Any, float]:  # the kept one wins
                return {launcher: 0.0 if launcher is chosen else float("inf")
                        for launcher in launchers}

            self.benchmark_all_configs = timings
            try:
                return original(self, *args, **kwargs)
            finally:
                del self.benchmark_all_configs
        finally:
            os.close(fd)  # releases the lock

    return autotune_to_one_config


#: A float literal in a kernel's code (``1e-05``, ``0.5``): what a twin may differ in.
_FLOAT = re.compile(r"(?<![\w.])(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")


def _twin_path(tuner: Any, root: str) -> str | None:
    """Where the name of the result kept for the twins of ``tuner``'s kernel is noted: a
    file named by the kernel's code with its float constants taken out, in a ``twins``
    folder beside the kept results' folders (under ``root``)."""
    source = getattr(getattr(tuner, "fn", None), "src", None)
    if not isinstance(source, str):
        return None
    digest = hashlib.sha256(_FLOAT.sub("F", source).encode()).hexdigest()[:40]
    return os.path.join(root, "twins", digest)


def _kept_by_twin(twin: str, root: str, configs_hash: str | None,
                  launchers: list[Any]) -> Any | None:
    """The launcher of ``launchers`` whose configuration is the result kept (under
    ``root``) for the twin that ``twin`` names, where that result was chosen among the
    same candidates."""
    try:
        with open(twin) as f:
            name = f.read().strip()
        parts = name.split("/")
        if len(parts) != 2 or any(not p or p.startswith(".") for p in parts):
            return None  # not a name this module wrote
        with open(os.path.join(root, *parts)) as f:
            best = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(best, dict) or configs_hash is None or \
            best.get("configs_hash") != configs_hash:
        return None
    same = [launcher for launcher in launchers
            if all(best.get(k) == v for k, v in launcher.config.kwargs.items())
            and launcher.config.num_warps == best.get("num_warps")
            and launcher.config.num_stages == best.get("num_stages")]
    return same[0] if len(same) == 1 else None
