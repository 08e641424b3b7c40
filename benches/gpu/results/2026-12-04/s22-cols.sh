#!/usr/bin/env bash
# Session 22's third call. The GPU tests on oxlm-e's engine (2-4 activation rows whose whole
# rows do not fit a block, four of the 7.2B's 14,336-wide down projection, go through the int16
# GEMV in slices of columns, `qgemv_columns`, instead of the tensor cores' one-tile product).
# Then main's build (oxlm-c, ba33377) against oxlm-e, alternated, two rounds: the 7.2B at 1-4
# sequences, and the 0.85B and Qwen2.5-0.5B's shape at 4 (whose products the change leaves
# alone), 4-bit, 512-token prompts.
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
wait
run() { # label, binary, model, batches...
  local label=$1 b=$2 m=$3; shift 3
  timeout 200 .device/$b bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 "$@" 2> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$label\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  run c oxlm-c llama-7.2b-4 --batch 2 --batch 3 --batch 4
  run e oxlm-e llama-7.2b-4 --batch 2 --batch 3 --batch 4
done
for m in llama-0.85b-4 qwen2.5-0.5b-4; do
  run c oxlm-c $m --batch 4
  run e oxlm-e $m --batch 4
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("%-3s %-15s 1 seq %5.0f tok/s (gpu span %6.1f us)" % (r["build"], r["model"].split("/")[-1],
        r["decode_tps"], r["decode_gpu_us_per_step"]),
        " ".join("%d seqs %5.0f (span %.0f)" % (b["sequences"], b["decode_tps"], b["gpu_us_per_step"]) for b in r["batches"]))
PY
