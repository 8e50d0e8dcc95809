"""A model that cannot be compiled fails once: the failure is remembered for that model in
the process and raised again at once (no second trace), or, with
``on_failure="eager"``, the model runs eagerly after one warning. A start that traces
because the model's file changed says that its source changed."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types

import models
import numpy
import pytest
import torch
import torch.nn as nn

import cachebuild
from cachebuild.errors import CompileFailed, ConfigError, UsageError


class NoSplit(nn.Module):
    """Its forward never calls the splitting op the config names: the split refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) + 1


def _config(**overrides):
    return cachebuild.CompileConfig(splitting_ops=("aten::softmax",), compile_ranges=((1, 16),),
                                    backend="eager_fusion", **overrides)


def test_a_failure_is_raised_at_once_after_the_first_time(open_local, tmp_path):
    store = open_local(tmp_path / "store")
    model = NoSplit().eval()
    compiled = cachebuild.compile(model, _config(), {0: 0}, store=store)
    before = cachebuild.stats()
    with pytest.raises(UsageError, match="not found in the traced graph"):
        compiled(torch.randn(4, 8))
    for size in (4, 6):  # the same model, other sizes of the range: no new attempt
        with pytest.raises(CompileFailed, match="not found in the traced graph") as e:
            compiled(torch.randn(size, 8))
        assert isinstance(e.value.original, UsageError) and e.value.exit_code == 2
    # A new compile of the same model (a server that retries) is refused at once too.
    with pytest.raises(CompileFailed, match="NoSplit cannot be compiled"):
        cachebuild.compile(model, _config(), {0: 0}, store=store)(torch.randn(4, 8))
    assert models.counters_delta(before, cachebuild.stats())["traced"] == 1
    # Call errors are about the call, not the model: said every time, never remembered.
    with pytest.raises(UsageError, match="size 0"):
        compiled(torch.randn(0, 8))


