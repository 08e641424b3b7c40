#!/usr/bin/env bash
# Session 16's last, short run: how many warps an SM the one-tile tensor-core products (5-8
# rows) aim for, with the kernels that now load whole runs (74 registers a thread): the landed
# 32 (a), 16 and 64. Same kernels; batched decode of 6 and 8 sequences of the 7.2B llama and 8 of
# the 0.85B (4-bit, 512-token prompts, 128 tokens), alternated twice.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm-w16.gz .device/oxlm-w64.gz 2>/dev/null
chmod +x .device/oxlm-w16 .device/oxlm-w64
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 --hidden 4096 --intermediate 14336 \
  --layers 32 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 --hidden 2048 --intermediate 5632 \
  --layers 16 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
for round in 1 2; do
  for v in a w16 w64; do
    bin=.device/oxlm; [ $v = a ] || bin=.device/oxlm-$v
    timeout 40 $bin bench --device cuda --model /tmp/models/llama-7.2b-4 --prompt-tokens 512 \
      --gen-tokens 128 --repeats 1 --batch 6 --batch 8 | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    timeout 30 $bin bench --device cuda --model /tmp/models/llama-0.85b-4 --prompt-tokens 512 \
      --gen-tokens 128 --repeats 1 --batch 8 | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    echo "$v done at $((SECONDS - start)) s"
  done
done
