#!/usr/bin/env bash
# One GPU run: the serve benchmark, the pass benchmark and the CUDA tests; results in $OUT.
# With two GPUs the serve benchmark runs on the first GPU and the first half of the CPUs
# while the tests and the pass benchmark run on the second; with one, one after the other.
# Wheels missing on the GPU machine travel in .whl/ (installed into /tmp/site).
#
#   SERVE_ARGS="--modes eager,cb_cold,cb_warm" PASSES_ARGS="--e2e --skip-kernels" \
#       bash tools/gpu_run.sh
#
# Time limits in seconds: SERVE_S (default 400), PASSES_S (200), TEST_S (200); 0 skips.
set -uo pipefail
OUT=${OUT:-/tmp/cachebuild-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())" | tee "$OUT/env.txt"
export CACHEBUILD_PROBE_DIR=/tmp/probe PYTHONUNBUFFERED=1

serve() {
    [ "${SERVE_S:-400}" = 0 ] && return
    timeout "${SERVE_S:-400}" python3 tools/bench_serve.py ${SERVE_ARGS:-} --json-out "$OUT/serve.json" \
        2>&1 | grep -v -i "warn" >"$OUT/serve.txt"
}

checks() {
    if [ "${TEST_S:-200}" != 0 ]; then
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-tests timeout "${TEST_S:-200}" \
            python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py \
            -k "gpu" >"$OUT/pytest_cuda.txt" 2>&1
    fi
    if [ "${PASSES_S:-200}" != 0 ]; then
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-passes timeout "${PASSES_S:-200}" \
            python3 tools/bench_passes.py --cudagraph ${PASSES_ARGS:---e2e} --json "$OUT/passes.json" \
            2>&1 | grep -v -i warn >"$OUT/passes.txt"
    fi
}

cpus=$(nproc)
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    half=$((cpus / 2))
    CUDA_VISIBLE_DEVICES=0 taskset -c 0-$((half - 1)) bash -c "$(declare -f serve); serve" &
    CUDA_VISIBLE_DEVICES=1 taskset -c "$half-$((cpus - 1))" bash -c "$(declare -f checks); checks" &
    wait
else
    serve
    checks
fi
tail -20 "$OUT/serve.txt" "$OUT/passes.txt" 2>/dev/null
grep -E "passed|failed|PASS|FAIL|capture of|artifact kinds" "$OUT/pytest_cuda.txt" 2>/dev/null | tail -20
