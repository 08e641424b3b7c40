#!/usr/bin/env bash
# Session 15's sixth run: s15-mma-rows.sh on the synthetic 7.2B llama (4,096-wide rows, where
# the 0.85B's are 2,048): should its products of fewer than 9 rows take the tensor cores? A: the
# landed build (tensor cores from 9 rows, or from 2 where the int16 activations do not fit);
# B: from 5 rows; C: from 3. Kernels identical (one cubin). Batched decode of 2, 4 and 8
# sequences on the 7.2B llama (4-bit), 512-token prompts, 128 tokens, A/B/C alternated twice;
# traced steps of 8 sequences with A and with C.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm-b.gz .device/oxlm-c.gz 2>/dev/null
chmod +x .device/oxlm-b .device/oxlm-c
llama=/tmp/models/llama-7.2b-4
[ -f $llama/config.json ] || python3 benches/gpu/synthetic_mlx.py $llama --hidden 4096 \
  --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
for round in 1 2; do
  for v in a b c; do
    bin=.device/oxlm; [ $v = a ] || bin=.device/oxlm-$v
    timeout 100 $bin bench --device cuda --model $llama --prompt-tokens 512 --gen-tokens 128 \
      --repeats 1 --batch 2 --batch 4 --batch 8 \
      | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    echo "$v done at $((SECONDS - start)) s"
  done
done
OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model $llama \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 8 > "$OUT/trace-a.json"
OXLM_TRACE=1 timeout 100 .device/oxlm-c bench --device cuda --model $llama \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 8 > "$OUT/trace-c.json"
echo "all done at $((SECONDS - start)) s"
