#!/usr/bin/env bash
# Session 20's fourth call. The branch build (.device/oxlm) on top of the third call's (.device/oxlm-a):
# one sequence's attention loads each key row across the warp (lanes sharing its features, their
# dot products summed by a transposing exchange) instead of a row a lane, and the merge of its
# splits loads their outputs with their maxima. The GPU tests; its traced decode at one sequence;
# then decode against oxlm-a, 1 to 8 sequences and after 2,048 tokens, two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
echo "tests and models at $((SECONDS - start)) s"
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
    for k in t["first_positions"][1:7]:
        s = {a: round(b, 2) for a, b in k["stages"].items() if b is not None}
        print(f'  {k["kernel"]:22s} chain {k["chain_us"]:6.2f} lag {k["lag_us"]:5.2f}', s)
PY
run() { # binary, model
  timeout 200 .device/$1 bench --device cuda --model /tmp/models/$2 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --depth 2048 \
    | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
    for b in oxlm-a oxlm; do run $b $m; done
  done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(b["decode_tps"]) for b in r["batches"]] + [round(d["decode_tps"]) for d in r["depths"]])
for k, v in runs.items(): print(*k, v)
PY
