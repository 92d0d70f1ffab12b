#!/usr/bin/env bash
# The methods table of docs/results/recipes.md ("Every method at its published recipe") with every
# row at its published recipe (recipes/*.toml, cifar10-c: the family `auto` picks for the
# bundled 10-class fmnist-resnet): no learning rate is chosen, the recipe gives it.
#   1. build the 15 benchmark corruptions at severity 3
#   2. run ROWS on the 15 under iid, label-shift:1.0 and dirichlet:0.01 (one bench), then as
#      one continual stream (--reset never)
#   3. print one methods x settings table (benchmarks/combine_tables.py)
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files.
# TEST_PER_CLASS=300 (3,000 images a domain) is the size of the table in docs/results/recipes.md.
# NORM=SETTING runs every row under `--norm SETTING` (alpha:0.1, unmix:16: the normalisation rows).
# PARALLEL=1 runs the two benches side by side (two cores). Results land in $OUT.
set -euo pipefail
OUT=${OUT:-recipes-out}; WORK=${WORK:-/tmp/fmnist-c}; WORKERS=${WORKERS:-0}
TEST_PER_CLASS=${TEST_PER_CLASS:-300}; SEEDS=${SEEDS:-0}; RECIPE=${RECIPE:-cifar10-c}
ROWS=${ROWS:-source,bn,tent,cafa,eta,eata,cafa-eata,sar,t3a,lame,rotta,cotta}
source "$(dirname "$0")/fmnist_c.sh"
mkdir -p "$OUT"
start=$(date +%s)

cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $REPORTED | tr ' ' ,)" --severity "$SEVERITY" \
  --test-per-class "$TEST_PER_CLASS" --quiet > /dev/null
echo "data ready at $(( $(date +%s) - start )) s" >&2

bench() {  # NAME, then the bench's own options
  local name=$1; shift
  cafa bench $(domains "$REPORTED") --methods "$ROWS" --seeds "$SEEDS" --recipe "$RECIPE" --workdir "$WORK/artifacts" \
    --num-workers "$WORKERS" ${NORM:+--norm "$NORM"} --metrics-json "$OUT/$name.json" --csv "$OUT/$name.csv" --quiet "$@" > "$OUT/$name.md"
  echo "$name done at $(( $(date +%s) - start )) s" >&2
}
if [ "${PARALLEL:-0}" = 1 ]; then
  bench orders --orders iid,label-shift:1.0,dirichlet:0.01 & orders=$!
  bench continual --reset never & continual=$!
  wait "$orders"; wait "$continual"  # each wait fails the script (set -e) when its bench failed
else
  bench orders --orders iid,label-shift:1.0,dirichlet:0.01
  bench continual --reset never
fi
"$PY" benchmarks/combine_tables.py "$OUT/orders.json" "$OUT/continual.json" | tee "$OUT/table.md"
