#!/usr/bin/env bash
# Session 15's second run. Both builds have f16 caches and the one-load mma_acts. A: batched
# attention's splits fill one wave and no more (floor, where the first run rounded up: 64
# sequences took 5 splits, 2,560 warps for 2,112 places); f16 cache elements converted by
# cvt. B: A, with the ring's f16 elements converted by integer operations and a multiply. The
# GPU tests of B (all but kernels_compile), then batched decode of 1 to 64 sequences on the
# 0.85B llama (4-bit), A and B alternated twice, batch-1 decode and prefill of the 0.85B and
# Qwen2.5-0.5B's shape with each, and traced steps of B at 1 and 64 sequences. The kernels
# came compiled by NVRTC 13.0 (the cache's key holds NVRTC's major.minor).
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm-a.gz
chmod +x .device/oxlm-a
python3 -m pip show nvidia-cuda-nvrtc 2>/dev/null | grep -i '^version'
ls .device/cache/cuda > "$OUT/cache-before.txt"
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
for t in .device/tests/*; do
  echo "== $t"
  timeout 200 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1
done > "$OUT/tests.log" 2>&1
grep -E "^(==|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log" | head -40
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
for round in 1 2; do
  for v in a b; do
    bin=.device/oxlm; [ $v = a ] && bin=.device/oxlm-a
    timeout 100 $bin bench --device cuda --model $llama --prompt-tokens 512 --gen-tokens 128 \
      --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
      | sed "s/^{/{\"build\":\"$v\",/" | tee -a "$OUT/batch.jsonl" | head -c 200; echo
    echo "batch $v done at $((SECONDS - start)) s"
  done
done
for m in llama-0.85b qwen2.5-0.5b; do
  for prompt in 512 2048; do
    for v in a b; do
      bin=.device/oxlm; [ $v = a ] && bin=.device/oxlm-a
      timeout 60 $bin bench --device cuda --model /tmp/models/$m-4 --prompt-tokens $prompt \
        --gen-tokens 128 --repeats 3 | sed "s/^{/{\"build\":\"$v\",/" \
        | tee -a "$OUT/bench.jsonl" | head -c 200; echo
    done
  done
done
echo "bench done at $((SECONDS - start)) s"
OXLM_TRACE=1 timeout 120 .device/oxlm bench --device cuda --model $llama \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 64 > "$OUT/trace.json"
ls .device/cache/cuda > "$OUT/cache-after.txt"
echo "all done at $((SECONDS - start)) s"
