#!/usr/bin/env bash
# Does Global FA lose its lead over CAFA when the features have more dimensions than the
# test batch has images (the paper's setting: d = 640 or 2048, batch 200 or 64)?
# The six corruptions of margin_scan.sh at severity 3, batch 64, with the Fashion-MNIST
# ResNet widened to d = $WIDTH features (benchmarks/wide_fmnist.py; trained first if
# $WEIGHTS is missing), each method at the learning rate margin_retuned.sh chose for the
# bundled d = 64 model at batch 64 (not re-chosen for the wide model).
# Needs cafa importable (PYTHONPATH=src) and corrupt-tta; results land in $OUT.
set -euo pipefail
OUT=${OUT:-wide-out}; WORK=${WORK:-/tmp/fmnist-c}; PY=${PY:-python3}; WIDTH=${WIDTH:-256}
WEIGHTS=${WEIGHTS:-$OUT/wide$WIDTH.safetensors}
CORRUPTIONS="gaussian_noise defocus_blur frost contrast fog motion_blur"
METHODS=${METHODS:-"bn,tent@0.0001,cafa@0.0003,global-fa@0.001,intra@0.001"}
mkdir -p "$OUT"
cafa() { "$PY" -m cafa_cli "$@"; }
[ -f "$WEIGHTS" ] || "$PY" benchmarks/wide_fmnist.py --width "$WIDTH" --out "$WEIGHTS" | tee "$OUT/train$WIDTH.log"
cafa demo --workdir "$WORK" --data-only --corruptions "$(echo $CORRUPTIONS | tr ' ' ,)" --severity 3 --test-per-class 0 --quiet > /dev/null
domains=$(for c in $CORRUPTIONS; do echo "$WORK/fashion-mnist-c/$c/3"; done)
export CAFA_WIDE_FMNIST_WIDTH=$WIDTH
cafa bench $domains --methods "$METHODS" --model benchmarks/wide_fmnist.py:build --weights "$WEIGHTS" \
    --train fashion-mnist --resize none --crop none --mean 0.2860 --std 0.3530 --channels 1 \
    --batch-size 64 --seeds 0 --per-class 300 --workdir "$OUT/artifacts-$WIDTH" --quiet \
    --metrics-json "$OUT/sev3-b64-d$WIDTH.json" > "$OUT/sev3-b64-d$WIDTH.md"
cat "$OUT/sev3-b64-d$WIDTH.md"
