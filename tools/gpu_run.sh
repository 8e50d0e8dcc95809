#!/usr/bin/env bash
# One GPU run: the CUDA tests, the generation benchmark and a profile of a decode step per
# serving mode (and, if asked, the serve, cold-build, pass and guard benchmarks), with the
# machine's own environment (its CXX and all); results in $OUT. The default run takes
# about 15 minutes at most (330 + 390 + 150 s of limits, and the install).
# Wheels missing on the GPU machine travel in .whl/ (installed into /tmp/site).
#
#   bash tools/gpu_run.sh
#   SERVE_S=420 SERVE_ARGS="--modes eager,cb_build_aoti,cb_warm_aoti" bash tools/gpu_run.sh
#
# Time limits in seconds: TEST_S (default 330), GEN_S (390; the generation benchmark,
# GEN_ARGS), PROFILE_S (150; the decode-step profile, PROFILE_ARGS, reusing the generation
# benchmark's stores and caches), SERVE_S (0: skipped by default; the serve benchmark,
# SERVE_ARGS), BUILD_S (0: skipped; the cold-build benchmark, BUILD_ARGS), WRAPPER_S (0:
# skipped; AOTInductor's C++ options, WRAPPER_ARGS), PASSES_S (0: skipped), GUARDS_S (0:
# skipped; the per-call guard check, GUARDS_ARGS); 0 skips a part.
# SERVE_FIRST=1 runs the benchmarks before the tests. TESTS: the test files (default: every
# GPU test file but the tensor-parallel ones, the generation tests first).
set -uo pipefail
OUT=${OUT:-/tmp/cachebuild-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())" | tee "$OUT/env.txt"
echo "CXX=${CXX:-} CC=${CC:-} g++ on PATH: $(command -v g++)" | tee -a "$OUT/env.txt"
# One probe directory and one bytecode cache for the tests and the benchmark alike.
export CACHEBUILD_PROBE_DIR=/tmp/probe PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE

tests() {
    [ "${TEST_S:-330}" = 0 ] && return
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-tests timeout "${TEST_S:-330}" \
        python3 -m pytest -m cuda -q -s -p no:cacheprovider \
        ${TESTS:-tests/test_generate_gpu.py tests/test_gpu.py tests/test_kernels.py} \
        >"$OUT/pytest_cuda.txt" 2>&1
    grep -E "passed|failed|error|Error|AOTInductor|capture of|cold |first output|pools|served|graph replays" \
        "$OUT/pytest_cuda.txt" | tail -40
}
serve() {
    [ "${SERVE_S:-0}" = 0 ] && return
    timeout "${SERVE_S}" python3 tools/bench_serve.py ${SERVE_ARGS:-} --json-out "$OUT/serve.json" \
        2>&1 | grep -v -i "warn" >"$OUT/serve.txt"
    tail -25 "$OUT/serve.txt"
}
generation() {
    [ "${GEN_S:-390}" = 0 ] && return
    timeout "${GEN_S:-390}" python3 tools/bench_generate.py ${GEN_ARGS:-} --work /tmp/gen-work \
        --json-out "$OUT/generate.json" 2>&1 | grep -v -i "warn" >"$OUT/generate.txt"
    # the tables again from the saved results (complete, or as far as the time limit let it go)
    python3 tools/bench_generate.py --from-json "$OUT/generate.json" >"$OUT/generate_table.txt" 2>&1
    cat "$OUT/generate_table.txt"
}
profile() {  # where a decode step's time goes, per mode (stores and caches of generation())
    [ "${PROFILE_S:-150}" = 0 ] && return
    timeout "${PROFILE_S:-150}" python3 tools/profile_decode.py ${PROFILE_ARGS:-} --work /tmp/gen-work \
        --out "$OUT/decode_profile.md" --json-out "$OUT/decode_profile.json" \
        >"$OUT/decode_profile.txt" 2>&1
    head -12 "$OUT/decode_profile.md" 2>/dev/null || tail -5 "$OUT/decode_profile.txt"
}
cold_builds() {
    [ "${BUILD_S:-0}" = 0 ] && return
    timeout "${BUILD_S}" python3 tools/bench_build.py \
        ${BUILD_ARGS:---device cuda --layers 22 --repeat 1 --serve} --markdown \
        2>&1 | grep -v -i "warn" | tee "$OUT/build.txt" | tail -25
}
if [ -n "${SERVE_FIRST:-}" ]; then generation; profile; serve; tests; else tests; generation; profile; serve; fi
cold_builds
if [ "${GUARDS_S:-0}" != 0 ]; then  # the per-call guard check against a decode step
    timeout "${GUARDS_S}" python3 tools/bench_guards.py ${GUARDS_ARGS:-} --json-out "$OUT/guards.json" \
        2>&1 | grep -v -i warn | tee "$OUT/guards.txt" | tail -8
fi
if [ "${WRAPPER_S:-0}" != 0 ]; then
    timeout "${WRAPPER_S}" python3 tools/bench_wrapper.py --device cuda \
        ${WRAPPER_ARGS:---variants default no_pch wrapper_O0} --json 2>&1 | grep -v -i warn \
        | tee "$OUT/wrapper.txt" | tail -25
fi
if [ "${PASSES_S:-0}" != 0 ]; then
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-passes timeout "${PASSES_S}" \
        python3 tools/bench_passes.py --cudagraph ${PASSES_ARGS:---e2e} --json "$OUT/passes.json" \
        2>&1 | grep -v -i warn >"$OUT/passes.txt"
    tail -20 "$OUT/passes.txt"
fi
