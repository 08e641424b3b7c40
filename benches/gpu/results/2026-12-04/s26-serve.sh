#!/usr/bin/env bash
# A planned call for the next session lent a GPU (prepared in session 26, not yet run): `oxlm
# serve --device cuda` with requests sent together (benches/serve_bench.py), decoding one request
# at a time against together. The model is the 0.85B llama of the GPU tables, random weights
# written here, with SmolLM2's vocabulary (49,152) so that SmolLM2's tokenizer, carried, reads
# and writes its text (noise: the figures are tokens a second). Run from main's tree, carrying
# .device/oxlm-main.gz .device/cache .device/smollm2-tokenizer.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm-main.gz 2>/dev/null
chmod +x .device/oxlm-main
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
M=/tmp/models/serve-0.85b
[ -f $M/config.json ] || python3 benches/gpu/synthetic_mlx.py $M --hidden 2048 \
  --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 49152 --bits 4
cp .device/smollm2-tokenizer/* $M/
python3 benches/serve_bench.py --oxlm .device/oxlm-main --model $M --requests 1,8,32,64 \
  --max-tokens 128 --serve-args="--device cuda" 2>&1 | tee "$OUT/serve.txt"
python3 benches/serve_bench.py --oxlm .device/oxlm-main --model $M --long-prompt 3000 \
  --prefill-steps 2048,512 --serve-args="--device cuda" 2>&1 | tee -a "$OUT/serve.txt"
