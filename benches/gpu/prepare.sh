#!/usr/bin/env bash
# Builds, here, what benches/gpu/device.sh runs on the GPU machine, into .device/ (ignored by
# git; name it in the device call's carry): the release oxlm binary and the GPU test binaries,
# stripped, and the kernels compiled for sm_90 (needs NVRTC: pip package nvidia-cuda-nvrtc, its
# lib folder on LD_LIBRARY_PATH), so that the machine spends no time compiling.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .device && mkdir -p .device/tests .device/cache
cargo build --release -p oxlm-cli
cp target/release/oxlm .device/oxlm
cargo test --no-run -p oxlm-engine --test cuda_ops -p oxlm-models --test tiny_parity \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["executable"])' | while read -r exe; do cp "$exe" ".device/tests/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
strip .device/oxlm .device/tests/*
OXLM_CACHE="$PWD/.device/cache" cargo test -q -p oxlm-engine --test cuda_ops kernels_compile
du -sh .device/* .device/cache/*
