#!/usr/bin/env bash
# The protocol tables of docs/results/protocols.md (issue 42) on Fashion-MNIST-C, every row at its
# cifar10-c recipe, as the recipes table:
#   1. RATE: a stream that does not wait (--stream-rate 1, costs from `cafa methods`), i.i.d.
#      and dirichlet:0.01, the 15 corruptions at severity 3, TEST_PER_CLASS 300 (the recipes
#      table's data: its cells are the waiting stream's), seeds SEEDS;
#   2. ROUNDS: ROUNDS passes over the 15 corruptions in one continual stream (--reset
#      never), ROUND_PER_CLASS images a class a domain, batch ROUND_BATCH, seed 0, with
#   3. forgetting: after every domain, the error on CLEAN_PER_CLASS clean Fashion-MNIST test
#      images a class (100: 1,000) predicted with the weights adapted so far.
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files.
# STAGES picks the parts (rate rounds); results land in $OUT (bench JSON, markdown, the figure).
# WAITING: bench JSON files of the waiting stream on the same data and seeds (the recipes
# table's, docs/results/recipes/*.json), for table 1's waiting columns.
set -euo pipefail
OUT=${OUT:-protocols-out}; WORK=${WORK:-/tmp/fmnist-c}; SEEDS=${SEEDS:-0,1,2}; STAGES=${STAGES:-"rate rounds"}
RATE_ROWS=${RATE_ROWS:-source,bn,tent,cafa,eta,eata,cafa-eata,sar,t3a,lame,rotta,cotta,cafa-robust,deyo,roid,cmf,rmt,santa,rpl,rdumb,adacontrast}
ROUND_ROWS=${ROUND_ROWS:-tent,cafa,eata,sar,rotta,cafa-robust,roid,cmf,rmt,santa,rdumb,deyo,rpl,adacontrast,cotta}
WAITING=${WAITING:-}; CLEAN_PER_CLASS=${CLEAN_PER_CLASS:-100}; ROUNDS=${ROUNDS:-10}; ROUND_PER_CLASS=${ROUND_PER_CLASS:-70}; ROUND_BATCH=${ROUND_BATCH:-64}
TEST_PER_CLASS=300; source "$(dirname "$0")/fmnist_c.sh"
mkdir -p "$OUT"
start=$(date +%s)
said() { echo "$1 at $(( $(date +%s) - start )) s" >&2; }

if [[ " $STAGES " == *" rate "* ]]; then
  cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $REPORTED | tr ' ' ,)" --severity "$SEVERITY" \
    --test-per-class 300 --quiet > /dev/null
  cafa bench $(domains "$REPORTED") --methods "$RATE_ROWS" --seeds "$SEEDS" --recipe cifar10-c \
    --workdir "$WORK/artifacts" --orders iid,dirichlet:0.01 --stream-rate 1 --num-workers 0 \
    --metrics-json "$OUT/rate.json" --quiet > "$OUT/rate.md"
  said "rate 1 done"
fi

if [[ " $STAGES " == *" rounds "* ]]; then
  TEST_PER_CLASS=$ROUND_PER_CLASS; source "$(dirname "$0")/fmnist_c.sh"
  cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $REPORTED | tr ' ' ,)" --severity "$SEVERITY" \
    --test-per-class "$ROUND_PER_CLASS" --quiet > /dev/null
  CLEAN=$WORK/fashion-mnist-clean-$CLEAN_PER_CLASS
  [ -f "$CLEAN/.complete" ] || "$PY" - "$CLEAN" "$CLEAN_PER_CLASS" <<'EOF'
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from cafa_cli.api import FASHION_MNIST_CLASSES, load_fashion_mnist

root, per_class = Path(sys.argv[1]), int(sys.argv[2])
images, labels = load_fashion_mnist(split="test")
for label, name in enumerate(FASHION_MNIST_CLASSES):
    (root / name).mkdir(parents=True, exist_ok=True)
    for i in np.flatnonzero(labels == label)[:per_class]:
        Image.fromarray(images[i]).save(root / name / f"{i:05d}.png")
(root / ".complete").touch()
EOF
  cafa bench $(domains "$REPORTED") --methods "$ROUND_ROWS" --seeds 0 --recipe cifar10-c --workdir "$WORK/artifacts" \
    --reset never --rounds "$ROUNDS" --forgetting "$CLEAN" --batch-size "$ROUND_BATCH" --num-workers 0 \
    --metrics-json "$OUT/rounds.json" --plot "$OUT/rounds.svg" --quiet > "$OUT/rounds.md"
  said "rounds done"
fi
"$PY" "$(dirname "$0")/protocols_tables.py" "$OUT" $WAITING | tee "$OUT/tables.md"
