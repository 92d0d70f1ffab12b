#!/usr/bin/env bash
# cafa-robust on the four held-out Fashion-MNIST-C corruptions only (the corruptions its
# options are chosen on; docs/design/cafa-robust.md), seed 0 (SEEDS=1,2: others), its cifar10-c recipe with
# each configuration's options on top: i.i.d. and one continual stream at severity 5 (where the
# source statistics' gate fails on gaussian blur), i.i.d. / label shift 1.0 / Dirichlet 0.01 at
# severity 3, continual streams at severity 3 (i.i.d., label shift 1.0 and Dirichlet 0.01 within
# each domain), with SMALL=1 batches of 8 and 1 at severity 3, and with LONG=1 two longer
# continual streams: the severity chain (each corruption at 3, then 5) and the mixed
# severities (all four at all five severities in one shuffled order, 20 domains). JOBS=N runs
# N configurations side by side.
#   CONFIGS="round2 first:source_pull=0,change_threshold=0,laplacian_weight=0" OUT=scan WORK=fm bash benchmarks/robust_held_out.sh
# A configuration is NAME or NAME:OPTION=VALUE,...; each writes OUT/NAME/{sev5-iid,sev5-continual,
# sev3-orders,sev3-continual,sev3-continual-orders,sev3-small,severity-chain,mixed-severities}.{md,json}.
# The typical-mix table (issue 43):
#   CONFIGS="B3-W50:mix_reference=3,source_pull=0,change_threshold=0,laplacian_weight=0 ..."
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files.
set -euo pipefail
OUT=${OUT:-held-out}; WORK=${WORK:-/tmp/fmnist-h}; CONFIGS=${CONFIGS:-committed}; SMALL=${SMALL:-0}; LONG=${LONG:-0}
JOBS=${JOBS:-1}; SEEDS=${SEEDS:-0}
TEST_PER_CLASS=300; source "$(dirname "$0")/fmnist_c.sh"  # cafa, HELD_OUT, domains
# the mixed-severities stream's order (drawn once, in issue 43's fourth session)
MIXED="spatter/1 saturate/4 saturate/2 spatter/5 speckle_noise/1 saturate/3 spatter/2
  speckle_noise/3 speckle_noise/4 gaussian_blur/5 gaussian_blur/1 gaussian_blur/3 speckle_noise/5 saturate/5
  gaussian_blur/2 saturate/1 gaussian_blur/4 speckle_noise/2 spatter/4 spatter/3"
for severity in $([ "$LONG" = 1 ] && echo 1 2 3 4 5 || echo 3 5); do
  cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $HELD_OUT | tr ' ' ,)" --severity $severity \
    --test-per-class 300 --quiet > /dev/null
done
COMMON="--methods cafa-robust --recipe cifar10-c --seeds $SEEDS --num-workers 0 --workdir $WORK/artifacts --quiet"
configuration() {  # one configuration's benches, in order
  local config=$1 name=${1%%:*} options=()
  if [[ $config == *:* ]]; then
    IFS=, read -ra pairs <<< "${config#*:}"
    for pair in "${pairs[@]}"; do options+=(--method-option "$pair"); done
  fi
  local O=$OUT/$name; mkdir -p "$O"
  run() {  # run NAME BENCH-OPTIONS...: one bench of the configuration, its table and JSON
    local what=$1; shift
    cafa bench "$@" $COMMON "${options[@]}" --metrics-json "$O/$what.json" > "$O/$what.md"
  }
  run sev5-iid $(SEVERITY=5 domains "$HELD_OUT")
  run sev5-continual $(SEVERITY=5 domains "$HELD_OUT") --reset never
  run sev3-orders $(SEVERITY=3 domains "$HELD_OUT") --orders iid,label-shift:1.0,dirichlet:0.01
  run sev3-continual $(SEVERITY=3 domains "$HELD_OUT") --reset never
  run sev3-continual-orders $(SEVERITY=3 domains "$HELD_OUT") --reset never --orders label-shift:1.0,dirichlet:0.01
  if [ "$SMALL" = 1 ]; then run sev3-small $(SEVERITY=3 domains "$HELD_OUT") --batch-sizes 8,1; fi
  if [ "$LONG" = 1 ]; then
    run severity-chain $(for c in $HELD_OUT; do echo "$FOLDER/$c/3 $FOLDER/$c/5"; done) --reset never
    run mixed-severities $(for d in $MIXED; do echo "$FOLDER/$d"; done) --reset never
  fi
  echo "$name done" >&2
}
for config in $CONFIGS; do  # JOBS configurations at a time (each bench uses one core with OMP_NUM_THREADS=1)
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  configuration "$config" &
done
wait
