"""Cache keys and manifests.

A key is the hash of a dict of named *factors*: everything that decides a compiled
output. The dict is rendered as canonical JSON (sorted keys, no whitespace, floats in
their shortest round-trip form, tuples as lists) and hashed with xxh3-128. The same dict
is kept beside the artifact as its *manifest*, so any miss can be explained by diffing
the manifest we wanted against the nearest one we have (``diff_manifests``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import xxhash


def canonical_json(factors: Any) -> str:
    """Render ``factors`` as canonical JSON: equal values give equal strings.

    Accepts dicts with string keys, lists, tuples, str, int, float, bool and None.
    Non-finite floats and other types are refused rather than rendered ambiguously.
    """
    return json.dumps(_canonical(factors), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"factor names must be strings, got {k!r}")
            out[k] = _canonical(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite float {value!r} cannot be part of a key")
        # repr() is the shortest string that round-trips; keep integral floats distinct
        # from ints so 1.0 and 1 never collide.
        return {"__float__": repr(value)}
    raise TypeError(f"cannot put {type(value).__name__} {value!r} into a key")


def make_key(factors: dict[str, Any]) -> str:
    """The key of a dict of factors: xxh3-128 of its canonical JSON, 32 lowercase hex."""
    return xxhash.xxh3_128_hexdigest(canonical_json(factors).encode())


@dataclass(frozen=True)
class Difference:
    """One factor that differs between two manifests.

    ``path`` is the dotted path of the factor (``env.torch_version``); ``old`` is the
    value in the stored manifest, ``new`` the value wanted now (``MISSING`` if absent).
    """

    path: str
    old: Any
    new: Any

    def describe(self) -> str:
        """The difference in words, e.g. ``env.torch_version: 2.11.0 → 2.13.0``."""
        if self.old is MISSING:
            return f"{self.path} added ({_short(self.new)})"
        if self.new is MISSING:
            return f"{self.path} removed (was {_short(self.old)})"
        old, new = _texts(self.old), _texts(self.new)
        # Long values alike up to a point (a list of inputs, one value apart): each from a
        # little before where they part, so that what differs is in view.
        start = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
                     min(len(old), len(new)))
        start = 0 if start < _SHORT // 2 else start - 24
        return f"{self.path}: {_short(old, start=start)} → {_short(new, start=start)}"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def guard_seal_key(entry_key: str, guards: Any) -> str:
    """The key of the seal stored beside a model entry: it names the entry's key and its
    guard list, so an entry whose guards were edited or deleted has no seal in the store
    and is a miss (``plan.Planner.lookup``)."""
    return make_key({"guard_seal": entry_key, "guards": guards})


def variant_key(entry_key: str, values: list[Any]) -> str:
    """Where the entry of a model lives whose values differ from those the entry at
    ``entry_key`` was traced with: derived from that key and the live values of its
    guards, so every process with the same model finds it without tracing."""
    return make_key({"variant_of": entry_key, "guards": values})


#: How many characters of a value a difference shows.
_SHORT = 60


def _texts(value: Any) -> str:
    return value if isinstance(value, str) else canonical_json(value)


def _short(value: Any, limit: int = _SHORT, start: int = 0) -> str:
    """``value`` as text, at most ``limit`` characters of it from ``start`` (``…`` where
    it is cut)."""
    text = _texts(value)
    if start > 0:
        text = "…" + text[start:]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def diff_manifests(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[Difference]:
    """The factors that differ between two manifests, recursing into nested dicts.

    Lists are compared whole: a changed graph is one difference, not hundreds.
    """
    diffs: list[Difference] = []
    for name in sorted(set(old) | set(new)):
        path = f"{prefix}{name}"
        a, b = old.get(name, MISSING), new.get(name, MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(diff_manifests(a, b, prefix=path + "."))
        elif a is MISSING or b is MISSING or canonical_json(a) != canonical_json(b):
            diffs.append(Difference(path, a, b))
    return diffs


#: Items a value may hold, all in all, to count as plain data (a table of constants, not
#: a dataset).
PLAIN_ITEMS = 256


#: What an environment variable's name looks like: a string constant of this form in code
#: whose reads a key follows may name one it reads (``os.environ[NAME]``).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def plain_data(value: Any, limit: int = PLAIN_ITEMS) -> bool:
    """Whether ``value`` is plain data whose ``repr`` says all of it, the same in every
    process: None, a bool, a number or a string, or a tuple, list or dict of such (no
    set: its order follows the process's string hashes), ``limit`` items at most in all."""
    left = [limit]

    def plain(v: Any, depth: int) -> bool:
        left[0] -= 1
        if left[0] < 0 or depth > 4:
            return False
        if v is None or isinstance(v, bool | int | float | str):
            return True
        if type(v) in (tuple, list):
            return all(plain(x, depth + 1) for x in v)
        if type(v) is dict:
            return all(plain(k, depth + 1) and plain(x, depth + 1) for k, x in v.items())
        return False

    return plain(value, 0)
