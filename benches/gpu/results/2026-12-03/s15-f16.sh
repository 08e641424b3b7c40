#!/usr/bin/env bash
# Session 15's run: f16 key/value caches on the GPU, and mma_acts from one load of each row
# (1,024 threads a row; before: 256, three passes over memory). The GPU tests (all but
# kernels_compile, which ran where the binaries were built), then oxlm's batched decode of 1 to
# 64 sequences on the 0.85B llama (4-bit) and batch-1 decode and prefill on it and on
# Qwen2.5-0.5B's shape, each with f16 caches (the default now) and with f32 (`--kv-cache f32`,
# the default before), alternated; traced steps at 8 and 64 sequences with f16; llama.cpp (Q4_0,
# built here meanwhile, f16 cache) on the same, llama-batched-bench and llama-bench.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
# The cubins came compressed, to fit the carry.
gunzip -f .device/cache/cuda/*.gz 2>/dev/null
benches/gpu/device.sh llamacpp-build
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
for t in .device/tests/*; do
  echo "== $t"
  timeout 240 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1
done > "$OUT/tests.log" 2>&1
grep -E "^(==|test result|.*f16 cache.*|.*FAILED.*|.*panicked.*)" "$OUT/tests.log" | head -60
echo "tests done at $((SECONDS - start)) s"
declare -A SHAPE=(
  [llama-0.85b]="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
  [qwen2.5-0.5b]="--hidden 896 --intermediate 4864 --layers 24 --heads 14 --kv-heads 2 --vocab 151936 --arch qwen2"
)
for m in llama-0.85b qwen2.5-0.5b; do
  dir=/tmp/models/$m-4
  [ -f $dir/config.json ] || python3 benches/gpu/synthetic_mlx.py $dir ${SHAPE[$m]} --bits 4 >&2
done
llama=/tmp/models/llama-0.85b-4
for kv in f16 f32 f16; do
  timeout 150 .device/oxlm bench --device cuda --model $llama --prompt-tokens 512 --gen-tokens 128 \
    --repeats 1 --kv-cache $kv --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    | tee -a "$OUT/batch.jsonl" | head -c 300; echo
  echo "batch $kv done at $((SECONDS - start)) s"
done
OXLM_TRACE=1 timeout 150 .device/oxlm bench --device cuda --model $llama \
  --prompt-tokens 512 --gen-tokens 32 --repeats 1 --batch 8 --batch 64 > "$OUT/trace.json"
echo "trace done at $((SECONDS - start)) s"
for m in llama-0.85b qwen2.5-0.5b; do
  for prompt in 512 2048; do
    for kv in f16 f32; do
      timeout 120 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens $prompt \
        --gen-tokens 128 --repeats 3 --kv-cache $kv | tee -a "$OUT/bench.jsonl" | head -c 300; echo
    done
  done
done
echo "bench done at $((SECONDS - start)) s"
[ $((SECONDS - start)) -lt 420 ] || { echo "no time left for llama.cpp"; exit 0; }
while [ ! -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 480 ]; do sleep 5; done
[ -f $LLAMA/build.done ] || { echo "llama.cpp not built in time"; exit 0; }
echo "llama.cpp built at $((SECONDS - start)) s"
timeout 100 benches/gpu/device.sh llamacpp-batch
bin=$LLAMA/build/bin
for m in llama-0.85b qwen2.5-0.5b; do
  [ -f /tmp/gguf/$m-f16.gguf ] || python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/$m-f16.gguf ${SHAPE[$m]} >&2
  [ -f /tmp/gguf/$m-Q4_0.gguf ] || $bin/llama-quantize /tmp/gguf/$m-f16.gguf /tmp/gguf/$m-Q4_0.gguf Q4_0 > /dev/null 2>&1
  timeout 60 $bin/llama-bench -m /tmp/gguf/$m-Q4_0.gguf -p 512,2048 -n 128 -ngl 99 -r 3 -o jsonl 2>/dev/null \
    | tee -a "$OUT/llamacpp.jsonl"
done
echo "all done at $((SECONDS - start)) s"
