#!/usr/bin/env bash
# Session 17's first run: the GPU tests on the session's starting build (208a6d6, whose last two
# commits had not run on a GPU) while llama.cpp (llama-cpp-python 0.3.36's) builds with CUDA;
# meanwhile the synthetic models' f16 GGUFs are written and, once the build is done, quantized
# to Q4_0; the built llama.cpp binaries come back (xz, in parts) so that later calls carry them
# instead of building again.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz 2>/dev/null
benches/gpu/device.sh llamacpp-build
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
mkdir -p /tmp/gguf
(nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/llama-0.85b-f16.gguf $S1 \
  && nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/llama-7.2b-f16.gguf $S7; \
  echo "gguf rc $?") > "$OUT/gguf.log" 2>&1 &
benches/gpu/device.sh tests
echo "tests done at $((SECONDS - start)) s"
while [ ! -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 470 ]; do sleep 5; done
[ -f $LLAMA/build.done ] || { echo "llama.cpp not built in time"; tail -3 $LLAMA/build.log; exit 0; }
echo "llama.cpp built (rc $(cat $LLAMA/build.done)) at $((SECONDS - start)) s"
wait
cat "$OUT/gguf.log"
bin=$LLAMA/build/bin
for m in llama-0.85b llama-7.2b; do
  $bin/llama-quantize /tmp/gguf/$m-f16.gguf /tmp/gguf/$m-Q4_0.gguf Q4_0 > /dev/null 2>&1
done
echo "quantized at $((SECONDS - start)) s"
ls -la $bin | head -30
(cd $bin && tar cf - llama-bench llama-batched-bench llama-quantize *.so* | xz -T16 -6 > /tmp/llamacpp-bin.tar.xz)
ls -la /tmp/llamacpp-bin.tar.xz
split -b 15M -d /tmp/llamacpp-bin.tar.xz "$OUT/llamacpp-bin.tar.xz.part"
echo "all done at $((SECONDS - start)) s"
