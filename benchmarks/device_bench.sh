#!/usr/bin/env bash
# The Fashion-MNIST-C benchmark of docs/results/index.md, end to end, in one go:
#   1. build the 15 benchmark and 4 held-out corruptions at severity 3 (10,000 images each)
#   2. choose each method's learning rate on the 4 held-out corruptions (1 seed)
#   3. run the reported benchmark with those rates: 15 corruptions x 3 stream seeds
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files
# (CAFA_FASHION_MNIST or Debian's package). Results land in $OUT (default ./bench-out).
set -euo pipefail
OUT=${OUT:-bench-out}; WORK=${WORK:-/tmp/fmnist-c}; WORKERS=${WORKERS:-4}
TEST_PER_CLASS=${TEST_PER_CLASS:-0}; SEEDS=${SEEDS:-0,1,2}
source "$(dirname "$0")/fmnist_c.sh"
mkdir -p "$OUT"

start=$(date +%s)
builds=()
for c in $REPORTED $HELD_OUT; do   # one process per corruption: they are independent
  cafa demo --workdir "$WORK" --data-only --corruptions "$c" --severity "$SEVERITY" --test-per-class "$TEST_PER_CLASS" --quiet > /dev/null &
  builds+=($!)
done
for pid in "${builds[@]}"; do wait "$pid"; done   # a plain wait would pass over a failed build (set -e stops here)
echo "data built in $(( $(date +%s) - start )) s"

grid=source,bn
for m in pl tent cafa global-fa intra cafa-tied cafa-diag; do for lr in 0.001 0.003 0.01; do grid="$grid,$m@$lr"; done; done
cafa bench $(domains "$HELD_OUT") --methods "$grid" --seeds 0 --workdir "$WORK/artifacts" \
  --num-workers "$WORKERS" --metrics-json "$OUT/heldout.json" --quiet > "$OUT/heldout.md"
chosen=$("$PY" benchmarks/choose_lr.py "$OUT/heldout.json")
echo "held out done at $(( $(date +%s) - start )) s; chosen: $chosen"

cafa bench $(domains "$REPORTED") --methods "$chosen" --seeds "$SEEDS" --workdir "$WORK/artifacts" \
  --num-workers "$WORKERS" --metrics-json "$OUT/results.json" --csv "$OUT/results.csv" --plot "$OUT/results.png" --quiet > "$OUT/results.md"
echo "benchmark done at $(( $(date +%s) - start )) s"
cat "$OUT/results.md"
