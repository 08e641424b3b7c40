#!/usr/bin/env bash
# Session 19's eighth call: the warps an SM the one-tile tensor-core products aim for, now that a
# tile's slices are one block's warps (temporary switch OXLM_ONE_TILE_WARPS: 16 as landed, 24,
# 32). Decode of the 7.2B and 0.85B llamas and Qwen2.5-0.5B's shape, 4-bit, 512-token prompts,
# 128 tokens, 4, 6 and 8 sequences, two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
echo "models at $((SECONDS - start)) s"
for round in 1 2; do
  for m in llama-7.2b-4 llama-0.85b-4 qwen2.5-0.5b-4; do
    for v in 16 24 32; do
      OXLM_ONE_TILE_WARPS=$v timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m \
        --prompt-tokens 512 --gen-tokens 128 --repeats 1 --batch 4 --batch 6 --batch 8 \
        | sed "s/^{/{\"warps\":\"$v\",/" >> "$OUT/ab.jsonl"
    done
  done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["warps"])].append([round(b["decode_tps"]) for b in r["batches"]])
for k, v in runs.items(): print(*k, v)
PY
