#!/usr/bin/env bash
# Session 18's second call: where decode_block's time goes (s18-block: 42 us a layer on the
# 0.85B, 39 on Qwen2.5-0.5B's shape, against 28 and 23 for the five kernels). Temporary
# variants, OXLM_DECODE_BLOCK: 0 the five kernels, 1 decode_block (barrier by fences and
# atomics), r the barrier by release and acquire operations, n no barrier at all (wrong
# results: only how long the phases take without waiting for each other). The GPU tests with
# 1 and with r, then two rounds of decode (4-bit, 512-token prompt, 128 tokens).
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models
echo "models at $((SECONDS - start)) s"
for v in 1 r; do
  for t in .device/tests/*; do
    echo "== OXLM_DECODE_BLOCK=$v $t"
    OXLM_DECODE_BLOCK=$v timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
  done
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
echo "tests at $((SECONDS - start)) s"
run() { # variant, model
  OXLM_DECODE_BLOCK=$1 timeout 60 .device/oxlm bench --device cuda --model /tmp/models/$2-4 \
    --prompt-tokens 512 --gen-tokens 128 --repeats 1 | sed "s/^{/{\"variant\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b qwen2.5-0.5b; do
    for v in 0 1 r n; do run $v $m; done
  done
  for v in 0 r; do run $v llama-7.2b; done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["variant"], r["model"].split("/")[-1], round(r["decode_tps"], 1))
PY
