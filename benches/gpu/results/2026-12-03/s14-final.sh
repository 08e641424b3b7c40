#!/usr/bin/env bash
# Session 14's run: the GPU tests, oxlm batched decode of 1 to 64 sequences on the 0.85B llama
# (4-bit) and traced steps at 8 and 64, batch-1 decode and prefill on the 0.85B and Qwen2.5-0.5B's
# shape, Nsight Compute on the 64-row tensor-core products, and llama.cpp (Q4_0, built here) on
# the same: llama-batched-bench and llama-bench.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
benches/gpu/device.sh llamacpp-build
benches/gpu/device.sh tests
echo "tests done at $((SECONDS - start)) s"
benches/gpu/device.sh batch
echo "batch done at $((SECONDS - start)) s"
OXLM_TRACE=1 timeout 150 .device/oxlm bench --device cuda --model /tmp/models/llama-0.85b-4 \
  --prompt-tokens 512 --gen-tokens 32 --repeats 1 --batch 8 --batch 64 > "$OUT/trace.json"
echo "trace done at $((SECONDS - start)) s"
declare -A SHAPE=(
  [llama-0.85b]="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
  [qwen2.5-0.5b]="--hidden 896 --intermediate 4864 --layers 24 --heads 14 --kv-heads 2 --vocab 151936 --arch qwen2"
)
for m in llama-0.85b qwen2.5-0.5b; do
  dir=/tmp/models/$m-4
  [ -f $dir/config.json ] || python3 benches/gpu/synthetic_mlx.py $dir ${SHAPE[$m]} --bits 4 >&2
  for prompt in 512 2048; do
    timeout 120 .device/oxlm bench --device cuda --model $dir --prompt-tokens $prompt --gen-tokens 128 \
      --repeats 3 | tee -a "$OUT/bench.jsonl"
  done
done
echo "bench done at $((SECONDS - start)) s"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 150 "$ncu" --clock-control none --kernel-name regex:'^(qmma_4_.*_8|mma_acts|mma_reduce)$' \
  --launch-skip 300 --launch-count 9 --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section SourceCounters .device/oxlm bench --device cuda --model /tmp/models/llama-0.85b-4 \
  --prompt-tokens 512 --gen-tokens 4 --repeats 1 --batch 64 > "$OUT/ncu-qmma.txt" 2>&1
echo "ncu done at $((SECONDS - start)) s"
while [ ! -f $LLAMA/build.done ]; do sleep 5; done
echo "llama.cpp built at $((SECONDS - start)) s"
benches/gpu/device.sh llamacpp-batch
bin=$LLAMA/build/bin
for m in llama-0.85b qwen2.5-0.5b; do
  [ -f /tmp/gguf/$m-f16.gguf ] || python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/$m-f16.gguf ${SHAPE[$m]} >&2
  [ -f /tmp/gguf/$m-Q4_0.gguf ] || $bin/llama-quantize /tmp/gguf/$m-f16.gguf /tmp/gguf/$m-Q4_0.gguf Q4_0 > /dev/null 2>&1
  $bin/llama-bench -m /tmp/gguf/$m-Q4_0.gguf -p 512,2048 -n 128 -ngl 99 -r 3 -o jsonl 2>/dev/null \
    | tee -a "$OUT/llamacpp.jsonl"
done
echo "all done at $((SECONDS - start)) s"
