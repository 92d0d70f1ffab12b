#!/usr/bin/env bash
# Does CAFA's margin over TENT depend on the number of updates or on the severity?
# Six Fashion-MNIST-C corruptions (all 10,000 test images), seed 0, the learning rates
# of docs/results/index.md (Adam 1e-3 for TENT and CAFA); only the batch size (200 or 64:
# 50 or 157 updates a domain) and the severity (3 or 5) change. One markdown table and
# one JSON per setting land in $OUT. Needs cafa importable (PYTHONPATH=src) and corrupt-tta.
set -euo pipefail
OUT=${OUT:-margin-out}; WORK=${WORK:-/tmp/fmnist-c}; PY=${PY:-python3}
CORRUPTIONS=${CORRUPTIONS:-"gaussian_noise defocus_blur frost contrast fog motion_blur"}
mkdir -p "$OUT"
cafa() { "$PY" -m cafa_cli "$@"; }
for severity in 3 5; do
  cafa demo --workdir "$WORK" --data-only --corruptions "${CORRUPTIONS// /,}" --severity "$severity" --test-per-class 0 --quiet > /dev/null
  for batch in 200 64; do
    start=$(date +%s)
    cafa bench $(for c in $CORRUPTIONS; do echo "$WORK/fashion-mnist-c/$c/$severity"; done) \
      --methods source,bn,tent@0.001,cafa@0.001 --batch-size "$batch" --seeds 0 --per-class 300 \
      --workdir "$WORK/artifacts" --metrics-json "$OUT/sev$severity-b$batch.json" --quiet > "$OUT/sev$severity-b$batch.md"
    echo "severity $severity, batch $batch: $(( $(date +%s) - start )) s"
    cat "$OUT/sev$severity-b$batch.md"
  done
done
