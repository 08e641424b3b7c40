#!/usr/bin/env bash
# Session 20's tenth call: the split merge's loads made unconditional (branch
# gpu-merge-unconditional, .device/oxlm: splits past the used ones read the last used one and
# weigh 0, features past d read the last one and are not stored), against gpu-merge-trace
# (.device/oxlm-a, main with the merge's marks). The GPU tests on the branch; both traced at one
# sequence; then decode untraced, one to 8 sequences and one after 2,048 tokens, two rounds
# alternated; 4-bit, 512-token prompts.
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
for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
  for b in oxlm-a oxlm; do
    OXLM_TRACE=1 timeout 200 .device/$b bench --device cuda --model /tmp/models/$m \
      --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-$b-$m.json" 2> "$OUT/trace-$b-$m.err"
  done
done
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/trace-*.json")):
    try: r = json.load(open(f))
    except Exception as e: print(f, e); continue
    t = r["trace"]
    print(f.split("/")[-1], round(r["decode_tps"]), "chain", round(t["chain_us_but_last"], 1))
    for k in t["first_positions"][2:3]:
        s = {a: round(b, 2) for a, b in k["stages"].items() if b is not None}
        print(f'  {k["kernel"]:22s} chain {k["chain_us"]:6.2f}', s)
PY
run() { # binary, model
  timeout 300 .device/$1 bench --device cuda --model /tmp/models/$2 --prompt-tokens 512 \
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
