"""CompileConfig: normalised, hashable, and every invalid value refused at construction
with one clear ConfigError."""

from __future__ import annotations

import pytest
import torch

import cachebuild
from cachebuild.backends import register_backend
from cachebuild.errors import ConfigError, UsageError
from cachebuild.keys import make_key
from cachebuild.passes import PassConfig
from cachebuild.passes.rewrites.manager import PassManager


def test_defaults_and_normalisation():
    a = cachebuild.CompileConfig(splitting_ops=["mylib::attention"],
                                 compile_ranges=[[1, 64], [65, 256]], compile_sizes=[8, 4, 8],
                                 inductor_options={"max_autotune": False, "cpp.threads": 1})
    b = cachebuild.CompileConfig(splitting_ops=("mylib::attention",),
                                 compile_ranges=((1, 64), (65, 256)), compile_sizes=(4, 8),
                                 inductor_options=(("cpp.threads", 1), ("max_autotune", False)))
    assert a == b and hash(a) == hash(b)
    assert a.compile_sizes == (4, 8)
    assert a.inductor_options_dict() == {"cpp.threads": 1, "max_autotune": False}
    assert make_key(a.factors()) == make_key(b.factors())
    default = cachebuild.CompileConfig()
    assert default.backend == "inductor" and default.compile_ranges == ((1, 8192),)
    assert default.capture_sizes[:4] == (1, 2, 4, 8) and default.capture_sizes[-1] == 512


def test_a_single_op_name_is_one_splitting_op():
    assert cachebuild.CompileConfig(splitting_ops="mylib::attention").splitting_ops == (
        "mylib::attention",)


def test_buckets_in_dispatch_order():
    cfg = cachebuild.CompileConfig(compile_ranges=((17, 48), (1, 16)), compile_sizes=(16, 4))
    assert cfg.buckets() == [{"size": 4}, {"size": 16}, {"range": [1, 16]}, {"range": [17, 48]}]


def test_factors_change_with_every_field():
    base = cachebuild.CompileConfig()
    variants = [
        cachebuild.CompileConfig(splitting_ops=("mylib::attention",)),
        cachebuild.CompileConfig(compile_ranges=((1, 4096),)),
        cachebuild.CompileConfig(compile_sizes=(8,)),
        cachebuild.CompileConfig(backend="eager_fusion"),
        cachebuild.CompileConfig(flavour="standalone"),
        cachebuild.CompileConfig(passes=PassConfig(cleanup=False)),
        cachebuild.CompileConfig(inductor_options={"max_autotune": True}),
    ]
    keys = {make_key(c.factors()) for c in variants}
    assert len(keys) == len(variants)
    assert make_key(base.factors()) not in keys


def test_run_time_policies_stay_out_of_the_factors():
    base = cachebuild.CompileConfig()
    for policy in (cachebuild.CompileConfig(out_of_range="eager"),
                   cachebuild.CompileConfig(cudagraph_mode="piecewise"),
                   cachebuild.CompileConfig(capture_sizes=(1, 2, 4))):
        assert policy != base
        assert make_key(policy.factors()) == make_key(base.factors())


@pytest.mark.parametrize("ranges", [((1, 64), (64, 128)), ((1, 64), (32, 48)),
                                    ((100, 200), (1, 150))])
def test_overlapping_ranges(ranges):
    with pytest.raises(ConfigError, match="compile ranges overlap"):
        cachebuild.CompileConfig(compile_ranges=ranges)


def test_adjacent_ranges_are_fine():
    cfg = cachebuild.CompileConfig(compile_ranges=((1, 64), (65, 128)))
    assert cfg.compile_ranges == ((1, 64), (65, 128))


@pytest.mark.parametrize("ranges", [((0, 8),), ((8, 4),), ((-3, 4),)])
def test_empty_range_or_below_one(ranges):
    with pytest.raises(ConfigError, match="empty or starts below 1"):
        cachebuild.CompileConfig(compile_ranges=ranges)


@pytest.mark.parametrize("ranges", [(1, 8192), ((1, 2, 3),), ("a",), ((1, "x"),)])
def test_ranges_that_are_not_pairs(ranges):
    with pytest.raises(ConfigError, match=r"\(lo, hi\) pairs"):
        cachebuild.CompileConfig(compile_ranges=ranges)


def test_no_range():
    with pytest.raises(ConfigError, match="compile_ranges is empty"):
        cachebuild.CompileConfig(compile_ranges=())


@pytest.mark.parametrize("size", [0, 65, 200])
def test_size_outside_every_range(size):
    with pytest.raises(ConfigError, match=f"compile size {size} lies outside every compile range"):
        cachebuild.CompileConfig(compile_ranges=((1, 64), (100, 150)), compile_sizes=(8, size))


