#!/usr/bin/env bash
# Session 17's second A/B of the staged attention: the batched kernel's splits now fit one wave
# (floor, not ceiling) and the split merge loads every head's maxima and sums in one round
# (build b), against the session's starting build (208a6d6, `.device/oxlm-a`). Variants of b
# for one sequence (temporary switch OXLM_ONE_ATTN): its attention through the staged kernel
# with a warp per query head (c, OXLM_ONE_ATTN=1) or per four (d, =4), instead of
# attention_split. GPU tests on b first (cuda_ops, tiny_parity); the builds alternated twice on
# the 0.85B and 7.2B llamas (4-bit, 512-token prompts, 128 tokens; 1, 8 and 64 sequences);
# traced steps of b, c and d last.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/oxlm-a.gz
benches/gpu/device.sh tests
for v in 1 4; do
  for t in .device/tests/*; do
    OXLM_ONE_ATTN=$v $t --test-threads=1 --skip kernels_compile 2>&1 | grep -E '^test result|FAILED|panicked' \
      | sed "s|^|OXLM_ONE_ATTN=$v $t: |"
  done
done
echo "tests done at $((SECONDS - start)) s"
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 $S7 --bits 4 >&2 &
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 $S1 --bits 4 >&2
wait
echo "models at $((SECONDS - start)) s"
run() { # binary, tag, model, extra args...
  local bin=$1 tag=$2 m=$3; shift 3
  timeout 100 $bin bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 --gen-tokens 128 \
    --repeats 1 "$@" | sed "s/^{/{\"build\":\"$tag\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b llama-7.2b; do
    run .device/oxlm-a a $m --batch 8 --batch 64
    run .device/oxlm b $m --batch 8 --batch 64
    OXLM_ONE_ATTN=1 run .device/oxlm c $m
    OXLM_ONE_ATTN=4 run .device/oxlm d $m
  done
  echo "round $round at $((SECONDS - start)) s"
done
for m in llama-0.85b llama-7.2b; do
  OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 32 --repeats 1 --batch 8 --batch 64 > "$OUT/trace-b-$m.json"
  for v in 1 4; do
    OXLM_ONE_ATTN=$v OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 \
      --prompt-tokens 512 --gen-tokens 32 --repeats 1 > "$OUT/trace-one$v-$m.json"
  done
done
echo "all done at $((SECONDS - start)) s"
