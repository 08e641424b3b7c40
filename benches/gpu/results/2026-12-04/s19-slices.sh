#!/usr/bin/env bash
# Session 19's sixth call: the sliced tensor-core products take a block per tile of 32 features,
# a warp per slice, whose sums meet in shared memory (no mma_reduce launch), with the output
# head through the one-wave GEMV (.device/oxlm, be10c00 and this), against a8c1b19
# (.device/oxlm-a). The GPU tests, then decode of the 0.85B and 7.2B llamas and Qwen2.5-0.5B's
# shape, 4-bit, 512-token prompts, 128 tokens, 1, 8, 16 and
# 64 sequences, two rounds alternated; a traced decode of the 7.2B at 8 sequences.
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
  timeout 150 .device/$1 bench --device cuda --model /tmp/models/$2 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 8 --batch 16 --batch 64 | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
    for b in oxlm-a oxlm; do run $b $m; done
  done
  echo "round $round at $((SECONDS - start)) s"
done
OXLM_TRACE=1 timeout 150 .device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 --prompt-tokens 512 \
  --gen-tokens 64 --repeats 1 --batch 8 > "$OUT/trace-llama-7.2b.json"
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(b["decode_tps"]) for b in r["batches"]])
for k, v in runs.items(): print(*k, v)
d = json.load(open(f"{sys.argv[1]}/trace-llama-7.2b.json"))
for b in [d] + d["batches"]:
    t = b.get("trace")
    if t: print(round(b["decode_tps"]), round(t["chain_us_but_last"]), [(k["kernel"], k["per_step"], round(k["chain_us"] / k["per_step"], 2)) for k in t["by_kernel"]])
PY
