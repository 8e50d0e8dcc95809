"""Triton autotuning shared by the processes that build in one work folder
(``compat.share_autotuning``), tested on its logic with stand-ins for Inductor's autotuner
and its kept result, in real processes: two builds of pieces holding the same kernel,
each of which would pick another launch configuration by its own timings, end with one
configuration, the one kept (a later build takes the kept one: its wrapper then differs
from the first builds' unless they agree). The effect on a GPU build is measured by
``tools/bench_build.py --edit`` (the edited piece's wrapper reused)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from cachebuild import compat

#: One build's autotuning of a kernel with two candidates, ``a`` and ``b``: this process's
#: timings favour ``argv[2]``; prints the configuration it keeps in its wrapper.
TUNE = textwrap.dedent('''
    import json, os, sys, time
    from cachebuild import compat

    path, pick, shared = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

    class Config:
        def __init__(self, name):
            self.name = name

    class Launcher:
        def __init__(self, name):
            self.config = Config(name)

    class Kept:  # Inductor's AutotuneCache over its local file
        def __init__(self):
            self.local_cache = (None, path)
        def read_best(self, meta, configs):
            if not os.path.exists(path):
                return None
            name = json.load(open(path))["name"]
            found = [c for c in configs if c.name == name]
            return found[0] if len(found) == 1 else None
        def save(self, config, *args, **kwargs):
            with open(path + ".tmp", "w") as f:
                json.dump({"name": config.name}, f)
            os.replace(path + ".tmp", path)

    class Tuner:
        def __init__(self):
            self.launchers = [Launcher("a"), Launcher("b")]
            self.inductor_meta = {}
            self.save_cache_hook = Kept().save
        def benchmark_all_configs(self):
            time.sleep(1.0)  # both processes time at once, unless one waits
            return {l: 0.0 if l.config.name == pick else 1.0 for l in self.launchers}

    def autotune_to_one_config(self):  # as Inductor's: time, keep the fastest, save it
        timings = self.benchmark_all_configs()
        best = min(timings, key=timings.get)
        self.launchers = [best]
        self.save_cache_hook(best.config)

    tune = compat.tune_once(autotune_to_one_config) if shared else autotune_to_one_config
    tuner = Tuner()
    tune(tuner)
    print(tuner.launchers[0].config.name)
''')


def _two_builds(tmp_path, shared: bool) -> tuple[set[str], str]:
    kept = tmp_path / "kernel.best_config"
    procs = [subprocess.Popen([sys.executable, "-c", TUNE, str(kept), pick,
                               "1" if shared else "0"], stdout=subprocess.PIPE, text=True)
             for pick in ("a", "b")]
    chosen = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    return chosen, json.loads(kept.read_text())["name"]


def test_builds_at_once_agree_on_a_kernels_configuration(tmp_path):
    chosen, kept = _two_builds(tmp_path, shared=True)
    assert chosen == {kept}, (chosen, kept)
    # Without it, each keeps the winner of its own timings: two configurations.
    (tmp_path / "plain").mkdir()
    chosen, _ = _two_builds(tmp_path / "plain", shared=False)
    assert chosen == {"a", "b"}


def test_sharing_is_hooked_into_this_torchs_autotuner():
    """The names ``share_autotuning`` patches exist in this torch (2.11-2.13); where Triton
    is not installed the hook leaves Inductor alone."""
    try:
        from torch._inductor.runtime import triton_heuristics
    except ImportError:
        return
    compat.share_autotuning()
    method = triton_heuristics.CachingAutotuner.autotune_to_one_config
    assert method.__name__ == "autotune_to_one_config"
    assert method.__code__ is compat.tune_once(lambda self: None).__code__
    assert hasattr(triton_heuristics.CachingAutotuner, "benchmark_all_configs")
