#!/usr/bin/env bash
# Session 15's fourth run: with mma_acts now cheap (38 µs a step at 8 sequences, was 116),
# should products of fewer than 9 rows take the tensor cores where the int16 GEMVs fit? A: the
# landed build (tensor cores from 9 rows, or from 2 where the int16 activations do not fit);
# B: from 5 rows; C: from 3. Kernels identical (one cubin). Batched decode of 2 to 16
# sequences on the 0.85B llama (4-bit), 512-token prompts, 128 tokens, A/B/C alternated twice.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm-b.gz .device/oxlm-c.gz 2>/dev/null
chmod +x .device/oxlm-b .device/oxlm-c
llama=/tmp/models/llama-0.85b-4
[ -f $llama/config.json ] || python3 benches/gpu/synthetic_mlx.py $llama --hidden 2048 \
  --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
for round in 1 2; do
  for v in a b c; do
    bin=.device/oxlm; [ $v = a ] || bin=.device/oxlm-$v
    timeout 100 $bin bench --device cuda --model $llama --prompt-tokens 512 --gen-tokens 128 \
      --repeats 1 --batch 2 --batch 3 --batch 4 --batch 5 --batch 6 --batch 8 --batch 16 \
      | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    echo "$v done at $((SECONDS - start)) s"
  done
done
OXLM_TRACE=1 timeout 100 .device/oxlm-c bench --device cuda --model $llama \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 4 --batch 8 > "$OUT/trace-c.json"
echo "all done at $((SECONDS - start)) s"
