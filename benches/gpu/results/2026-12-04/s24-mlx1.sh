#!/usr/bin/env bash
# Session 24's eighth call: the first part of MLX's CUDA library and the MLX and mlx-lm wheels
# (benches/gpu/prepare.sh), kept on the machine by device.sh's mlx stage for the next call, which
# brings the second part; the benchmark models written meanwhile, in the background.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
benches/gpu/device.sh mlx
rm -f /tmp/models.done
setsid bash -c 'benches/gpu/device.sh models > /tmp/models.log 2>&1; touch /tmp/models.done' \
  > /dev/null 2>&1 < /dev/null &
ls -la /tmp/mlx
