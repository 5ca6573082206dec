#!/usr/bin/env bash
# The multi-GPU pass (tensor parallelism), in one device call on a machine of >= 2 GPUs. Results land
# in $OUT (default ./out). From the root of a checkout installed with `pip install -e .`:
#   bash scripts/tp_check.sh [step ...]
# Steps: tests (NCCL + graphs against one GPU), bench (llama-8b-shape, TP = 1 then TP = N in the same
# call: plain and EAGLE-3 speculative at simulated L, B = 1, 8, 64), ab (TP = N plain decode with the
# symmetric-memory all-reduces, the push and the one-shot kernel, against NCCL's), push
# (scripts/push_bench.py's GEMV chain: the all-reduce inside the GEMV, after it, and none), b70
# (llama-70b-shape's first 10 layers: plain and EAGLE-3 at simulated L = 3), profile (kernel time per
# phase by family, communication included, at TP = N), sampler (vocab-parallel sampler and argmax
# against all-gather + the one-GPU kernels).
# Default: all.
# TP=N sets the ranks (default: every GPU, at most 4).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHRT_CACHE=${GRAPHRT_CACHE:-/tmp/graphrt-cache}
ngpu=$(nvidia-smi -L | wc -l)
TP=${TP:-$(( ngpu < 4 ? ngpu : 4 ))}
steps=${*:-tests push bench ab b70 profile sampler}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda",
torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} | tee "$OUT/env.txt"
log() { tee -a "$OUT/log.txt"; }
for step in $steps; do
  echo "=== $step (TP = $TP)" | log
  case $step in
    # one file at a time, each with a deadline inside the call's 10 minutes: a cold Triton cache
    # makes each take minutes, and a hang must not take the other's output with it
    tests)   for f in tests/test_push_reduce.py tests/test_tensor_parallel.py tests/test_vocab_parallel.py; do
               # -s: the ranks' progress and, past a deadline, their stacks reach the log as they happen
               timeout 330 python3 -m pytest -q -s -x -m gpu -p no:cacheprovider "$f" 2>&1 | log | tail -30
             done ;;
    bench)   for tp in 1 "$TP"; do
               python3 -m graphrt bench --preset llama-8b-shape --sweep-accept --sweep-k 3 --batch-sizes 1,8,64 \
                 --max-new-tokens 64 --tp "$tp" --json "$OUT/bench_tp$tp.json" 2>&1 | grep -v '^bench' | log | tail -40
             done ;;
    ab)      for ar in nccl auto; do
               GRAPHRT_ALLREDUCE=$ar python3 -m graphrt bench --preset llama-8b-shape --no-draft --batch-sizes 1,8,64 \
                 --max-new-tokens 64 --tp "$TP" 2>&1 | grep '^plain-graphs ' | sed "s/^/allreduce=$ar /" | log
             done ;;
    # plain, then EAGLE-3 at simulated L = 3 (a whole sweep of 70B-shape layers does not fit one call)
    b70)     for tp in 1 "$TP"; do for d in --no-draft "--draft-kind eagle3 --accept-len 3"; do
               python3 -m graphrt bench --preset llama-70b-shape --layers 10 $d --batch-sizes 1,8,64 \
                 --max-new-tokens 32 --tp "$tp" --json "$OUT/b70_tp${tp}_$(echo $d | tr -dc a-z0-9).json" 2>&1 \
                 | grep -v '^bench' | log | tail -12
             done; done ;;
    profile) for d in --no-draft "--draft-kind eagle3"; do
               python3 -m graphrt profile --preset llama-8b-shape $d --batch-sizes 1,8,64 --tp "$TP" \
                 --json "$OUT/profile_tp${TP}_$(echo $d | tr -dc a-z0-9).json" 2>&1 | log | tail -60
             done ;;
    push)    for r in 1 2 4 8; do  # a decode step's row, the two-row FMA launch, a verify step's 4, B = 8
               torchrun --nproc-per-node "$TP" scripts/push_bench.py --rows $r --out "$OUT/push_tp${TP}_r$r.json" 2>&1 \
                 | log | tail -6
             done ;;
    sampler) torchrun --nproc-per-node "$TP" scripts/bench_vocab_parallel.py --out "$OUT/sampler_tp$TP.json" 2>&1 \
               | log | tail -30 ;;
    *) echo "unknown step $step" | log ;;
  esac
done
bash "$(dirname "$0")/pack_results.sh" "$OUT"  # at most 8 files go back from a device call
