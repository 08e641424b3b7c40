#!/usr/bin/env bash
# Session 24's fourth call: a one-row GEMV whose weights come through bulk copies into a ring of
# shared-memory stages (qgemv_bulk, the copy engine streaming as s24-flow's chains did), chosen
# here by a temporary switch, OXLM_BULK_MIN_WEIGHTS (the least weights of a matrix that takes
# it; unset: never, main's path). GPU tests with it on every matrix it can take (0) and from
# 2^24 weights; cuda_gemv without and with it; then decode at one sequence, alternated, two
# rounds: off, every matrix (0), from 2^24 weights.
# (The build is branch gpu-bulk-gemv's kernel and switch before its two-runs-a-turn loop.)
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm.gz; chmod +x .device/oxlm
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for min in 0 16777216; do
  for t in .device/tests/*; do
    echo "== $t OXLM_BULK_MIN_WEIGHTS=$min"
    OXLM_BULK_MIN_WEIGHTS=$min timeout 300 "$t" --test-threads=1 --skip kernels_compile 2>&1; echo "rc $?"
  done
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
echo "== cuda_gemv, main's path"; timeout 120 .device/cuda_gemv 2>&1 | tee "$OUT/gemv-off.txt"
echo "== cuda_gemv, bulk copies"; OXLM_BULK_MIN_WEIGHTS=0 timeout 120 .device/cuda_gemv 2>&1 | tee "$OUT/gemv-bulk.txt"
wait
run() { # label, min weights (empty: unset), model
  env ${2:+OXLM_BULK_MIN_WEIGHTS=$2} timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$3 \
    --prompt-tokens 512 --gen-tokens 128 --repeats 1 2>> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
    run off "" $m
    run all 0 $m
    run big 16777216 $m
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("%-4s %-15s 1 seq %5.0f tok/s (gpu span %6.1f us)" % (r["build"], r["model"].split("/")[-1],
        r["decode_tps"], r["decode_gpu_us_per_step"]))
PY
