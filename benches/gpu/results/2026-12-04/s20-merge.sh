#!/usr/bin/env bash
# Session 20's eighth call: where one sequence's attention merge spends its time. The traced
# build of main with two more marks in combine_splits (branch gpu-merge-trace): its maxima and
# sums loaded and reduced, and its outputs summed. Traced decode at one sequence, 4-bit,
# 512-token prompts; the attention's stages of the first layer.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
  OXLM_TRACE=1 timeout 200 .device/oxlm bench --device cuda --model /tmp/models/$m \
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
