"""Shared test set-up.

Everything a test run writes goes under one session folder, removed when the run ends
(kept, and named, when a test failed): pytest's own temporary folders, the temp files of
every process the tests start (``TMPDIR``), one Inductor and Triton cache and one probe
folder for the whole session (Inductor on CPU is slow to start: it probes the CPU and
builds C++), shared with child processes through the environment. Only what other users
must enter (``trust.public_dir``) goes to the system's temp folder, removed by its test.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

#: The system's temp folder, where a folder other users can enter is made.
SYSTEM_TMP = tempfile.gettempdir()
_SESSION_TMP = tempfile.mkdtemp(prefix="cachebuild-tests-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SESSION_TMP, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_SESSION_TMP, "triton"))
os.environ.setdefault("CACHEBUILD_PROBE_DIR", os.path.join(_SESSION_TMP, "probe"))
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = _SESSION_TMP


def pytest_sessionfinish(session, exitstatus):
    if exitstatus != 0:
        print(f"\nthis run's files are kept in {_SESSION_TMP}")
        return
    # Removed at exit, after multiprocessing removes its own folder in there (its
    # finalizers run in priority order; its folder's is -100).
    import multiprocessing.util

    multiprocessing.util.Finalize(None, shutil.rmtree, args=(_SESSION_TMP,),
                                  kwargs={"ignore_errors": True}, exitpriority=-101)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def store_dir(tmp_path):
    """A fresh store directory (created 0700 by the store itself)."""
    return tmp_path / "store"


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs: a disk that fills up (root only; skipped where mounting is not
    permitted)."""
    from trust import tmpfs

    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        yield mnt
