#!/usr/bin/env bash
# Session 14's experiment: qmma's activation rows split over warps (OXLM_MMA_TILES tiles of 8
# rows a warp, the rest in more row groups) and warps per SM aimed at (OXLM_MMA_WARPS). Both
# were environment knobs of an experiment build (qmma took its row group from blockIdx.z),
# reverted after this run: main has neither.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
start=$SECONDS
dir=/tmp/models/llama-0.85b-4
python3 benches/gpu/synthetic_mlx.py $dir --hidden 2048 --intermediate 5632 --layers 16 --heads 32 \
  --kv-heads 8 --vocab 32000 --bits 4 >&2
for round in 1 2; do
  for tw in 8,8 4,8 4,16 2,16 2,32 1,32; do
    IFS=, read t w <<< "$tw"
    echo "tiles $t warps $w round $round"
    OXLM_MMA_TILES=$t OXLM_MMA_WARPS=$w timeout 60 .device/oxlm bench --device cuda --model $dir \
      --prompt-tokens 512 --gen-tokens 128 --repeats 1 --batch 16 --batch 32 --batch 64 \
      >> "$OUT/ab.jsonl"
  done
done
echo "ab done at $((SECONDS - start)) s"
for t in 1 2 4; do
  echo "== tests with OXLM_MMA_TILES=$t"
  OXLM_MMA_TILES=$t .device/tests/cuda_ops --test-threads=1 quantized_matmul int16 many_row greedy 2>&1 | grep -E "test result|panicked|FAILED" 
  OXLM_MMA_TILES=$t .device/tests/tiny_parity --test-threads=1 2>&1 | grep -E "test result|panicked|FAILED"
done > "$OUT/tests.log" 2>&1
cat "$OUT/tests.log"
echo "all done at $((SECONDS - start)) s"
