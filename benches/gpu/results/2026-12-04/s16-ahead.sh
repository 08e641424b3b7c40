#!/usr/bin/env bash
# Session 16's third run. B: the landed build (3b704ef, qmma from whole runs). D: qmma asks L2
# for its first turn's weights, scales and biases before it waits for its inputs, and for each
# next turn's weights while it multiplies this one's (prefetch.global.L2: no registers). D5: D's
# kernels, and the tensor cores from 5 rows everywhere (the landed rule takes them past 8 rows,
# or from 2 where the int16 activations do not fit a block). The GPU tests on D first; then
# batched decode on the 7.2B and 0.85B llamas (4-bit, 512-token prompts, 128 tokens) at 2 to 8,
# 16 and 64 sequences, B/D/D5 alternated twice; then a traced step of D at 8 and 64 sequences
# of the 7.2B.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm-b.gz .device/oxlm-d5.gz 2>/dev/null
chmod +x .device/oxlm-b .device/oxlm-d5
benches/gpu/device.sh tests
echo "tests done at $((SECONDS - start)) s"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 --hidden 4096 --intermediate 14336 \
  --layers 32 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 --hidden 2048 --intermediate 5632 \
  --layers 16 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
echo "models at $((SECONDS - start)) s"
for round in 1 2; do
  for v in b d d5; do
    bin=.device/oxlm; [ $v = d ] || bin=.device/oxlm-$v
    for m in llama-7.2b llama-0.85b; do
      timeout 120 $bin bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
        --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 5 --batch 6 --batch 7 --batch 8 \
        --batch 16 --batch 64 | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    done
    echo "$v done at $((SECONDS - start)) s"
  done
done
OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 8 --batch 64 > "$OUT/trace-d.json"
echo "all done at $((SECONDS - start)) s"
