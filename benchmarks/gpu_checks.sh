#!/usr/bin/env bash
# The GPU measurements issue #6 still lacks, as one script for a lent device
# (each stage writes its JSON to $OUT and logs to $OUT/log as it goes, so a time-out
# keeps what was measured). Run stages separately with STAGES="speed perf compile loader":
# speed and perf take about 3 and 5 minutes on an H100 (the dense C = 1000 rows build a
# 16.8 GB factor tensor each), compile 3 to 4; one command may run 10 minutes, and the
# device time of a session is about 15 minutes in all, machine start included, so pass
# one or two stages per call (STAGES=perf first: it measures the most targets).
#   speed:   one 50,000-image ImageNet-C-shaped domain end to end (fp32, bf16) and PIL vs nvjpeg
#   perf:    C = 1000 ResNet-50: dense full (chunks kept and recomputed) and low-rank vs TENT
#   compile: the same with torch.compile, low-rank only
#   loader:  the data loader's images/s, uint8 batches vs per-image float, 0 to $WORKERS processes
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; PY=${PY:-python3}; STAGES=${STAGES:-"perf speed"}
WORKERS=${WORKERS:-$(( $(nproc) - 2 ))}
mkdir -p "$OUT"
log() { tee -a "$OUT/log"; }
for stage in $STAGES; do
  start=$(date +%s)
  echo "== $stage" | log
  case $stage in
    speed) "$PY" benchmarks/imagenet_c_speed.py --images 50000 --workers "$WORKERS" --json "$OUT/speed.json" 2>&1 | log ;;
    perf) "$PY" benchmarks/perf.py --model resnet50 --classes 1000 --batch 64 --repeats 5 \
            --covariances lowrank,full,full-recompute --json "$OUT/perf-c1000.json" 2>&1 | grep --line-buffered -v '^ \|^[{}]' | log ;;
    compile) "$PY" benchmarks/perf.py --model resnet50 --classes 1000 --batch 64 --repeats 10 \
               --covariances lowrank --compile --json "$OUT/perf-c1000-compile.json" 2>&1 | grep --line-buffered -v '^ \|^[{}]' | log ;;
    loader) "$PY" benchmarks/loader.py --images 6400 --workers "0,4,$WORKERS" --json "$OUT/loader.json" 2>&1 | log ;;
    *) echo "unknown stage $stage" | log ;;
  esac
  echo "== $stage done in $(( $(date +%s) - start )) s" | log
done
