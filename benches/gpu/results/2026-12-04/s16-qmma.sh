#!/usr/bin/env bash
# Session 16's second run: the tensor-core products from packed weights (qmma) rewritten so that
# a lane loads a whole run of 32 weights a feature (16 bytes, 4 runs a warp's turn) and the
# activations come in the order the warp loads them (512 contiguous bytes a load), where each
# lane loaded 4-byte words (8 rows of 8 bytes a warp's load). A: the landed build (bb534f6);
# B: the new kernels, the landed rule (tensor cores past 8 rows, or from 2 where the int16
# activations do not fit a block); C: the new kernels from 2 rows everywhere. The GPU tests on
# B first; then batched decode on the 7.2B and 0.85B llamas (4-bit), A/B/C alternated twice;
# then traced steps of B at 8 and 64 sequences of the 7.2B.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm-a.gz .device/oxlm-c.gz 2>/dev/null
chmod +x .device/oxlm-a .device/oxlm-c
benches/gpu/device.sh tests
echo "tests done at $((SECONDS - start)) s"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 --hidden 4096 --intermediate 14336 \
  --layers 32 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 --hidden 2048 --intermediate 5632 \
  --layers 16 --heads 32 --kv-heads 8 --vocab 32000 --bits 4 >&2
echo "models at $((SECONDS - start)) s"
for round in 1 2; do
  for v in a b c; do
    bin=.device/oxlm; [ $v = b ] || bin=.device/oxlm-$v
    timeout 100 $bin bench --device cuda --model /tmp/models/llama-7.2b-4 --prompt-tokens 512 \
      --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 64 \
      | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    timeout 100 $bin bench --device cuda --model /tmp/models/llama-0.85b-4 --prompt-tokens 512 \
      --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 64 \
      | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    echo "$v done at $((SECONDS - start)) s"
  done
done
OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 8 --batch 64 > "$OUT/trace-b.json"
echo "all done at $((SECONDS - start)) s"
