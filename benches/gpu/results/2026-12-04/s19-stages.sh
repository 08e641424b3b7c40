#!/usr/bin/env bash
# Session 19's second call: the one-row int16 GEMVs with more loads in flight (temporary
# switches): OXLM_GEMV_SHAPE=r4d2 (4 rows a warp, 2 stages), r2d4, r2d3 (2 rows, 4 or 3 stages)
# for qgemv; OXLM_GLU_STAGES=3 or 4 for qglu (4-bit, bf16 scales, one activation row). The GPU
# tests under each, the GEMVs alone (cuda_gemv) under each, then decode of the three models
# (4-bit, 512-token prompts, 128 tokens), two rounds alternated.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
benches/gpu/device.sh models > /dev/null 2>&1 &
VARIANTS="base r4d2 r2d4 r2d3 glu3 glu4"
set_variant() {
  unset OXLM_GEMV_SHAPE OXLM_GLU_STAGES
  case $1 in r*) export OXLM_GEMV_SHAPE=$1 ;; glu*) export OXLM_GLU_STAGES=${1#glu} ;; esac
}
for v in $VARIANTS; do
  set_variant $v
  for t in .device/tests/*; do
    echo "== $v $t"
    timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
  done
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
echo "tests at $((SECONDS - start)) s"
for v in $VARIANTS; do
  set_variant $v
  echo "== $v"; timeout 60 .device/cuda_gemv 2>&1 | grep 4-bit
done | tee "$OUT/gemv.txt"
wait
echo "gemv at $((SECONDS - start)) s"
for round in 1 2; do
  for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do
    for v in $VARIANTS; do
      set_variant $v
      timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$m-4 --prompt-tokens 512 \
        --gen-tokens 128 --repeats 1 | sed "s/^{/{\"variant\":\"$v\",/" >> "$OUT/ab.jsonl"
    done
  done
  echo "round $round at $((SECONDS - start)) s"
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l)
    runs[(r["model"].split("/")[-1], r["variant"])].append(round(r["decode_tps"]))
for k, v in runs.items(): print(*k, v)
PY
