#!/usr/bin/env bash
# Session 20's review call: the traced decode after the trace's globals are read through one
# helper (take_global) and the stages kept as NaN where unmarked; main's kernels, traced at one
# sequence on the 0.85B and 7.2B llamas, 4-bit, 512-token prompts, then an untraced run.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
ONLY=llama-0.85b benches/gpu/device.sh models > "$OUT/models.log" 2>&1
ONLY=llama-7.2b benches/gpu/device.sh models >> "$OUT/models.log" 2>&1
for m in llama-0.85b-4 llama-7.2b-4; do
  OXLM_TRACE=1 timeout 200 .device/oxlm bench --device cuda --model /tmp/models/$m \
    --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-$m.json" 2> "$OUT/trace-$m.err"
  timeout 200 .device/oxlm bench --device cuda --model /tmp/models/$m \
    --prompt-tokens 512 --gen-tokens 128 --repeats 1 > "$OUT/bench-$m.json" 2> "$OUT/bench-$m.err"
done
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    r = json.load(open(f))
    print(f.split("/")[-1], round(r["decode_tps"]))
    if r.get("trace"):
        t = r["trace"]
        print("  steps", t["steps"], "chain", round(t["chain_us_but_last"], 1))
        for k in t["first_positions"][1:6]:
            s = {a: round(b, 2) for a, b in k["stages"].items() if b is not None}
            print(f'  {k["kernel"]:22s} chain {k["chain_us"]:6.2f}', s)
PY
