#!/usr/bin/env bash
# Session 15's fifth run: the synthetic 7.2B llama (4-bit), not measured since the ninth session,
# on the landed build: oxlm batch-1 decode and prefill after 512- and 2,048-token prompts
# (`--repeats 3`) and batched decode of 8 and 64 sequences, with f16 caches; llama.cpp built
# here meanwhile (llama-cpp-python 0.3.36's), on the Q4_0 its quantizer makes of the same
# shape: llama-bench -p 512,2048 -n 128 -r 3, then llama-batched-bench at 1, 8 and 64.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz 2>/dev/null
benches/gpu/device.sh llamacpp-build
SHAPE="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
mkdir -p /tmp/gguf
# The GGUF (f16) is written meanwhile, at low priority beside the build.
(nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/llama-7.2b-f16.gguf $SHAPE \
  > "$OUT/gguf.log" 2>&1; echo done >> "$OUT/gguf.log") &
dir=/tmp/models/llama-7.2b-4
python3 benches/gpu/synthetic_mlx.py $dir $SHAPE --bits 4 >&2
echo "model written at $((SECONDS - start)) s"
for prompt in 512 2048; do
  timeout 100 .device/oxlm bench --device cuda --model $dir --prompt-tokens $prompt --gen-tokens 128 \
    --repeats 3 | tee -a "$OUT/bench.jsonl" | head -c 300; echo
done
timeout 120 .device/oxlm bench --device cuda --model $dir --prompt-tokens 512 --gen-tokens 128 \
  --repeats 1 --batch 8 --batch 64 | tee -a "$OUT/batch.jsonl" | head -c 300; echo
echo "oxlm done at $((SECONDS - start)) s"
while [ ! -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 420 ]; do sleep 5; done
[ -f $LLAMA/build.done ] || { echo "llama.cpp not built in time"; exit 0; }
echo "llama.cpp built at $((SECONDS - start)) s"
wait
bin=$LLAMA/build/bin
$bin/llama-quantize /tmp/gguf/llama-7.2b-f16.gguf /tmp/gguf/llama-7.2b-Q4_0.gguf Q4_0 > /dev/null 2>&1
echo "quantized at $((SECONDS - start)) s"
timeout 90 $bin/llama-bench -m /tmp/gguf/llama-7.2b-Q4_0.gguf -p 512,2048 -n 128 -ngl 99 -r 3 \
  -o jsonl 2>/dev/null | tee -a "$OUT/llamacpp.jsonl" | cut -c1-120
[ $((SECONDS - start)) -lt 500 ] && timeout 80 $bin/llama-batched-bench -m /tmp/gguf/llama-7.2b-Q4_0.gguf \
  -c 41984 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,64 -ngl 99 --output-format jsonl 2>/dev/null \
  | grep '^{' | tee -a "$OUT/llamacpp-batch.jsonl" | cut -c1-200
echo "all done at $((SECONDS - start)) s"
