#!/usr/bin/env bash
# Session 24's third call: s24-flow.py with each thread's reads of the operation before's output
# issued together (eight at once) rather than one after another, and the pick taking the head
# blocks' partial picks rather than all 32,000 logits in one block.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
timeout 200 python3 benches/gpu/results/2026-12-04/s24-flow.py .device/flow.cubin 2>&1 | tee "$OUT/flow.txt"
