#!/usr/bin/env bash
# Session 19's last call: the one-tile tensor-core products with their slices as one block's
# warps (sums meeting in shared memory; more tiles keep one-warp blocks and mma_reduce), with
# the output head through the one-wave GEMV (.device/oxlm), against a8c1b19, the session's
# start (.device/oxlm-a). The GPU tests, then decode of the 0.85B and 7.2B llamas and
# Qwen2.5-0.5B's shape, 4-bit, 512-token prompts, 128 tokens, 1 to 64 sequences, two rounds
# alternated.
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
  timeout 200 .device/$1 bench --device cuda --model /tmp/models/$2 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
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
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(b["decode_tps"]) for b in r["batches"]])
for k, v in runs.items(): print(*k, v)
PY
