#!/usr/bin/env bash
# Session 18's seventh call: the int16-activation GEMVs allowed shared memory past 48 KiB
# (temporary switch OXLM_INT_ACTS_KIB, the most their activations and arrays may take: 48 as
# before, 100, 200), so that 2-4 rows of a wide down projection (the 7.2B's 14,336, the 0.85B's
# 5,632 at 4 rows, Qwen2.5's 4,864 at 4) take them instead of the tensor cores. The GPU tests at
# 48 and 200, then 2 and 4 sequences of the three models under each (4-bit, 512-token
# prompts, 128 tokens), two rounds.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models
for v in 48 200; do
  for t in .device/tests/*; do
    echo "== OXLM_INT_ACTS_KIB=$v $t"
    OXLM_INT_ACTS_KIB=$v timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
  done
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
echo "tests at $((SECONDS - start)) s"
run() { # limit, model
  OXLM_INT_ACTS_KIB=$1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$2-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 | sed "s/^{/{\"kib\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do
    for v in 48 100 200; do run $v $m; done
  done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["kib"], r["model"].split("/")[-1], round(r["decode_tps"]), [round(b["decode_tps"]) for b in r["batches"]])
PY
