#!/usr/bin/env bash
# Session 19's third call: the one-row GEMV in three stages where each lane has three runs to
# load (.device/oxlm) against main before it (.device/oxlm-a). The GPU tests, then decode of the
# 0.85B (4 and 8 bits), Qwen2.5-0.5B's shape and the 7.2B (4 bits), 512-token prompts (the 0.85B
# also 2048), 128 tokens, two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
(benches/gpu/device.sh models; python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-8 --hidden 2048 \
  --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000 --bits 8) > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
echo "tests and models at $((SECONDS - start)) s"
run() { # binary, model, prompt
  timeout 100 .device/$1 bench --device cuda --model /tmp/models/$2 --prompt-tokens $3 \
    --gen-tokens 128 --repeats 1 | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 llama-0.85b-8 qwen2.5-0.5b-4 llama-7.2b-4; do
    for b in oxlm-a oxlm; do run $b $m 512; done
  done
  for b in oxlm-a oxlm; do run $b llama-0.85b-4 2048; done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["prompt_tokens"], r["build"])].append(round(r["decode_tps"]))
for k, v in runs.items(): print(*k, v)
PY
