"""Helpers for the trust tests: real processes, another uid, one-line errors.

``cli`` runs the ``cachebuild`` command in a fresh process; ``python`` runs a snippet in
one; ``assert_one_line_error`` checks that a process failed the way a user should see it
fail (an exit code, one ``error:`` line, no traceback); ``as_nobody`` prefixes a command
so that it runs as uid 65534 (tests run as root; skipped elsewhere);
``linked_environment`` makes an environment folder of a test's own from the session's;
``share_with_a_group`` makes a folder group-writable for a group another user is in.
(A small tmpfs to fill: ``mounts.tmpfs``.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without CACHEBUILD_* settings (the probe cache stays), plus
    ``extra``, with the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CACHEBUILD_") or k == "CACHEBUILD_PROBE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
        prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``cachebuild ARGS`` in a fresh process."""
    return subprocess.run([*prefix, sys.executable, "-m", "cachebuild.cli", *args],
                          env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def python(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
           prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` in a fresh process."""
    return subprocess.run([*prefix, sys.executable, "-c", code, *args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], code: int,
                          match: str | None = None) -> str:
    """Assert that ``proc`` exited with ``code`` and said why in one ``error:`` line, with
    no traceback; returns that line."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    assert proc.returncode == code, out[-3000:]
    # "error: ..." from cachebuild, or click's "Error: ..." for an option it rejected.
    errors = [line for line in proc.stderr.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    if match is not None:
        import re

        assert re.search(match, errors[0]), errors[0]
    return errors[0]


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (to act as another user, or to mount a file system)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run a command as another user")


def as_nobody() -> tuple[str, ...]:
    """A command prefix that runs the command as uid/gid 65534 with no groups."""
    require_root()
    return ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")


def share_with_a_group(path: Path, mode: int) -> None:
    """``chmod mode path``, its group made one that another user is in where ``mode``
    lets the group write (a group of its owner alone may write what the owner may)."""
    import grp
    import pwd

    os.chmod(path, mode)
    if not mode & 0o020:
        return
    others = {u.pw_gid for u in pwd.getpwall() if u.pw_uid != os.geteuid()}
    shared = next((g.gr_gid for g in grp.getgrall() if g.gr_gid in others or g.gr_mem), None)
    if os.geteuid() != 0 or shared is None:
        pytest.skip("needs root and a group another user is in")
    os.chown(path, -1, shared)


@contextmanager
def public_dir() -> Iterator[Path]:
    """A fresh directory under the system's temp directory that every user can enter
    (pytest's own are private to root), removed afterwards."""
    import tempfile

    from conftest import SYSTEM_TMP

    path = Path(tempfile.mkdtemp(prefix="cachebuild-trust-", dir=SYSTEM_TMP))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fill(directory: Path) -> None:
    """Fill the file system holding ``directory`` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as f:
        size = 1 << 20
        while size:
            try:
                f.write(b"\0" * size)
            except OSError:
                size //= 2


def linked_environment(folder: Path) -> Path:
    """An environment folder at ``folder`` with the session's verdicts and headers (its
    probe folder, probed first if need be), linked file by file, and none of its kept C++
    objects or records: what a test plants or removes there is no other test's, and it
    pays no probe."""
    from cachebuild.backends import environment, probe

    probe.verdict("cpu")
    session = Path(os.environ["CACHEBUILD_PROBE_DIR"])
    skipped = {environment.IN_USE, *(part.split("/")[0] for part in environment.OBJECTS)}
    shutil.copytree(session, folder, copy_function=os.link,
                    ignore=lambda _, names: [n for n in names if n.endswith(".lock")
                                             or n in skipped])
    os.chmod(folder, 0o700)
    return folder


def flip_payload_byte(bundle: Path, key: str) -> None:
    """Damage one payload byte of ``key``'s blob inside the bundle at ``bundle``, in place
    (its checksum no longer holds)."""
    with tarfile.open(bundle) as tar:
        member = tar.getmember(f"objects/{key}")
        offset = member.offset_data + member.size - 10
    with open(bundle, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
