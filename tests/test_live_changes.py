"""A value the forward reads, changed after the first call, is never served the old answer.

Each case of ``tests/live_changes.py`` (an attribute, a nested attribute, ``train()``, a
global, a config value, a list's contents, an environment variable, a forward hook, one
module-level object swapped for another of its class (or a sentinel, or an object held by
a list or a class attribute, or the object compared with), a function's or a method's code
swapped in place, an int made a bool, an object's or a submodule's class swapped in
place, a class attribute set on a subclass of the class that gave it, a weight's or an
input's requires_grad read, a value under a tuple key, autograd's mode read and a call
made with it on) runs in
a process of its own, through both front doors, cold then warm against one store, every
output compared with the live eager model's. Through ``cachebuild.compile``: a change costs
one trace the first time, undoing it none (the forward for the old values is still there),
and a warm process traces nothing at all (every variant was stored). The per-call check
itself (``guard_watch``) is tested below for what it watches and what it reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from cachebuild import compat
from cachebuild.dictwatch import ANY, TagPoll
from cachebuild.tracing import guard_watch
from cachebuild.tracing.guards import GuardSet, identity

sys.path.insert(0, str(Path(__file__).resolve().parent))
import live_changes  # noqa: E402

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


def _run(door: str, backend: str, store: Path, *cases: str) -> list[dict]:
    env = {**os.environ, "CACHEBUILD_DIR": str(store)}
    for name in ("LIVE_DOUBLE", "LIVE_TRIPLE", "live_quarter", "LV", "LIVE_HELD"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(HERE / "live_changes.py"), door, backend,
                           *cases], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _assert_exact(rows: list[dict]) -> None:
    wrong = [r for r in rows if r["error"] > 1e-5]
    assert not wrong, wrong
    assert {r["case"] for r in rows} >= {"attribute"}


def _traces_per_step(rows: list[dict]) -> dict[tuple[str, str], int]:
    out, before = {}, 0
    for r in rows:
        out[r["case"], r["step"]] = r["traced"] - before
        before = r["traced"]
    return out


def test_every_live_change_through_cachebuild_compile_cold_then_warm(tmp_path):
    store = tmp_path / "store"
    cold = _run("compile", "eager_fusion", store)
    _assert_exact(cold)
    traces = _traces_per_step(cold)
    for (case, step), n in traces.items():
        if case in (live_changes.AROUND_THE_CALL, live_changes.GRAD_ON):
            assert n == 0, (case, n)  # run eagerly under the caller's mode
        elif step == "changed":
            # the new values are traced once (or served by the forward made for them)...
            assert n == (0 if case in live_changes.SEEN_BEFORE else 1), (case, n)
        elif step == "undone":
            assert n == 0, (case, n)  # ...and the old forward serves the old ones again
    warm = _run("compile", "eager_fusion", store)
    _assert_exact(warm)
    assert warm[-1]["traced"] == 0  # every variant was stored: nothing traced
    assert len(warm) == len(cold) == 3 * len(live_changes.CASES)


#: What torch.compile's own guards do not follow (torch 2.11-2.13): a forward hook added
#: after the first call (``torch._dynamo.config.skip_nnmodule_hook_guards``), an
#: environment variable the forward reads, ``x is Y`` between two objects of one
#: class (guarded by their type alone), a method replaced on the model's class or given
#: other code in place, a class attribute set on a subclass of the class that gave it.
#: That door is Dynamo's; the README says so.
DYNAMO_UNGUARDED = ("environment variable", "environment variable named by an attribute",
                    *[c.name for c in live_changes.CASES
                      if c.name.startswith("environment variable read ")],
                    "forward hook", "module-level object", "sentinel made by object()",
                    "object held by a list",
                    "the list holding the object compared with reordered",
                    "object held by another class's attribute",
                    "class attributes compared with swapped", "method of the class",
                    "code of a method", "class attribute shadowed",
                    "class attribute of an object shadowed",
                    "class attribute shadowed on a sibling class")


def test_every_live_change_through_torch_compile(tmp_path):
    cases = [c.name for c in live_changes.CASES if c.name not in DYNAMO_UNGUARDED]
    _assert_exact(_run("torch", "eager_fusion", tmp_path / "store", *cases))


def test_a_flag_flipped_with_inductor_cold_then_warm(tmp_path):
    """Also a caller's dispatch mode around a call (generated code would run past it), and
    the process's default dtype changed (build workers have their own)."""
    store = tmp_path / "store"
    cases = ("attribute", live_changes.AROUND_THE_CALL, live_changes.DEFAULT_DTYPE)
    _assert_exact(_run("compile", "inductor", store, *cases))
    warm = _run("compile", "inductor", store, *cases)
    _assert_exact(warm)
    assert warm[-1]["traced"] == 0


