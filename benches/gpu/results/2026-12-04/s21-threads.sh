#!/usr/bin/env bash
# Session 21's eighth call: each block of an int16-activation GEMV reads the whole activation
# row from L2 (s21-rows: copying it in all at once was slower, so the rounding waits on L2's
# bandwidth, not its latency). Fewer, larger blocks read it fewer times: a temporary switch
# sets the threads of a block by row length (OXLM_INT_THREADS_2K for rows under 4,096,
# _4K under 8,192, _8K past; 256, 512, 512 on main). One sequence, 4-bit, 512-token prompts,
# two rounds alternated; then traced decodes of the 7.2B.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1
run() { # label, model, env...
  local label=$1 m=$2; shift 2
  env "$@" timeout 120 .device/oxlm bench --device cuda --model /tmp/models/$m \
    --prompt-tokens 512 --gen-tokens 128 --repeats 2 --depth 2048 \
    | sed "s/^{/{\"build\":\"$label\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  m=llama-7.2b-4
  run main $m
  run 8k1024 $m OXLM_INT_THREADS_8K=1024
  run 4k1024 $m OXLM_INT_THREADS_8K=1024 OXLM_INT_THREADS_4K=1024
  for m in llama-0.85b-4 qwen2.5-0.5b-4; do
    run main $m
    run 4k1024 $m OXLM_INT_THREADS_4K=1024
    run 2k512 $m OXLM_INT_THREADS_2K=512
  done
done
for c in main 8k1024 4k1024; do
  e=(); [ $c = 8k1024 ] && e=(OXLM_INT_THREADS_8K=1024); [ $c = 4k1024 ] && e=(OXLM_INT_THREADS_8K=1024 OXLM_INT_THREADS_4K=1024)
  env "${e[@]}" OXLM_TRACE=1 timeout 120 .device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 \
    --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-$c.json" 2> "$OUT/trace-$c.err"
done
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(x) for x in r["decode_tps_runs"]] + [round(d["decode_tps"]) for d in r["depths"]])
for k, v in runs.items(): print(*k, v)
for c in ("main", "8k1024", "4k1024"):
    t = json.load(open(f"{sys.argv[1]}/trace-{c}.json"))["trace"]
    print(c, "chain %.1f" % t["chain_us_but_last"])
    for p in t["first_positions"][1:6]:
        s = p["stages"]
        print("  %-24s %6.2f us  ready %.2f acts %s done %s" % (p["kernel"], p["chain_us"],
              s["last_ready_us"] or 0, "%.2f" % s["acts_us"] if s["acts_us"] else "-", "%.2f" % s["done_us"] if s["done_us"] else "-"))
PY
