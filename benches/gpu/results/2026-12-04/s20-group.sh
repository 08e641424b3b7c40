#!/usr/bin/env bash
# Session 20's fifth call: one sequence's decode attention through the batched kernel
# (attention_group: the first tile's rows staged in shared memory with cp.async before the
# wait, one query head a warp at one sequence), by a temporary switch OXLM_ATTN_BATCH1 in
# ops.rs kept on no branch, against attention_split as the fourth call left it; traced at one
# sequence, then decode at one sequence and after 2,048 tokens, two rounds alternated; 4-bit,
# 512-token prompts.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
  OXLM_ATTN_BATCH1=1 OXLM_TRACE=1 timeout 200 .device/oxlm bench --device cuda --model /tmp/models/$m \
    --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-$m.json" 2> "$OUT/trace-$m.err"
done
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/trace-*.json")):
    try: r = json.load(open(f))
    except Exception as e: print(f, e); continue
    t = r["trace"]
    print(f.split("/")[-1], round(r["decode_tps"]), "chain", round(t["chain_us_but_last"], 1))
    for k in t["first_positions"][1:4]:
        s = {a: round(b, 2) for a, b in k["stages"].items() if b is not None}
        print(f'  {k["kernel"]:22s} chain {k["chain_us"]:6.2f} lag {k["lag_us"]:5.2f}', s)
PY
run() { # switch, model
  env $1 timeout 200 .device/oxlm bench --device cuda --model /tmp/models/$2 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --depth 2048 \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
    for b in OXLM_ATTN_SPLIT=1 OXLM_ATTN_BATCH1=1; do run $b $m; done
  done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(d["decode_tps"]) for d in r["depths"]])
for k, v in runs.items(): print(*k, v)
PY
