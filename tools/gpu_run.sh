#!/usr/bin/env bash
# One GPU run: the CUDA tests and a warm-start smoke of the example model, results in $OUT.
# Wheels missing on the GPU machine travel in .whl/ (installed into /tmp/site).
set -uo pipefail
OUT=${OUT:-/tmp/cachebuild-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor CACHEBUILD_PROBE_DIR=/tmp/probe PYTHONUNBUFFERED=1
python3 -m cachebuild.backends.probe cuda >"$OUT/probe.txt" 2>&1; echo "probe exit $?" | tee -a "$OUT/probe.txt"
python3 -m pytest -m cuda -q -s -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py 2>&1 | tee "$OUT/pytest_cuda.txt" | tail -40
export CACHEBUILD_DIR=/tmp/cb LLAMA_DEVICE=cuda LLAMA_LAYERS=${LLAMA_LAYERS:-22} LLAMA_HIDDEN=${LLAMA_HIDDEN:-2048} \
    LLAMA_HEADS=32 LLAMA_KV_HEADS=4 LLAMA_MLP=5632 LLAMA_VOCAB=32000
{ time cachebuild warm examples/llama.py --jobs 8; } >"$OUT/warm.txt" 2>&1; tail -3 "$OUT/warm.txt"
for i in 1 2; do { time python3 examples/llama.py; } 2>&1 | grep -v -i warn | tail -6 | tee -a "$OUT/serve.txt"; done