# -- the per-call check ----------------------------------------------------------------------

class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.flag = False
        self.names = ["x"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2 if self.flag else 1)


def _records(model: Flagged) -> GuardSet:
    """Guards like those a trace of ``Flagged`` records: the flag, a submodule and its
    hook dict, a list's length, the process state."""
    hooks = [["model"], ["attr", "_modules"], ["item", "lin"], ["attr", "_forward_hooks"]]
    return GuardSet([
        [[["model"], ["attr", "flag"]], "equals", None, {"bool": False}],
        [[["model"], ["attr", "_modules"], ["item", "lin"]], "type", None,
         {"type": "torch.nn.modules.linear.Linear"}],
        [hooks, "len", None, 0],
        [[["model"], ["attr", "names"]], "len", None, 1],
        [[["state", "default_dtype"]], "equals", None, {"torch": "torch.float32"}],
    ])


@pytest.mark.parametrize("change", ["setattr", "dict write", "hook", "submodule", "list",
                                    "dtype"])
def test_the_check_sees_every_kind_of_change(change):
    model = Flagged()
    watch = guard_watch.CallGuards(_records(model))
    args = (torch.zeros(2, 4),)
    assert watch.mismatches(model, args) == []  # arms
    assert watch.mismatches(model, args) == []
    assert watch.full_checks == 1
    assert watch.read_per_call == 1  # the list's length; the rest is watched
    dtype = torch.get_default_dtype()
    try:
        if change == "setattr":
            model.flag = True
        elif change == "dict write":  # past nn.Module.__setattr__
            model.__dict__["flag"] = True
        elif change == "hook":
            model.lin.register_forward_hook(lambda m, i, o: o)
        elif change == "submodule":
            model.lin = nn.Conv1d(4, 4, 1)
        elif change == "list":
            model.names.append("y")
        else:
            torch.set_default_dtype(torch.float64)
        assert watch.mismatches(model, args), change
    finally:
        torch.set_default_dtype(dtype)


@pytest.mark.parametrize("change", ["matmul precision", "fp32 precision", "autocast dtype",
                                    "warn only"])
def test_the_check_sees_torch_state_a_forward_may_read(change):
    """Torch's process state that Dynamo's global-state guard holds and a forward may
    branch on: how matmuls may round, the dtype autocast casts to (where it is on),
    deterministic algorithms' warn-only mode."""
    from cachebuild.tracing.guards import STATE_NAMES, fingerprint, process_state

    model = Flagged()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = [[[["state", name]], "equals", None,
                  fingerprint("equals", process_state(name), None)] for name in STATE_NAMES]
        watch = guard_watch.CallGuards(GuardSet(state))
        args = (torch.zeros(2, 4),)
        assert watch.mismatches(model, args) == []
        tf32 = torch.backends.cuda.matmul.allow_tf32
        fp32 = torch.backends.cuda.matmul.fp32_precision
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            if change == "matmul precision":
                torch.backends.cuda.matmul.allow_tf32 = not tf32
            elif change == "fp32 precision":  # the newer setting, which the legacy flag's
                torch.backends.cuda.matmul.fp32_precision = "tf32"  # reader refuses then
            elif change == "autocast dtype":
                torch.set_autocast_dtype("cpu", torch.float16)
            else:
                torch.use_deterministic_algorithms(deterministic, warn_only=not warn_only)
            wrong = watch.mismatches(model, args)
            assert [m.name for m in wrong] == ["torch " + {
                "matmul precision": "matmul precision", "fp32 precision": "matmul precision",
                "autocast dtype": "autocast dtype",
                "warn only": "deterministic warn only"}[change]], wrong
        finally:
            torch.backends.cuda.matmul.fp32_precision = fp32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.set_autocast_dtype("cpu", torch.bfloat16)
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        assert watch.mismatches(model, args) == []


