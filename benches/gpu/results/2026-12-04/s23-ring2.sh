#!/usr/bin/env bash
# Session 23's second call. The weight runs' pipeline in shared memory (RunRing, 4 stages) only
# in kernels of 2 to 8 activation rows of 4-bit weights (the `r` kernels), chosen by a
# temporary switch: OXLM_INT_RING_MIN, the least rows × cols that take them (unset: none). The
# GPU tests with every such product through the ring kernels, then with none; then main (a)
# against build d with none (d0), all (dall) and matrices of 16M weights and more (dbig),
# alternated: 1, 2 and 4 sequences after 512-token prompts, 4-bit; a second round of a and dbig.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/*.gz && chmod +x .device/oxlm-*
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for ring in 0 none; do
  for t in .device/tests/*; do
    echo "== $t ring min $ring"
    if [ $ring = none ]; then unset OXLM_INT_RING_MIN; else export OXLM_INT_RING_MIN=$ring; fi
    timeout 200 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
  done
done > "$OUT/tests.log" 2>&1
unset OXLM_INT_RING_MIN
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
run() { # label, binary, model, ring min
  if [ -n "$4" ]; then export OXLM_INT_RING_MIN=$4; else unset OXLM_INT_RING_MIN; fi
  timeout 100 .device/$2 bench --device cuda --model /tmp/models/$3 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 2>> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
  run a oxlm-a $m ""
  run d0 oxlm-d $m ""
  run dall oxlm-d $m 0
  run dbig oxlm-d $m 16000000
done
for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
  run a oxlm-a $m ""
  run dbig oxlm-d $m 16000000
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("%-5s %-15s 1 seq %5.0f tok/s (gpu span %6.1f us)" % (r["build"], r["model"].split("/")[-1],
        r["decode_tps"], r["decode_gpu_us_per_step"]),
        " ".join("%d seqs %5.0f (%6.1f)" % (b["sequences"], b["decode_tps"], b["gpu_us_per_step"]) for b in r["batches"]))
PY
