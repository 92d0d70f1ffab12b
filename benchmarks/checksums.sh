#!/usr/bin/env bash
# Checksums of every prediction and error a refactor must leave byte-identical: the demo's
# table, `cafa adapt` predictions and metrics (without times and paths' dates) for every
# built-in method and a few stream settings, and a bench table.
# Usage: benchmarks/checksums.sh WORKDIR  (re-uses WORKDIR/cafa-demo's data when there)
# Ends by comparing with benchmarks/checksums.expected, made on the 2-core dev VM, torch
# 2.14.1 CPU, in WORKDIR /tmp/ck (the metrics record absolute paths, so use the same
# WORKDIR), at torch's default thread count (with OMP_NUM_THREADS=1, tent --params all and
# cotta differ); another CPU or torch may differ. About 12 minutes on 2 cores. Its predictions
# (demo, adapt-*, bench) are 7e563d8's byte for byte but eata's, whose Fisher images are read
# in their random order since issue 40 (d076ef8); its metrics differ from 7e563d8's by the keys
# issues 39, 44, 45, 41, 42 and 40 added or changed on purpose (`method_option`, `state`, each
# error's `unit`, `cuda_graph` (true since 45) and its `step_runner`, `fisher_data` renamed
# `source_data`, `rounds`, `stream_rate`, `step_cost`, `recipe.chosen_by` under `recipe` auto,
# eta's and eata's `keep_mean_on_reset` option, cafa-robust's `mix_reference` and `mix_window`
# options, off), and eata's by its errors. cafa-robust's three files changed on purpose with
# issue 43's second design (`source_pull` 0.01, `change_threshold` 1, `laplacian_weight` 1,
# `laplacian_power` 4, and its recipes' `mix_reference` 10); with those four at 0 its two
# prediction files are the first design's byte for byte (checked when it landed), and lame's
# are unchanged by the `corrected_logits` it now shares with cafa-robust. Its three changed again
# with issue 43's third session: its metrics gained `domain_changes`, and its recipe (which
# `adapt` picks by default) took batch 200 and `update_every` 32. And again with its recipe's
# `entropy_rise` 0.15, `memory_expiry` 320, `restart_weights` fitter and `source_pull` 0.02
# (fifth to seventh sessions) and the metrics' `source_restarts` (eighth): with
# `--method-option entropy_rise=0 --method-option memory_expiry=0 --method-option
# restart_weights=carry --method-option source_pull=0.01` its two prediction files are the
# third session's byte for byte (checked in the eighth session, when the three were renewed).
# Issue 60 replaced the metrics' `versions` by `environment` (the commit, torch's build, the
# threads, the device), which `steady` leaves out: the metrics sums are the earlier ones'
# files less `versions` (checked when they were renewed: with it put back, each gave its old sum).
# Issue 63 gave tent, eta, eata and sar the option `entropy` (shannon, their own): their metrics
# gained it under `method_options`, and nothing else moved (every prediction file and every other
# metrics file byte for byte those of 903cb4c on the same VM, compared in the session that added it).
# Renewed 2026-12-06 at 158721e (issue 66's stop) on the 2-core dev VM, WORKDIR /tmp/ck: the sums
# before no longer matched on this VM even at their own commits (42 of 45), the demo's and bench's
# tables excepted, which still did; every method's predictions were checked byte for byte against
# 6205b79's by running both commits side by side in that session, so these sums start from code
# whose predictions are the earlier ones.
set -euo pipefail
expected=$(cd "$(dirname "$0")" && pwd)/checksums.expected
work=${1:?give a work folder}
mkdir -p "$work" && cd "$work"
cafa demo -q > demo-table.md
demo=cafa-demo/fashion-mnist-c-300
domains=("$demo"/*/3)
data=(); for d in "${domains[@]}"; do data+=(--data "$d"); done
stats=cafa-demo/stats-auto.safetensors
# the metrics JSON without what changes from run to run (times, the artifact's creation time)
# and without its `environment` (the checkout's commit changes with every commit), which goes
# to environment.json: what ran, to compare with the conditions above when a sum differs
steady() {
  python3 -c 'import json, sys
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in ("seconds", "images_per_second", "stats_created")}
    return [strip(v) for v in x] if isinstance(x, list) else x
report = json.load(open(sys.argv[1]))
json.dump(report.pop("environment"), open("environment.json", "w"), indent=1)
print(json.dumps(strip(report), indent=1, sort_keys=True))' "$1" > "$1.steady"
  rm "$1"
}
for m in source bn pl tent cafa global-fa intra euclidean eta cafa-eata sar t3a lame cotta rotta cafa-robust; do
  cafa adapt -q --stats "$stats" --method "$m" "${data[@]}" --metrics-json "metrics-$m.json" > "adapt-$m.csv"
  steady "metrics-$m.json"
done
cafa adapt -q --stats "$stats" --method eata --fisher-data cafa-demo/train-300 --fisher-samples 400 "${data[@]}" \
  --metrics-json metrics-eata.json > adapt-eata.csv
steady metrics-eata.json
for m in lame rotta cafa-robust tent; do
  cafa adapt -q --stats "$stats" --method "$m" --order dirichlet:0.1 --batch-size 64 "${data[@]}" > "adapt-$m-dirichlet.csv"
done
cafa adapt -q --stats "$stats" --reset never --optimizer sgd --lr 0.01 "${data[@]}" > adapt-cafa-never-sgd.csv
cafa adapt -q --stats "$stats" --reset episodic --norm prior:16 --batch-size 50 "${data[@]}" > adapt-cafa-episodic-prior.csv
cafa adapt -q --stats "$stats" --method tent --params all --steps 2 --format jsonl "${data[@]}" > adapt-tent-all.jsonl
cafa adapt -q --stats "$stats" --method cafa --oracle --norm ema:0.05 "${data[@]}" > adapt-cafa-oracle-ema.csv
cafa bench -q "${domains[@]}" --methods source,bn,pl,tent,cafa,global-fa,intra,euclidean,cafa-tied,cafa-diag,cafa-dense,cafa-lowrank,cafa-full \
  --workdir bench --per-class 300 --csv bench.csv > bench-table.md
sha256sum demo-table.md adapt-*.csv adapt-*.jsonl metrics-*.steady bench.csv bench-table.md
sha256sum --check "$expected"