@pytest.mark.parametrize("mode", ["grad", "inference"])
def test_the_check_sees_autograd_modes_where_a_forward_reads_them(mode):
    """A forward that reads autograd's mode records it as the trace saw it (no grad); a
    call in another mode is a mismatch the runtime tells apart (it runs eagerly), at the
    fast check as at the full one."""
    from cachebuild.tracing.guards import GRAD_STATES, fingerprint, grad_mode_changed

    model = Flagged()
    with torch.no_grad():
        state = [[[["state", name]], "equals", None, fingerprint("equals", False, None)]
                 for name in GRAD_STATES]
        watch = guard_watch.CallGuards(GuardSet(state))
        args = (torch.zeros(2, 4),)
        assert watch.mismatches(model, args) == [] and watch.mismatches(model, args) == []
    with torch.enable_grad() if mode == "grad" else torch.inference_mode():
        wrong = watch.mismatches(model, args)
        assert grad_mode_changed(wrong) and [m.name for m in wrong] == [
            "torch grad enabled" if mode == "grad" else "torch inference mode"], wrong
    with torch.no_grad():
        assert watch.mismatches(model, args) == []


def test_a_change_between_the_full_check_and_arming_is_seen(monkeypatch):
    """Another thread sets the flag after the full check held and before the watch is
    set: the armed check must not take the new value as the traced one."""
    model = Flagged()
    watch = guard_watch.CallGuards(_records(model))
    args = (torch.zeros(2, 4),)
    walk = guard_watch._Plan.walk

    def walk_after_a_change(plan, *a):
        model.flag = True  # what the other thread does, in the window
        walk(plan, *a)

    monkeypatch.setattr(guard_watch._Plan, "walk", walk_after_a_change)
    assert watch.mismatches(model, args) == []  # the call that raced the change
    monkeypatch.setattr(guard_watch._Plan, "walk", walk)
    assert watch.mismatches(model, args), "the flag set meanwhile went unseen"


def test_an_equal_value_in_a_new_object_arms_again_without_a_mismatch():
    model = Flagged()
    watch = guard_watch.CallGuards(_records(model))
    args = (torch.zeros(2, 4),)
    watch.mismatches(model, args)
    model.flag = bool(int("0"))  # the same value: the watch fires, the full check holds
    model.names = ["z"]
    assert watch.mismatches(model, args) == []
    assert watch.mismatches(model, args) == []
    assert watch.full_checks <= 2


def test_a_model_held_by_a_global_stays_armed_while_other_globals_change():
    """The trace's identity check on the model names it by the global that holds it (a
    script's ``m``): that global's module is not watched for it, so a script's loop
    counter, set in the same globals at every call, does not make every call a full check
    (Python 3.11 watches whole dicts)."""
    import types as _types

    script = _types.ModuleType("script_like")
    script.Model = type("Model", (Flagged,), {"__module__": "script_like"})
    script.m = script.Model()
    sys.modules["script_like"] = script
    try:
        records = _records(script.m)
        held = identity(script.m)
        assert "global" in held, held
        watch = guard_watch.CallGuards(GuardSet([*records.data, [[["model"]], "id", None, held]]))
        args = (torch.zeros(2, 4),)
        for i in range(5):
            script.i = i  # the loop's counter, a global beside the model's
            assert watch.mismatches(script.m, args) == []
        assert watch.full_checks == 1
        script.m.flag = True  # a real change is still seen
        assert watch.mismatches(script.m, args)
    finally:
        del sys.modules["script_like"]


def test_polling_version_tags_sees_a_change_at_any_key():
    holder = type("Holder", (), {})()
    holder.a, holder.b = 1, 2
    unchanged = TagPoll().watch([(vars(holder), "a"), ({"k": 1}, ANY)])
    assert unchanged()
    holder.b = 3
    assert not unchanged()


@pytest.mark.skipif(not (Path(sys.base_prefix).parent / "3.12.1").exists()
                    and sys.version_info < (3, 12), reason="no Python 3.12 here")
