#!/usr/bin/env bash
# Session 20's second call (the first recorded events in one list, whose atomics slowed the kernels): where a batch-1 decode step's kernels spend their time, block by
# block. The traced build (OXLM_TRACE) now records every block's inputs ready and, for the
# int16 GEMVs and one sequence's attention, the activations rounded, keys summed and each
# warp's end (`trace_stage` in kernels.cu); `oxlm bench` reports per kernel, from its first block
# ready: its last block ready, those stages, its end, and its end to the next launch's first
# block ready. 0.85B and 7.2B llamas and Qwen2.5-0.5B's shape, 4-bit, 512-token prompts.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
echo "models at $((SECONDS - start)) s"
for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
  OXLM_TRACE=1 timeout 200 .device/oxlm bench --device cuda --model /tmp/models/$m \
    --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-$m.json" 2> "$OUT/trace-$m.err"
  echo "$m rc $? at $((SECONDS - start)) s"
done
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/trace-*.json")):
    try: r = json.load(open(f))
    except Exception as e: print(f, e); continue
    t = r["trace"]
    print(f.split("/")[-1], round(r["decode_tps"]), "chain", round(t["chain_us_but_last"], 1))
    for k in t["by_kernel"]:
        s = k["mean_stages"]
        print(f'  {k["kernel"]:28s} x{k["per_step"]:3d} chain/launch {k["chain_us"]/k["per_step"]:6.2f}',
              {a: (round(b, 2) if b is not None else None) for a, b in s.items()})
    for k in t["first_positions"][1:7]:
        s = k["stages"]
        print(f'  first {k["kernel"]:22s} chain {k["chain_us"]:6.2f} lag {k["lag_us"]:5.2f}',
              {a: (round(b, 2) if b is not None else None) for a, b in s.items()})
PY
