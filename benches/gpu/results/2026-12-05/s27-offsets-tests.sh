#!/usr/bin/env bash
# Session 27, third call: the GPU tests of main with the 32-bit-offset kernels (branch
# gpu-int-offsets rebased onto main ede4fbe; its cubin 75c1560406fba937), which s26-offsets.sh
# measured against main with main's tests; then that build's bench on the 0.85B: one sequence,
# and 16 and 64 staggered; then the long prompt arriving while another request streams, which
# s27-main.sh's run missed (its stream of 200 tokens had ended before the prompt came, half a
# second in), now ten tokens into a stream of 3,000. Carry .device/oxlm-c.gz .device/tests
# .device/cache .device/smollm2-tokenizer.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm-c.gz .device/tests/*.gz 2>/dev/null
chmod +x .device/oxlm-c .device/tests/*
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
for t in .device/tests/*; do
  echo "== $t"
  timeout 120 "$t" --test-threads=1 --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
ls "$OXLM_CACHE"/cuda
M=/tmp/models/llama-0.85b-4
python3 benches/gpu/synthetic_mlx.py $M --hidden 2048 --intermediate 5632 --layers 16 \
  --heads 32 --kv-heads 8 --vocab 32000 --bits 4 > "$OUT/model.log" 2>&1
timeout 120 .device/oxlm-c bench --device cuda --model $M --prompt-tokens 512 --gen-tokens 256 \
  --repeats 2 --batch 16 --batch 64 --stagger 2>> "$OUT/bench.err" | tee "$OUT/bench.jsonl" \
  | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(round(d['decode_tps']), d['replayed_steps'], round(d['decode_gpu_us_per_step'],1), [(b['sequences'], round(b['decode_tps']), b['replayed_steps']) for b in d['batches']])"
S=/tmp/models/serve-0.85b
python3 benches/gpu/synthetic_mlx.py $S --hidden 2048 --intermediate 5632 --layers 16 \
  --heads 32 --kv-heads 8 --vocab 49152 --bits 4 >> "$OUT/model.log" 2>&1
cp .device/smollm2-tokenizer/* $S/
python3 benches/serve_bench.py --oxlm .device/oxlm-c --model $S --long-prompt 3000 \
  --prefill-steps 2048,512,128 --stream-tokens 3000 --serve-args="--device cuda" 2>&1 \
  | tee "$OUT/serve.txt"
