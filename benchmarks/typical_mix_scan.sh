#!/usr/bin/env bash
# cafa-robust's gate against the stream's typical class mix (issue 43: `mix_reference` B,
# `mix_window` W) on the four held-out Fashion-MNIST-C corruptions only, seed 0, its
# cifar10-c recipe: i.i.d. at severity 5 (where the source statistics' gate fails on
# gaussian blur), i.i.d. / label shift 1.0 / Dirichlet 0.01 at severity 3, and one continual
# stream at severity 3. B = 0 is the committed method. docs/design.md has the table.
#   BS="0 3 10 30" WS="50 200" OUT=scan WORK=fm bash benchmarks/typical_mix_scan.sh
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files.
set -euo pipefail
OUT=${OUT:-typical-mix}; WORK=${WORK:-/tmp/fmnist-h}; BS=${BS:-"0 3 10 30"}; WS=${WS:-50}
TEST_PER_CLASS=300; source "$(dirname "$0")/fmnist_c.sh"  # cafa, HELD_OUT, domains
for severity in 3 5; do
  cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $HELD_OUT | tr ' ' ,)" --severity $severity \
    --test-per-class 300 --quiet > /dev/null
done
COMMON="--methods cafa-robust --recipe cifar10-c --seeds 0 --num-workers 0 --workdir $WORK/artifacts --quiet"
for B in $BS; do
  for W in $WS; do
    O=$OUT/B$B-W$W; mkdir -p "$O"
    options="--method-option mix_reference=$B --method-option mix_window=$W"
    cafa bench $(SEVERITY=5 domains "$HELD_OUT") $COMMON $options --metrics-json "$O/sev5-iid.json" > "$O/sev5-iid.md"
    cafa bench $(SEVERITY=3 domains "$HELD_OUT") $COMMON $options --orders iid,label-shift:1.0,dirichlet:0.01 \
      --metrics-json "$O/sev3-orders.json" > "$O/sev3-orders.md"
    cafa bench $(SEVERITY=3 domains "$HELD_OUT") $COMMON $options --reset never --metrics-json "$O/sev3-continual.json" \
      > "$O/sev3-continual.md"
    echo "B=$B W=$W done" >&2
  done
done
