#!/usr/bin/env bash
# Session 22's last call: main at ba33377 (the int16 GEMVs' warps a pair of rows by the
# kernel's resident warps). The GPU tests; the GEMVs alone (cuda_gemv, steps of 1 GiB of
# weights) at the 7.2B's shapes and larger ones; the floor of a step again (s22-floor.py); then
# decode at 1 to 64 sequences and one after 2,048 tokens, 4-bit, 512-token prompts, one run each.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz
benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
timeout 240 .device/cuda_gemv 32000x2048 14336x4096 4096x14336 28672x8192 8192x28672 128256x4096 \
  2>&1 | tee "$OUT/gemv.txt"
timeout 120 python3 benches/gpu/results/2026-12-04/s22-floor.py .device/floor.cubin 2>&1 | tee "$OUT/floor.txt"
wait
for m in llama-0.85b-4 llama-7.2b-4 qwen2.5-0.5b-4; do
  timeout 300 .device/oxlm bench --device cuda --model /tmp/models/$m --prompt-tokens 512 \
    --gen-tokens 128 --repeats 2 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    --depth 2048 >> "$OUT/final.jsonl"
done
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/final.jsonl"):
    r = json.loads(l)
    print(r["model"].split("/")[-1], "1 seq %.0f tok/s (runs %s; wall %.1f us, gpu span %.1f), after 2,048: %.0f" % (
        r["decode_tps"], [round(x) for x in r["decode_tps_runs"]], 1e6 / r["decode_tps"], r["decode_gpu_us_per_step"], r["depths"][0]["decode_tps"]))
    for b in r["batches"]:
        print("   %2d seqs %6.0f tok/s (wall %.1f us, gpu span %.1f)" % (b["sequences"], b["decode_tps"], b["sequences"] * 1e6 / b["decode_tps"], b["gpu_us_per_step"]))
PY
