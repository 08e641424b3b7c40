#!/usr/bin/env bash
# `oxlm convert` against `mlx_lm convert` on this machine, in one run: wall time and peak memory
# (max RSS) of each, converting the same fp16 Hugging Face checkpoints to 4 bits in groups of 64;
# then the 1.6 GB llama in a memory cgroup of 512 MiB (page cache included; where cgroup v1's memory
# controller is writable, as root); then `oxlm convert --gguf` on the three
# real GGUFs, which mlx-lm cannot import (K-quants).
#
# usage: benches/convert.sh [llama-0.85b|qwen2.5-coder-0.5b|smollm2-135m ...]   (default: all three)
# The sources come from benches/models.sh --hf-only (a few minutes the first time).
set -Eeuo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release -p oxlm-cli >&2
PY="$(scripts/oracle/venv.sh)"
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(smollm2-135m qwen2.5-coder-0.5b llama-0.85b)
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

measure() {  # the command's "seconds peak_kb", its output discarded
  /usr/bin/time -f "%e %M" -o "$scratch/time" "$@" > /dev/null 2>&1 || { echo "failed: $*" >&2; exit 1; }
  cat "$scratch/time"
}

mb() { echo $(( $1 / 1024 )); }

echo "| source | size | oxlm convert | mlx_lm convert | speed-up | oxlm peak RSS | mlx-lm peak RSS |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for name in "${names[@]}"; do
  hf="$(benches/models.sh --hf-only "$name")/hf"
  size_kb=$(du -sk --exclude='*.json' "$hf" | cut -f1)
  read -r ox_s ox_kb < <(measure target/release/oxlm convert --hf-path "$hf" --mlx-path "$scratch/oxlm" -q --q-bits 4 --q-group-size 64)
  read -r ml_s ml_kb < <(measure "$PY" -m mlx_lm convert --hf-path "$hf" --mlx-path "$scratch/mlx" -q --q-bits 4 --q-group-size 64)
  rm -rf "$scratch/oxlm" "$scratch/mlx"
  printf '| %s fp16 | %s MB | %.2f s | %.2f s | %.1fx | %s MB (%d%% of the source) | %s MB (%d%%) |\n' \
    "$name" "$(mb "$size_kb")" "$ox_s" "$ml_s" "$(echo "$ml_s / $ox_s" | bc -l)" \
    "$(mb "$ox_kb")" $(( 100 * ox_kb / size_kb )) "$(mb "$ml_kb")" $(( 100 * ml_kb / size_kb ))
done
limit=/sys/fs/cgroup/memory/oxlm-convert-bench
if mkdir -p "$limit" 2>/dev/null && echo $((512 << 20)) > "$limit/memory.limit_in_bytes"; then
  in_limit() {  # the command's exit status inside the cgroup
    bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$limit" "$@" > /dev/null 2>&1 && echo 0 || echo $?
  }
  hf="$(benches/models.sh --hf-only llama-0.85b)/hf"
  echo
  echo "In 512 MiB (llama-0.85b fp16, $(( $(du -sk --exclude='*.json' "$hf" | cut -f1) / 1024 )) MB): oxlm convert exits" \
    "$(in_limit target/release/oxlm convert --hf-path "$hf" --mlx-path "$scratch/oxlm" -q)," \
    "mlx_lm convert exits $(in_limit "$PY" -m mlx_lm convert --hf-path "$hf" --mlx-path "$scratch/mlx" -q)" \
    "(137: killed for memory)."
  rm -rf "$scratch/oxlm" "$scratch/mlx"
  rmdir "$limit"
fi
echo
echo "| GGUF | size | oxlm convert --gguf | peak RSS |"
echo "|---|---:|---:|---:|"
for model in smollm2 qwen2.5 gemma3; do
  gguf="$(scripts/models/fetch_gguf.sh "$model")"
  size_kb=$(du -k "$gguf" | cut -f1)
  read -r s kb < <(measure target/release/oxlm convert --gguf "$gguf" --mlx-path "$scratch/gguf")
  rm -rf "$scratch/gguf"
  printf '| %s | %s MB | %.2f s | %s MB |\n' "$(basename "$gguf")" "$(mb "$size_kb")" "$s" "$(mb "$kb")"
done
