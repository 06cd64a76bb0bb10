#!/usr/bin/env bash
# Builds the random-weight models once, then runs every engine benchmark of issue 9 on the GPU machine.
#
#   bench/run_all.sh [STEP ...]        steps: build latency throughput startup serving (default: all, in order)
#
# Writes <bench>.json and one run_all.log into $OUT (the device tool's output folder) or bench/results.
# Models are cached in $PAGODA_BENCH_MODELS (default /tmp/pagoda-bench): a later call on the same warm machine
# skips the build ($BUILD_SPECS: which models). $BENCH_FLAGS goes to every bench (e.g. "--enforce-eager"),
# $LATENCY_FLAGS, $THROUGHPUT_FLAGS, $STARTUP_FLAGS, $SERVING_FLAGS to one (e.g. THROUGHPUT_FLAGS="--only mix").
# Each step is cut off after $STEP_TIMEOUT seconds (default 360), keeping the rows it had written.
# Sized for about 8 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-bench/results}
MODELS=${PAGODA_BENCH_MODELS:-/tmp/pagoda-bench}
PY=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-360}
read -r -a FLAGS <<< "${BENCH_FLAGS:-}"
read -r -a SPECS <<< "${BUILD_SPECS:-smollm2-135m:awq llama2-7b:awq llama2-7b:fp16}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/run_all.log
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build latency throughput startup serving)

{
  echo "[run_all] $(date -u +%FT%TZ) steps: ${steps[*]} flags: ${FLAGS[*]:-none}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1
} | tee -a "$LOG"

status=0
for step in "${steps[@]}"; do
  start=$(date +%s)
  case $step in
    build)
      cmd=("$PY" bench/random_model.py --cache "$MODELS" "${SPECS[@]}") ;;
    latency|throughput|startup|serving)
      var="${step^^}_FLAGS"
      read -r -a own <<< "${!var:-}"
      cmd=("$PY" "bench/$step.py" --models-dir "$MODELS" --out "$OUT_DIR/$step.json" "${FLAGS[@]}" "${own[@]}") ;;
    *)
      echo "[run_all] unknown step $step" | tee -a "$LOG"; status=1; continue ;;
  esac
  echo "[run_all] $ ${cmd[*]}" | tee -a "$LOG"
  timeout --kill-after=20 "$STEP_TIMEOUT" "${cmd[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "[run_all] $step: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
