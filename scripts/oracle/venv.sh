#!/usr/bin/env bash
# Prints the path of the oracle's python (mlx-lm and friends, pinned), creating the venv on first use.
# Usage: PY=$(scripts/oracle/venv.sh)
set -euo pipefail
cache="${OXLM_CACHE:-$HOME/.cache/oxlm}"
venv="$cache/oracle-venv"
stamp="$venv/.oxlm-pins-1"
if [ ! -f "$stamp" ]; then
  mkdir -p "$cache"
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "mlx[cpu]==0.32.4" "mlx-lm==0.32.2" "transformers==5.24.0" "tokenizers==0.23.3" \
    "gguf==0.19.0" "tiktoken==0.14.0" "jinja2==3.1.6" "numpy<3" >&2
  touch "$stamp"
fi
echo "$venv/bin/python"
