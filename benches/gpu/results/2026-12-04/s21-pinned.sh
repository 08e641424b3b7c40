#!/usr/bin/env bash
# Session 21's fifth call (the fourth, .device/oxlm with a temporary print of each step's host times, is not kept): downloads through pinned host memory (.device/oxlm-p) against
# pageable (.device/oxlm), both with a temporary print of each step's host times
# (OXLM_STEP_TIMES: run() to the first graph launch, the download's wait) and the GPU span;
# one sequence and 8, 4-bit, 512-token prompts, two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
    for b in oxlm oxlm-p; do
      OXLM_STEP_TIMES=1 timeout 120 .device/$b bench --device cuda --model /tmp/models/$m \
        --prompt-tokens 512 --gen-tokens 128 --repeats 2 --batch 8 2> "$OUT/times-$b-$m-$round.err" \
        | sed "s/^{/{\"build\":\"$b\",/" >> "$OUT/ab.jsonl"
      echo "$b $m: $(grep STEP_TIMES "$OUT/times-$b-$m-$round.err" | tail -1)"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    b = r["batches"][0]
    print(r["build"], r["model"].split("/")[-1], "1 seq %.0f tok/s (wall %.1f us, gpu span %.1f)" % (
        r["decode_tps"], 1e6 / r["decode_tps"], r["decode_gpu_us_per_step"]),
        "8 seqs %.0f (wall %.1f, span %.1f)" % (b["decode_tps"], 8e6 / b["decode_tps"], b["gpu_us_per_step"]))
PY
