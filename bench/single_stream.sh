#!/usr/bin/env bash
# Issue 15 in one device run: Pagoda's batch-1 decode against llama.cpp built and run in the same run, the M = 1
# int4 kernel against GemLite and tinygemm, and the GPU tests the issue asks to pass after a change.
#
#   bash bench/single_stream.sh        (carry .peers: ../shared/peers/fetch.sh fills it)
#
# Order: llama.cpp's build (~4.5 min on 16 cores, niced) runs beside the GPU tests and the kernel bench, whose
# timings are CUDA-graph replays timed on the device; the two end-to-end benches (llama.cpp's, then ours with
# --llamacpp pointing at its output) run after the build, with nothing else on the machine. Writes
# llamacpp.txt, latency.json, kernels_gemv.json and single_stream.log into $OUT (or bench/results).
# $MODELS: the latency shapes (default smollm2-135m,llama2-7b,llama3-8b); $LATENCY_FLAGS: extra latency flags;
# $GEMV_BASELINE: an earlier kernels/triton/w4a16_gemv.py to A/B the fused layer's launches against (carried).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-bench/results}
PY=${PYTHON:-python3}
SHAPES=${MODELS:-smollm2-135m,llama2-7b,llama3-8b}
read -r -a LATENCY <<< "${LATENCY_FLAGS:-}"
LCPP=/tmp/lcpp
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p "$OUT_DIR" "$LCPP"
LOG=$OUT_DIR/single_stream.log
start=$(date +%s)
say() { echo "[single_stream +$(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }

say "llama.cpp build in the background"
( nice -n 19 cmake -S .peers/llama.cpp -B $LCPP/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release \
    > $LCPP/cmake.log 2>&1 &&
  nice -n 19 cmake --build $LCPP/build -j"$(nproc)" --target llama-bench llama-quantize llama-batched-bench \
    > $LCPP/build.log 2>&1; echo $? > $LCPP/done ) &

say "GPU tests: kernels against the reference, greedy against transformers, the fused layer"
timeout 200 $PY -m pytest -q -m gpu tests/test_kernels.py tests/test_fused_decode.py tests/test_gpu_engine.py \
  -k "gemv or fused or greedy or decode_attention" 2>&1 | tail -n 4 | tee -a "$LOG"

say "int4 GEMV at M = 1 against GemLite and tinygemm"
timeout 150 $PY bench/gemv.py --only "8B,SmolLM2" --out "$OUT_DIR/kernels_gemv.json" 2>&1 | grep -E "^w4a16|card" \
  | tee -a "$LOG"

if [ -n "${GEMV_BASELINE:-}" ]; then  # an earlier w4a16_gemv.py (git show <commit>:kernels/triton/w4a16_gemv.py)
  say "fused-layer launches against $GEMV_BASELINE"
  timeout 150 $PY bench/gemv_ab.py --baseline-file "$GEMV_BASELINE" --k-step 128 --out "$OUT_DIR/kernels_gemv_ab.json" \
    2>&1 | grep -E "baseline|Error" | tee -a "$LOG"
fi

say "waiting for the llama.cpp build"
while [ ! -f $LCPP/done ] && [ $(( $(date +%s) - start )) -lt 420 ]; do sleep 5; done
if [ "$(cat $LCPP/done 2>/dev/null)" = 0 ]; then
  say "llama.cpp batch-1 decode"
  timeout 180 bash .peers/llamacpp_bench.sh smol,l7b,l8b 1 > "$OUT_DIR/llamacpp.txt" 2>&1
  grep -E "^## |tg128" "$OUT_DIR/llamacpp.txt" | tee -a "$LOG"
  LATENCY+=(--llamacpp "$OUT_DIR/llamacpp.txt")
else
  say "llama.cpp did not build in time ($LCPP/build.log): ratios use the recorded figures"
  tail -n 5 $LCPP/build.log 2>/dev/null | tee -a "$LOG"
fi

say "Pagoda batch-1 decode"
timeout 300 $PY bench/latency.py --models "$SHAPES" --only decode --output-len 256 --repeats 3 \
  --out "$OUT_DIR/latency.json" "${LATENCY[@]}" 2>&1 | grep -E "decode|roofline|targets|FAILED" | tee -a "$LOG"
say "done"
