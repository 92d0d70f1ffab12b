#!/usr/bin/env bash
# Issue 33's GPU measurements as one prepared script for a lent device (ResNet-50, C = 1000,
# batch 64, synthetic data): every figure of the issue's table, in ≤ 9 minutes on an H100.
#
#   OUT=$OUT bash benchmarks/gpu_checks.sh          # one device call, timeout_s 600
#   DRY=1 OUT=/tmp/dry PY=.venv/bin/python bash benchmarks/gpu_checks.sh   # every stage on the CPU, tiny sizes
#
# Default stages, in order of priority (STAGES="..." picks others), each with its own time
# limit (`timeout`, which ends the stage's whole process group, a --fresh row's process
# included) and all under one deadline, BUDGET seconds (530) from the start: a stage that
# would start with under 20 s left is skipped, and one that would outrun the deadline gets
# what is left. Each stage writes its JSON to $OUT as it goes (perf.py after every row),
# so a stage cut off keeps what it measured; the log ($OUT/log) has every line printed.
# Estimates for an H100 are the limits' reasoning, not measurements.
#   capture  (90 s, ~30 s) tests/test_step_graph_cuda.py and test_step_graph.py under pytest on
#            the device: every replayable method captured by CUDA itself and replayed as its
#            eager twin steps (fp32, bf16; three norms), every other one eager with its reason:
#            capture.xml (junit) and the log. On the CPU (DRY=1) the CUDA file is skipped.
#   step     (90 s each, ~60 s) TENT and CAFA low-rank, each in a process of its own
#            (perf.py --fresh), replayed from a CUDA graph and eager (--eager: rows
#            tent+eager, cafa-lowrank+eager; each row's step_runner says which ran),
#            fp32 then bf16: step-fp32.json, step-bf16.json, and
#            torch.profiler's tables of 3 steps of each (device and host time, the issue's
#            host-bound question): trace-step-fp32.txt, trace-step-bf16.txt
#   methods  (120 s, ~60 s) one process: TENT, then LAME, SAR, RoTTA, cafa-robust, CoTTA and
#            --norm class-balanced (TENT, CAFA) each beside TENT in alternating rounds, then
#            TENT again and CAFA low-rank: methods.json. Its last rows are also the history
#            check with the state kept (cafa-lowrank's ratio_to_tent: TENT timed first, before
#            the other rows; ratio_to_tent_again: TENT after the same history as CAFA)
#   speed    (240 s, ~200 s) a 50,000-image ImageNet-C-shaped domain and a hard-linked copy
#            of it adapted in one `cafa adapt` process, fp32 then bf16, each stepped by the CUDA
#            graph and then eagerly (--no-cuda-graph; ~45 s a run on an H200): each domain's loop,
#            the marginal domain time and the 75-domain estimate, then PIL vs nvjpeg: speed.json
#   history  (120 s, ~60 s) the methods stage again with --between-rows clean (gc,
#            empty_cache, cudnn.benchmark off, dynamo reset): history-clean.json. How to read
#            it beside step and methods: docs/performance/cuda-graph.md, "A step cost that does not
#            depend on history"
#   compile  (180 s, ~90 s) TENT and CAFA low-rank eager and with --compile: compile.json
#            (last: the issue has its figure already, and compile may yield to CUDA graphs)
# Throughout, nvidia-smi logs the SM clock, temperature and power each second (smi.csv):
# a card that clocks down after minutes of load is one of the history hypotheses.
# That is 11 files; at most 8 come back from a device call, so at the end all but the log
# are packed into $OUT/results.tar (the script ends within BUDGET, before the call's limit).
# Optional stages (not in the default list; they predate issue 33):
#   sync     step_sync.py: today's TENT and CAFA low-rank step counted (aten operators, about
#            the kernel launches, and host reads, which must be 0) and timed, fp32: sync-fp32.json
#   perf     issue 6's C = 1000 rows: dense full (chunks kept and recomputed) and low-rank vs TENT
#   trace    torch.profiler tables of the tent and low-rank cafa steps (fp32, bf16, with
#            cudnn.benchmark too), lowrank_gemm.py, and the cafa adapt loop profiled whole
#   loader   the data loader's images/s, 0 to $WORKERS processes
# DRY=1 runs the same commands on the CPU with the 28-pixel fmnist-resnet, one step a
# round and a 4-image domain (bf16 is CUDA's: the dry run times fp32 where the real one
# times bf16), to prove every stage's command before device time is spent on it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; PY=${PY:-python3}; DRY=${DRY:-0}
STAGES=${STAGES:-"capture step methods speed history compile"}
# the CPU is far slower than the card: a dry run's limits are SCALE times the H100's
if [ "$DRY" = 1 ]; then SCALE=${SCALE:-4}; BUDGET=${BUDGET:-2400}; else SCALE=${SCALE:-1}; BUDGET=${BUDGET:-530}; fi
WORKERS=${WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
if [ "$DRY" = 1 ]; then
  MODEL=(--model fmnist-resnet --batch 4 --size 28 --channels 1 --device cpu)
  TIMING=(--repeats 1 --rounds 1 --stats-batches 2); SYNC=(--repeats 1 --rounds 2)
  PRECISIONS="fp32"
  SPEED=(--images 4 --classes 2 --workers 0 --domains 2 --precisions fp32,fp32+eager --no-decode --root /tmp/gpu-checks-dry-domain)
  SMALL=(--images 4 --classes 2 --workers 0 --precisions fp32 --root /tmp/gpu-checks-dry-small)
  GEMM=(--classes 20 --rank 7 --dim 64 --batch 8 --repeats 2 --device cpu); LOADER=(--images 64 --workers 0)
else
  MODEL=(--model resnet50 --classes 1000 --batch 64)
  TIMING=(--repeats 10 --rounds 5); SYNC=(--repeats 5 --rounds 3)
  PRECISIONS="fp32 bf16"
  SPEED=(--images 50000 --workers "$WORKERS" --domains 2 --precisions fp32,bf16,fp32+eager,bf16+eager)
  SMALL=(--images 6400 --workers "$WORKERS" --root /tmp/imagenet-c-small)
  GEMM=(--classes 1000); LOADER=(--images 6400 --workers "0,4,$WORKERS")
fi
mkdir -p "$OUT"
log() { tee -a "$OUT/log"; }
deadline=$(( $(date +%s) + BUDGET ))
# perf.py's closing JSON dump (from a line "{" to a line "}") is in its file; the rest, tracebacks too, goes to the log
quiet() { awk '/^\{$/ { dump = 1 } !dump { print; fflush() } /^\}$/ { dump = 0 }'; }
failed=()

# stage NAME LIMIT COMMAND...: COMMAND under min(LIMIT, time to the deadline), output to the log
stage() {
  local name=$1 limit=$(( $2 * SCALE )) left start rc; shift 2
  left=$(( deadline - $(date +%s) ))
  if (( left < 20 )); then echo "== $name skipped: $left s left of the $BUDGET s budget" | log; failed+=("$name"); return; fi
  (( limit > left )) && limit=$left
  echo "== $name (limit $limit s): $*" | log
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | quiet | log
  rc=${PIPESTATUS[0]}
  if (( rc == 124 || rc == 137 )); then echo "== $name cut off at its limit ($limit s)" | log; fi
  (( rc == 0 )) || failed+=("$name")
  echo "== $name done in $(( $(date +%s) - start )) s, exit $rc" | log
}

{ echo "== $(date -u +%FT%TZ) stages: $STAGES; budget $BUDGET s; DRY=$DRY"
  "$PY" -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  echo "cores $(nproc), loader workers $WORKERS"; } 2>&1 | log
smi=
if command -v nvidia-smi > /dev/null && [ "$DRY" != 1 ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,memory.used \
    --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
  smi=$!
  trap '[ -n "$smi" ] && kill "$smi" 2> /dev/null' EXIT
fi

PERF=("$PY" benchmarks/perf.py "${MODEL[@]}" "${TIMING[@]}")
# the methods of the issue's table, each beside TENT; then TENT again and CAFA after them
HISTORY=(--methods lame,sar,rotta,cafa-robust,cotta --norms class-balanced --statistics lowrank --covariances lowrank --tent-again
         --rows "tent,lame,sar,rotta,cafa-robust,cotta,tent --norm class-balanced,cafa --norm class-balanced,tent-again,cafa-lowrank")
for name in $STAGES; do
  case $name in
    capture) stage capture 90 "$PY" -m pytest -q -p no:cacheprovider -rfs --junitxml="$OUT/capture.xml" \
               tests/test_step_graph_cuda.py tests/test_step_graph.py ;;
    step) for p in $PRECISIONS; do
            stage "step-$p" 90 "${PERF[@]}" --precision "$p" --fresh --methods none --covariances lowrank --eager \
              --rows tent,tent+eager,cafa-lowrank,cafa-lowrank+eager --trace "$OUT/trace-step-$p.txt" --json "$OUT/step-$p.json"
          done ;;
    methods) stage methods 120 "${PERF[@]}" "${HISTORY[@]}" --json "$OUT/methods.json" ;;
    speed) stage speed 240 "$PY" benchmarks/imagenet_c_speed.py "${SPEED[@]}" --json "$OUT/speed.json" ;;
    compile) stage compile 180 "${PERF[@]}" --methods none --covariances lowrank --compile \
               --rows tent,tent+compile,cafa-lowrank,cafa-lowrank+compile --json "$OUT/compile.json" ;;
    history) stage history-clean 120 "${PERF[@]}" "${HISTORY[@]}" --between-rows clean --json "$OUT/history-clean.json" ;;
    sync) stage sync 90 "$PY" benchmarks/step_sync.py "${MODEL[@]}" --covariances lowrank "${SYNC[@]}" --json "$OUT/sync-fp32.json" ;;
    perf) stage perf 200 "${PERF[@]}" --methods none --covariances lowrank,full,full-recompute --json "$OUT/perf-c1000.json" ;;
    trace) for p in $PRECISIONS; do
             stage "trace-$p" 120 "${PERF[@]}" --precision "$p" --methods none --covariances lowrank --cudnn-benchmark \
               --rows tent,tent+cudnn-benchmark,cafa-lowrank,cafa-lowrank+cudnn-benchmark --trace "$OUT/trace-$p.txt"
           done
           stage lowrank-gemm 60 "$PY" benchmarks/lowrank_gemm.py "${GEMM[@]}" --json "$OUT/lowrank-gemm.json"
           # the whole cafa adapt loop on a 6,400-image domain under torch.profiler
           stage adapt-profile 200 "$PY" benchmarks/imagenet_c_speed.py "${SMALL[@]}" --no-decode --torch-profile "$OUT" ;;
    loader) stage loader 120 "$PY" benchmarks/loader.py "${LOADER[@]}" --json "$OUT/loader.json" ;;
    *) echo "== unknown stage $name" | log; failed+=("$name") ;;
  esac
done
[ -n "$smi" ] && kill "$smi" 2> /dev/null
# a device call brings back at most 8 files: beyond that, the results travel as one
files=("$OUT"/*)
if (( ${#files[@]} > 8 )); then
  (cd "$OUT" && tar -cf results.tar --exclude=log --exclude=results.tar ./* && find . -maxdepth 1 -type f ! -name log ! -name results.tar -delete)
  echo "== more than 8 files: packed into $OUT/results.tar" | log
fi
echo "== finished in $(( BUDGET - (deadline - $(date +%s)) )) s; stages failed, cut off or skipped: ${failed[*]:-none}" | log
(( ${#failed[@]} == 0 ))
