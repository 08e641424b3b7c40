#!/usr/bin/env bash
# Session 17's second run, on the machine of the first (s17-start.sh: llama.cpp built there, the
# GGUFs quantized): llama-batched-bench at 1 to 64 sequences, then the session's starting build
# of oxlm (208a6d6) batched on the same shapes, then llama-bench and `oxlm bench` at batch 1.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz 2>/dev/null
start=$SECONDS
bin=/opt/llama.cpp/build/bin
ls /tmp/gguf
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 $S7 --bits 4 >&2 &
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 $S1 --bits 4 >&2 &
for m in llama-0.85b llama-7.2b; do
  timeout 150 $bin/llama-batched-bench -m /tmp/gguf/$m-Q4_0.gguf -c 41984 -b 2048 -ub 512 -npp 512 -ntg 128 \
    -npl 1,8,16,32,64 -ngl 99 --output-format jsonl 2>/dev/null | grep '^{' | sed "s/^{/{\"model\":\"$m\",/" \
    | tee -a "$OUT/llamacpp-batch.jsonl" | cut -c1-160
  echo "$m batched at $((SECONDS - start)) s"
done
wait
for m in llama-0.85b llama-7.2b; do
  timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 8 --batch 16 --batch 32 --batch 64 >> "$OUT/batch.jsonl"
  echo "$m oxlm at $((SECONDS - start)) s"
done
for m in llama-0.85b llama-7.2b; do
  timeout 100 $bin/llama-bench -m /tmp/gguf/$m-Q4_0.gguf -p 512 -n 128 -ngl 99 -r 3 -o jsonl 2>/dev/null | tee -a "$OUT/llamacpp.jsonl" | cut -c1-100
  timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 --gen-tokens 128 --repeats 3 | tee -a "$OUT/bench.jsonl" | cut -c1-300
done
echo "all done at $((SECONDS - start)) s"
