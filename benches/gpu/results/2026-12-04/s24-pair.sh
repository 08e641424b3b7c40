#!/usr/bin/env bash
# Session 24's tenth call. Build d (branch gpu-int-pair-row): qgemv_int divides the warp's index
# by `parts` once, where first_row divided it again for every run a lane loaded (the SASS of
# qgemv_int1: 86 instructions for each refill, 56 without the division). GPU tests on d;
# cuda_gemv b (main's int16 GEMVs) against d; then main (c0efd31) against d, alternated: two
# rounds on the 0.85B and Qwen2.5-0.5B's shape while the 7.2B is written, then the 7.2B; 1, 2
# and 4 sequences after 512-token prompts. Written to run in what device time was left.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm-*.gz; chmod +x .device/oxlm-* .device/cuda_gemv-*
(ONLY=llama-0.85b benches/gpu/device.sh models; ONLY=qwen2.5-0.5b benches/gpu/device.sh models
 ONLY=llama-7.2b benches/gpu/device.sh models) > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 120 "$t" --test-threads=1 --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
for b in b d; do
  echo "== cuda_gemv $b"
  timeout 40 .device/cuda_gemv-$b 2048x5632 14336x4096 2>&1 | tee "$OUT/gemv-$b.txt"
done
run() { # label, binary, model
  while [ ! -f /tmp/models/$3/model.safetensors ] || ! grep -q "${3}" "$OUT/models.log"; do sleep 1; done
  timeout 60 .device/oxlm-$2 bench --device cuda --model /tmp/models/$3 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 2>> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$1\",/" | tee -a "$OUT/ab.jsonl" | cut -c1-150
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4; do
    run a main $m
    run d d $m
  done
done
for round in 1 2; do
  run a main llama-7.2b-4
  run d d llama-7.2b-4
done
