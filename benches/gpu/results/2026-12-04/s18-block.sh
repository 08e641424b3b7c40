#!/usr/bin/env bash
# Session 18's first call: a llama block's decode step in one launch (`decode_block`: the five
# kernels' work between grid barriers). The three models' 4-bit checkpoints, the GPU tests
# (each binary under a time limit, in case a grid barrier never opens), then decode with the
# block kernel off (temporary switch OXLM_DECODE_BLOCK=0), on (1 block of 16 warps an SM, 128
# registers) and its 64-register variant (=2, 2 blocks an SM), 4-bit, 512-token prompt, 128
# tokens; and one traced run of each model with it on.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models
echo "models at $((SECONDS - start)) s"
for t in .device/tests/*; do
  echo "== $t"
  timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
echo "tests at $((SECONDS - start)) s"
run() { # variant, model
  OXLM_DECODE_BLOCK=$1 timeout 60 .device/oxlm bench --device cuda --model /tmp/models/$2-4 \
    --prompt-tokens 512 --gen-tokens 128 --repeats 1 | sed "s/^{/{\"variant\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do
  for v in 0 1 2; do run $v $m; done
done
echo "round 1 at $((SECONDS - start)) s"
for m in llama-0.85b qwen2.5-0.5b; do
  OXLM_TRACE=1 timeout 60 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 32 --repeats 1 > "$OUT/trace-$m.json"
done
echo "all done at $((SECONDS - start)) s"
