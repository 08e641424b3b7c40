#!/usr/bin/env bash
# Session 17's third A/B, on the staged batched attention of s17-attn (the second's merge and
# one-wave splits undone): how many warps its splits aim at (temporary switch OXLM_ATTN_AIM):
# the kernel's resident warps (b, as in s17-attn), twice that (b2, =2) or 16 a multiprocessor
# (b16, =16, the rule before). GPU tests under each; then the builds, with the session's
# starting one (a, 208a6d6), alternated twice on the 0.85B and 7.2B llamas (4-bit, 512-token
# prompts, 128 tokens; 1, 8, 16, 32 and 64 sequences); traced steps of b last.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/oxlm-a.gz
benches/gpu/device.sh tests
for v in 2 16; do
  for t in .device/tests/*; do
    OXLM_ATTN_AIM=$v $t --test-threads=1 --skip kernels_compile 2>&1 | grep -E '^test result|FAILED|panicked' \
      | sed "s|^|OXLM_ATTN_AIM=$v $t: |"
  done
done
echo "tests done at $((SECONDS - start)) s"
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 $S7 --bits 4 >&2 &
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 $S1 --bits 4 >&2
wait
echo "models at $((SECONDS - start)) s"
run() { # binary, tag, model
  timeout 100 $1 bench --device cuda --model /tmp/models/$3-4 --prompt-tokens 512 --gen-tokens 128 \
    --repeats 1 --batch 8 --batch 16 --batch 32 --batch 64 | sed "s/^{/{\"build\":\"$2\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b llama-7.2b; do
    run .device/oxlm-a a $m
    run .device/oxlm b $m
    OXLM_ATTN_AIM=2 run .device/oxlm b2 $m
    OXLM_ATTN_AIM=16 run .device/oxlm b16 $m
  done
  echo "round $round at $((SECONDS - start)) s"
done
OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 --prompt-tokens 512 \
  --gen-tokens 32 --repeats 1 --batch 8 --batch 64 > "$OUT/trace-b-llama-7.2b.json"
echo "all done at $((SECONDS - start)) s"
