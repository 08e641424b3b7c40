#!/usr/bin/env bash
# Session 27, from main's tree. First the GPU tests of main (cuda_ops, and tiny_parity with
# the new batched_steps_replay_while_caches_grow), built from 9bcd068. Then build a (0ff44db:
# `bench --stagger`) against b (9bcd068: caches made room for before each decoding step, outside
# the replayed step): batches of 16 and 64 sequences whose prompts are spread over 256 tokens up
# to 512, so that they outgrow their caches at different steps, 256 steps each, alternated, two
# rounds; the steps replayed are in the JSON. Then s26-serve.sh's serving runs with b (`oxlm
# serve --device cuda`, 1, 8, 32 and 64 requests sent together, and a long prompt arriving
# mid-stream). Carry .device/oxlm-sta.gz .device/oxlm-stb.gz .device/tests .device/cache
# .device/smollm2-tokenizer.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm-st*.gz 2>/dev/null
chmod +x .device/oxlm-st*
# The test binaries find tests/fixtures through the path they were built at.
gunzip -f .device/tests/*.gz && chmod +x .device/tests/*
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
for t in .device/tests/*; do
  echo "== $t"
  timeout 120 "$t" --test-threads=1 --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
M=/tmp/models/serve-0.85b
python3 benches/gpu/synthetic_mlx.py $M --hidden 2048 --intermediate 5632 --layers 16 \
  --heads 32 --kv-heads 8 --vocab 49152 --bits 4 > "$OUT/model.log" 2>&1
cp .device/smollm2-tokenizer/* $M/
for round in 1 2; do
  for b in sta stb; do
    timeout 120 .device/oxlm-$b bench --device cuda --model $M --prompt-tokens 512 \
      --gen-tokens 256 --repeats 1 --batch 16 --batch 64 --stagger 2>> "$OUT/bench.err" \
      | sed "s/^{/{\"build\":\"$b\",/" | tee -a "$OUT/stagger.jsonl" \
      | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['build'], round(d['decode_tps']), d['replayed_steps'], [(b['sequences'], round(b['decode_tps']), b['replayed_steps'], round(b['gpu_us_per_step'] or 0)) for b in d['batches']])"
  done
done
cp .device/oxlm-stb .device/oxlm-main
python3 benches/serve_bench.py --oxlm .device/oxlm-main --model $M --requests 1,8,32,64 \
  --max-tokens 128 --serve-args="--device cuda" 2>&1 | tee "$OUT/serve.txt"
python3 benches/serve_bench.py --oxlm .device/oxlm-main --model $M --long-prompt 3000 \
  --prefill-steps 2048,512 --serve-args="--device cuda" 2>&1 | tee -a "$OUT/serve.txt"
