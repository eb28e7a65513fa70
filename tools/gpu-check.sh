#!/usr/bin/env bash
# `make gpu-check` (and gpu-check-bare): every GPU test (a skip fails), the kernel benchmarks with the tile sweep,
# the Llama-3-8B-shape roofline eager and with CUDA graphs, and the decode profile with CUDA graphs, into
# $GPU_CHECK_DIR. A GPU is lent for minutes: every step runs even when an earlier one failed, and the exit status
# says whether all passed.
# Env: PY (python), GPU_CHECK_DIR (default bench/gpu-check), PYTEST_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
out=${GPU_CHECK_DIR:-bench/gpu-check}
mkdir -p "$out"
failed=()
step() {  # step NAME LOG COMMAND...
  local name=$1 log=$2
  shift 2
  echo "==> [gpu-check] $name ($(date -u +%H:%M:%S))"
  "$@" 2>&1 | tee "$out/$log" || failed+=("$name")
}
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
step tests tests.log env LORAFLEET_REQUIRE_GPU=1 LORAFLEET_GPU_LARGE=1 \
  "$PY" -m pytest tests/kernels -v -rA --junitxml="$out/tests.xml" ${PYTEST_ARGS:-}
step bench bench.log "$PY" bench/bench_gpu.py --out "$out/gpu.json" --markdown "$out/gpu.md" --skip-e2e
step profile profile.log "$PY" bench/profile_gpu.py --cuda-graph-max-bs 64 --out "$out/gpu-profile.json"
echo "==> [gpu-check] results in $out/ (tests.log, tests.xml, gpu.json, gpu.md, bench.log, gpu-profile.json, profile.log)"
if [ ${#failed[@]} -gt 0 ]; then
  echo "==> [gpu-check] FAILED: ${failed[*]}"
  exit 1
fi
echo "==> [gpu-check] every step passed"
