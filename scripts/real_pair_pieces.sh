#!/usr/bin/env bash
# The real SmolLM2 pair on the GPU machine when the model no longer fits beside the tree: a device
# call carries at most 64 MiB, tracked files included, and the tracked tree (with the trained head
# in data/smollm2-eagle3) leaves less room than ../shared/device/prepare-smollm2.sh's two 47 MB
# halves need. Run once after that script (it leaves the whole .gguf in .gpu-model/); this writes
# .gpu-model/pieces/NN files small enough to ride beside the tree and .gpu-carry, and prints the
# back-to-back device calls that put the model together (a warm machine keeps /tmp).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
gguf=.gpu-model/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || { echo "no $gguf: run ../shared/device/prepare-smollm2.sh first" >&2; exit 1; }
tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
carry=$(du -sb .gpu-carry | cut -f1)
room=$(( 64 * 1024 * 1024 - tracked - carry - 2 * 1024 * 1024 ))   # 2 MiB for untracked files
[ "$room" -gt 4000000 ] || { echo "only $room bytes of room beside the tree" >&2; exit 1; }
rm -rf .gpu-model/pieces && mkdir -p .gpu-model/pieces
split -b "$room" -d "$gguf" .gpu-model/pieces/
cp .gpu-model/b/gguf-*.whl .gpu-model/pieces/ 2>/dev/null || true
ls .gpu-model/pieces | grep -v whl | while read -r p; do
  echo "call: carry [\".gpu-carry\", \".gpu-model/pieces/$p\"], command: mkdir -p /tmp/m && cp .gpu-model/pieces/$p /tmp/m/"
done
echo "then, in the last call (or one more): cat /tmp/m/[0-9][0-9] > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf &&"
echo "  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-model/pieces/gguf-*.whl;"
echo "  source .gpu-carry/env.sh; python3 scripts/bench_real_pair.py --target /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf \\
  --json \$OUT/realpair.json   (the head, data/smollm2-eagle3, rides in the tracked tree)"
echo "(carry the wheel with the last piece; sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)"
