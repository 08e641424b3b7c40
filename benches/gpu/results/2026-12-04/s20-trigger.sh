#!/usr/bin/env bash
# Session 20's ninth call: one sequence's attention lets the next kernel (the o projection)
# start only when it ends (branch gpu-attention-late-trigger, .device/oxlm) rather than once its
# inputs are ready (gpu-merge-trace, .device/oxlm-a), so that the projection's early weight
# loads do not crowd the merge's loads. Both traced (with the merge's marks); decode at one
# sequence under the trace and after 2,048 tokens, two rounds alternated; 4-bit, 512-token
# prompts.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
for round in 1 2; do
  for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
    for b in oxlm-a oxlm; do
      OXLM_TRACE=1 timeout 200 .device/$b bench --device cuda --model /tmp/models/$m \
        --prompt-tokens 512 --gen-tokens 64 --repeats 1 --depth 2048 \
        > "$OUT/trace-$b-$m-$round.json" 2> "$OUT/trace-$b-$m-$round.err"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/trace-*.json")):
    try: r = json.load(open(f))
    except Exception as e: print(f, e); continue
    t = r["trace"]
    print(f.split("/")[-1], round(r["decode_tps"]), [round(d["decode_tps"]) for d in r["depths"]], "chain", round(t["chain_us_but_last"], 1))
    if f.endswith("-1.json"):
        for k in t["first_positions"][2:4]:
            s = {a: round(b, 2) for a, b in k["stages"].items() if b is not None}
            print(f'  {k["kernel"]:22s} chain {k["chain_us"]:6.2f} lag {k["lag_us"]:5.2f}', s)
PY
