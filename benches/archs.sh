#!/usr/bin/env bash
# The architectures benchmark, one command: builds oxlm, the bandwidth probe and the models
# (benches/make_archs.py: a synthetic 0.85B llama and, at its budget, Qwen3.5, Phi-3, OLMo 3, LFM2,
# Qwen3-MoE, DeepSeek-V3, GLM-4.5 MoE and Qwen3-Next; a synthetic Gemma 4 MoE; the real
# Gemma-3-270M), then runs benches/archs.py and writes its table into BENCHMARKS.md.
#
# usage: benches/archs.sh [archs.py options, e.g. --threads 1 --repeats 5, --models llama-0.85b,...]
# Cold: about 10 minutes of model building (mlx-lm on the CPU, under a minute a model, 5 GB on
# disk), then about half an hour of runs on 2 CPUs.
# The GPU's figures: benches/gpu/device.sh's `archs` stage (the same models, written there).
set -Eeuo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release -p oxlm-cli >&2
cargo build --release -p oxlm-engine --example membw >&2
PY="$(scripts/oracle/venv.sh)"
scripts/models/fetch_models.sh gemma3 >/dev/null
"$PY" benches/make_archs.py "${OXLM_CACHE:-$HOME/.cache/oxlm}/bench-models/archs" >&2
exec "$PY" benches/archs.py --oxlm target/release/oxlm --write BENCHMARKS.md "$@"
