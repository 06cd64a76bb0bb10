#!/usr/bin/env bash
# llama.cpp's batch-1 decode on the fp16 Llama-2-7B shape (F16 GGUF): the peer of issue 15's fp16 target, which
# .peers/llamacpp_bench.sh (quantized shapes only) does not run. Uses the llama.cpp it built in /tmp/lcpp/build and
# its GGUF writer (.peers/make_gguf.py: random F16 weights of the shape, the vocabulary of .peers/vocab.gguf);
# prints a "## l7b-f16 (F16)" heading and llama-bench's table, the format bench/latency.py --llamacpp reads.
#   bash bench/llamacpp_fp16.sh >> llamacpp.txt        (on the GPU machine, from the project root, .peers carried)
set -u
B=/tmp/lcpp/build; M=/tmp/lcpp/models; mkdir -p $M
[ -x $B/bin/llama-bench ] || { echo "llama.cpp is not built in $B: run .peers/llamacpp_bench.sh first" >&2; exit 2; }
[ -f $M/l7b-f16.gguf ] || PYTHONPATH=.peers/llama.cpp/gguf-py python3 .peers/make_gguf.py .peers/vocab.gguf \
  $M/l7b-f16.gguf 4096 11008 32 32 32 > /dev/null || exit 2
echo "## l7b-f16 (F16)"
$B/bin/llama-bench -m $M/l7b-f16.gguf -ngl 99 -p 512 -n 128 -r 3 -o md 2>/dev/null | grep -E "^\|"
