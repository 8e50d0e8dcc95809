"""Shared test set-up.

Everything a test run writes goes under one session folder, removed when the run ends
(kept, and named, when a test failed): pytest's own temporary folders, the temp files of
every process the tests start (``TMPDIR``), one Inductor and Triton cache and one probe
folder for the whole session (Inductor on CPU is slow to start: it probes the CPU and
builds C++), shared with child processes through the environment; cold starts build in
the calling process (``CACHEBUILD_BUILD_JOBS=1``) unless a test asks for workers. Only what other users
must enter (``trust.public_dir``) goes to the system's temp folder, removed by its test.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

#: The system's temp folder, where a folder other users can enter is made. Kept in the
#: environment: pytest-xdist's workers inherit a ``TMPDIR`` already pointing into the
#: session folder, which only its owner may enter.
SYSTEM_TMP = os.environ.setdefault("CACHEBUILD_TESTS_SYSTEM_TMP", tempfile.gettempdir())
_SESSION_TMP = tempfile.mkdtemp(prefix="cachebuild-tests-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SESSION_TMP, "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_SESSION_TMP, "triton"))
os.environ.setdefault("CACHEBUILD_PROBE_DIR", os.path.join(_SESSION_TMP, "probe"))
# Cold starts build in this process unless a test asks for workers: a worker's start
# (torch and Inductor imported afresh) costs more than a tiny model's targets take.
os.environ.setdefault("CACHEBUILD_BUILD_JOBS", "1")
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
    _group_shared_fixtures(items)
    _slow_first(items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _group_shared_fixtures(items):
    """With ``pytest -n N --dist loadgroup`` (what CI runs), each module whose tests share a
    module-scoped fixture (a compiled model, a warmed store) runs on one worker, so that
    fixture is built once; every other test goes to whichever worker is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d[-1].scope in ("module", "package") for d in defs if d):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _slow_first(items):
    """The slow tests that no group holds run first, so that a run with workers ends on
    short tests rather than one worker's minutes-long test while the others wait
    (pytest-xdist hands out groups first, then single tests in this order). A group's
    tests keep their place: moving them apart would build its shared fixture twice."""
    def later(item):
        grouped = item.get_closest_marker("xdist_group") is not None
        return grouped or item.get_closest_marker("slow") is None

    items.sort(key=later)


@pytest.fixture
def store_dir(tmp_path):
    """A fresh store directory (created 0700 by the store itself)."""
    return tmp_path / "store"


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs: a disk that fills up (root only; skipped where mounting is not
    permitted)."""
    from mounts import tmpfs

    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        yield mnt


@pytest.fixture(scope="module")
def example_llama():
    """The example Llama (examples/llama.py) at its small default shape, seeded."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import llama

    torch.manual_seed(0)
    return llama.make_model()


@pytest.fixture
def clock():
    """The test's clock: the stores ``open_local`` opens keep time by it, and it moves only
    when the test says (``clock.advance(seconds)``)."""
    from clock import ManualClock

    return ManualClock()


@pytest.fixture
def open_local(store_dir, clock):
    """Opens ``LocalStore``s for a test and closes each one when the test ends: at
    ``store_dir`` unless given a path, on the test's ``clock`` unless given another."""
    from cachebuild.store import LocalStore

    opened = []

    def open_(path=None, **options):
        options.setdefault("clock", clock)
        store = LocalStore(store_dir if path is None else path, **options)
        opened.append(store)
        return store

    yield open_
    for store in reversed(opened):
        store.close()


@pytest.fixture
def store(open_local):
    """A fresh ``LocalStore`` at ``store_dir`` on the test's clock, closed when it ends."""
    return open_local()


@pytest.fixture
def fresh_dynamo():
    """The test starts and ends with Dynamo's caches empty: models of a module share one
    forward's code, which Dynamo would otherwise answer from its cache (a module uses it
    for every test with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def module_store(tmp_path_factory):
    """One store per test module: graph modes and capture policies are run-time settings,
    so a module's tests load the one entry its first test built. Closed after the module."""
    from cachebuild.store import LocalStore

    with LocalStore(tmp_path_factory.mktemp("module") / "store") as shared:
        yield shared


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Each test starts as a fresh process would (``process_state.fresh``): targets loaded
    or proven and models that failed to compile (on purpose, with a broken verifier or
    store) in an earlier test are not remembered."""
    from cachebuild import process_state

    with process_state.fresh():
        yield