class BreaksInTraining(nn.Module):
    """Its forward breaks the graph in train() only."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            torch._dynamo.graph_break()
        return torch.relu(self.proj(x))


def test_a_failure_is_the_models_with_the_values_it_had(open_local, tmp_path):
    """A trace that fails in train() is not eval()'s failure: eval() compiles (and matches
    eager); train() fails again, and from then on at once, with no new trace."""
    import torch._dynamo

    store = open_local(tmp_path / "store")
    model = BreaksInTraining().train()
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    with pytest.raises(UsageError, match="does not trace as one graph"), torch.no_grad():
        cachebuild.compile(model, config, {0: 0}, store=store)(torch.randn(4, 8))
    model.eval()
    compiled = cachebuild.compile(model, config, {0: 0}, store=store)
    models.assert_matches_eager(compiled, model, (torch.randn(4, 8),))
    model.train()
    # A variant of the stored eval() entry now: its own failure, met once more.
    with pytest.raises(UsageError, match="does not trace as one graph"), torch.no_grad():
        cachebuild.compile(model, config, {0: 0}, store=store)(torch.randn(4, 8))
    before = cachebuild.stats()
    with pytest.raises(CompileFailed, match="does not trace as one graph"), torch.no_grad():
        cachebuild.compile(model, config, {0: 0}, store=store)(torch.randn(4, 8))
    assert models.counters_delta(before, cachebuild.stats())["traced"] == 0


class BreaksInOneMode(nn.Module):
    """Its forward breaks the graph where a plain attribute says so (a mode, an adapter's
    name), not where ``training`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.config = types.SimpleNamespace(mode="breaks")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.mode == "breaks":
            torch._dynamo.graph_break()
        return torch.relu(self.proj(x))


def test_a_failure_is_the_models_with_the_attribute_values_it_had(open_local, tmp_path):
    """A trace that fails for one value of a config's field is not another value's
    failure, on the same compiled module: it compiles (and matches eager) once the value
    changes, and the failing value fails again, then at once (it blocked every value for
    the rest of the process)."""
    store = open_local(tmp_path / "store")
    model = BreaksInOneMode().eval()
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    compiled = cachebuild.compile(model, config, {0: 0}, store=store)
    with pytest.raises(UsageError, match="does not trace as one graph"), torch.no_grad():
        compiled(torch.randn(4, 8))
    model.config.mode = "plain"
    models.assert_matches_eager(compiled, model, (torch.randn(4, 8),))
    model.config.mode = "breaks"
    with pytest.raises(Exception, match="does not trace as one graph"), torch.no_grad():
        compiled(torch.randn(4, 8))


def _breaks(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return x


class CallsItsFunction(nn.Module):
    """Its forward calls the function an attribute holds (an activation chosen by config)."""

    def __init__(self, f) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.proj(x))


@pytest.mark.parametrize("works", [torch.relu, lambda x: x * 2, "partial"])
def test_a_failure_is_not_another_function_attributes(open_local, tmp_path, works):
    """A model whose trace fails for the function one instance's attribute holds is not
    that failure with another function there (a builtin, a lambda, a partial):
    compiles and matches eager, in the same process, after the other failed (it was
    refused as that failure: every function read as one plain value)."""
    import functools

    store = open_local(tmp_path / "store")
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    failing, fine = (CallsItsFunction(_breaks).eval(), CallsItsFunction(_breaks).eval())
    if works == "partial":
        failing.f, works = functools.partial(_breaks), functools.partial(torch.mul, other=3.0)
    fine.f = works
    with pytest.raises(UsageError, match="does not trace as one graph"), torch.no_grad():
        cachebuild.compile(failing, config, {0: 0}, store=store)(torch.randn(4, 8))
    models.assert_matches_eager(cachebuild.compile(fine, config, {0: 0}, store=store), fine,
                                (torch.randn(4, 8),))


#: Read by ``BreaksByGlobal``'s forward.
BREAKS = True


class BreaksByGlobal(nn.Module):
    """Its forward breaks the graph where a module global, a class attribute or an
    environment variable says so."""

    loud = True

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if BREAKS or self.loud or os.environ.get("CB_TEST_BREAKS") == "1":
            torch._dynamo.graph_break()
        return torch.relu(self.proj(x))


def test_a_failure_is_not_one_of_other_globals_class_attributes_or_environment(
        open_local, tmp_path, monkeypatch):
    """A trace that failed for a module global's value, a class attribute's or an
    environment variable's is traced again once that value changes (it was refused as
    the same failure: "nothing it depends on changed"), and compiles, matching eager."""
    store = open_local(tmp_path / "store")
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    model = BreaksByGlobal().eval()
    compiled = cachebuild.compile(model, config, {0: 0}, store=store)
    monkeypatch.setenv("CB_TEST_BREAKS", "1")
    monkeypatch.setattr(BreaksByGlobal, "loud", True)
    monkeypatch.setattr(sys.modules[__name__], "BREAKS", True)
    for change in (lambda: monkeypatch.setattr(sys.modules[__name__], "BREAKS", False),
                   lambda: monkeypatch.setattr(BreaksByGlobal, "loud", False),
                   lambda: monkeypatch.setenv("CB_TEST_BREAKS", "0")):
        with pytest.raises(UsageError, match="does not trace as one graph"), torch.no_grad():
            compiled(torch.randn(4, 8))
        change()
    models.assert_matches_eager(compiled, model, (torch.randn(4, 8),))


#: A global of this module that no model's code names.
UNRELATED = 0


def test_a_failure_is_met_again_where_only_globals_its_code_does_not_name_changed(
        open_local, tmp_path, monkeypatch):
    """A script's other globals (a loop counter, a notebook's last output) and unrelated
    environment variables change between calls: the failure is still this model's, raised
    at once without a second trace (every call traced again when all globals counted)."""
    store = open_local(tmp_path / "store")
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    monkeypatch.setattr(sys.modules[__name__], "BREAKS", True)
    compiled = cachebuild.compile(BreaksByGlobal().eval(), config, {0: 0}, store=store)
    before = cachebuild.stats()
    with pytest.raises(UsageError, match="does not trace as one graph"), torch.no_grad():
        compiled(torch.randn(4, 8))
    for i in range(2):
        monkeypatch.setattr(sys.modules[__name__], "UNRELATED", i + 1)
        monkeypatch.setenv("CB_TEST_UNRELATED", str(i))
        with pytest.raises(CompileFailed, match="BreaksByGlobal cannot be compiled"), \
                torch.no_grad():
            compiled(torch.randn(4, 8))
    # (a trace that fails is not counted as one: none was made)
    assert models.counters_delta(before, cachebuild.stats()).get("traced", 0) == 0


def test_with_on_failure_eager_the_model_runs_eagerly_after_one_warning(open_local, tmp_path, caplog):
    store = open_local(tmp_path / "store")
    model = NoSplit().eval()
    with caplog.at_level(logging.WARNING, logger="cachebuild"):
        compiled = cachebuild.compile(model, _config(on_failure="eager"), {0: 0}, store=store)
        for size in (3, 5, 3):
            x = torch.randn(size, 8)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), model(x))
        again = cachebuild.compile(model, _config(on_failure="eager"), {0: 0}, store=store)
        with torch.no_grad():
            x = torch.randn(7, 8)
            torch.testing.assert_close(again(x), model(x))
    said = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("cachebuild: NoSplit cannot be compiled, so it runs eagerly "
                              "(on_failure='eager'): UsageError: splitting op(s)"), said


def test_another_config_is_tried_again(open_local, tmp_path):
    """Remembered per model and config: the same model with a config that works compiles."""
    store = open_local(tmp_path / "store")
    model = NoSplit().eval()
    with pytest.raises(UsageError):
        cachebuild.compile(model, _config(), {0: 0}, store=store)(torch.randn(4, 8))
    works = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    compiled = cachebuild.compile(model, works, {0: 0}, store=store)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **models.TOL)


def test_on_failure_is_checked():
    with pytest.raises(ConfigError, match="on_failure must be one of"):
        cachebuild.CompileConfig(on_failure="ignore")


SOURCE = '''
import torch
import torch.nn as nn


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x))
'''


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_start_after_the_model_file_changed_says_the_source_changed(open_local, tmp_path, caplog,
                                                                       monkeypatch):
    store = open_local(tmp_path / "store")
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    (tmp_path / "small.py").write_text(SOURCE)
    first = _import(tmp_path / "small.py", "small_before")
    monkeypatch.delitem(sys.modules, "small_before")
    model = first.Small().eval()
    cachebuild.compile(model, config, {0: 0}, store=store)(torch.randn(4, 8))
    # One line added at module level: the source changed, and the notice says so.
    (tmp_path / "small.py").write_text(SOURCE + "\nEXTRA = 1\n")
    second = _import(tmp_path / "small.py", "small_after")
    monkeypatch.delitem(sys.modules, "small_after")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cachebuild"):
        cachebuild.compile(second.Small().eval(), config, {0: 0}, store=store)(torch.randn(4, 8))
    said = [r.getMessage() for r in caplog.records if "from scratch" in r.getMessage()]
    assert len(said) == 1, said
    assert "because its source differs from the one warmed (its file was edited since, or " \
           "the warmed class of that name is another file's): the file defining the " \
           "model's class differs (source " in said[0], said[0]
    assert "not warmed" not in said[0]


class LastTokens(torch.nn.Module):
    """Keeps the last 4 tokens: a branch on the token count at size 1 of a range."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[max(0, x.shape[0] - 4):]


def test_a_branch_on_the_token_count_inside_a_range_says_which_ranges_would_do(open_local):
    model = LastTokens().eval()
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    with pytest.raises(Exception, match=r"give that size a range of its own, e\.g\. "
                                        r"compile_ranges=\(\(1, 1\), \(2, 16\)\)"):
        cachebuild.compile(model, config, {0: 0}, store=open_local())(torch.randn(6, 8))
    split = cachebuild.CompileConfig(compile_ranges=((1, 1), (2, 16)), backend="eager_fusion")
    compiled = cachebuild.compile(model, split, {0: 0}, store=open_local())
    with torch.no_grad():
        for n in (6, 1, 3, 16):
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x))


class OneTokenPath(torch.nn.Module):
    """A decode fast path: another answer at one token. Dynamo traces a dynamic dim as at
    least 2, so the branch leaves no guard behind."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if x.shape[0] == 1:
            return y * 0 + 1
        return y


@pytest.mark.parametrize("first", [4, 1])
def test_a_branch_at_one_token_is_refused_where_a_range_serves_one_token(open_local, first):
    model = OneTokenPath().eval()
    config = cachebuild.CompileConfig(compile_ranges=((1, 16),), backend="eager_fusion")
    compiled = cachebuild.compile(model, config, {0: 0}, store=open_local())
    with pytest.raises(UsageError, match=r"another branch at size 1 than at \d+ .*compile "
                                         r"range \(1, 16\) holds both"), torch.no_grad():
        compiled(torch.randn(first, 8))
    # Ranges from 2 on are served from the same trace.
    above = cachebuild.compile(model, cachebuild.CompileConfig(
        compile_ranges=((2, 16),), backend="eager_fusion"), {0: 0}, store=open_local())
    with torch.no_grad():
        for n in (4, 2, 9):
            x = torch.randn(n, 8)
            torch.testing.assert_close(above(x), model(x))


class FixedTokens(torch.nn.Module):
    """Adds a table of 5 rows: the token dim given as dynamic is fixed at 5."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.table = torch.nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table


def test_a_forward_that_fixes_a_dynamic_dim_is_refused_in_one_line(open_local, caplog):
    compiled = cachebuild.compile(FixedTokens().eval(), cachebuild.CompileConfig(
        compile_ranges=((1, 16),), backend="eager_fusion"), {0: 0}, store=open_local())
    with pytest.raises(UsageError, match=r"fixes the size of a dim given as dynamic .*constant "
                                         r"\(5\).*another argument's dim of that size left out "
                                         r"of dynamic_dims .*or a weight"), torch.no_grad():
        compiled(torch.randn(5, 8))
    assert not [r for r in caplog.records if r.name == "torch._guards"]  # no page of log


def test_an_object_argument_keys_the_entry_by_its_class_not_its_address():
    from cachebuild.building.entry_key import entry_factors

    class Options:
        pass

    model = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    config = cachebuild.CompileConfig(backend="eager_fusion")
    first, second = (entry_factors(model, (x, Options()), {0: 0}, config, {})
                     for _ in range(2))
    assert first["inputs"] == second["inputs"]
    assert "0x" not in str(first["inputs"])


def test_an_input_of_another_layout_keys_another_entry():
    """An entry traced on a transposed input is not found for contiguous calls (which
    it would refuse): each layout traces its own."""
    from cachebuild.building.entry_key import entry_factors

    model = torch.nn.Linear(4, 4)
    config = cachebuild.CompileConfig(backend="eager_fusion")
    plain = entry_factors(model, (torch.randn(3, 4),), {0: 0}, config, {})
    turned = entry_factors(model, (torch.randn(4, 3).t(),), {0: 0}, config, {})
    again = entry_factors(model, (torch.randn(5, 4),), {0: 0}, config, {})
    assert plain["inputs"] != turned["inputs"] and plain["inputs"] == again["inputs"]


class HoldsAnArray(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.coef = numpy.array([1.0, 2.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * float(self.coef[1])


def test_a_numpy_array_the_forward_reads_is_refused_in_one_line(open_local, tmp_path):
    """Dynamo reads the array as a tensor (and rebuilds its guards: torch's own check of
    them compared the array elementwise, an internal Dynamo error): both doors refuse it,
    naming NumPy, where nothing can bind it in a warm process."""
    model = HoldsAnArray().eval()
    config = models.config(splitting_ops=(), compile_ranges=((1, 16),))
    store = open_local(tmp_path / "store")
    with pytest.raises(UsageError, match="NumPy array"), torch.no_grad():
        cachebuild.compile(model, config, {0: 0}, store=store)(torch.randn(4, 8))
    torch._dynamo.reset()
    door = torch.compile(model, backend=cachebuild.backend(config, store=store), dynamic=False)
    with pytest.raises(Exception, match="stand-in for NumPy code"), torch.no_grad():
        door(torch.randn(4, 8))


class Settings:
    """A config reading a dict: a missing name raises KeyError, not AttributeError."""

    def __init__(self) -> None:
        object.__setattr__(self, "values", {"scale": 2.0})

    def __getattr__(self, name: str) -> object:
        return self.values[name]

    def __setattr__(self, name: str, value: object) -> None:
        self.values[name] = value


class ReadsSettings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.settings = Settings()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.settings.scale


def test_a_config_whose_getattr_raises_keyerror_compiles_and_is_watched(open_local, tmp_path):
    """Reading ``__func__``, ``__module__`` or ``__qualname__`` of such an object raises
    KeyError: taken as absent, as ``getattr`` takes AttributeError."""
    model = ReadsSettings().eval()
    config = models.config(splitting_ops=(), compile_ranges=((1, 16),))
    compiled = cachebuild.compile(model, config, {0: 0}, store=open_local(tmp_path / "store"))
    x = torch.randn(4, 8)
    models.assert_matches_eager(compiled, model, (x,))
    model.settings.scale = 3.0
    models.assert_matches_eager(compiled, model, (x,))
