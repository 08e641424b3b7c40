#!/usr/bin/env bash
# Session 24's first call. The GPU tests on main (c0efd31: the 8-row int16 GEMVs dropped in
# 461c3b1, not yet run on a GPU). A decode step as one persistent kernel (s24-flow.py, flow.cubin
# compiled here from s24-flow.cu) against the floor of one kernel per operation. Then main's
# decode at one sequence on the 0.85B, for the same call's figure.
# (This call ran a first version of s24-flow.cu, whose activation reads conflicted in shared
# memory; s24-flow2 on have the file as it stands.)
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm.gz; chmod +x .device/oxlm
ONLY=llama-0.85b benches/gpu/device.sh models > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
timeout 120 python3 benches/gpu/results/2026-12-04/s24-flow.py .device/flow.cubin 2>&1 | tee "$OUT/flow.txt"
wait
timeout 150 .device/oxlm bench --device cuda --model /tmp/models/llama-0.85b-4 --prompt-tokens 512 \
  --gen-tokens 128 --repeats 2 2> "$OUT/bench.err" | tee "$OUT/bench.jsonl"
