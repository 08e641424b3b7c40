#!/usr/bin/env bash
# Session 18's sixth call: the int16-activation GEMVs for 2 and for 3-4 activation rows in
# kernels of their own width (qgemv_int2_*, qgemv_int4_*, and the qgemv3 and qglu ones), which
# hold fewer sums a lane than the 8-row kernel that took them (s18-final: the 7.2B at 2 and 4
# sequences under llama.cpp). The GPU tests on that build (b), then it and the landed build
# (a, 83dc5a6) alternated, two rounds, on the three models at 2 and 4 sequences (4-bit,
# 512-token prompts, 128 tokens).
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
run() { # binary, tag, model
  timeout 100 $1 bench --device cuda --model /tmp/models/$3-4 --prompt-tokens 512 --gen-tokens 128 \
    --repeats 1 --batch 2 --batch 4 | sed "s/^{/{\"build\":\"$2\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do
    run .device/oxlm-a a $m
    run .device/oxlm b $m
  done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["build"], r["model"].split("/")[-1], round(r["decode_tps"]),
          [round(b["decode_tps"]) for b in r["batches"]])
PY
