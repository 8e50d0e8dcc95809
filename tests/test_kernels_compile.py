"""Every kernel variant compiles for an H100/H200 (sm_90) without a GPU.

The interpreter tests check the kernels' arithmetic but not what only the compiler sees
(constexpr branches, types, layouts). Triton can compile ahead of time for a target
without the device, so this runs anywhere Triton's NVIDIA backend is installed. It runs
in a child process: the kernels must be decorated without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cachebuild.passes.ops import kernels as k

    target = GPUTarget("cuda", 90, 32)
    compiled = 0

    def comp(fn, sig, constexprs):
        global compiled
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target)
        compiled += 1

    for dt in ("bf16", "fp16", "fp32"):
        for res in (False, True):
            for quant in (False, True):
                comp(k._rms_norm_kernel, {
                    "x_ptr": f"*{dt}", "x_stride": "i64", "res_ptr": f"*{dt}",
                    "res_stride": "i64", "w_ptr": f"*{dt}",
                    "out_ptr": "*fp8e4nv" if quant else f"*{dt}", "out_stride": "i32",
                    "res_out_ptr": f"*{dt}", "res_out_stride": "i32", "scale_ptr": "*fp32",
                    "hidden": "i32", "eps": "fp32", "BLOCK": "constexpr",
                    "HAS_RESIDUAL": "constexpr", "QUANT": "constexpr", "FP8_LIMIT": "constexpr",
                }, {"BLOCK": 4096, "HAS_RESIDUAL": res, "QUANT": quant, "FP8_LIMIT": 448.0})
    for quant in (False, True):
        comp(k._silu_and_mul_kernel, {
            "x_ptr": "*bf16", "x_stride": "i64", "out_ptr": "*fp8e4nv" if quant else "*bf16",
            "out_stride": "i32", "scale_ptr": "*fp32", "d": "i32", "BLOCK": "constexpr",
            "QUANT": "constexpr", "FP8_LIMIT": "constexpr",
        }, {"BLOCK": 1024, "QUANT": quant, "FP8_LIMIT": 448.0})
    comp(k._static_quant_kernel, {
        "x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "n": "i32",
        "BLOCK": "constexpr", "FP8_LIMIT": "constexpr",
    }, {"BLOCK": 1024, "FP8_LIMIT": 448.0})
    comp(k._dynamic_quant_kernel, {
        "x_ptr": "*bf16", "x_stride": "i64", "out_ptr": "*fp8e4nv", "out_stride": "i32",
        "scale_out_ptr": "*fp32", "hidden": "i32", "BLOCK": "constexpr",
        "FP8_LIMIT": "constexpr", "MIN_SCALE": "constexpr",
    }, {"BLOCK": 4096, "FP8_LIMIT": 448.0, "MIN_SCALE": 1 / (448 * 512)})
    for norm in (False, True):
        for has_pass in (False, True):
            comp(k._rope_kernel, {
                "pos_ptr": "*i64", "q_ptr": "*bf16", "q_stride": "i64", "k_ptr": "*bf16",
                "k_stride": "i64", "q_out_ptr": "*bf16", "q_out_stride": "i64",
                "k_out_ptr": "*bf16", "k_out_stride": "i64", "q_w_ptr": "*bf16",
                "k_w_ptr": "*bf16", "cache_ptr": "*fp32", "cache_stride": "i64",
                "num_heads_q": "i32", "num_heads_kv": "i32", "head_size": "i32",
                "half": "i32", "eps": "fp32", "BLOCK_H": "constexpr", "BLOCK_R": "constexpr",
                "BLOCK_P": "constexpr", "HAS_PASS": "constexpr", "NORM": "constexpr",
            }, {"BLOCK_H": 16, "BLOCK_R": 64, "BLOCK_P": 64 if has_pass else 1,
                "HAS_PASS": has_pass, "NORM": norm})
    print("compiled", compiled)
""")


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except Exception:
        return False


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend is not installed")
def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "compiled 20" in done.stdout
