#!/usr/bin/env bash
# The GPU measurements of issue #6, as one script for a lent device (each stage writes
# its JSON to $OUT and logs to $OUT/log as it goes, so a time-out keeps what was
# measured). Pick stages with STAGES="speed perf compile loader trace". On an H100
# (2026-11-26) speed took about 2 minutes and perf under 3; all of speed (fp32 only),
# perf, loader and a bf16 perf row ran in 306 s in one call. One command may run 10
# minutes and a session's device time is about 15 minutes, machine start included.
# Still open after that session: STAGES="trace compile" (why CAFA low-rank costs
# ~10 ms a step more than TENT on the H100, and torch.compile).
#   speed:   one 50,000-image ImageNet-C-shaped domain end to end (fp32, bf16) and PIL vs nvjpeg
#   perf:    C = 1000 ResNet-50: dense full (chunks kept and recomputed) and low-rank vs TENT
#   compile: the same with torch.compile, low-rank only
#   loader:  the data loader's images/s, uint8 batches vs per-image float, 0 to $WORKERS processes
#   sync:    issue 22: the step without host synchronisations against the step before it,
#            side by side (step_sync.py), C = 1000 ResNet-50, TENT and low-rank CAFA, fp32 and
#            bf16: the CAFA / TENT ratio of both; needs the earlier step's two files in
#            $BEFORE (default benchmarks/before-22), extracted where git is (see step_sync.py)
#   trace:   where a C = 1000 step's time goes: torch.profiler tables of tent and low-rank cafa
#            steps (fp32 and bf16; with cudnn.benchmark too), each loss timed alone, the distances' GEMMs computed
#            four ways (lowrank_gemm.py), and the cafa adapt loop profiled whole on a
#            6,000-image domain (4 to 5 minutes by estimate; 6 files in $OUT, so it fits
#            the 8 that come back beside compile's one)
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
    trace) for p in fp32 bf16; do "$PY" benchmarks/perf.py --model resnet50 --classes 1000 --batch 64 --repeats 10 --precision $p \
            --covariances lowrank --cudnn-benchmark --trace "$OUT/trace-$p.txt" 2>&1 | grep --line-buffered -v '^ \|^[{}]' | log; done
           "$PY" benchmarks/lowrank_gemm.py --classes 1000 --json "$OUT/lowrank-gemm.json" 2>&1 | log
           # and the whole cafa adapt loop on a 6,000-image domain, fp32 and bf16, under torch.profiler
           "$PY" benchmarks/imagenet_c_speed.py --images 6400 --root /tmp/imagenet-c-small --workers "$WORKERS" \
             --no-decode --torch-profile "$OUT" 2>&1 | log ;;
    sync) before=${BEFORE:-benchmarks/before-22}
          if [ -f "$before/adapter.py" ] && [ -f "$before/distances.py" ]; then
            for p in fp32 bf16; do "$PY" benchmarks/step_sync.py --before "$before" --model resnet50 --classes 1000 --batch 64 \
              --covariances lowrank --precision $p --repeats 5 --rounds 5 --json "$OUT/sync-$p.json" 2>&1 | log; done
          else echo "no $before/adapter.py and distances.py: extract the step before issue 22 first (step_sync.py)" | log; fi ;;
    loader) "$PY" benchmarks/loader.py --images 6400 --workers "0,4,$WORKERS" --json "$OUT/loader.json" 2>&1 | log ;;
    *) echo "unknown stage $stage" | log ;;
  esac
  echo "== $stage done in $(( $(date +%s) - start )) s" | log
done
