#!/usr/bin/env bash
# Session 19's first call: one sequence's decode attention in thread-block clusters (splits
# merged through shared memory and one cluster barrier) against attention_split (temporary
# switch OXLM_SPLIT_ATTENTION). The GPU tests with the clusters, then 1 sequence of the three
# models under each (4-bit, 512-token prompts, 128 tokens; the 0.85B also after 2048), two
# rounds alternated, a traced decode of two models with the clusters, and the GEMVs alone.
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
run() { # variant (split or cluster), model, prompt
  if [ $1 = split ]; then export OXLM_SPLIT_ATTENTION=1; else unset OXLM_SPLIT_ATTENTION; fi
  timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$2-4 --prompt-tokens $3 \
    --gen-tokens 128 --repeats 1 | sed "s/^{/{\"variant\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do
    for v in split cluster; do run $v $m 512; done
  done
  for v in split cluster; do run $v llama-0.85b 2048; done
  echo "round $round at $((SECONDS - start)) s"
done
unset OXLM_SPLIT_ATTENTION
for m in llama-0.85b llama-7.2b; do
  OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 64 --repeats 1 > "$OUT/trace-$m.json"
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print(r["variant"], r["model"].split("/")[-1], r["prompt_tokens"], round(r["decode_tps"]))
for m in ["llama-0.85b", "llama-7.2b"]:
    t = json.load(open(f"{sys.argv[1]}/trace-{m}.json"))["trace"]
    print(m, round(t["chain_us_but_last"]), [(k["kernel"], k["per_step"], round(k["chain_us"] / k["per_step"], 2)) for k in t["by_kernel"]])
PY
timeout 120 .device/cuda_gemv > "$OUT/gemv.txt" 2>&1; tail -30 "$OUT/gemv.txt"
