#!/usr/bin/env bash
# Session 16's first run: the GPU tests on the landed build (97f4ffa's one-tile slicing and the
# review after it had not run on the GPU), then the baseline of batched decode the session's
# kernel work is measured against: 2, 4 and 8 sequences of the 7.2B llama, 2 to 64 of the 0.85B
# (4-bit, 512-token prompts, 128 tokens).
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
start=$SECONDS
benches/gpu/device.sh tests
echo "tests done at $((SECONDS - start)) s"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 --hidden 4096 --intermediate 14336 \
  --layers 32 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 --hidden 2048 --intermediate 5632 \
  --layers 16 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
echo "models at $((SECONDS - start)) s"
export OXLM_CACHE="$PWD/.device/cache"
.device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 --prompt-tokens 512 \
  --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 | tee -a "$OUT/batch.jsonl"
.device/oxlm bench --device cuda --model /tmp/models/llama-0.85b-4 --prompt-tokens 512 \
  --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 64 | tee -a "$OUT/batch.jsonl"
echo "done at $((SECONDS - start)) s"
