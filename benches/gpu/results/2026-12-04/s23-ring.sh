#!/usr/bin/env bash
# Session 23's first call. The int16-activation GEMVs' weight runs through a pipeline in shared
# memory (cp.async, RunRing) instead of two stages in registers: 4 stages for 4-bit runs, 2 for
# 8-bit (build b), 6 and 3 (build c, the GEMVs alone). The GPU tests on b; the GEMVs alone
# (cuda_gemv) for main (a), b and c; then main against b, alternated, one round: 1, 2 and 4
# sequences after 512-token prompts, 4-bit.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/*.gz && chmod +x .device/oxlm-* .device/gemv-*
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 200 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
for v in a b; do
  echo "== gemv $v"
  timeout 100 .device/gemv-$v 5632x2048 2048x5632 14336x4096 4096x14336 28672x8192 128256x4096 2>&1
done | tee "$OUT/gemv.txt"
wait
run() { # label, binary, model
  timeout 100 .device/$2 bench --device cuda --model /tmp/models/$3 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 2> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
  run a oxlm-a $m
  run b oxlm-b $m
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("%-3s %-15s 1 seq %5.0f tok/s (gpu span %6.1f us)" % (r["build"], r["model"].split("/")[-1],
        r["decode_tps"], r["decode_gpu_us_per_step"]),
        " ".join("%d seqs %5.0f" % (b["sequences"], b["decode_tps"]) for b in r["batches"]))
PY
echo "== gemv c"
timeout 80 .device/gemv-c 14336x4096 4096x14336 28672x8192 128256x4096 2>&1 | tee -a "$OUT/gemv.txt"
