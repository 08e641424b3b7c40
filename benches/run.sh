#!/usr/bin/env bash
# The CPU benchmark, one command: builds oxlm and the memory-bandwidth probe, the peers' venv
# (llama-cpp-python from its sdist, mistralrs, gguf) and the benchmark models, then runs
# benches/bench.py and writes its table into BENCHMARKS.md.
#
# usage: benches/run.sh [bench.py options, e.g. --models smollm2-135m --repeats 5 --threads 1,2]
# Cold, the llama.cpp build takes ~16 min of CPU and the models a few minutes; the run itself
# about half an hour on 2 CPUs.
set -Eeuo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release -p oxlm-cli >&2
cargo build --release -p oxlm-engine --example membw >&2
BPY="$(benches/venv.sh)"
benches/models.sh >/dev/null
exec "$BPY" benches/bench.py --oxlm target/release/oxlm --write BENCHMARKS.md "$@"
