#!/usr/bin/env bash
# Session 19's ninth call: one sequence's decode attention over an f16 ring of head dim 128
# with each lane's four features adjacent, all 32 rows' values loaded with the keys
# (.device/oxlm), against main (.device/oxlm-a). The GPU tests, then decode of the 7.2B llama
# (head dim 128) after 512- and 2048-token prompts and of the 0.85B (64, unchanged), 4-bit, 128
# tokens, two rounds alternated; a traced 7.2B decode.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
ONLY=llama-7.2b benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
ONLY=llama-0.85b benches/gpu/device.sh models >> "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
echo "tests and models at $((SECONDS - start)) s"
for round in 1 2; do
  for mp in "llama-7.2b-4 512" "llama-7.2b-4 2048" "llama-0.85b-4 512"; do
    set -- $mp
    for b in oxlm-a oxlm; do
      timeout 100 .device/$b bench --device cuda --model /tmp/models/$1 --prompt-tokens $2 \
        --gen-tokens 128 --repeats 1 | sed "s/^{/{\"build\":\"$b\",/" >> "$OUT/ab.jsonl"
    done
  done
  echo "round $round at $((SECONDS - start)) s"
done
OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 \
  --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-llama-7.2b.json"
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["prompt_tokens"], r["build"])].append(round(r["decode_tps"]))
for k, v in runs.items(): print(*k, v)
t = json.load(open(f"{sys.argv[1]}/trace-llama-7.2b.json"))["trace"]
print(round(t["chain_us_but_last"]), [(k["kernel"], k["per_step"], round(k["chain_us"] / k["per_step"], 2)) for k in t["by_kernel"]])
PY
