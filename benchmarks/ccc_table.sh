#!/usr/bin/env bash
# The continual methods on a CCC-style stream made from Fashion-MNIST's test images (docs/results/ccc.md):
# one stream of $IMAGES images, $SPEED a step, the walks keeping the bundled model's accuracy near $ACCURACY %.
# Each method under its recipe's reset (one domain: continual; rdumb resets every N). The error by
# thousand images comes from the per-image CSV of `cafa adapt` (same stream: the seed makes it).
# Needs: cafa importable (PYTHONPATH=src), corrupt-tta, the Fashion-MNIST idx files. Results land in $OUT.
set -euo pipefail
OUT=${OUT:-docs/results/ccc}; IMAGES=${IMAGES:-6000}; SPEED=${SPEED:-200}; ACCURACY=${ACCURACY:-40}
METHODS=${METHODS:-"source tent eta cotta rotta rdumb cafa cafa-robust"}; BATCH=${BATCH:-50}
PY=${PY:-python3}
mkdir -p "$OUT"
for method in $METHODS; do
  "$PY" -m cafa_cli adapt --model fmnist-resnet --method "$method" --data fashion-mnist-test --ccc "$IMAGES" \
    --ccc-speed "$SPEED" --ccc-accuracy "$ACCURACY" --batch-size "$BATCH" --seed 0 \
    --metrics-json "$OUT/$method.json" --quiet > "$OUT/$method.csv"
done
"$PY" - "$OUT" $METHODS > "$OUT/table.md" <<'PY'
import csv, json, sys
out, methods = sys.argv[1], sys.argv[2:]
chunk = 1000
rows = {}
for m in methods:
    with open(f"{out}/{m}.csv") as f:
        records = list(csv.DictReader(f))
    wrong = [r["prediction"] != r["label"] for r in records]
    rows[m] = [100 * sum(wrong[k:k + chunk]) / len(wrong[k:k + chunk]) for k in range(0, len(wrong), chunk)]
    rows[m].append(100 * sum(wrong) / len(wrong))
n = len(next(iter(rows.values()))) - 1
print("| method | " + " | ".join(f"images {k * chunk:,}-{min((k + 1) * chunk, len(wrong)):,}" for k in range(n)) + " | all |")
print("|---|" + "---:|" * (n + 1))
for m, errors in rows.items():
    print(f"| {m} | " + " | ".join(f"{e:.1f}" for e in errors) + " |")
PY
