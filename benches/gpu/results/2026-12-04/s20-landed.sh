#!/usr/bin/env bash
# Session 20's seventh and last call: the landed build (.device/oxlm): the GEMV's early residual read and
# one sequence's attention loading key rows across the warp (s20-final-tile.sh measured its
# first tile's rows loaded before the wait too, not kept). The GPU tests; then decode
# against 5836a3e, the session's start
# (.device/oxlm-a): 1 to 64 sequences and one after 2,048 tokens, two rounds alternated; 4-bit,
# 512-token prompts, 128 tokens.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
echo "tests and models at $((SECONDS - start)) s"
run() { # binary, model
  timeout 300 .device/$1 bench --device cuda --model /tmp/models/$2 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 \
    --batch 64 --depth 2048 | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
    for b in oxlm-a oxlm; do run $b $m; done
  done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(b["decode_tps"]) for b in r["batches"]] + [round(d["decode_tps"]) for d in r["depths"]])
for k, v in runs.items(): print(*k, v)
PY
