#!/usr/bin/env bash
# One GPU run: the serve benchmark, the pass benchmark, then the CUDA tests; results in $OUT.
# Wheels missing on the GPU machine travel in .whl/ (installed into /tmp/site).
# Usage: tools/gpu_run.sh [SERVE_MODES] [SERVE_SECONDS] [PASSES_SECONDS] [TEST_SECONDS]
set -uo pipefail
OUT=${OUT:-/tmp/cachebuild-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
export CACHEBUILD_PROBE_DIR=/tmp/probe PYTHONUNBUFFERED=1
timeout "${2:-300}" python3 tools/bench_serve.py --modes "${1:-eager,torch_cold,torch_warm,aot_load,cb_cold,cb_warm}" \
    --variants --json-out "$OUT/serve.json" 2>&1 | grep -v -i "warn" | tee "$OUT/serve.txt" | tail -14
timeout "${3:-120}" python3 tools/bench_passes.py --cudagraph --e2e --json "$OUT/passes.json" 2>&1 \
    | grep -v -i warn | tee "$OUT/passes.txt" | tail -25
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-tests
timeout "${4:-150}" python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py -k "gpu" 2>&1 \
    | tee "$OUT/pytest_cuda.txt" | grep -E "passed|failed|PASS|FAIL|capture of|artifact kinds" | tail -20
