#!/usr/bin/env bash
# Checksums of every prediction a refactor must leave byte-identical: the demo's table,
# `cafa adapt` predictions for every method and a few stream settings, and a bench table.
# Usage: benchmarks/checksums.sh WORKDIR  (re-uses WORKDIR/cafa-demo's data when there)
# Ends by comparing with benchmarks/checksums.expected: the sums of bc0928b (before the
# redesign) on the 2-core dev VM, torch 2.14.1 CPU; another CPU or torch may differ.
set -euo pipefail
expected=$(cd "$(dirname "$0")" && pwd)/checksums.expected
work=${1:?give a work folder}
mkdir -p "$work" && cd "$work"
cafa demo -q > demo-table.md
demo=cafa-demo/fashion-mnist-c-300
domains=("$demo"/*/3)
data=(); for d in "${domains[@]}"; do data+=(--data "$d"); done
stats=cafa-demo/stats-auto.safetensors
for m in source bn pl tent cafa global-fa intra euclidean; do
  cafa adapt -q --stats "$stats" --method "$m" "${data[@]}" > "adapt-$m.csv"
done
cafa adapt -q --stats "$stats" --reset never --optimizer sgd --lr 0.01 "${data[@]}" > adapt-cafa-never-sgd.csv
cafa adapt -q --stats "$stats" --reset episodic --norm prior:16 --batch-size 50 "${data[@]}" > adapt-cafa-episodic-prior.csv
cafa adapt -q --stats "$stats" --method tent --params all --steps 2 --format jsonl "${data[@]}" > adapt-tent-all.jsonl
cafa bench -q "${domains[@]}" --methods source,bn,pl,tent,cafa,global-fa,intra,euclidean,cafa-tied,cafa-diag,cafa-dense,cafa-lowrank,cafa-full \
  --workdir bench --per-class 300 --csv bench.csv > bench-table.md
sha256sum demo-table.md adapt-*.csv adapt-*.jsonl bench.csv bench-table.md
sha256sum --check "$expected"
