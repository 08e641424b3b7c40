#!/usr/bin/env bash
# Session 21's first call: the one-wave GEMVs (qgemv_int, qglu_int) fill an SM's registers, so
# that the next kernel's blocks cannot start (and load their first weights) until they leave.
# A temporary switch caps their blocks an SM (OXLM_WAVE_CAP_GLU for the gated MLP,
# OXLM_WAVE_CAP_GEMV for the others); decode at 1 and 4 sequences, two rounds alternated,
# 4-bit, 512-token prompts; then traced decodes of the 0.85B without and with a cap.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
echo "models at $((SECONDS - start)) s"
run() { # label, model, env...
  local label=$1 model=$2; shift 2
  env "$@" timeout 120 .device/oxlm bench --device cuda --model /tmp/models/$model \
    --prompt-tokens 512 --gen-tokens 128 --repeats 1 --batch 4 \
    | sed "s/^{/{\"build\":\"$label\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4; do
    run none $m
    run glu3 $m OXLM_WAVE_CAP_GLU=3
    run glu2 $m OXLM_WAVE_CAP_GLU=2
    run both2 $m OXLM_WAVE_CAP_GLU=2 OXLM_WAVE_CAP_GEMV=2
    run both1 $m OXLM_WAVE_CAP_GLU=1 OXLM_WAVE_CAP_GEMV=1
  done
  m=llama-7.2b-4
  run none $m
  run glu1 $m OXLM_WAVE_CAP_GLU=1
  run both1 $m OXLM_WAVE_CAP_GLU=1 OXLM_WAVE_CAP_GEMV=1
  echo "round $round at $((SECONDS - start)) s"
done
for c in none glu2; do
  e=(); [ $c = glu2 ] && e=(OXLM_WAVE_CAP_GLU=2)
  env "${e[@]}" OXLM_TRACE=1 timeout 120 .device/oxlm bench --device cuda --model /tmp/models/llama-0.85b-4 \
    --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-$c.json" 2> "$OUT/trace-$c.err"
done
echo "traces at $((SECONDS - start)) s"
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(b["decode_tps"]) for b in r["batches"]])
for k, v in runs.items(): print(*k, v)
PY
