#!/usr/bin/env bash
# Session 18's last call, on the landed build (4b38380): the GPU tests, then batched decode of
# the three models at 1 to 64 sequences (4-bit, 512-token prompts, 128 tokens each).
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
echo "tests at $((SECONDS - start)) s"
for m in llama-0.85b llama-7.2b qwen2.5-0.5b; do
  timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    >> "$OUT/batch.jsonl"
  echo "$m at $((SECONDS - start)) s"
done
python3 - "$OUT/batch.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["model"].split("/")[-1], round(r["decode_tps"]), [round(b["decode_tps"]) for b in r["batches"]])
PY
