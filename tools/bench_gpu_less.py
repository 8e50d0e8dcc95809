"""How much of a CUDA build runs on a machine without a GPU: Triton's part.

Compiles a Triton kernel of the kind Inductor writes for a decoder (a row-wise RMSNorm in
bf16) for a named GPU architecture (``--arch 90``: an H100/H200) with no GPU present, and
reports the seconds and the cubin's size. This is the part of warming CUDA targets on a
build machine that Triton alone can do today; the rest (Inductor's code generation for a
``cuda`` device, which reads the device's properties, and AOTInductor's C++ wrapper, which
needs the CUDA headers) needs a CUDA build of torch and is not measured here. Usage::

    python tools/bench_gpu_less.py [--arch 90]
"""

from __future__ import annotations

import argparse
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90)")
    args = parser.parse_args()
    import os

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def rms_norm(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols,
                 (x * tl.rsqrt(var + eps) * w).to(tl.bfloat16), mask=mask)

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32",
                 "eps": "fp32", "BLOCK": "constexpr"}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # an empty cache: a real compile
        start = time.perf_counter()
        kernel = triton.compile(ASTSource(rms_norm, signature, constexprs={"BLOCK": 2048}),
                                target=GPUTarget("cuda", args.arch, 32))
        seconds = time.perf_counter() - start
    print(f"triton {triton.__version__}: compiled for sm_{args.arch} without a GPU in "
          f"{seconds:.2f} s; cubin {len(kernel.asm['cubin'])} bytes")


if __name__ == "__main__":
    main()
