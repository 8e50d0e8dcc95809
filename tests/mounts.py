"""File systems mounted for a test: a small tmpfs (a disk that fills), a folder served
read-only. Root only where a mount is needed; skipped where mounting is not allowed."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(command: list[str], where: Path, what: str) -> Iterator[Path]:
    """``where`` with ``mount COMMAND... WHERE`` on it until the block ends (``what`` names
    it where the mount is refused: the test is skipped)."""
    done = subprocess.run(["mount", *command, str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {what} here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (root only; skipped where not allowed)."""
    where.mkdir(parents=True, exist_ok=True)
    with mounted(["-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs"], where,
                 "a tmpfs") as mnt:
        yield mnt


@contextlib.contextmanager
def read_only(store: Path, view: Path) -> Iterator[Path]:
    """``store`` served read-only at ``view``: a read-only bind mount as root (whom file
    modes do not stop), else the store itself with every write bit taken away."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(store)], check=True)
        try:
            yield store
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(store)], check=True)
        return
    view.mkdir()
    with mounted(["--bind", "-o", "ro", str(store)], view, "a read-only bind") as mnt:
        yield mnt
