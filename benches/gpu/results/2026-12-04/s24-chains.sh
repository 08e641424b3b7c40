#!/usr/bin/env bash
# Session 24's sixth call. Build c: every int16 GEMV's run of 16 dp2a summed in four chains of
# four (exact: integer sums) rather than one chain of 16, and the bulk-copy GEMV (still behind
# the temporary switch OXLM_BULK_MIN_WEIGHTS) taking two runs a turn. GPU tests on c with the
# bulk GEMV off and on every matrix it can take; cuda_gemv b (the chain of 16) against c; then
# main (c0efd31) against c, alternated, two rounds: 1, 2 and 4 sequences after 512-token prompts.
# (Build c is branch gpu-bulk-gemv, 0aca926. The test binaries were not carried, so the tests
# did not run.)
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm-*.gz; chmod +x .device/oxlm-* .device/cuda_gemv-*
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for min in "" 0; do
  for t in .device/tests/*; do
    echo "== $t OXLM_BULK_MIN_WEIGHTS=$min"
    env ${min:+OXLM_BULK_MIN_WEIGHTS=$min} timeout 300 "$t" --test-threads=1 --skip kernels_compile 2>&1; echo "rc $?"
  done
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*|DEBUG.*bad)" "$OUT/tests.log"
for b in b c; do
  echo "== cuda_gemv $b"; timeout 100 .device/cuda_gemv-$b 2048x2048 5632x2048 2048x5632 32000x2048 14336x4096 4096x14336 128256x4096 2>&1 | tee "$OUT/gemv-$b.txt"
done
echo "== cuda_gemv c, bulk"; OXLM_BULK_MIN_WEIGHTS=0 timeout 100 .device/cuda_gemv-c 14336x4096 4096x14336 128256x4096 2>&1 | tee "$OUT/gemv-c-bulk.txt"
wait
run() { # label, binary, model
  timeout 100 .device/oxlm-$2 bench --device cuda --model /tmp/models/$3 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 2>> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
    run a main $m
    run c c $m
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("%-3s %-15s 1 seq %5.0f tok/s (gpu span %6.1f us)" % (r["build"], r["model"].split("/")[-1],
        r["decode_tps"], r["decode_gpu_us_per_step"]),
        " ".join("%d seqs %5.0f" % (b["sequences"], b["decode_tps"]) for b in r["batches"]))
PY
