#!/usr/bin/env bash
# Session 23's second peer call, right after s23-peer.sh on the same machine (its models,
# GGUFs and llama.cpp build kept): finishes the llama.cpp build (again in the foreground if the
# first call's ended with it), runs llama-batched-bench as s23-peer.sh does, then prefill of 512
# and 2,048 tokens (llama-bench -n 0; `oxlm bench` with 8 tokens after) while time is left.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm.gz && chmod +x .device/oxlm
ls /tmp/models /tmp/gguf; tail -2 $LLAMA/build.log
if [ ! -f $LLAMA/build.done ] && ! pgrep -f "cmake --build" > /dev/null; then
  echo "build not running: resumed"
  (cd $LLAMA && cmake --build build -j16 --target llama-bench llama-batched-bench llama-quantize \
    >> build.log 2>&1; echo $? > build.done)
fi
while [ ! -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 150 ]; do sleep 3; done
echo "llama.cpp build: $(cat $LLAMA/build.done 2>/dev/null || echo not done) at $((SECONDS - start)) s"
bin=$LLAMA/build/bin
for m in llama-0.85b llama-7.2b; do
  [ -f /tmp/gguf/$m-Q4_0.gguf ] || $bin/llama-quantize /tmp/gguf/$m-f16.gguf /tmp/gguf/$m-Q4_0.gguf Q4_0 > /dev/null 2>&1
  if ! grep -q "\"model\":\"$m\"" "$OUT/llamacpp-batch.jsonl" 2>/dev/null; then
    timeout 80 $bin/llama-batched-bench -m /tmp/gguf/$m-Q4_0.gguf -c 41984 -b 2048 -ub 512 -npp 512 \
      -ntg 128 -npl 1,2,4,8,16,32,64 -ngl 99 --output-format jsonl 2>/dev/null | grep '^{' \
      | sed "s/^{/{\"model\":\"$m\",/" >> "$OUT/llamacpp-batch.jsonl"
  fi
  echo "$m llama.cpp at $((SECONDS - start)) s"
done
for m in llama-0.85b llama-7.2b; do
  [ $((SECONDS - start)) -lt 300 ] || break
  timeout 40 $bin/llama-bench -m /tmp/gguf/$m-Q4_0.gguf -p 512,2048 -n 0 -ngl 99 -r 3 \
    -o jsonl 2>/dev/null | sed "s/^{/{\"model\":\"$m\",/" >> "$OUT/llamacpp-prefill.jsonl"
  for p in 512 2048; do
    timeout 40 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens $p \
      --gen-tokens 8 --repeats 3 >> "$OUT/prefill.jsonl"
  done
  echo "$m prefill at $((SECONDS - start)) s"
done
