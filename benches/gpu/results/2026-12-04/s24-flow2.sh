#!/usr/bin/env bash
# Session 24's second call: s24-flow.py again, with the weights copied in but not read (the
# bulk copies' own rate), and rings of 3 to 24 stages.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
timeout 200 python3 benches/gpu/results/2026-12-04/s24-flow.py .device/flow.cubin 2>&1 | tee "$OUT/flow.txt"
