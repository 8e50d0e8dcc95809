#!/usr/bin/env bash
# The GPU part of tensor parallelism, on one host:
# - with two or more GPUs: the NCCL tests (groups of two ranks on cuda:0 and cuda:1, CUDA
#   graphs per rank, artifacts built on cuda:0 run on cuda:1) and the benchmark over NCCL;
# - with one GPU: what it can show (a one-rank NCCL group whose all-reduces are captured
#   into CUDA graphs; two ranks sharing the GPU over gloo that build each target once) and
#   the benchmark with two ranks on GPU 0 over gloo.
# The environment is used as it is (CXX and NCCL_* variables included). Results go to
# $OUT (default /tmp/cachebuild-tp-out).
#
#   bash tools/tp_gpu.sh            # tests, then the benchmark (bf16, TinyLlama-sized shards)
#   TP_TESTS=0 bash tools/tp_gpu.sh # the benchmark alone (TP_BENCH=0: the tests alone)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cachebuild-tp-out}; mkdir -p "$OUT"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "${TP_TESTS:-1}" != 0 ]; then
    python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_tp_gpu.py 2>&1 | tee "$OUT/pytest_tp.txt" | tail -15
fi
if [ "${TP_BENCH:-1}" != 0 ]; then
    if [ "$GPUS" -ge 2 ]; then where=(--device cuda); else where=(--device cuda:0 --dist-backend gloo); fi
    for backend in ${TP_BACKENDS:-inductor}; do
        LLAMA_HIDDEN=2048 LLAMA_LAYERS=${TP_LAYERS:-22} LLAMA_HEADS=32 LLAMA_KV_HEADS=4 \
          LLAMA_MLP=5632 LLAMA_VOCAB=32000 \
          python3 tools/bench_tp.py --world-size 2 "${where[@]}" --backend "$backend" --json \
            >"$OUT/bench_tp_$backend.json" 2>"$OUT/bench_tp_$backend.err" &&
        python3 tools/bench_tp.py --from-json "$OUT/bench_tp_$backend.json" --markdown \
            | tee "$OUT/bench_tp_$backend.txt" || tail -20 "$OUT/bench_tp_$backend.err"
    done
fi
