#!/usr/bin/env bash
# Session 16's fourth run. E: the landed build (ba29a8d). F: qmma's slices added up by each
# feature tile's last slice to finish (counted in the split counters, as split attention does),
# in the slices' order, where a second kernel (mma_reduce) did it after every sliced product.
# llama.cpp (llama-cpp-python 0.3.36's) builds meanwhile. The GPU tests on F first; then
# batched decode on the 7.2B and 0.85B llamas (4-bit, 512-token prompts, 128 tokens), E/F
# alternated twice; traced steps of F; then llama-batched-bench on Q4_0 GGUFs of the same
# shapes at the same counts and lengths.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz .device/oxlm.gz .device/oxlm-e.gz 2>/dev/null
chmod +x .device/oxlm .device/oxlm-e
benches/gpu/device.sh llamacpp-build
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
mkdir -p /tmp/gguf
(nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/llama-0.85b-f16.gguf $S1 \
  && nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/llama-7.2b-f16.gguf $S7; \
  echo done) > "$OUT/gguf.log" 2>&1 &
benches/gpu/device.sh tests
echo "tests done at $((SECONDS - start)) s"
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-7.2b-4 $S7 --bits 4 >&2
python3 benches/gpu/synthetic_mlx.py /tmp/models/llama-0.85b-4 $S1 --bits 4 >&2
echo "models at $((SECONDS - start)) s"
for round in 1 2; do
  for v in e f; do
    bin=.device/oxlm; [ $v = f ] || bin=.device/oxlm-$v
    for m in llama-7.2b llama-0.85b; do
      timeout 100 $bin bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
        --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 \
        --batch 64 | sed "s/^{/{\"build\":\"$v\",/" >> "$OUT/batch.jsonl"
    done
    echo "$v done at $((SECONDS - start)) s"
  done
done
OXLM_TRACE=1 timeout 60 .device/oxlm bench --device cuda --model /tmp/models/llama-7.2b-4 \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 8 --batch 64 > "$OUT/trace-f-7b.json"
OXLM_TRACE=1 timeout 60 .device/oxlm bench --device cuda --model /tmp/models/llama-0.85b-4 \
  --prompt-tokens 512 --gen-tokens 16 --repeats 1 --batch 64 > "$OUT/trace-f.json"
echo "oxlm done at $((SECONDS - start)) s"
while [ ! -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 400 ]; do sleep 5; done
[ -f $LLAMA/build.done ] || { echo "llama.cpp not built in time"; tail -3 $LLAMA/build.log; exit 0; }
echo "llama.cpp built at $((SECONDS - start)) s"
wait
bin=$LLAMA/build/bin
for m in llama-0.85b llama-7.2b; do
  $bin/llama-quantize /tmp/gguf/$m-f16.gguf /tmp/gguf/$m-Q4_0.gguf Q4_0 > /dev/null 2>&1
done
echo "quantized at $((SECONDS - start)) s"
timeout 70 $bin/llama-batched-bench -m /tmp/gguf/llama-0.85b-Q4_0.gguf -c 41984 -b 2048 -ub 512 \
  -npp 512 -ntg 128 -npl 1,2,4,8,16,32,64 -ngl 99 --output-format jsonl 2>/dev/null | grep '^{' \
  | sed 's/^{/{"model":"llama-0.85b",/' | tee -a "$OUT/llamacpp-batch.jsonl" | cut -c1-60
timeout $((585 - (SECONDS - start))) $bin/llama-batched-bench -m /tmp/gguf/llama-7.2b-Q4_0.gguf \
  -c 41984 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,16,64 -ngl 99 --output-format jsonl \
  2>/dev/null | grep '^{' | sed 's/^{/{"model":"llama-7.2b",/' \
  | tee -a "$OUT/llamacpp-batch.jsonl" | cut -c1-60
echo "all done at $((SECONDS - start)) s"
