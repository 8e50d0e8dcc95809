"""Which store a process uses, decided in one place for the library and the CLI alike.

``StoreOptions`` holds every setting; ``StoreOptions.from_env`` is the only reader of the
store's environment variables, and ``open_store(options)`` (``opening.py``) the only way a
configured store is opened. The settings, with their variables:

- ``cache_dir`` (``CACHEBUILD_DIR``, default ``$XDG_CACHE_HOME/cachebuild``, and
  ``~/.cache/cachebuild`` where that is unset): the local store (L1).
- ``remote`` (``CACHEBUILD_REMOTE``): ``redis://host:port/db`` of a shared tier (L2).
- ``remote_mode`` (``CACHEBUILD_REMOTE_MODE``): ``rw`` (default), ``ro`` (never write to
  the remote) or ``off`` (ignore a configured remote).
- ``signing_key`` (``CACHEBUILD_SIGNING_KEY``, its UTF-8 bytes): blobs written are signed
  with it (HMAC-SHA256) and signed blobs read are checked.
- ``require_signature`` (``CACHEBUILD_REQUIRE_SIGNATURE``): also refuse unsigned blobs.
- ``allow_unsigned`` (``CACHEBUILD_ALLOW_UNSIGNED``): use a remote without a signing key
  (anyone who can write to it can then run code here).
- ``work_dir`` (``CACHEBUILD_WORK_DIR``): where compilers write while a target builds
  (Inductor's and Triton's caches, precompiled headers, temp files); default the store's
  ``work/`` folder. ``stats`` counts it and ``gc`` empties it when no build runs.
- ``overlay_dir`` (``CACHEBUILD_OVERLAY_DIR``): where this user's builds go when
  ``cache_dir`` is read-only here (an image layer, a read-only mount, a store root owns):
  a store of its own, read before the read-only one. Unset: in memory, gone at exit.

Options are plain values, so worker processes open the very same store from them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cachebuild.errors import UsageError
from cachebuild.units import plural

REMOTE_MODES = ("rw", "ro", "off")

#: The shortest signing key taken: a shorter one can be guessed, and a guessed key signs
#: anything (what a store or remote serves runs as code here).
MIN_SIGNING_KEY_BYTES = 16


def cache_home() -> Path:
    """The user's cache folder by the XDG rules: ``$XDG_CACHE_HOME`` if it is an absolute
    path, else ``~/.cache``."""
    given = os.environ.get("XDG_CACHE_HOME", "")
    if given and os.path.isabs(given):
        return Path(given)
    return home() / ".cache"


def home() -> Path:
    """The user's home folder: ``$HOME``, or the account's where ``HOME`` is unset, empty or
    relative (``HOME=`` would otherwise put every user's store at ``/.cache``)."""
    given = os.environ.get("HOME", "")
    if given and os.path.isabs(given):
        return Path(given)
    import pwd

    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def default_dir() -> Path:
    """The store of a user who names none: ``cache_home()/cachebuild``."""
    return cache_home() / "cachebuild"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off (or unset)."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UsageError(f"{name}={os.environ[name]!r}: use 1 or 0 (or true/false, yes/no, on/off)")


@dataclass(frozen=True)
class StoreOptions:
    """Everything that decides the store (see the module doc for each setting)."""

    cache_dir: Path | str = field(default_factory=default_dir)
    remote: str | None = None
    remote_mode: str = "rw"
    signing_key: bytes | None = None
    require_signature: bool = False
    allow_unsigned: bool = False
    overlay_dir: Path | str | None = None
    work_dir: Path | str | None = None

    def __post_init__(self) -> None:
        if not str(self.cache_dir).strip():
            raise UsageError("the cache directory is empty: give a path (--cache-dir or "
                             "CACHEBUILD_DIR)")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if self.remote is not None:  # a line read from a file keeps its end
            object.__setattr__(self, "remote", self.remote.strip() or None)
        if self.overlay_dir is not None:
            if not str(self.overlay_dir).strip():
                raise UsageError("CACHEBUILD_OVERLAY_DIR is empty: give a path, or unset it")
            object.__setattr__(self, "overlay_dir", Path(self.overlay_dir).expanduser())
        if self.work_dir is not None:
            if not str(self.work_dir).strip():
                raise UsageError("CACHEBUILD_WORK_DIR is empty: give a path, or unset it")
            object.__setattr__(self, "work_dir", Path(self.work_dir).expanduser().absolute())
        mode = self.remote_mode.strip().lower()
        if mode not in REMOTE_MODES:
            raise UsageError(f"the remote mode (--remote-mode, CACHEBUILD_REMOTE_MODE) must be "
                             f"one of {', '.join(REMOTE_MODES)}, not {self.remote_mode!r}")
        object.__setattr__(self, "remote_mode", mode)
        if self.signing_key is not None and len(self.signing_key) < MIN_SIGNING_KEY_BYTES:
            raise UsageError(
                f"CACHEBUILD_SIGNING_KEY is {plural(len(self.signing_key), 'byte')} long: use at least "
                f"{MIN_SIGNING_KEY_BYTES} random bytes (for example the output of python -c "
                f"'import secrets; print(secrets.token_hex(32))'), the same on every machine")
        if self.require_signature and not self.signing_key:
            raise UsageError("CACHEBUILD_REQUIRE_SIGNATURE needs a signing key: set "
                             "CACHEBUILD_SIGNING_KEY")

    @classmethod
    def from_env(cls, **given: Any) -> StoreOptions:
        """Options from the environment; ``given`` values that are not None win (what a
        command line or a caller said explicitly)."""
        env: dict[str, Any] = {}
        if os.environ.get("CACHEBUILD_DIR") is not None:
            env["cache_dir"] = os.environ["CACHEBUILD_DIR"]
        if os.environ.get("CACHEBUILD_REMOTE"):
            env["remote"] = os.environ["CACHEBUILD_REMOTE"]
        if os.environ.get("CACHEBUILD_REMOTE_MODE"):
            env["remote_mode"] = os.environ["CACHEBUILD_REMOTE_MODE"]
        if os.environ.get("CACHEBUILD_WORK_DIR") is not None:
            env["work_dir"] = os.environ["CACHEBUILD_WORK_DIR"]
        if os.environ.get("CACHEBUILD_OVERLAY_DIR") is not None:
            env["overlay_dir"] = os.environ["CACHEBUILD_OVERLAY_DIR"]
        if os.environ.get("CACHEBUILD_SIGNING_KEY"):
            env["signing_key"] = os.environ["CACHEBUILD_SIGNING_KEY"].encode("utf-8")
        env["require_signature"] = env_flag("CACHEBUILD_REQUIRE_SIGNATURE")
        env["allow_unsigned"] = env_flag("CACHEBUILD_ALLOW_UNSIGNED")
        env.update({k: v for k, v in given.items() if v is not None})
        if isinstance(env.get("signing_key"), str):
            env["signing_key"] = env["signing_key"].encode("utf-8")
        return cls(**env)

    def with_remote_off(self) -> StoreOptions:
        return replace(self, remote_mode="off")

    @property
    def uses_remote(self) -> bool:
        return bool(self.remote) and self.remote_mode != "off"
