#!/usr/bin/env bash
# Session 15's last run, on the build that lands (the kernels of s15-f16.sh's run, the test
# tolerance mended): the GPU tests (all but kernels_compile, which ran where they were built),
# batched decode of 1 to 64 sequences on the 0.85B llama (4-bit) with f16 caches, twice, and
# with f32 once, and traced steps at 1, 8 and 64 sequences.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz 2>/dev/null
ls .device/cache/cuda > "$OUT/cache-before.txt"
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
for t in .device/tests/*; do
  echo "== $t"
  timeout 200 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1
done > "$OUT/tests.log" 2>&1
grep -E "^(==|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log" | head -40
echo "tests done at $((SECONDS - start)) s"
llama=/tmp/models/llama-0.85b-4
python3 benches/gpu/synthetic_mlx.py $llama --hidden 2048 --intermediate 5632 --layers 16 \
  --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
for kv in f16 f32 f16; do
  timeout 100 .device/oxlm bench --device cuda --model $llama --prompt-tokens 512 --gen-tokens 128 \
    --repeats 1 --kv-cache $kv --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    | tee -a "$OUT/batch.jsonl" | head -c 200; echo
done
OXLM_TRACE=1 timeout 120 .device/oxlm bench --device cuda --model $llama \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 8 --batch 64 > "$OUT/trace.json"
ls .device/cache/cuda > "$OUT/cache-after.txt"
echo "all done at $((SECONDS - start)) s"
