"""Counters in the Prometheus text exposition format, for fleets that scrape files.

cachebuild runs no server of its own: ``cachebuild stats --prometheus FILE`` (or ``-`` for
stdout) writes the store's counters, and ``cachebuild.prometheus_text()`` renders this
process's. A file is written atomically (temporary file, then rename), so a collector such
as node_exporter's textfile collector never reads half of one.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cachebuild.errors import UsageError

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class Metric:
    """One sample: ``kind`` is ``counter`` (only grows) or ``gauge``."""

    name: str
    value: float
    help: str
    kind: str = "counter"
    labels: tuple[tuple[str, str], ...] = ()


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(metrics: Iterable[Metric], prefix: str = "cachebuild_") -> str:
    """The exposition text of ``metrics``: one HELP and TYPE line per name, then samples."""
    lines: list[str] = []
    described: set[str] = set()
    for m in metrics:
        name = prefix + m.name
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a metric name: {name!r}")
        if name not in described:
            described.add(name)
            lines.append(f"# HELP {name} {m.help}")
            lines.append(f"# TYPE {name} {m.kind}")
        labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in m.labels)
        value = m.value if math.isfinite(m.value) else 0.0
        shown = repr(int(value)) if float(value).is_integer() else repr(float(value))
        lines.append(f"{name}{{{labels}}} {shown}" if labels else f"{name} {shown}")
    return "\n".join(lines) + "\n"


def check_target(path: str | os.PathLike[str]) -> Path | None:
    """Where ``write`` would write ``path`` (None for ``-``, stdout), or UsageError saying
    why it cannot: a directory, or a folder that does not exist or is not writable."""
    if str(path) == "-":
        return None
    target = Path(path)
    if not str(path).strip():
        raise UsageError("--prometheus needs a file name (or - for stdout)")
    if target.is_dir():
        raise UsageError(f"--prometheus {path} is a directory: give a file name in it, e.g. "
                         f"{target / 'cachebuild.prom'}")
    if target.exists() and not target.is_file():  # a device, a socket: never replaced
        raise UsageError(f"--prometheus {path} exists and is not a regular file: give a file "
                         "name (or - for stdout)")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"--prometheus {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--prometheus {path}: the folder {parent} is not writable")
    return target


def write(text: str, path: str | os.PathLike[str]) -> None:
    """Write ``text`` to ``path`` atomically (``-`` is stdout); UsageError where ``path``
    cannot be written (``check_target``, or the write failed)."""
    target = check_target(path)
    if target is None:
        print(text, end="")
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                   suffix=".tmp")
    except OSError as e:
        raise UsageError(f"cannot write --prometheus {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"cannot write --prometheus {path}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def process_metrics(snapshot: dict) -> list[Metric]:
    """This process's counters (``cachebuild.stats()``) as metrics."""
    names = {
        "planned": "Targets planned (pieces times buckets, before dedup).",
        "unique": "Distinct target keys among the planned ones.",
        "hits": "Targets found in the store (loaded instead of built).",
        "misses": "Targets not in the store when looked up (then built).",
        "loaded": "Targets loaded from the store.",
        "built": "Targets compiled.",
        "failed": "Targets that failed to compile.",
        "fallbacks": "Targets built in another flavour than asked (logged with why).",
        "layout_copies": "Piece inputs copied to the strides the piece was compiled for.",
        "device_copies": "Targets used as a copy built for this GPU index (artifacts whose "
                         "code names their GPU).",
        "traced": "Models traced with Dynamo.",
        "entries_loaded": "Model entries loaded (warm starts).",
    }
    out = [Metric(f"{name}_total", float(snapshot.get(name, 0)), text)
           for name, text in names.items() if name in snapshot]
    for phase, seconds in sorted(snapshot.get("seconds", {}).items()):
        out.append(Metric("phase_seconds_total", seconds,
                          "Seconds spent per phase (trace, build, load, capture, ...).",
                          labels=(("phase", phase),)))
    return out
