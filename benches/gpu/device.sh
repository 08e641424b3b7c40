#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with what benches/gpu/prepare.sh left in
# .device/: the stripped oxlm binary, the GPU test binaries and the compiled-kernel cache.
#
# usage: benches/gpu/device.sh [tests] [bench] ...   (stages, in order; default: tests bench)
#   tests  every carried test binary (CUDA op parity, tiny-model parity on the GPU)
#   bench  synthetic llama 0.85B at 4 and 8 bits and 7.2B at 4 bits (random weights written
#          here by synthetic_mlx.py): decode after a 512-token prompt, prefill of 512 and 2048
# Logs and a JSON line per bench go to $OUT (or ./out).
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
# The test binaries find tests/fixtures through the path they were built at.
mkdir -p /work && [ -e /work/main ] || ln -s "$PWD" /work/main
stages=("${@:-tests bench}")
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"

run_tests() {
  for t in .device/tests/*; do
    echo "== $t"
    "$t" --test-threads=1 2>&1 | tail -60
  done 2>&1 | tee "$OUT/tests.log" | grep -E "^(==|test result|test .* FAILED|thread .* panicked)" 
}

bench_model() {  # name, synthetic_mlx.py args...
  local name=$1; shift
  local dir=/tmp/models/$name
  [ -f "$dir/config.json" ] || python3 benches/gpu/synthetic_mlx.py "$dir" "$@" >&2
  for prompt in 512 2048; do
    .device/oxlm bench --device cuda --model "$dir" --prompt-tokens "$prompt" --gen-tokens 128 \
      --repeats 3 | tee -a "$OUT/bench.jsonl"
  done
}

run_bench() {
  bench_model llama-0.85b-4bit --bits 4
  bench_model llama-0.85b-8bit --bits 8
  bench_model llama-7.2b-4bit --bits 4 --hidden 4096 --intermediate 14336 --layers 32
}

for stage in ${stages[@]}; do
  case $stage in
    tests) run_tests ;;
    bench) run_bench ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
