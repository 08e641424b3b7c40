#!/usr/bin/env bash
# The planned first call of the next session lent a GPU (prepared in sessions 25 and 26, not yet
# run). Build b (branch gpu-int-offsets): the int16-activation kernels place each weight run by
# 32-bit offsets from the matrices' starts (RowSources), where every refill multiplied rows by
# lengths in 64 bits (qgemv_int1_4_bf16's refill: 62 -> 32 instructions; held to 64 registers by
# __launch_bounds__). GPU tests of main (0bf8bdf: they include the batched recurrent kernels and
# the batched decode of Qwen3.5, Gemma 3 and Gemma 4 on the GPU); cuda_gemv main against b, two
# rounds; then main against b, alternated, two rounds on the 0.85B and Qwen2.5-0.5B's shape while
# the 7.2B is written, then the 7.2B; 1, 2 and 4 sequences after 512-token prompts.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
# The test binaries find tests/fixtures through the path they were built at.
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
gunzip -f .device/cache/cuda/*.gz .device/oxlm-*.gz .device/cuda_gemv-*.gz .device/tests/*.gz
chmod +x .device/oxlm-* .device/cuda_gemv-* .device/tests/*
(ONLY=llama-0.85b benches/gpu/device.sh models; ONLY=qwen2.5-0.5b benches/gpu/device.sh models
 ONLY=llama-7.2b benches/gpu/device.sh models) > "$OUT/models.log" 2>&1 &
for t in .device/tests/*; do
  echo "== $t"
  timeout 120 "$t" --test-threads=1 --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
for round in 1 2; do
  for b in main b; do
    echo "== cuda_gemv $b"
    timeout 60 .device/cuda_gemv-$b 2048x5632 14336x4096 4096x14336 128256x4096 2>&1 \
      | tee -a "$OUT/gemv-$b.txt"
  done
done
run() { # label, binary, model
  while [ ! -f /tmp/models/$3/model.safetensors ] || ! grep -q "${3}" "$OUT/models.log"; do sleep 1; done
  timeout 60 .device/oxlm-$2 bench --device cuda --model /tmp/models/$3 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 2>> "$OUT/bench.err" \
    | sed "s/^{/{\"build\":\"$1\",/" | tee -a "$OUT/ab.jsonl" \
    | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['build'], d['model'][13:], round(d['decode_tps']), round(d['decode_gpu_us_per_step'],1), [round(b['decode_tps']) for b in d['batches']])"
}
for round in 1 2; do
  for m in llama-0.85b-4 qwen2.5-0.5b-4; do
    run a main $m
    run b b $m
  done
done
for round in 1 2; do
  run a main llama-7.2b-4
  run b b llama-7.2b-4
done
