#!/usr/bin/env bash
# The batch-64 rows of margin_scan.sh with learning rates re-chosen for batch 64: each
# method's rate from {1e-4, 3e-4, 1e-3} by its mean error on the four held-out
# corruptions (severity 3), then the six reported corruptions with those rates.
# Needs cafa importable (PYTHONPATH=src) and corrupt-tta; results land in $OUT.
set -euo pipefail
OUT=${OUT:-margin-out}; WORK=${WORK:-/tmp/fmnist-c}; PY=${PY:-python3}; SEVERITY=${SEVERITY:-3}
CORRUPTIONS=${CORRUPTIONS:-"gaussian_noise defocus_blur frost contrast fog motion_blur"}
HELD_OUT="speckle_noise gaussian_blur spatter saturate"
METHODS=${METHODS:-"tent cafa"}  # e.g. "tent cafa global-fa intra"
TAG=${TAG:-retuned}
mkdir -p "$OUT"
cafa() { "$PY" -m cafa_cli "$@"; }
domains() { for c in $1; do echo "$WORK/fashion-mnist-c/$c/$SEVERITY"; done; }
cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $CORRUPTIONS $HELD_OUT | tr ' ' ,)" --severity "$SEVERITY" --test-per-class 0 --quiet > /dev/null
grid=""
for m in $METHODS; do for lr in 0.0001 0.0003 0.001; do grid="$grid${grid:+,}$m@$lr"; done; done
common=(--batch-size 64 --seeds 0 --per-class 300 --workdir "$WORK/artifacts" --quiet)
cafa bench $(domains "$HELD_OUT") --methods "$grid" "${common[@]}" --metrics-json "$OUT/heldout-sev$SEVERITY-b64-$TAG.json" > "$OUT/heldout-sev$SEVERITY-b64-$TAG.md"
chosen=$("$PY" benchmarks/choose_lr.py "$OUT/heldout-sev$SEVERITY-b64-$TAG.json")
echo "chosen on the held-out corruptions at batch 64: $chosen"
cafa bench $(domains "$CORRUPTIONS") --methods "bn,$chosen" "${common[@]}" --metrics-json "$OUT/sev$SEVERITY-b64-$TAG.json" > "$OUT/sev$SEVERITY-b64-$TAG.md"
cat "$OUT/sev$SEVERITY-b64-$TAG.md"
