#!/usr/bin/env bash
# Session 27, fourth call: is the 0.11-0.12 s pause that s27-offsets-tests.sh measured (a stream
# stalled while a 3,000-word prompt arrives, whatever the prefill step) a first-use cost of
# the server's first long prefill? Each server here first answers a prompt of 1,000 words,
# then the long-prompt measurement runs as before. Carry .device/oxlm-c.gz .device/cache
# .device/smollm2-tokenizer.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz .device/oxlm-c.gz 2>/dev/null
chmod +x .device/oxlm-c
S=/tmp/models/serve-0.85b
[ -f $S/model.safetensors ] || python3 benches/gpu/synthetic_mlx.py $S --hidden 2048 \
  --intermediate 5632 --layers 16 --heads 32 --kv-heads 8 --vocab 49152 --bits 4 > "$OUT/model.log" 2>&1
cp .device/smollm2-tokenizer/* $S/
cd benches && python3 - "$S" <<'PY' 2>&1 | tee "$OUT/pause.txt"
import sys
import serve_bench as sb
model = sys.argv[1]
for step in ["2048", "128"]:
    for warm in [False, True]:
        process, base = sb.started(["../.device/oxlm-c", "serve", "--model", model, "--device",
                                    "cuda", "--prefill-step-size", step, "--log-level", "WARNING"])
        try:
            if warm:
                sb.post(base, {"prompt": " ".join(["word"] * 1000), "max_tokens": 1})
            longest, median, took = sb.long_prompt(base, 3000, 3000)
        finally:
            process.terminate()
            process.wait()
        print(f"step {step}, warmed by a long prompt: {warm}: longest pause {longest:.3f} s, "
              f"median {median:.4f} s; the long prompt took {took:.2f} s", flush=True)
PY
