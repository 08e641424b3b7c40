#!/usr/bin/env bash
# Session 23's third call. Build e: the ring kernels (weight runs through a 4-stage pipeline in
# shared memory) for 2-4 rows of 4-bit matrices of 2^24 weights and more, registers elsewhere.
# The GPU tests on e (cuda_ops with a 4,200×4,032 matrix that takes the ring kernels); then main
# (a, ff4c864, its kernels ec1a911d…) against e, alternated, two rounds: 1, 2 and 4 sequences
# after 512-token prompts, 4-bit.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/*.gz && chmod +x .device/oxlm-*
ls .device/cache/cuda
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 200 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
run() { # label, binary, model
  timeout 60 .device/$2 bench --device cuda --model /tmp/models/$3 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 2>> "$OUT/bench-$1.err" \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-7.2b-4 llama-0.85b-4 qwen2.5-0.5b-4; do
    run a oxlm-a $m
    run e oxlm-e $m
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("%-3s %-15s 1 seq %5.0f tok/s (gpu span %6.1f us)" % (r["build"], r["model"].split("/")[-1],
        r["decode_tps"], r["decode_gpu_us_per_step"]),
        " ".join("%d seqs %5.0f (%6.1f)" % (b["sequences"], b["decode_tps"], b["gpu_us_per_step"]) for b in r["batches"]))
PY
