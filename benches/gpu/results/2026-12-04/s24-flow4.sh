#!/usr/bin/env bash
# Session 24's seventh call: the 0.85B's chain in s24-flow.py's persistent kernel, its parts
# taken away one by one (the fence before each count, the reads of the operation before's
# output and the writes of its own, the sums over the weights, the waits), to see what an
# operation's fixed cost is made of.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
FLOW_PARTS=1 timeout 120 python3 benches/gpu/results/2026-12-04/s24-flow.py .device/flow.cubin 2>&1 | tee "$OUT/flow.txt"
