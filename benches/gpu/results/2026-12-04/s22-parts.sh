#!/usr/bin/env bash
# Session 22's second call. The GPU tests on oxlm-c's engine (the int16 GEMVs' warps a pair of
# rows chosen by the kernel's resident warps: four where a row has four tiles and the shares fit
# one wave). The floor of a step of one kernel per operation (s22-floor.py, which failed in the
# first call). Then main's build (oxlm) against oxlm-c, alternated, two rounds: 1, 2 and 4
# sequences after 512-token prompts, 4-bit.
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
timeout 200 python3 benches/gpu/results/2026-12-04/s22-floor.py .device/floor.cubin 2>&1 | tee "$OUT/floor.txt"
wait
run() { # label, binary, model
  timeout 150 .device/$2 bench --device cuda --model /tmp/models/$3 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 2> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
    run a oxlm $m
    run c oxlm-c $m
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