def test_unknown_backend_lists_the_known_ones_where_it_is_resolved(open_local, tmp_path):
    from cachebuild.backends import get_backend

    config = cachebuild.CompileConfig(backend="tvm")  # a plain value: nothing resolved yet
    with pytest.raises(ConfigError, match="unknown backend 'tvm'") as info:
        get_backend(config.backend)
    assert "eager_fusion" in str(info.value) and "inductor" in str(info.value)
    compiled = cachebuild.compile(torch.nn.Linear(2, 2), config, store=open_local(tmp_path / "s"))
    with pytest.raises(ConfigError, match="unknown backend 'tvm'"):
        compiled(torch.randn(3, 2))


def test_building_a_config_imports_no_torch_ops_backends_or_passes():
    import subprocess
    import sys

    code = ("import sys\n"
            "from cachebuild.config import CompileConfig, PassConfig\n"
            "CompileConfig(backend='inductor', passes=PassConfig.all_fusions())\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('cachebuild.passes')\n"
            "       or m.startswith('cachebuild.backends')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_registered_backend_is_accepted():
    from cachebuild.backends.eager_fusion import EagerFusionBackend

    register_backend("test_config_backend", EagerFusionBackend)
    assert cachebuild.CompileConfig(backend="test_config_backend").backend == "test_config_backend"


@pytest.mark.parametrize("op", ["attention", "mylib:attention", "mylib::", "::attention",
                                "my lib::attention", "mylib::attention.default.out",
                                "mylib::1attention", "mylib::attention()", ""])
def test_op_name_that_does_not_parse(op):
    with pytest.raises(ConfigError, match="does not parse: write it as 'namespace::name'"):
        cachebuild.CompileConfig(splitting_ops=(op,))


def test_op_name_that_is_not_a_string():
    with pytest.raises(ConfigError, match="does not parse"):
        cachebuild.CompileConfig(splitting_ops=(3,))


@pytest.mark.parametrize("op", ["mylib::attention", "aten::scaled_dot_product_attention",
                                "mylib::attention.default", "vllm::unified_attention_with_output"])
def test_op_names_that_parse(op):
    assert cachebuild.CompileConfig(splitting_ops=(op,)).splitting_ops == (op,)


@pytest.mark.parametrize("field,value,message", [
    ("flavour", "tensorrt", "unknown flavour"),
    ("cudagraph_mode", "always", "unknown cudagraph_mode"),
    ("out_of_range", "ignore", "out_of_range must be one of"),
    ("capture_sizes", (0, 8), "capture sizes must be positive"),
    ("passes", {"cleanup": True}, "passes must be a cachebuild.passes.PassConfig"),
])
def test_other_invalid_values(field, value, message):
    with pytest.raises(ConfigError, match=message):
        cachebuild.CompileConfig(**{field: value})


def test_config_error_is_a_usage_error_and_a_value_error():
    with pytest.raises(UsageError) as info:
        cachebuild.CompileConfig(flavour="tensorrt")
    assert isinstance(info.value, ValueError)
    assert info.value.exit_code == 2


def test_config_is_frozen():
    cfg = cachebuild.CompileConfig()
    with pytest.raises(AttributeError):
        cfg.backend = "eager_fusion"  # type: ignore[misc]


def test_pass_config_enters_the_pass_manager_factors():
    on = PassManager.from_config(PassConfig()).factors()
    off = PassManager.from_config(PassConfig(cleanup=False)).factors()
    assert on["config"]["cleanup"] is True and off["config"]["cleanup"] is False
    assert make_key(on) != make_key(off)


def test_inductor_freezing_is_refused_before_a_trace(monkeypatch):
    """Freezing makes the weights constants of the compiled code; pieces read the live
    model's weights: refused in one line, not a trace that fails deep in the split."""
    from cachebuild.config import check_inductor_options
    from cachebuild.errors import ConfigError

    with pytest.raises(ConfigError, match="freezing"):
        check_inductor_options(cachebuild.CompileConfig(inductor_options={"freezing": True}))
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "1")
    with pytest.raises(ConfigError, match="TORCHINDUCTOR_FREEZING"):
        check_inductor_options(cachebuild.CompileConfig())
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "0")
    check_inductor_options(cachebuild.CompileConfig())


def test_inductor_freezing_is_refused_by_the_torch_compile_door(monkeypatch):
    """``cachebuild.backend`` refuses it as it is made, before torch.compile (whose Dynamo
    would wrap the error in a traceback of its own), and at a graph if it was turned on
    since."""
    import torch._inductor.config as inductor

    from cachebuild.errors import ConfigError

    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "1")
    with pytest.raises(ConfigError, match="freezing"):
        cachebuild.backend(cachebuild.CompileConfig(backend="eager_fusion"))
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "0")
    door = cachebuild.backend(cachebuild.CompileConfig(backend="eager_fusion"))
    # Inductor's own way to set a setting for a while (monkeypatch would delete it after)
    with inductor.patch(freezing=True), pytest.raises(ConfigError, match="freezing"):
        door(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [torch.randn(1, 2)])
    assert inductor.freezing is False
