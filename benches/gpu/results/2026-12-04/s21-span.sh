#!/usr/bin/env bash
# Session 21's third call: each replayed decode step's GPU span (its first graph's launch to
# its last replayed call's end, from stream events) beside its wall time, to see how long the
# GPU waits between steps; 4-bit, 512-token prompts, 1 to 8 sequences; the wave caps off.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
  timeout 120 .device/oxlm bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
    --gen-tokens 128 --repeats 3 --batch 2 --batch 8 >> "$OUT/span.jsonl"
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/span.jsonl"):
    r = json.loads(l)
    print(r["model"].split("/")[-1], "1 seq: %.0f tok/s, wall %.1f us, gpu span %.1f, host walk %.1f" % (
        r["decode_tps"], 1e6 / r["decode_tps"], r["decode_gpu_us_per_step"], r["decode_host_us_per_step"]))
    for b in r["batches"]:
        print("   %d seqs: wall %.1f us, gpu span %.1f, host walk %.1f" % (b["sequences"], 1e6 * b["sequences"] / b["decode_tps"], b["gpu_us_per_step"], b["host_us_per_step"]))
PY
