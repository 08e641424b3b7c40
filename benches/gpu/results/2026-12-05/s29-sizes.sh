#!/usr/bin/env bash
# Prepared in session 29, run in session 30 (on an H100: the call got no H200). First the
# GPU tests built from main with the server's recordings kept per batch size
# (cuda_ops; tiny_parity with the new a_recording_replays_for_another_batch_of_its_size, and main's
# tests since ff2f79a's on_gpu refactor, never yet run on a GPU). Then `oxlm serve
# --device cuda` with main's build (15a0acc: a new recording whenever a request joins or ends)
# against the branch's (one recording per batch size, kept while the batch runs), under
# requests arriving at random (serve_bench.py --arrivals: 150 and 50 a second for 4 s, each
# asking for 32 to 128 tokens), alternated, two rounds (ROUNDS=1: one). Carry .device/oxlm-main.gz
# .device/oxlm-sizes.gz .device/tests .device/cache .device/smollm2-tokenizer.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm-*.gz .device/tests/*.gz 2>/dev/null
chmod +x .device/oxlm-* .device/tests/*
# The test binaries find tests/fixtures through the path they were built at.
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
for t in .device/tests/*; do
  echo "== $t"
  timeout 120 "$t" --test-threads=1 --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
M=/tmp/models/serve-0.85b
python3 benches/gpu/synthetic_mlx.py $M --hidden 2048 --intermediate 5632 --layers 16 \
  --heads 32 --kv-heads 8 --vocab 49152 --bits 4 > "$OUT/model.log" 2>&1
cp .device/smollm2-tokenizer/* $M/
for round in $(seq "${ROUNDS:-2}"); do
  for rate in 150 50; do
    for b in main sizes; do
      python3 benches/serve_bench.py --oxlm .device/oxlm-$b --model $M \
        --arrivals $((rate * 4)) --rate $rate --max-tokens 128 --serve-args="--device cuda" \
        2>> "$OUT/arrivals.err" | sed "s/^{/{\"build\":\"$b\",/" | tee -a "$OUT/arrivals.jsonl"
    done
  done
done
