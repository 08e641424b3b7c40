#!/usr/bin/env bash
# Session 24's ninth call, right after the eighth on the same machine: the second part of MLX's
# CUDA library. oxlm (main, c0efd31) on the three models first: one sequence after 512- and
# 2048-token prompts, then 8, 32 and 64 sequences after 512; then mlx-lm on MLX's CUDA backend,
# the same (device.sh mlx: mlx_lm_bench.py), the 7.2B last.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm.gz; chmod +x .device/oxlm
while [ ! -f /tmp/models.done ]; do sleep 2; done
cat /tmp/models.log
for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do
  for p in 512 2048; do
    extra=""; [ $p = 512 ] && extra="--batch 8 --batch 32 --batch 64"
    timeout 120 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens $p \
      --gen-tokens 128 --repeats 2 $extra 2>> "$OUT/bench.err" | tee -a "$OUT/oxlm.jsonl"
  done
done
for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do ONLY=$m benches/gpu/device.sh mlx; done
tail -5 "$OUT/mlx.err"
