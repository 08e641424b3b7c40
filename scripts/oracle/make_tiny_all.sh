#!/usr/bin/env bash
# Regenerates every fixture under tests/fixtures/tiny (tokenizer, tiny MLX checkpoints, goldens). ~20 s on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$(scripts/oracle/venv.sh)
out="${1:-tests/fixtures/tiny}"
"$PY" scripts/oracle/make_tiny_tokenizer.py "$out/tokenizer"
"$PY" scripts/oracle/make_tiny_models.py "$out"
# make_tiny_models.py's models only: the scripts below make their own models' goldens (make_goldens.py alone
# would run Gemma 3n's cache-free forward without the caches its KV-shared layers read).
"$PY" scripts/oracle/make_goldens.py "$out" $("$PY" -c 'import sys; sys.path.insert(0, "scripts/oracle")
import make_tiny_models; print(*make_tiny_models.MODELS)')
"$PY" scripts/oracle/make_tiny_qwen3_5.py "$out"   # builds its models and their goldens
"$PY" scripts/oracle/make_tiny_gemma.py "$out"     # builds its models and their goldens
"$PY" scripts/oracle/make_embedding_fixture.py "$out"  # a Qwen3-Embedding checkpoint and its embeddings
"$PY" scripts/oracle/numpy_reference.py "$out"   # independent numpy forward must match the goldens (< 1e-3)
