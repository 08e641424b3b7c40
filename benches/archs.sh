#!/usr/bin/env bash
# The architectures benchmark, one command: builds oxlm, the bandwidth probe and the models
# (synthetic llama and Qwen3.5 of 0.85B, a synthetic Gemma 4 MoE, the real Gemma-3-270M), then runs
# benches/archs.py and writes its table into BENCHMARKS.md.
#
# usage: benches/archs.sh [archs.py options, e.g. --threads 1 --repeats 5]
# Cold: a few minutes of model building (mlx-lm on the CPU), then about 15 minutes of runs on 2 CPUs.
set -Eeuo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release -p oxlm-cli >&2
cargo build --release -p oxlm-engine --example membw >&2
PY="$(scripts/oracle/venv.sh)"
scripts/models/fetch_models.sh gemma3 >/dev/null
"$PY" benches/make_archs.py "${OXLM_CACHE:-$HOME/.cache/oxlm}/bench-models/archs" >&2
exec "$PY" benches/archs.py --oxlm target/release/oxlm --write BENCHMARKS.md "$@"
