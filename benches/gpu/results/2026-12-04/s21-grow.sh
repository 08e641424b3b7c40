#!/usr/bin/env bash
# Session 21's thirteenth call: the steps' arena doubles after a step outgrows it (while the
# doubling takes at most half the free memory), .device/oxlm, against main at aa04a76 with its
# fixed 256 MiB (.device/oxlm-a: the twelfth call's build, its switch unset). The GPU tests on
# it (cuda_ops now with a step that outgrows the arena); decode at 8 to 64 sequences, 4-bit,
# 512-token prompts, one round.
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
for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
  for b in oxlm-a oxlm; do
    timeout 300 .device/$b bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
      --gen-tokens 128 --repeats 1 --batch 8 --batch 16 --batch 32 --batch 64 \
      | sed "s/^{/{\"build\":\"$b\",/" >> "$OUT/ab.jsonl"
  done
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print(r["build"], r["model"].split("/")[-1], "1: %.0f" % r["decode_tps"], " ".join("%d: %.0f (wall %.0f, span %.0f)" % (b["sequences"], b["decode_tps"], b["sequences"] * 1e6 / b["decode_tps"], b["gpu_us_per_step"]) for b in r["batches"]))
PY
