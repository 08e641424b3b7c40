#!/usr/bin/env bash
# Session 22's first call. The GPU tests on oxlm-b's engine (one sequence's attention at d = 128
# loading a tile's other value rows right after its keys are summed; a temporary switch,
# OXLM_INT_PARTS, for how many warps share a pair of rows in the int16 GEMVs of few rows). Then
# the floor of a step of one kernel per operation (s22-floor.py), and main's build (oxlm)
# against oxlm-b and oxlm-b with 4 warps a pair, alternated, two rounds: one sequence after
# 512-token prompts and after 2,048 tokens, 4-bit.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
python3 benches/gpu/results/2026-12-04/s22-floor.py .device/floor.cubin 2>&1 | tee "$OUT/floor.txt"
wait
run() { # label, binary, model, env...
  local label=$1 b=$2 m=$3; shift 3
  env "$@" timeout 150 .device/$b bench --device cuda --model /tmp/models/$m \
    --prompt-tokens 512 --gen-tokens 128 --repeats 1 --depth 2048 2> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$label\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
    run a oxlm $m
    run b oxlm-b $m
    run b-parts4 oxlm-b $m OXLM_INT_PARTS=4
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("%-9s %-15s 1 seq %5.0f tok/s (wall %6.1f us, gpu span %6.1f), after 2,048: %5.0f" % (
        r["build"], r["model"].split("/")[-1], r["decode_tps"], 1e6 / r["decode_tps"],
        r["decode_gpu_us_per_step"], r["depths"][0]["decode_tps"]))
PY
