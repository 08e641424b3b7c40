#!/usr/bin/env bash
# Fuzzes oxlm's parsers for SECONDS (default 60): every target of fuzz/fuzz_targets (safetensors
# files, config.json, request bodies, model output's tool calls, tokenizer_config.json) at once,
# from seeds made of tests/fixtures. Fails on any crash, naming the input that caused it; rerun
# one with `cd fuzz && cargo fuzz run -s none --dev TARGET INPUT`.
#
# libFuzzer through cargo-fuzz on stable Rust, so without sanitizers (they need nightly): what is
# caught is a panic (overflows included: debug assertions are on), an abort, a stack overflow, an
# allocation over 2 GB, or an input that takes over 20 s.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
TIME="${1:-60}"
CARGO_FUZZ_VERSION=0.13.2

if [ "$(cargo fuzz --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
  cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi
python3 seeds.py corpus
cargo fuzz build -s none --dev

# The targets make their scratch model directories here.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
targets=$(cargo fuzz list)
for target in $targets; do
  TMPDIR="$scratch" cargo fuzz run -s none --dev "$target" -- -max_total_time="$TIME" \
    -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 >"$scratch/$target.log" 2>&1 &
  echo $! >"$scratch/$target.pid"
done
passed=0
failed=0
for target in $targets; do
  log="$scratch/$target.log"
  if wait "$(cat "$scratch/$target.pid")"; then
    passed=$((passed + 1))
    echo "fuzz: $target: $(grep -o '^stat::number_of_executed_units: [0-9]*' "$log" | cut -d' ' -f2) inputs, no crash"
  else
    failed=$((failed + 1))
    tail -n 60 "$log"
    echo "fuzz: $target FAILED: $(grep -o 'Test unit written to .*' "$log" | tail -n 1)"
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
