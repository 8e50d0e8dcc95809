"""The errors cachebuild raises on purpose.

Each one carries a message meant for a person: what went wrong and what to do. The CLI
prints the message on one line and exits with the error's ``exit_code`` (2 for bad usage
or bad input, 1 for an operation that failed).
"""

from __future__ import annotations


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


class LockTimeout(StoreError):
    """A build lock was not acquired in time."""


class BuildError(CachebuildError):
    """A target failed to compile; the message names its piece, bucket and key."""
