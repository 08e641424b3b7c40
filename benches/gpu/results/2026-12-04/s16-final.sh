#!/usr/bin/env bash
# Session 16's last run, on the landed kernels (ba29a8d) with cuda_ops' int16-GEMV test taking
# 4 rows, the most those kernels now take: the GPU tests, then batched decode of 1 to 64
# sequences on the 7.2B and 0.85B llamas (4-bit, 512-token prompts, 128 tokens).
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh tests
echo "tests done at $((SECONDS - start)) s"
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 $S7 --bits 4 >&2
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 $S1 --bits 4 >&2
for m in llama-7.2b llama-0.85b; do
  timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 \
    --batch 64 >> "$OUT/batch.jsonl"
done
echo "all done at $((SECONDS - start)) s"
