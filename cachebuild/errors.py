"""The errors cachebuild raises on purpose.

Each one carries a message meant for a person: what went wrong and what to do. The CLI
prints the message on one line and exits with the error's ``exit_code`` (2 for bad usage
or bad input, 1 for an operation that failed).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator


class CachebuildError(Exception):
    """Base class: an operation failed (exit code 1)."""

    exit_code = 1


class UsageError(CachebuildError):
    """Bad usage or bad input: a wrong option, a broken model file (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError, ValueError):
    """An invalid CompileConfig or ModelSpec value."""


class StoreError(CachebuildError):
    """The store could not do what was asked (unsafe directory, full disk, ...)."""


class StoredArtifactError(StoreError):
    """A stored artifact could not be loaded (damaged, refused by the checks on stored
    graphs, or not runnable on this machine): the store's trouble, not the model's, so a
    build is never remembered as failed for it (the store may be repaired meanwhile)."""


class LockTimeout(StoreError):
    """A build lock was not acquired in time."""


class BuildError(CachebuildError):
    """A target failed to compile; the message names its piece, bucket and key."""


class ToolchainRefuted(CachebuildError):
    """Builds began with the C++ compiler the probe presumed (its small library loaded),
    and the probe's verdict then refused it: what was built with it is not used here,
    and the work starts again with the verdict. ``device``: the device it was presumed
    for."""

    def __init__(self, message: str, device: str) -> None:
        super().__init__(message)
        self.device = device


class MachineShort(CachebuildError):
    """Work that failed for the machine's sake (``transient``: ``reason``), not the
    model's: never remembered as the model's failure, never a verdict."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class CompileFailed(CachebuildError):
    """A model failed to compile earlier in this process and nothing it depends on
    changed, so it is not tried again; ``original`` is the first failure (also the
    ``__cause__``), whose exit code this one keeps."""

    def __init__(self, message: str, original: BaseException) -> None:
        super().__init__(message)
        self.original = original
        self.exit_code = getattr(original, "exit_code", 1)


#: errno values of a machine that is short of something (not of a piece that is wrong).
_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EIO, errno.EROFS,
                     errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.EFBIG}
_TRANSIENT_TEXT = ("No space left on device", "Disk quota exceeded", "Cannot allocate memory",
                   "Read-only file system", "Too many open files", "File too large",
                   "File size limit exceeded",  # gcc under a file size limit (ulimit -f)
                   "when writing output to")  # gcc: the file it writes could not be written
#: What a compiler driver says when the compiler it ran was killed (by the kernel's
#: out-of-memory killer, say): the driver itself exits 1, not by a signal.
_KILLED_TEXT = ("Killed signal terminated program",  # gcc
                "due to signal",  # clang: "... command failed due to signal"
                "unable to execute command: Killed")  # clang


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what caused it, and so on, each once."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        # Inductor wraps what a lowering raised ``from None``, keeping it as an attribute.
        e = e.__cause__ or getattr(e, "inner_exception", None)


def transient(error: BaseException) -> str | None:
    """Why ``error`` is the machine's fault rather than the piece's (a full disk, no
    memory, a killed compiler), looking through what caused it; None if it is not.

    A build that fails this way fails: it is never a reason to build something else.
    """
    for e in causes(error):
        if isinstance(e, MachineShort):
            return e.reason
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
            return "out of memory"  # the host's, or torch's for a GPU
        if isinstance(e, subprocess.TimeoutExpired):
            return "a compiler timed out"
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return e.strerror or errno.errorcode.get(e.errno, str(e.errno))
        said = str(e)
        if isinstance(e, subprocess.CalledProcessError):  # what the compiler printed
            said += "".join(x if isinstance(x, str) else bytes(x).decode(errors="replace")
                            for x in (e.stdout, e.stderr) if x)
        if (isinstance(e, subprocess.CalledProcessError) and (e.returncode or 0) < 0) or \
                any(t in said for t in _KILLED_TEXT):
            return "the compiler was killed"
        found = next((t for t in _TRANSIENT_TEXT if t in said), None)
        if found is not None:
            return found
    return None


def transient_advice(reason: str) -> str:
    """What to do about a build that failed for ``reason`` (``transient``'s answer)."""
    if "Read-only" in reason:
        return "a folder the build writes to is read-only; build where it can write"
    return "the machine ran short; free some and build again"


def one_line(error: BaseException | str, *, typed: bool = False) -> str:
    """``error``'s text on one line (its words, whitespace folded); ``typed``: led by the
    exception's type (``"ValueError: ..."``). An empty text gives the type's name."""
    text = " ".join(str(error).split())
    name = type(error).__name__
    if not text:
        return name
    return f"{name}: {text}" if typed and isinstance(error, BaseException) else text


def printable(value: object, limit: int = 200) -> str:
    """``value`` as plain text that is safe to echo: control characters (terminal escape
    sequences among them) written as ``\\xNN``, cut at ``limit`` characters (after the
    last item of a ``;`` list that fits, where that keeps most of it: no word cut in two)."""
    text = str(value)
    end = limit
    if len(text) > limit:
        items = text.rfind("; ", 0, limit)
        end = items if items > limit * 0.6 else limit
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text[:end]) + (
        ("; …" if end < limit else "…") if len(text) > limit else "")


def _package_folders(names: tuple[str, ...]) -> tuple[str, ...]:
    from importlib.util import find_spec

    found = (find_spec(name) for name in names)
    return tuple(os.path.dirname(spec.origin) + os.sep for spec in found
                 if spec is not None and spec.origin)


#: Where a frame is cachebuild's or torch's own: this project's packages (installed as
#: cachebuild's subpackages from folders of their own), torch's, and the code torch.fx
#: generates for a graph module.
_INSIDE = _package_folders(("cachebuild", "cachebuild.store", "cachebuild.backends",
                            "cachebuild.passes", "torch")) + ("<eval_with_key>",)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """A warning (``category``) attributed to the caller's own line: the first frame
    outside cachebuild and torch (a model called through ``nn.Module.__call__``, or
    through Dynamo's frames, is warned about where it was called)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
