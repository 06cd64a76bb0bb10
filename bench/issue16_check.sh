#!/usr/bin/env bash
# Issue 16 on the device: the GPU tests of what changed since the last GPU run, then the figures the issue asks
# for, most important first, each step cut off after its own timeout so a slow step cannot take the rest with it.
# All steps take up to ~17 minutes, more than one device call (10 minutes at most): run them as three calls,
#
#   bash bench/issue16_check.sh tests memory      bash bench/issue16_check.sh awq128 mix
#   bash bench/issue16_check.sh timeline batched  bash bench/issue16_check.sh sweep   (the last: its own call)
#
# Steps (default: all, in this order):
#   tests      the runner's GPU tests (greedy = transformers with graphs and eager, async scheduling, the budget and
#              the allocator limit) and the W4A16 kernel tests at the tuned tiles
#   memory     bench/memory_budget.py: 8B AWQ under --gpu-memory-limit 24GiB, start-up and a varied top-p load
#   awq128     bench/throughput.py --only awq128 on the 7B and the 8B shape (default engine flags)
#   mix        bench/throughput.py --only mix: the ShareGPT-like mix on fp16 7B against HF transformers' static batch
#   timeline   bench/step_timeline.py on the 7B shape, with and without --async-scheduling
#   batched    bench/kernels.py --only batched: the shipped W4A16 path at 16-256 rows against fp16 cuBLAS
#   sweep      bench/kernels.py --sweep-mma: the transposed kernel's tiles, switches and splits at 32-256 rows on the
#              7B and 8B shapes; the card's fastest go to $OUT/w4a16_mma.json (copy it over
#              kernels/triton/tuned/w4a16_mma.json: the swept shapes' entries are new, the others the tree's). It
#              takes about two calls: SWEEP_SHAPES=8B, copy its table over the tree's, then SWEEP_SHAPES=7B;
#              SWEEP_ROWS=16,32,64 sweeps those row counts only (the table's other rows stay)
# Writes the benches' JSON files and issue16_check.log (every step's whole output) into $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-bench/results}
PY=${PYTHON:-python3}
MODELS=${PAGODA_BENCH_MODELS:-/tmp/pagoda-bench}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/issue16_check.log
start=$(date +%s)
say() { echo "[issue16 +$(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests memory awq128 mix timeline batched)

run() {  # run TIMEOUT NAME CMD...: the whole output into the log (the device returns at most 8 files), its tail here
  local limit=$1 name=$2 part
  shift 2
  say "$ $*"
  part=$(mktemp)
  timeout --kill-after=15 "$limit" "$@" > "$part" 2>&1
  local rc=$?
  cat "$part" >> "$LOG"
  tail -n "${TAIL:-6}" "$part"
  rm -f "$part"
  say "$name: exit $rc"
}

for step in "${steps[@]}"; do
  case $step in
    tests)
      run 300 tests "$PY" -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_warmup.py \
        "tests/test_kernels.py::test_gpu_w4a16_at_the_tuned_tiles" ;;
    memory)
      TAIL=30 run 150 memory_budget "$PY" bench/memory_budget.py --models-dir "$MODELS" \
        --out "$OUT_DIR/memory_budget.json" ;;
    awq128)
      run 110 throughput_7b "$PY" bench/throughput.py --models-dir "$MODELS" --only awq128 --repeats 2 \
        --out "$OUT_DIR/throughput_awq128.json"
      run 110 throughput_8b "$PY" bench/throughput.py --models-dir "$MODELS" --only awq128 --repeats 2 \
        --shape llama3-8b --out "$OUT_DIR/throughput_awq128_llama3_8b.json" ;;
    mix)
      run 230 throughput_mix "$PY" bench/throughput.py --models-dir "$MODELS" --only mix \
        --out "$OUT_DIR/throughput_mix.json" ;;
    timeline)
      TAIL=25 run 60 timeline_async "$PY" bench/step_timeline.py --models-dir "$MODELS"
      TAIL=25 run 60 timeline_sync "$PY" bench/step_timeline.py --models-dir "$MODELS" --no-async-scheduling ;;
    batched)
      TAIL=40 run 90 kernels_batched "$PY" bench/kernels.py --only batched --out "$OUT_DIR/kernels_batched.json" ;;
    sweep)
      cp kernels/triton/tuned/w4a16_mma.json "$OUT_DIR/w4a16_mma.json"  # the swept shapes' entries are replaced
      TAIL=30 run 540 kernels_mma_sweep "$PY" bench/kernels.py --only "" --sweep-mma "$OUT_DIR/kernels_mma_sweep.json" \
        --mma-shapes "${SWEEP_SHAPES:-}" --mma-rows "${SWEEP_ROWS:-16,32,64,128,256}" \
        --tuned-out "$OUT_DIR/w4a16_mma.json" ;;
    *)
      say "unknown step $step" ;;
  esac
done
say "done"
