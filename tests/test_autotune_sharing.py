"""Triton autotuning shared by the processes that build in one work folder
(``backends/autotune.py``), tested on its logic with stand-ins for Inductor's autotuner
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

from cachebuild.backends import autotune

#: One build's autotuning of a kernel (its code ``argv[4]``) with two candidates, ``a`` and
#: ``b``, its result kept at ``argv[1]``: this process's timings favour ``argv[2]``; prints
#: the configuration it keeps in its wrapper.
TUNE = textwrap.dedent('''
    import json, os, sys, time
    from cachebuild.backends import autotune

    path, pick, shared, source = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]

    class Config:
        def __init__(self, name):
            self.kwargs, self.num_warps, self.num_stages = {"XBLOCK": name}, 4, 1

    class Launcher:
        def __init__(self, name):
            self.config = Config(name)

    class Kept:  # Inductor's AutotuneCache over its local file
        configs_hash = "candidates a and b"
        def __init__(self):
            self.local_cache = (None, path)
        def read_best(self, meta, configs):
            if not os.path.exists(path):
                return None
            name = json.load(open(path))["XBLOCK"]
            found = [c for c in configs if c.kwargs["XBLOCK"] == name]
            return found[0] if len(found) == 1 else None
        def save(self, config, *args, **kwargs):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({**config.kwargs, "num_warps": config.num_warps,
                           "num_stages": config.num_stages,
                           "configs_hash": self.configs_hash}, f)
            os.replace(path + ".tmp", path)

    class Fn:
        src = source

    class Tuner:
        def __init__(self):
            self.launchers = [Launcher("a"), Launcher("b")]
            self.inductor_meta = {}
            self.save_cache_hook = Kept().save
            self.fn = Fn()
        def benchmark_all_configs(self):
            time.sleep(1.0)  # both processes time at once, unless one waits
            return {l: 0.0 if l.config.kwargs["XBLOCK"] == pick else 1.0
                    for l in self.launchers}

    def autotune_to_one_config(self):  # as Inductor's: time, keep the fastest, save it
        timings = self.benchmark_all_configs()
        best = min(timings, key=timings.get)
        self.launchers = [best]
        self.save_cache_hook(best.config)

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tune = autotune.tune_once(autotune_to_one_config) if shared else autotune_to_one_config
    tuner = Tuner()
    tune(tuner)
    print(tuner.launchers[0].config.kwargs["XBLOCK"])
''')

KERNEL = "def k(x):\n    return x * 1e-05 + 2048\n"


def _builds(kept_paths, picks, sources, shared: bool, at_once: bool = True) -> list[str]:
    """Processes tuning at once (or one after another), each its kernel and result path."""
    def start(path, pick, source):
        return subprocess.Popen([sys.executable, "-c", TUNE, str(path), pick,
                                 "1" if shared else "0", source], stdout=subprocess.PIPE,
                                text=True)

    chosen = []
    procs = []
    for args in zip(kept_paths, picks, sources, strict=True):
        procs.append(start(*args))
        if not at_once:
            chosen.append(procs[-1].communicate(timeout=60)[0].strip())
    if at_once:
        chosen = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return chosen


def test_builds_at_once_agree_on_a_kernels_configuration(tmp_path):
    kept = tmp_path / "inductor" / "ab" / "kernel.best_config"
    chosen = _builds([kept, kept], ["a", "b"], [KERNEL, KERNEL], shared=True)
    assert len(set(chosen)) == 1 and json.loads(kept.read_text())["XBLOCK"] == chosen[0]
    # Without it, each keeps the winner of its own timings: two configurations.
    plain = tmp_path / "plain" / "ab" / "kernel.best_config"
    assert sorted(_builds([plain, plain], ["a", "b"], [KERNEL, KERNEL], shared=False)) == \
        ["a", "b"]


def test_a_kernel_edited_in_a_float_constant_takes_its_twins_configuration(tmp_path):
    """The edited kernel (another epsilon, so another kept result) picks what its twin
    kept, though its own timings favour the other candidate; one that differs in an int
    (a size) is timed for itself."""
    root = tmp_path / "inductor"
    first, edited, resized = (root / "ab" / "one.best_config", root / "cd" / "two.best_config",
                              root / "ef" / "three.best_config")
    chosen = _builds([first, edited, resized], ["a", "b", "b"],
                     [KERNEL, KERNEL.replace("1e-05", "1e-06"), KERNEL.replace("2048", "4096")],
                     shared=True, at_once=False)
    assert chosen == ["a", "a", "b"]


def test_sharing_is_hooked_into_this_torchs_autotuner():
    """The names ``compat.hook_autotuning`` patches exist in this torch (2.11-2.13); where
    Triton is not installed the hook leaves Inductor alone."""
    try:
        from torch._inductor.runtime import triton_heuristics
    except ImportError:
        return
    autotune.share()
    method = triton_heuristics.CachingAutotuner.autotune_to_one_config
    assert method.__name__ == "autotune_to_one_config"
    assert method.__code__ is autotune.tune_once(lambda self: None).__code__
    assert hasattr(triton_heuristics.CachingAutotuner, "benchmark_all_configs")
