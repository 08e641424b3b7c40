#!/usr/bin/env bash
# Session 21's ninth call: one sequence's attention loads each value row, as each key row,
# across the warp in vectors (a lane's features lane·E.., 2 or 4 a load; f16 keys of 64
# features took 2 loads a lane, values 2 and 4 at 128), .device/oxlm, against main at
# aa04a76 (.device/oxlm-a: the eighth call's build, its switch unset). The GPU tests on it;
# decode at 1 to 8 sequences and after 2,048 tokens, two rounds alternated, 4-bit, 512-token
# prompts; then traced decodes of both builds.
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
for b in oxlm-a oxlm; do
  for m in llama-0.85b-4 llama-7.2b-4; do
    OXLM_TRACE=1 timeout 120 .device/$b bench --device cuda --model /tmp/models/$m \
      --prompt-tokens 512 --gen-tokens 64 --repeats 1 > "$OUT/trace-$b-$m.json" 2> "$OUT/trace-$b-$m.err"
  done
done
echo "traces at $((SECONDS - start)) s"
python3 - "$OUT" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["build"])].append([round(r["decode_tps"])] + [round(b["decode_tps"]) for b in r["batches"]] + [round(d["decode_tps"]) for d in r["depths"]])
for k, v in runs.items(): print(*k, v)
for b in ("oxlm-a", "oxlm"):
    for m in ("llama-0.85b-4", "llama-7.2b-4"):
        t = json.load(open(f"{sys.argv[1]}/trace-{b}-{m}.json"))["trace"]
        print(b, m, "chain %.1f" % t["chain_us_but_last"])
        for k in t["by_kernel"]:
            s = k["mean_stages"]
            print("  %-24s %2d x %6.2f us " % (k["kernel"], k["per_step"], k["chain_us"] / k["per_step"]),
                  " ".join("%s %.2f" % (n[:-3], v) for n, v in s.items() if v is not None))
PY
