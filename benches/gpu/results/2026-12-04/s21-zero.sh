#!/usr/bin/env bash
# Session 21's sixth call: greedy picks written by their kernel straight into mapped pinned
# host memory (.device/oxlm-z) against downloads through pinned memory (.device/oxlm-p); the
# GPU tests on oxlm-z's engine; then a temporary switch for the size of a step's first graph
# (OXLM_FIRST_SEGMENT: 8 calls, then twice as many...). One sequence and 8, 4-bit, 512-token
# prompts, two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
run() { # label, binary, model, env...
  local label=$1 b=$2 m=$3; shift 3
  env "$@" OXLM_STEP_TIMES=1 timeout 120 .device/$b bench --device cuda --model /tmp/models/$m \
    --prompt-tokens 512 --gen-tokens 128 --repeats 2 --batch 8 2> "$OUT/times.err" \
    | sed "s/^{/{\"build\":\"$label\",/" >> "$OUT/ab.jsonl"
  echo "$label $m: $(grep STEP_TIMES "$OUT/times.err" | tail -1)"
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
    run p oxlm-p $m
    run z oxlm-z $m
  done
  for m in llama-0.85b-4 qwen2.5-0.5b-4; do
    run z-first2 oxlm-z $m OXLM_FIRST_SEGMENT=2
    run z-first4 oxlm-z $m OXLM_FIRST_SEGMENT=4
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
