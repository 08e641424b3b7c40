#!/usr/bin/env bash
# Session 23's peer call, on build e (the ring kernels; its GPU tests passed in s23-landed):
# llama.cpp (llama-cpp-python 0.3.36's, built here meanwhile, at the lowest priority) and oxlm
# on the same shapes. First oxlm alone: `oxlm bench --batch` at 1 to 64 sequences and one after
# 2,048 tokens (4-bit, 512-token prompts, 128 tokens each); then, once the build is done,
# llama-batched-bench at 1 to 64 sequences on the Q4_0 GGUFs of the same shapes. If the build
# is not done by 430 s, s23-peer2.sh, run right after on the same machine, finishes it.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm.gz && chmod +x .device/oxlm
benches/gpu/device.sh llamacpp-build
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
mkdir -p /tmp/gguf
(nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/llama-0.85b-f16.gguf $S1 \
  && nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/llama-7.2b-f16.gguf $S7; \
  echo "gguf rc $?") > "$OUT/gguf.log" 2>&1 &
ONLY=llama-0.85b benches/gpu/device.sh models > "$OUT/models.log" 2>&1
ONLY=llama-7.2b benches/gpu/device.sh models >> "$OUT/models.log" 2>&1
echo "models at $((SECONDS - start)) s"
for m in llama-0.85b llama-7.2b; do
  timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 2 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    --depth 2048 >> "$OUT/batch.jsonl"
  echo "$m oxlm at $((SECONDS - start)) s"
done
while [ ! -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 430 ]; do sleep 5; done
if [ -f $LLAMA/build.done ]; then
  echo "llama.cpp built (rc $(cat $LLAMA/build.done)) at $((SECONDS - start)) s"
  wait
  bin=$LLAMA/build/bin
  for m in llama-0.85b llama-7.2b; do
    $bin/llama-quantize /tmp/gguf/$m-f16.gguf /tmp/gguf/$m-Q4_0.gguf Q4_0 > /dev/null 2>&1
    timeout 80 $bin/llama-batched-bench -m /tmp/gguf/$m-Q4_0.gguf -c 41984 -b 2048 -ub 512 -npp 512 \
      -ntg 128 -npl 1,2,4,8,16,32,64 -ngl 99 --output-format jsonl 2>/dev/null | grep '^{' \
      | sed "s/^{/{\"model\":\"$m\",/" >> "$OUT/llamacpp-batch.jsonl"
    echo "$m llama.cpp at $((SECONDS - start)) s"
  done
else
  echo "llama.cpp not built by $((SECONDS - start)) s"; tail -2 $LLAMA/build.log
fi
