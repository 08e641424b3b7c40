#!/usr/bin/env bash
# Session 18's third call. (1) How many query heads a warp of the batched attention takes
# (temporary switch OXLM_ATTN_G: main takes 4 of the llamas' groups of 4; 2 and 1 put more
# warps on each key/value head, whose split merges then run side by side): the GPU tests under
# each, then the 0.85B and 7.2B llamas at 1, 2, 4, 8 and 16 sequences (4-bit, 512-token
# prompts, 128 tokens), two rounds. (2) Main's build against the decode_block branch's
# (.device/oxlm-b) with its block kernel off (OXLM_DECODE_BLOCK=0), which leaves its other
# changes (activations and the residual read through L2, attention's pointers unrestricted):
# one sequence, two rounds.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
start=$SECONDS
gunzip -f .device/oxlm-b.gz
benches/gpu/device.sh models
echo "models at $((SECONDS - start)) s"
for g in 4 2 1; do
  for t in .device/tests/*; do
    echo "== OXLM_ATTN_G=$g $t"
    OXLM_ATTN_G=$g timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1; echo "rc $?"
  done
done > "$OUT/tests.log" 2>&1
grep -E "^(==|rc|test result|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
echo "tests at $((SECONDS - start)) s"
run() { # G, model
  OXLM_ATTN_G=$1 timeout 100 .device/oxlm bench --device cuda --model /tmp/models/$2-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 \
    | sed "s/^{/{\"g\":\"$1\",/" >> "$OUT/ab.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b llama-7.2b; do
    for g in 4 2 1; do run $g $m; done
  done
  echo "round $round at $((SECONDS - start)) s"
done
one() { # build tag, binary, model
  OXLM_DECODE_BLOCK=0 timeout 60 $2 bench --device cuda --model /tmp/models/$3-4 --prompt-tokens 512 \
    --gen-tokens 128 --repeats 1 | sed "s/^{/{\"build\":\"$1\",/" >> "$OUT/one.jsonl"
}
for round in 1 2; do
  for m in llama-0.85b qwen2.5-0.5b llama-7.2b; do
    one main .device/oxlm $m
    one branch .device/oxlm-b $m
  done
done
echo "all done at $((SECONDS - start)) s"
python3 - "$OUT" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/ab.jsonl"):
    r = json.loads(l)
    print("G", r["g"], r["model"].split("/")[-1], round(r["decode_tps"]),
          [(b.get("sequences"), round(b.get("decode_tps", 0))) for b in r["batches"]])
for l in open(sys.argv[1] + "/one.jsonl"):
    r = json.loads(l)
    print(r["build"], r["model"].split("/")[-1], round(r["decode_tps"], 1))
PY