def test_dict_watchers_on_python_312(tmp_path):
    """CPython's dict watchers (3.12+), run where a 3.12 interpreter is at hand."""
    python = sys.executable if sys.version_info >= (3, 12) else \
        str(Path(sys.base_prefix).parent / "3.12.1" / "bin" / "python")
    script = tmp_path / "watch.py"
    script.write_text(f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("dw", {str(HERE.parent / "cachebuild" / "dictwatch.py")!r})
dw = importlib.util.module_from_spec(spec); spec.loader.exec_module(dw)
w = dw.watcher(True)
assert type(w).__name__ == "DictWatcher", type(w)
class O: pass
o = O(); o.a = 1; o.b = 2
d = {{"x": 1}}
same = w.watch([(vars(o), "a"), (d, dw.ANY)])
o.b = 3; assert same(), "a key nobody watches"
o.a = 1; assert same(), "the same object again"
o.a = 2; assert not same(), "a watched key"
same = w.watch([(d, dw.ANY)])
d["y"] = 1; assert not same(), "any key"
same = w.watch([(vars(o), "a")])
del o; assert not same(), "freed"
a, b, c = {{"k": 1}}, {{"k": 1}}, {{"k": 1}}
same_a, same_b, same_c = (w.watch([(x, "k")]) for x in (a, b, c))
b["k"] = 2; assert same_a() and not same_b(), "a change of another watch's dict"
del c; assert same_a() and not same_c(), "a dict freed: its own watches alone"
x = {{"k": 0}}
live = w.watch([(x, "k")])
for _ in range(200):  # dropped at once: pruned along the way
    w.watch([(x, "k")])
x["k"] = 1; assert not live(), "a live watch after others were pruned"
import threading
sys.setswitchinterval(1e-6)  # threads taking turns inside the watcher's own work
stop = []
def churn():  # watches made and dropped, pruned, while the main thread changes x
    while not stop:
        w.watch([(x, "k"), ({{}}, "k")])
churner = threading.Thread(target=churn); churner.start()
missed = 0
for i in range(20000):
    same = w.watch([(x, "k")]); x["k"] = i + 2
    missed += same()
stop.append(1); churner.join()
assert missed == 0, f"{{missed}} changes missed"
# dicts that live until the interpreter ends: a module's, a class's (CPython calls the
# watcher as it frees them, after the callback is gone, unless the watcher is closed)
import gc, json
class C: x = 1
same = w.watch([(vars(json), "dumps"), (gc.get_referents(vars(C))[0], "x")])
C.x = 2; assert not same(), "a class attribute"
if sys.argv[1] == "close":
    same = w.watch([(vars(json), "dumps")])
    w.close(); assert not same(), "a check armed before the watcher closed"
    d = {{"x": 1}}
    same = w.watch([(d, "x")])  # version tags, read with NumPy
    assert same(); d["x"] = 2; assert not same(), "watched by tags once closed"
print("ok")  # and the watcher closes as the interpreter ends
""")
    has_numpy = subprocess.run([python, "-c", "import numpy"], capture_output=True).returncode == 0
    for how in ("close", "exit") if has_numpy else ("exit",):
        proc = subprocess.run([python, str(script), how], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and "ok" in proc.stdout, (how, proc.returncode, proc.stderr)


def test_this_process_uses_the_fastest_watch_it_has():
    kind = type(compat.dict_watcher()).__name__
    assert kind == ("DictWatcher" if sys.version_info >= (3, 12) else "TagPoll")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_flag_flipped_after_graph_capture_on_the_gpu(tmp_path, mode):
    """Graphs captured for one value of a flag never serve the other: the flip is seen
    before the call, which runs on (and captures) the forward for the new value."""
    import cachebuild
    from cachebuild.store import LocalStore

    torch.manual_seed(0)
    model = Flagged().cuda().eval()
    config = cachebuild.CompileConfig(backend="eager_fusion", compile_ranges=((1, 16),),
                                      cudagraph_mode=mode, capture="eager",
                                      capture_sizes=(1, 2, 4, 8))
    compiled = cachebuild.compile(model, config=config, dynamic_dims={0: 0},
                                  store=LocalStore(tmp_path / "store"))
    with torch.no_grad():
        for flag in (False, True, False, True):
            model.flag = flag
            for size in (1, 3, 8):
                x = torch.randn(size, 4, device="cuda")
                torch.testing.assert_close(compiled(x).clone(), model(x))
    assert cachebuild.stats()["variant_switches"] >= 2


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: object) -> torch.Tensor:
        return self.lin(x) * scale


def test_a_value_where_a_tensor_was_traced_is_another_forward_not_an_error(open_local):
    """An argument that is a float, then a tensor, then the float again (all of which
    eager runs): each call runs on the forward for what it passed."""
    import cachebuild

    torch.manual_seed(0)
    model = Scaled().eval()
    compiled = cachebuild.compile(model, cachebuild.CompileConfig(
        backend="eager_fusion", compile_ranges=((1, 16),)), {0: 0}, store=open_local())
    x = torch.randn(4, 8)
    with torch.no_grad():
        for scale in (2.0, 3.0, torch.tensor(2.0), 2.0, torch.tensor(0.5), 3.0):
            torch.testing.assert_close(compiled(x, scale), model(x, scale))
