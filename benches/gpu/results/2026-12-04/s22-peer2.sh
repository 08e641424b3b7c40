#!/usr/bin/env bash
# Session 22's peer call (second part), on main (ba33377; the .device build of s22-final): the GPU tests, then
# llama.cpp (llama-cpp-python 0.3.36's, built here meanwhile) and oxlm one after the other on
# the same shapes: llama-batched-bench and `oxlm bench --batch` at 1 to 64 sequences (4-bit,
# Q4_0 for llama.cpp; 512-token prompts, 128 tokens each), then prefill of 512 and 2,048 tokens
# (llama-bench -n 0, `oxlm bench` with 8 tokens after) while the call has time left. llama.cpp
# is left out if its build is not done within 360 s. As s18-final.sh, with the prefill added.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
LLAMA=/opt/llama.cpp
start=$SECONDS
gunzip -f .device/cache/cuda/*.gz 2>/dev/null
# The second call, meant to find the first's llama.cpp build (at 79% after 360 s) still running:
# it came to a fresh machine, where nothing had started the build, so llama.cpp was left out
# again and only oxlm ran.
S7="--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --vocab 32000"
S1="--hidden 2048 --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 32000"
mkdir -p /tmp/gguf
(for m in "llama-0.85b $S1" "llama-7.2b $S7"; do set -- $m; n=$1; shift
   python3 -c "import sys; sys.exit(0)"; [ -s /tmp/gguf/$n-f16.gguf.done ] || \
   { nice -n 10 python3 benches/gpu/synthetic_gguf.py $LLAMA /tmp/gguf/$n-f16.gguf "$@" && echo ok > /tmp/gguf/$n-f16.gguf.done; }
 done; echo "gguf rc $?") > "$OUT/gguf.log" 2>&1 &
ONLY=llama-0.85b benches/gpu/device.sh models > /dev/null 2>&1
ONLY=llama-7.2b benches/gpu/device.sh models > /dev/null 2>&1
while [ ! -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 300 ]; do sleep 5; done
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
  echo "llama.cpp not built in time"; tail -3 $LLAMA/build.log
fi
for m in llama-0.85b llama-7.2b; do
  timeout 80 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    >> "$OUT/batch.jsonl"
  echo "$m oxlm at $((SECONDS - start)) s"
done
if [ -f $LLAMA/build.done ] && [ $((SECONDS - start)) -lt 470 ]; then
  for m in llama-0.85b llama-7.2b; do
    timeout 40 $LLAMA/build/bin/llama-bench -m /tmp/gguf/$m-Q4_0.gguf -p 512,2048 -n 0 -ngl 99 -r 3 \
      -o jsonl 2>/dev/null | sed "s/^{/{\"model\":\"$m\",/" >> "$OUT/llamacpp-prefill.jsonl"
    for p in 512 2048; do
      timeout 40 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens $p \
        --gen-tokens 8 --repeats 3 >> "$OUT/prefill.jsonl"
    done
    echo "$m prefill at $((SECONDS - start)) s"
  done
fi
echo "all done at $((SECONDS - start)) s"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
for l in open(out + "/batch.jsonl"):
    r = json.loads(l)
    print("oxlm", r["model"].split("/")[-1], round(r["decode_tps"]), [round(b["decode_tps"]) for b in r["batches"]])
if os.path.exists(out + "/llamacpp-batch.jsonl"):
    for l in open(out + "/llamacpp-batch.jsonl"):
        r = json.loads(l)
        print("llama.cpp", r["model"], r.get("pl"), round(r.get("speed_tg", 0)))
if os.path.exists(out + "/prefill.jsonl"):
    for l in open(out + "/prefill.jsonl"):
        r = json.loads(l)
        print("oxlm prefill", r["model"].split("/")[-1], r["prompt_tokens"], [round(x) for x in r["prefill_tps_runs"]])
if os.path.exists(out + "/llamacpp-prefill.jsonl"):
    for l in open(out + "/llamacpp-prefill.jsonl"):
        r = json.loads(l)
        print("llama.cpp prefill", r["model"], r.get("n_prompt"), round(r.get("avg_ts", 0)), "+-", round(r.get("stddev_ts", 0)))
PY
