#!/usr/bin/env bash
# Label-shift-robust normalisation on Fashion-MNIST-C (docs/results/label-shift.md, "Label-shift-robust
# normalisation"): Source, BN, TENT and CAFA with batch statistics and with
# --norm class-balanced, under iid, label-shift:1.0, label-shift:0.5 and dirichlet:0.01,
# at the learning rates the methods table chose (TENT 1e-3, CAFA 3e-3).
#   1. build the 15 corruptions at severity 3 (as methods_table.sh)
#   2. one bench of the rows with batch statistics, one with --norm class-balanced (it
#      computes the artifact with the class moments of the BatchNorms' inputs itself)
#   3. one table (benchmarks/combine_tables.py)
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files.
# TEST_PER_CLASS=0 gives the full 10,000-image domains; the table in docs/results/label-shift.md used
# 300 (3,000 images a domain) and SEEDS=0,1,2. Results land in $OUT.
set -euo pipefail
OUT=${OUT:-norm-out}; WORK=${WORK:-/tmp/fmnist-c}; WORKERS=${WORKERS:-0}
TEST_PER_CLASS=${TEST_PER_CLASS:-300}; SEEDS=${SEEDS:-0,1,2}
ROWS=${ROWS:-"bn,tent@0.001,cafa@0.003"}
ORDERS=${ORDERS:-"iid,label-shift:1.0,label-shift:0.5,dirichlet:0.01"}
source "$(dirname "$0")/fmnist_c.sh"
mkdir -p "$OUT"

cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $REPORTED | tr ' ' ,)" --severity "$SEVERITY" \
  --test-per-class "$TEST_PER_CLASS" --quiet > /dev/null
cafa bench $(domains "$REPORTED") --methods "source,$ROWS" --seeds "$SEEDS" --orders "$ORDERS" \
  --workdir "$WORK/artifacts" --num-workers "$WORKERS" --metrics-json "$OUT/batch.json" --quiet > "$OUT/batch.md"
cafa bench $(domains "$REPORTED") --methods "$ROWS" --norm class-balanced --seeds "$SEEDS" --orders "$ORDERS" \
  --workdir "$WORK/artifacts-balanced" --num-workers "$WORKERS" --metrics-json "$OUT/balanced.json" --quiet > "$OUT/balanced.md"
"$PY" benchmarks/combine_tables.py "$OUT/batch.json" "$OUT/balanced.json" | tee "$OUT/table.md"
