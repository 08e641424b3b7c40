#!/usr/bin/env bash
# Session 21's fourteenth call: two kernel tidy-ups (the tensor-core products' three stores of a
# scaled row sum through one helper, one sequence's attention's two loops over value rows through
# one lambda), .device/oxlm, against main at 5707a7b (.device/oxlm-a). The GPU tests on it; one
# and 8 sequences, 4-bit, 512-token prompts, two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
wait
for round in 1 2; do
  for m in llama-0.85b-4 llama-7.2b-4; do
    for b in oxlm-a oxlm; do
      timeout 120 .device/$b bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
        --gen-tokens 128 --repeats 1 --batch 8 | sed "s/^{/{\"build\":\"$b\",/" >> "$OUT/ab.jsonl"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print(r["build"], r["model"].split("/")[-1], "1: %.0f" % r["decode_tps"], " ".join("%d: %.0f" % (b["sequences"], b["decode_tps"]) for b in r["batches"]))
PY
