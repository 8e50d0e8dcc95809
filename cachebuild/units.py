"""Human sizes and durations: ``20G``, ``512MiB``, ``7d``, ``1h30m``.

Sizes use binary multiples throughout, as ``du -h`` and ``ls -h`` do: ``K``, ``KB`` and
``KiB`` all mean 1024 bytes. ``format_size`` writes what ``parse_size`` reads back.
Parsers raise ValueError with a message that says what was expected.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
               "P": 1 << 50}
#: The largest size a size parameter takes (what a signed 64-bit byte count holds).
MAX_SIZE = (1 << 63) - 1
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]?)(?:I?B)?\s*", re.IGNORECASE)

_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|w)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in a size such as ``20G``, ``1.5GiB``, ``500M``, ``64k`` or ``1024``.

    A bare number is whole bytes. Raises ValueError for anything else, or a negative size.
    """
    m = _SIZE_RE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 20G, 512M or 64K)")
    number, unit = m.groups()
    if len(number) > 40:  # longer than any size a disk has, and costly to parse
        raise ValueError(f"size {text[:20]!r}… is too large (at most 8 EiB)")
    size = Fraction(number) * _SIZE_UNITS[unit.upper()]  # exact: no float overflow
    if size.denominator != 1 and not unit:
        raise ValueError(f"not a size: {text!r} (a bare number is bytes, and whole; "
                         "give a unit for a part of one: 1.5G)")
    if size > MAX_SIZE:
        raise ValueError(f"size {text!r} is too large (at most 8 EiB)")
    return int(size)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``7d``, ``12h``, ``1h30m``, ``90s``, ``2w`` or ``300``.

    A bare number (alone) is seconds; parts add up. Raises ValueError for anything else.
    """
    pos, total, stripped = 0, 0.0, text.strip()
    if not stripped:
        raise ValueError("empty duration (expected e.g. 7d, 12h, 30m, 90s)")
    parts = 0
    for m in _DURATION_PART.finditer(stripped):
        if m.start() != pos:
            break
        number, unit = m.groups()
        parts += 1
        if unit is None and (parts > 1 or m.end() != len(stripped)):
            break  # "1h30" is ambiguous: a bare number must be the whole duration
        total += float(number) * _DURATION_UNITS[(unit or "s").lower()]
        pos = m.end()
        while pos < len(stripped) and stripped[pos] == " ":
            pos += 1
    if pos != len(stripped):
        raise ValueError(f"not a duration: {text!r} (expected e.g. 7d, 12h, 1h30m, 90s)")
    if not math.isfinite(total):
        raise ValueError(f"duration {text[:20]!r} is too long")
    return total


def format_size(n: int | float) -> str:
    """A size for people: ``512 B``, ``4.0 KiB``, ``1.5 GiB`` (``parse_size`` reads it back)."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} PiB"


def format_duration(seconds: float, units: int = 2) -> str:
    """A duration for people, in at most ``units`` units: ``250ms``, ``45s``, ``3m 20s``,
    ``2d 4h`` (one unit: ``3m``, ``2d``)."""
    if not math.isfinite(seconds):
        return "never"
    if seconds < 0:
        return "-" + format_duration(-seconds, units)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    parts = []
    rest = int(round(seconds))
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
        if len(parts) == units or (parts and rest == 0):
            break
    return " ".join(parts)


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and ``word``, or ``words`` (default: ``word`` + "s") unless ``n`` is 1."""
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"
