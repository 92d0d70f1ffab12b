#!/usr/bin/env bash
# Label-free selection of the learning rate on Fashion-MNIST-C (docs/results/selection.md): the gradient
# methods at each lr of $GRID on the 15 corruptions (severity 3, $TEST_PER_CLASS images a class), the lr
# picked by each rule beside the oracle's. One bench scores every rule: entropy, consistency (a flip),
# source-accuracy (clean test images none of the corrupted ones were made of, as --forgetting), oracle,
# and held-out (the 4 held-out corruptions, run apart; the --by of its first table).
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files. Results land in $OUT.
set -euo pipefail
OUT=${OUT:-docs/results/selection}; WORK=${WORK:-/tmp/select-work}; TEST_PER_CLASS=${TEST_PER_CLASS:-30}
METHODS=${METHODS:-tent,eata,sar,cotta,rotta,cafa}; GRID=${GRID:-1e-4,1e-3,1e-2}; BATCH=${BATCH:-50}
NAME=${NAME:-selection}; EXTRA=${EXTRA:-}  # e.g. NAME=continual EXTRA="--reset never": one stream through the domains
source "$(dirname "$0")/fmnist_c.sh"
mkdir -p "$OUT"
cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $REPORTED $HELD_OUT | tr ' ' ,)" --severity "$SEVERITY" \
  --test-per-class "$TEST_PER_CLASS" --quiet > /dev/null
held_out=$(domains "$HELD_OUT" | paste -sd,)
# source-accuracy's labelled source images: 20 clean test images a class, none of those the corruptions were made of
"$PY" - "$WORK/clean-source" "$TEST_PER_CLASS" <<'PY'
import sys
from pathlib import Path
import numpy as np
from cafa_cli.api import load_fashion_mnist
from cafa_cli.data.fmnist_c import stratified_rows, write_image_folder
images, labels = load_fashion_mnist(None, "test")
used = set(stratified_rows(labels, int(sys.argv[2]), 0).tolist())
free = np.array([i for i in np.random.default_rng(1).permutation(len(labels)) if i not in used])
rows = np.sort(np.concatenate([free[labels[free] == c][:20] for c in range(10)]))
write_image_folder(Path(sys.argv[1]), images[rows], labels[rows])
PY
cafa bench $(domains "$REPORTED") --methods "$METHODS" --select "lr=$GRID" --by "held-out:$held_out" \
  --forgetting "$WORK/clean-source" --batch-size "$BATCH" --seeds 0 --workdir "$WORK/artifacts" $EXTRA \
  --metrics-json "$OUT/$NAME.json" --quiet > "$OUT/$NAME.md"
