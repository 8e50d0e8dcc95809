#!/usr/bin/env bash
# The two-GPU part of tensor parallelism, on one host with two or more CUDA GPUs:
# the NCCL tests (groups of two ranks on cuda:0 and cuda:1, CUDA graphs per rank,
# artifacts built on cuda:0 run on cuda:1) and the benchmark for docs/benchmarks.md.
# The environment is used as it is (NCCL_* variables included).
#
#   bash tools/tp_gpu.sh            # tests, then the benchmark (bf16, TinyLlama-sized shards)
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -p no:cacheprovider -m cuda tests/test_tp_gpu.py
LLAMA_DEVICE=cuda LLAMA_HIDDEN=2048 LLAMA_LAYERS=22 LLAMA_HEADS=32 LLAMA_KV_HEADS=4 \
  LLAMA_MLP=5632 LLAMA_VOCAB=32000 \
  python tools/bench_tp.py --world-size 2 --device cuda --backend inductor --markdown
