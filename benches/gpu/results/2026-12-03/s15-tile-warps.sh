#!/usr/bin/env bash
# Session 15's seventh run: the one-tile tensor-core products (2-8 rows whose int16 activations
# do not fit: every matrix of the 7.2B at 8 sequences, 28 µs a launch, 0.46 TB/s) are sliced to
# aim at 8 warps an SM, as the 8-tile ones are. A: the landed build; X: one-tile products aim at
# 16 warps an SM; Y: at 32. Kernels identical. Batched decode of 2, 4 and 8 sequences on the
# 7.2B llama (4-bit), A/X/Y alternated twice, then once on the 0.85B (its down projection).
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm-x.gz .device/oxlm-y.gz 2>/dev/null
chmod +x .device/oxlm-x .device/oxlm-y
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 --hidden 4096 --intermediate 14336 \
  --layers 32 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 --hidden 2048 --intermediate 5632 \
  --layers 16 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
for m in llama-7.2b llama-7.2b llama-0.85b; do
  for v in a x y; do
    bin=.device/oxlm; [ $v = a ] || bin=.device/oxlm-$v
    timeout 60 $bin bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 --gen-tokens 128 \
      --repeats 1 --batch 2 --batch 4 --batch 8 \
      | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    echo "$m $v done at $((SECONDS - start)) s"
  done
done
