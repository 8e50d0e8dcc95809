"""The building layer's environment variables, checked at once.

Each is read where it is used (``pool``: ``CACHEBUILD_BUILD_JOBS``,
``CACHEBUILD_BUILD_MEMORY``, torch's ``TORCHINDUCTOR_COMPILE_THREADS``; ``build``: ``CACHEBUILD_LOAD_THREADS``; ``verify``:
``CACHEBUILD_VERIFY``; ``background``: ``CACHEBUILD_WHILE_BUILDING``), which may be never
in a run that finds everything stored. A typo would then pass in silence and bite on the
day a build happens; so a compile call and every model command check them all first, with
the same parsers and the same one-line UsageError.
"""

from __future__ import annotations

from cachebuild.building.background import while_building_setting
from cachebuild.building.build import load_threads
from cachebuild.building.pool import build_memory, check_compile_threads, cold_start_jobs
from cachebuild.building.verify import verify_on_load


def check_settings() -> None:
    """UsageError naming the variable and what it takes, for the first of the building
    variables that is set to a value its parser refuses."""
    cold_start_jobs(1)
    build_memory()
    check_compile_threads()
    load_threads()
    verify_on_load()
    while_building_setting()
