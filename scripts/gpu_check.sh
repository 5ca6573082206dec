#!/usr/bin/env bash
# The whole GPU pass in one device call: GPU tests, kernel benchmarks, decode benchmark.
# Usage on the device machine (repo root, .gpu-carry carried):
#   source .gpu-carry/env.sh && bash scripts/gpu_check.sh [tests|kernels|decode ...]
# Results land in $OUT (default ./out): pytest log, JSON tables, environment.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHRT_CACHE=${GRAPHRT_CACHE:-/tmp/graphrt-cache}
steps=${*:-tests kernels decode}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
} | tee "$OUT/env.txt"
for step in $steps; do
  case $step in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25 ;;
    alltests)
      python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_all.log" | tail -25 ;;
    kernels)
      python3 -m graphrt bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" ;;
    decode)
      python3 -m graphrt bench --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
