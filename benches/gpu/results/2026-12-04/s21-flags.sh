#!/usr/bin/env bash
# Session 21's tenth call: greedy_rows sets a flag a row in pinned host memory after its pick,
# and the host spins on the flags instead of synchronizing the stream; each step's GPU span is
# read two steps later instead of waited for as it ends (.device/oxlm), against main at aa04a76
# (.device/oxlm-a). The GPU tests on it; decode at 1, 2 and 8 sequences, two rounds
# alternated, 4-bit, 512-token prompts.
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
  for m in llama-0.85b-4 qwen2.5-0.5b-4 llama-7.2b-4; do
    for b in oxlm-a oxlm; do
      timeout 120 .device/$b bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
        --gen-tokens 128 --repeats 2 --batch 2 --batch 8 | sed "s/^{/{\"build\":\"$b\",/" >> "$OUT/ab.jsonl"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print(r["build"], r["model"].split("/")[-1], "1 seq %.0f tok/s (wall %.1f us, gpu span %.1f)" % (
        r["decode_tps"], 1e6 / r["decode_tps"], r["decode_gpu_us_per_step"]),
        " ".join("%d seqs %.0f (wall %.1f, span %.1f)" % (b["sequences"], b["decode_tps"], b["sequences"] * 1e6 / b["decode_tps"], b["gpu_us_per_step"]) for b in r["batches"]))
PY
