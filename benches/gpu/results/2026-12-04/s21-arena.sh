#!/usr/bin/env bash
# Session 21's twelfth call: s21-final's GPU spans put the replayed part of a step at 16 to 64
# sequences well under its wall time: the step's temporaries outgrow the 256 MiB arena (the
# tensor-core products' partial sums above all), and the rest of the step is launched call by
# call. A temporary switch (OXLM_ARENA_MB) sizes the arena: 256 (main) against 4,096; 8 to 64
# sequences, 4-bit, 512-token prompts, two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
for round in 1 2; do
  for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
    for mb in 256 4096; do
      OXLM_ARENA_MB=$mb timeout 300 .device/oxlm bench --device cuda --model /tmp/models/$m \
        --prompt-tokens 512 --gen-tokens 128 --repeats 1 --batch 8 --batch 16 --batch 32 --batch 64 \
        | sed "s/^{/{\"build\":\"arena$mb\",/" >> "$OUT/ab.jsonl"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print(r["build"], r["model"].split("/")[-1], " ".join("%d: %.0f (wall %.0f, span %.0f, host %.0f)" % (b["sequences"], b["decode_tps"], b["sequences"] * 1e6 / b["decode_tps"], b["gpu_us_per_step"], b["host_us_per_step"]) for b in r["batches"]))
PY
