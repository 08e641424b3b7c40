#!/usr/bin/env bash
# Session 19's fourth call: an output head (one matrix, the final norm) through the one-wave
# int16 GEMV instead of qgemv3's block per 16 or 32 rows (.device/oxlm against main,
# .device/oxlm-a). The GPU tests, then decode of the 0.85B (4 and 8 bits), Qwen2.5-0.5B's
# shape and the 7.2B (4 bits), 512-token prompts, 128 tokens, 1, 4 and 8 sequences, two rounds
# alternated; a traced decode of the 0.85B and Qwen's shape with the new build.
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
run() { # binary, model
  timeout 100 .device/$1 bench --device cuda --model /tmp/models/$2 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 4 --batch 8 | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 llama-0.85b-8 qwen2.5-0.5b-4 llama-7.2b-4; do
    for b in oxlm-a oxlm; do run $b $m; done
  done
  echo "round $round at $((SECONDS - start)) s"
done
for m in llama-0.85b-4 qwen2.5-0.5b-4; do
  OXLM_TRACE=1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
    --gen-tokens 64 --repeats 1 > "$OUT/trace-$m.json"
done
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(b["decode_tps"]) for b in r["batches"]])
for k, v in runs.items(): print(*k, v)
for m in ["llama-0.85b-4", "qwen2.5-0.5b-4"]:
    t = json.load(open(f"{sys.argv[1]}/trace-{m}.json"))["trace"]
    print(m, round(t["chain_us_but_last"]), [(k["kernel"], k["per_step"], round(k["chain_us"] / k["per_step"], 2)) for k in t["by_kernel"]])
PY
