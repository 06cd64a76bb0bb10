#!/usr/bin/env bash
# Issue 15 on the device: Pagoda's batch-1 decode against llama.cpp built and run on the same machine, the
# server's streaming against offline, the M = 1 kernels against their peers, and the GPU tests the issue asks to
# pass after a change. All steps take more than one device call (10 minutes at most): run them as calls in a row,
# so the machine stays warm (its /tmp keeps llama.cpp, the peer figures and the random-weight models):
#
#   bash bench/single_stream.sh peer tests,   then at once   bash bench/single_stream.sh latency,
#   then   bash bench/single_stream.sh half2 kernels
#
# or, where one call cannot hold the build and the tests: `build tests kernels` (the build outlives the call),
# then at once `peer`, then `latency`.
#
# (carry .peers: ../shared/peers/fetch.sh fills it; with a GEMV baseline also .devcache). Steps:
#   peer      llama.cpp's build (~4.5 min on 16 cores, niced, in the background from the start, with the F16 GGUF
#             and the latency step's random-weight models built beside it), then, with nothing else running,
#             llama-bench on the quantized shapes and the fp16 7B, and llama-batched-bench at 1, 32 and 128
#             sequences on the 8B shape (issue 16's peers): $OUT/llamacpp.txt, kept in /tmp/lcpp too
#   build     only the first half of peer: llama.cpp's build started in its own process session (it runs on after
#             this call returns, while the machine stays warm) and the random-weight models; a later peer step
#             waits for the build and benches
#   tests     GPU tests: the GEMVs against the reference, the fused layer against the unfused one, greedy
#             decoding against transformers (graphs and eager)
#   latency   bench/latency.py: batch-1 decode of $MODELS (default SmolLM2, 7B AWQ, 7B fp16, 8B AWQ) and the 7B
#             streamed through app.py serve; llama.cpp's figures from this machine's peer step (else recorded)
#   head8     bench/latency.py on the 7B and 8B AWQ with --lm-head-quantization int8 (the LM head as int8 rows):
#             $OUT/latency_int8_head.json, against the latency step's figures of the same run
#   half2     bench/latency.py on the 7B and 8B AWQ with --no-x16-rows (the half2 dot over fp16 rows, the engine's
#             default before session 22), the A/B of EngineArgs.x16_rows against the latency step's figures of the
#             same run: $OUT/latency_half2.json
#   grids     bench/gemv.py --x16 on the 7B and 8B launches at 8-24 warps an SM and K steps of 64 and 128, both dots:
#             the grids that beat the rule go to $OUT/w4a16_gemv.json (copy it over kernels/triton/tuned/, then
#             rerun latency to see them in the step)
#   ab        the tree against an earlier one in $BASE_TREE (default .devrun/base: `git archive <commit> | tar -x
#             -C .devrun/base` here, carry .devrun): the x16 launches at the rule and the rule before its one-wave
#             cap, the fp16 7B launches likewise, then batch-1 decode of the 7B / 8B AWQ and the fp16 7B in both
#             trees, one after the other: $OUT/kernels_gemv_x16.json, kernels_gemv_dense.json, latency_base.json
#             and latency.json
#   probes    the kernel timings prepared without a device (BENCHMARKS.md, session 33): batch-1 decode attention's
#             tiles with PREFETCH_TILES 2 (bench/kernels.py --only decode1), the int8 head's W8A16 tiles for
#             many rows against cuBLAS (bench/gemv.py --dense on the heads), and the x16 o / qkv launches at
#             17-25 splits (bench/gemv.py --x16 --x16-warps 4,6,8): kernels_decode1.json,
#             kernels_gemv_dense_heads.json, kernels_gemv_x16_splits.json
#   kernels   bench/gemv.py: the int4 GEMV against GemLite and tinygemm, bench/kernels.py --only decode1 (batch-1
#             decode attention's splits, tiles and stages), the fp16 GEMV against cuBLAS (and its plans); with
#             $GEMV_BASELINE (an earlier w4a16_gemv.py), or .devcache/baseline_kernels
#             (bench/baseline_kernels.sh <commit>: GEMV and epilogue), the fused-layer launches A/B
# $LATENCY_FLAGS: extra latency flags. Writes llamacpp.txt, latency.json, kernels_*.json and single_stream.log
# into $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-bench/results}
PY=${PYTHON:-python3}
SHAPES=${MODELS:-smollm2-135m,llama2-7b,llama2-7b-fp16,llama3-8b}
MODELS_DIR=${PAGODA_BENCH_MODELS:-/tmp/pagoda-bench}
read -r -a LATENCY <<< "${LATENCY_FLAGS:-}"
LCPP=/tmp/lcpp
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
mkdir -p "$OUT_DIR" "$LCPP"
LOG=$OUT_DIR/single_stream.log
start=$(date +%s)
say() { echo "[single_stream +$(( $(date +%s) - start ))s] $*" | tee -a "$LOG"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(peer tests)
has_step() { [[ " ${steps[*]} " == *" $1 "* ]]; }

if { has_step peer || has_step build; } && [ ! -x $LCPP/build/bin/llama-bench ] && [ ! -f $LCPP/building ]; then
  say "llama.cpp build (and the F16 GGUF after it) in the background, in its own session (it outlives this call)"
  rm -f $LCPP/done
  touch $LCPP/building
  setsid nohup bash -c "nice -n 19 cmake -S .peers/llama.cpp -B $LCPP/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DCMAKE_BUILD_TYPE=Release > $LCPP/cmake.log 2>&1 &&
    nice -n 19 cmake --build $LCPP/build -j$(nproc) --target llama-bench llama-quantize llama-batched-bench \
      > $LCPP/build.log 2>&1; rc=\$?
    mkdir -p $LCPP/models
    [ -f $LCPP/models/l7b-f16.gguf ] || PYTHONPATH=.peers/llama.cpp/gguf-py nice -n 19 python3 .peers/make_gguf.py \
      .peers/vocab.gguf $LCPP/models/l7b-f16.gguf 4096 11008 32 32 32 > /dev/null 2>&1
    echo \$rc > $LCPP/done; rm -f $LCPP/building" > /dev/null 2>&1 < /dev/null &
fi
if { has_step peer || has_step build; } && [ ! -f "$MODELS_DIR/.built" ]; then
  say "the latency step's random-weight models, beside the build"
  timeout 400 $PY bench/random_model.py --cache "$MODELS_DIR" smollm2-135m:awq llama2-7b:awq llama2-7b:fp16 \
    llama3-8b:awq 2>&1 | tail -n 4 | tee -a "$LOG" && touch "$MODELS_DIR/.built"
fi

for step in "${steps[@]}"; do
  case $step in
    peer) ;;  # after the others (below): its benches run with nothing else on the machine
    build) ;;  # started above; a later call's peer step waits for it and benches
    tests)
      say "GPU tests: GEMVs against the reference, the fused layer, greedy against transformers"
      timeout 280 $PY -m pytest -q -m gpu tests/test_kernels.py tests/test_fused_decode.py tests/test_gpu_engine.py \
        -k "gemv or fused or greedy or decode_attention or w8a16" 2>&1 | tail -n 6 | tee -a "$LOG" ;;
    latency)
      lcpp=()
      [ -s $LCPP/llamacpp.txt ] && lcpp=(--llamacpp "$LCPP/llamacpp.txt") && cp $LCPP/llamacpp.txt "$OUT_DIR/"
      [ ${#lcpp[@]} -eq 0 ] && say "no llama.cpp figures from this machine: the ratios use the recorded ones"
      say "Pagoda batch-1 decode and the 7B streamed through app.py serve"
      timeout 480 $PY bench/latency.py --models "$SHAPES" --models-dir "$MODELS_DIR" --only decode,stream \
        --output-len 256 --repeats 3 --out "$OUT_DIR/latency.json" "${lcpp[@]}" "${LATENCY[@]}" 2>&1 \
        | grep -E "decode|roofline|streamed|targets|FAILED" | tee -a "$LOG" ;;
    half2)
      say "the 7B and 8B AWQ batch-1 decode with the fused layer's int4 rows in fp16 (--no-x16-rows)"
      timeout 300 $PY bench/latency.py --models llama2-7b,llama3-8b --models-dir "$MODELS_DIR" --only decode \
        --output-len 256 --repeats 3 --no-x16-rows --out "$OUT_DIR/latency_half2.json" "${LATENCY[@]}" 2>&1 \
        | grep -E "decode|roofline|targets|FAILED" | tee -a "$LOG" ;;
    head8)
      say "the 7B and 8B AWQ batch-1 decode with --lm-head-quantization int8 (the A/B of the latency step's figures)"
      timeout 300 $PY bench/latency.py --models llama2-7b,llama3-8b --models-dir "$MODELS_DIR" --only decode \
        --output-len 256 --repeats 3 --lm-head-quantization int8 --out "$OUT_DIR/latency_int8_head.json" \
        "${LATENCY[@]}" 2>&1 | grep -E "decode|roofline|targets|FAILED" | tee -a "$LOG" ;;
    grids)
      say "the fused layer's int4 launches at other grids; this card's fastest into \$OUT/w4a16_gemv.json"
      cp kernels/triton/tuned/w4a16_gemv.json "$OUT_DIR/w4a16_gemv.json"  # the timed shapes' entries are replaced
      timeout 300 $PY bench/gemv.py --x16 --only 7B,8B --x16-warps 8,10,12,14 \
        --out "$OUT_DIR/kernels_gemv_x16.json" --tuned-out "$OUT_DIR/w4a16_gemv.json" 2>&1 \
        | grep -E "tuned grids|Error" | tee -a "$LOG" ;;
    ab)
      base=${BASE_TREE:-.devrun/base}
      [ -d "$base/bench" ] || { say "no earlier tree in $base"; continue; }
      say "the x16 launches and the fp16 7B ones at the rule and at the rule before its one-wave cap"
      timeout 150 $PY bench/gemv.py --x16 --only 7B,8B --x16-warps 12 --out "$OUT_DIR/kernels_gemv_x16.json" 2>&1 \
        | grep -E "^\{|Error" | tee -a "$LOG"
      timeout 80 $PY bench/gemv.py --dense --only "7B o,7B down,7B qkv" --out "$OUT_DIR/kernels_gemv_dense.json" \
        2>&1 | grep -E "^\{|Error" | tee -a "$LOG"
      out_abs=$(realpath "$OUT_DIR")
      for tree in "$base" .; do
        name=latency_base.json
        [ "$tree" = . ] && name=latency.json
        say "batch-1 decode in $tree"
        (cd "$tree" && timeout 200 $PY bench/latency.py --models llama2-7b,llama3-8b,llama2-7b-fp16 \
          --models-dir "$MODELS_DIR" --only decode --output-len 256 --repeats 3 --out "$out_abs/$name") 2>&1 \
          | grep -E "decode|roofline|FAILED" | tee -a "$LOG"
      done ;;
    probes)
      say "batch-1 decode attention's tiles, two of them before the wait among them"
      timeout 120 $PY bench/kernels.py --only decode1 --out "$OUT_DIR/kernels_decode1.json" 2>&1 \
        | grep -E "^  paged decode|Error" | tee -a "$LOG"
      say "the int8 head: one row, and the W8A16 matmul's tiles at 32-256 rows against cuBLAS"
      timeout 120 $PY bench/gemv.py --dense --only "7B head,8B head" --out "$OUT_DIR/kernels_gemv_dense_heads.json" \
        2>&1 | grep -E "^\{|Error" | tee -a "$LOG"
      say "the fused layer's x16 launches at fewer splits (4-8 warps an SM)"
      timeout 150 $PY bench/gemv.py --x16 --only 7B,8B --x16-warps 4,6,8 --out "$OUT_DIR/kernels_gemv_x16_splits.json" \
        2>&1 | grep -E "^\{|Error" | tee -a "$LOG" ;;
    kernels)
      say "int4 GEMV at M = 1 against GemLite and tinygemm"
      timeout 150 $PY bench/gemv.py --only "8B,SmolLM2" --out "$OUT_DIR/kernels_gemv.json" 2>&1 \
        | grep -E "^w4a16|card" | tee -a "$LOG"
      say "batch-1 decode attention at 128-2,048 keys: split counts, tile lengths and stages"
      timeout 120 $PY bench/kernels.py --only decode1 --out "$OUT_DIR/kernels_decode1.json" 2>&1 \
        | grep -E "^\{|Error" | tee -a "$LOG"
      say "fp16 GEMV at M = 1 against cuBLAS, with its plans"
      timeout 150 $PY bench/gemv.py --dense --sweep --out "$OUT_DIR/kernels_gemv_dense.json" 2>&1 | tail -n 12 \
        | tee -a "$LOG"
      if [ -n "${GEMV_BASELINE:-}" ]; then  # an earlier w4a16_gemv.py (git show <commit>:kernels/triton/w4a16_gemv.py)
        say "fused-layer launches against $GEMV_BASELINE"
        timeout 150 $PY bench/gemv_ab.py --baseline-file "$GEMV_BASELINE" --k-step 128 \
          --out "$OUT_DIR/kernels_gemv_ab.json" 2>&1 | grep -E "baseline|Error" | tee -a "$LOG"
      elif [ -d .devcache/baseline_kernels ]; then  # bench/baseline_kernels.sh <commit>: GEMV and epilogue of then
        say "fused-layer launches against .devcache/baseline_kernels"
        timeout 150 $PY bench/gemv_ab.py --baseline-package .devcache \
          --out "$OUT_DIR/kernels_gemv_ab.json" 2>&1 | grep -E "baseline|Error" | tee -a "$LOG"
      fi ;;
    *)
      say "unknown step $step" ;;
  esac
done

if has_step peer; then
  say "waiting for the llama.cpp build"
  while [ -f $LCPP/building ] && [ ! -f $LCPP/done ] && [ $(( $(date +%s) - start )) -lt 420 ]; do sleep 5; done
  [ -x $LCPP/build/bin/llama-bench ] && [ ! -f $LCPP/done ] && echo 0 > $LCPP/done  # built in an earlier call
  if [ "$(cat $LCPP/done 2>/dev/null)" = 0 ]; then
    say "llama.cpp batch-1 decode (quantized shapes, then the fp16 7B)"
    { timeout 200 bash .peers/llamacpp_bench.sh smol,l7b,l8b 1,32,128; timeout 90 bash bench/llamacpp_fp16.sh; } \
      > $LCPP/llamacpp.txt 2>&1
    cp $LCPP/llamacpp.txt "$OUT_DIR/llamacpp.txt"
    grep -E "^## |tg128" $LCPP/llamacpp.txt | tee -a "$LOG"
  else
    say "llama.cpp did not build in time ($LCPP/build.log)"
    tail -n 5 $LCPP/build.log 2>/dev/null | tee -a "$LOG"
  fi
fi
say "done"
