#!/usr/bin/env bash
# Session 19's review call: each kernel's most threads a block found once, when it is loaded,
# rather than asked of the driver at every tensor-core product (same launches). The GPU tests,
# then the 0.85B and 7.2B llamas (4-bit, 512-token prompts, 128 tokens) at 1, 4 and 8 sequences.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
ONLY=llama-7.2b benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
ONLY=llama-0.85b benches/gpu/device.sh models >> "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
for m in llama-0.85b-4 llama-7.2b-4; do
  timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 4 --batch 8 >> "$OUT/bench.jsonl"
done
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["model"].split("/")[-1], round(r["decode_tps"]), [round(b["decode_tps"]) for b in r["batches"]])
PY
