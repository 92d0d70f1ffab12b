#!/usr/bin/env bash
# Every method under four stream settings on Fashion-MNIST-C, before the recipes (docs/results/recipes.md, "Every method
# under four stream settings, before the recipes"), end to end; recipes_table.sh runs the current table:
#   1. build the 15 benchmark and 4 held-out corruptions at severity 3
#   2. choose each method's learning rate from {1e-3, 3e-3, 1e-2} on the 4 held-out ones (seed 0)
#   3. run the chosen rows on the 15 under iid, label-shift:1.0 and dirichlet:0.01 (one bench),
#      and as one continual stream (--reset never, a second bench beside the first)
#   4. print one methods x settings table (benchmarks/combine_tables.py)
# Every bench runs with --recipe none: the command line's settings for every method, as that table did
# (since then LAME's default affinity is rbf, that table's was knn, symmetric; CoTTA's views translate 1/8).
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files.
# TEST_PER_CLASS=0 gives the full 10,000-image domains (hours on a 2-core CPU; the table in
# docs/results/recipes.md used 300, 3,000 images a domain). Results land in $OUT.
set -euo pipefail
OUT=${OUT:-methods-out}; WORK=${WORK:-/tmp/fmnist-c}; WORKERS=${WORKERS:-0}
TEST_PER_CLASS=${TEST_PER_CLASS:-300}; SEEDS=${SEEDS:-0}
TUNED=${TUNED:-"tent cafa eta eata cafa-eata sar rotta"}  # rows whose learning rate is chosen
EXTRA=${EXTRA-cotta@0.001}  # rows at a given rate (EXTRA= for none): CoTTA's step costs 36 TENT steps on a CPU (docs/performance/methods.md)
source "$(dirname "$0")/fmnist_c.sh"
mkdir -p "$OUT"
start=$(date +%s)

cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $REPORTED $HELD_OUT | tr ' ' ,)" --severity "$SEVERITY" \
  --test-per-class "$TEST_PER_CLASS" --quiet > /dev/null

grid=source,bn
for m in $TUNED; do for lr in 0.001 0.003 0.01; do grid="$grid,$m@$lr"; done; done
cafa bench $(domains "$HELD_OUT") --methods "$grid,t3a,lame" --seeds 0 --recipe none --workdir "$WORK/artifacts" \
  --num-workers "$WORKERS" --metrics-json "$OUT/heldout.json" --quiet > "$OUT/heldout.md"
rows=$("$PY" benchmarks/choose_lr.py "$OUT/heldout.json")${EXTRA:+,$EXTRA}
echo "held out done at $(( $(date +%s) - start )) s; rows: $rows" >&2

cafa bench $(domains "$REPORTED") --methods "$rows" --seeds "$SEEDS" --recipe none --orders iid,label-shift:1.0,dirichlet:0.01 \
  --workdir "$WORK/artifacts" --num-workers "$WORKERS" --metrics-json "$OUT/orders.json" --csv "$OUT/orders.csv" --quiet > "$OUT/orders.md" &
orders=$!
cafa bench $(domains "$REPORTED") --methods "$rows" --seeds "$SEEDS" --recipe none --reset never \
  --workdir "$WORK/artifacts" --num-workers "$WORKERS" --metrics-json "$OUT/continual.json" --csv "$OUT/continual.csv" --quiet > "$OUT/continual.md" &
continual=$!
wait "$orders"; wait "$continual"  # each wait fails the script (set -e) when its bench failed
echo "benchmark done at $(( $(date +%s) - start )) s" >&2
"$PY" benchmarks/combine_tables.py "$OUT/orders.json" "$OUT/continual.json" | tee "$OUT/table.md"
