#!/usr/bin/env bash
# cafa-robust at its recipe on a lent GPU against the CPU: `cafa adapt --reset never` over two
# domains, i.i.d. and class-sorted (label shift 1.0), on the CPU, then CUDA in fp32 and bf16;
# prints each run's error and how many predictions differ from the CPU's (docs/design/cafa-robust.md,
# Cost, has the last results). Two 300-image Fashion-MNIST-C domains and their
# artifact travel in a few MB (`cafa demo --data-only --test-per-class 30`), so one device call does it:
#   bash benchmarks/robust_device_check.sh STATS DOMAIN_1 DOMAIN_2      # e.g. in .devdata, carried
# RECIPE (cifar10-c) and BATCH (the recipe's) choose the setting; PY the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STATS=${1:?give the artifact}; A=${2:?give two domains}; B=${3:?give two domains}
PY=${PY:-python3}; RECIPE=${RECIPE:-cifar10-c}; WORK=$(mktemp -d)
batch=(); [ -n "${BATCH:-}" ] && batch=(--batch-size "$BATCH")
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
for order in iid label-shift:1.0; do
  for run in "cpu fp32" "cuda fp32" "cuda bf16"; do
    set -- $run
    csv=$WORK/$1-$2-${order%%:*}.csv
    "$PY" -m cafa_cli adapt -q --stats "$STATS" --method cafa-robust --recipe "$RECIPE" "${batch[@]}" --data "$A" --data "$B" \
      --reset never --order "$order" --device "$1" --precision "$2" --metrics-json "$csv.json" > "$csv"
    echo "$order $1 $2: exit $?"
  done
  "$PY" - "$WORK" "${order%%:*}" <<'EOF'
import csv, json, sys
work, order = sys.argv[1:]
def read(run):
    with open(f"{work}/{run}-{order}.csv") as f:
        return {row["path"]: row["prediction"] for row in csv.DictReader(f)}
cpu = read("cpu-fp32")
for run in ("cpu-fp32", "cuda-fp32", "cuda-bf16"):
    try:
        error = json.load(open(f"{work}/{run}-{order}.csv.json"))["error"]
        other = read(run)
    except (OSError, ValueError, KeyError):
        print(f"{order} {run}: no predictions (its error is above)")
        continue
    differ = sum(other[path] != label for path, label in cpu.items())
    print(f"{order} {run}: error {100 * error:.2f} %, {differ} of {len(cpu)} predictions differ from the CPU's")
EOF
done
rm -rf "$WORK"
