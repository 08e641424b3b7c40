#!/usr/bin/env bash
# Session 13's final run: the GPU tests, oxlm batch-1 decode on the 0.85B llama and Qwen2.5-0.5B's
# shape (4-bit), batched decode on the 0.85B, and llama.cpp (Q4_0) on the same shapes, built here.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
benches/gpu/device.sh llamacpp-build
benches/gpu/device.sh tests
declare -A SHAPE=(
  [llama-0.85b]="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
  [qwen2.5-0.5b]="--hidden 896 --intermediate 4864 --layers 24 --heads 14 --kv-heads 2 --vocab 151936 --arch qwen2"
)
for m in llama-0.85b qwen2.5-0.5b; do
  dir=/tmp/models/$m-4
  python3 benches/gpu/synthetic_mlx.py $dir ${SHAPE[$m]} --bits 4 >&2
  for prompt in 512 2048; do
    timeout 120 .device/oxlm bench --device cuda --model $dir --prompt-tokens $prompt --gen-tokens 128 \
      --repeats 3 | tee -a "$OUT/bench.jsonl"
  done
done
timeout 120 .device/oxlm bench --device cuda --model /tmp/models/llama-0.85b-4 --prompt-tokens 512 \
  --gen-tokens 128 --repeats 1 --batch 8 --batch 32 --batch 64 | tee -a "$OUT/batch.jsonl"
while [ ! -f $LLAMA/build.done ]; do sleep 5; done
bin=$LLAMA/build/bin
mkdir -p /tmp/gguf
for m in llama-0.85b qwen2.5-0.5b; do
  python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/$m-f16.gguf ${SHAPE[$m]} >&2
  $bin/llama-quantize /tmp/gguf/$m-f16.gguf /tmp/gguf/$m-Q4_0.gguf Q4_0 > /dev/null 2>&1
  $bin/llama-bench -m /tmp/gguf/$m-Q4_0.gguf -p 512 -n 128 -ngl 99 -r 3 -o jsonl 2>/dev/null \
    | tee -a "$OUT/llamacpp.jsonl"
done
