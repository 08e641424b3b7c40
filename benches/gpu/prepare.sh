#!/usr/bin/env bash
# Builds, here, what benches/gpu/device.sh runs on the GPU machine, into .device/ (ignored by
# git; name it in the device call's carry): the release oxlm binary and the GPU test binaries,
# stripped, and the kernels compiled for sm_90, plain and traced (`OXLM_TRACE`), gzipped (10 MB
# each, 3 MB so; device.sh unpacks them), so that the machine spends no time compiling. That
# needs the NVRTC the machine has, 13.0 (the cache's key holds NVRTC's major.minor: kernels
# from 13.5 were compiled again there, over two minutes of device time a variant): pip package
# nvidia-cuda-nvrtc==13.0.88, its lib folder on LD_LIBRARY_PATH. And, kept from
# one run to the next, llama.cpp's source from the llama-cpp-python 0.3.36 sdist, trimmed to
# the CUDA backend (about 10 MB), which device.sh builds there; and SmolLM2's tokenizer
# (scripts/models/fetch_models.sh), for device.sh's serving stages.
# AB=REV (a git revision: main, a branch, a commit) also builds oxlm and cuda_gemv at REV, in a
# worktree of its own (target/ab-src, built into target/ab), with its kernels in the same cache:
# .device/oxlm-NAME.gz and .device/cuda_gemv-NAME.gz (NAME: REV with any / as -), for
# device.sh's A/B (AB=NAME there).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .device/tests .device/cache .device/oxlm .device/oxlm-*.gz .device/cuda_gemv-*.gz
mkdir -p .device/tests .device/cache
cargo build --release -p oxlm-cli
cargo build --release -p oxlm-engine --example cuda_gemv
cp target/release/examples/cuda_gemv .device/cuda_gemv
cp target/release/oxlm .device/oxlm
cargo test --no-run -p oxlm-engine --test cuda_ops -p oxlm-models --test tiny_parity --test lora \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["executable"])' | while read -r exe; do cp "$exe" ".device/tests/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
strip .device/oxlm .device/cuda_gemv .device/tests/*
OXLM_CACHE="$PWD/.device/cache" cargo test -q -p oxlm-engine --test cuda_ops kernels_compile
if [ -n "${AB:-}" ]; then
  ab=${AB//\//-} root=$PWD src=$PWD/target/ab-src
  rm -rf "$src" && git worktree prune && git worktree add -q --detach "$src" "$AB"
  (
    cd "$src"
    export CARGO_TARGET_DIR="$root/target/ab"
    cargo build --release -p oxlm-cli
    cargo build --release -p oxlm-engine --example cuda_gemv
    OXLM_CACHE="$root/.device/cache" cargo test -q -p oxlm-engine --test cuda_ops kernels_compile
  )
  git worktree remove --force "$src"
  cp target/ab/release/oxlm ".device/oxlm-$ab"
  cp target/ab/release/examples/cuda_gemv ".device/cuda_gemv-$ab"
  strip ".device/oxlm-$ab" ".device/cuda_gemv-$ab"
  gzip -f ".device/oxlm-$ab" ".device/cuda_gemv-$ab"
fi
rm -f .device/cache/cuda/kernels-sm_80-*
gzip -1 .device/cache/cuda/*.cubin
if [ ! -f .device/llama.cpp.tgz ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp" llama-cpp-python==0.3.36
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp"
  rm -rf "$src"/models/*.gguf "$src"/models/*.inp "$src"/models/*.out "$src"/docs "$src"/benches
  for b in sycl vulkan opencl hexagon cann musa hip metal webgpu openvino zdnn zendnn virtgpu et; do
    rm -rf "$src/ggml/src/ggml-$b"
  done
  tar czf .device/llama.cpp.tgz -C "$src/.." llama.cpp
  rm -rf "$tmp"
fi
# mlx-lm as a peer (device.sh's `mlx` stage): the wheels of MLX 0.32.4 for the machine's Python
# (3.12) and CUDA (13), and mlx-lm 0.32.2, the oracle's versions, without dependencies (the
# machine's PyTorch brings the CUDA 13 libraries MLX opens). MLX's CUDA library is a 90 MB wheel,
# over what one call carries, so it comes recompressed (75 MB) in two parts (40 and 32 MiB),
# each carried by a call of its own: .device/mlx/part1 with the wheels, then .device/mlx/part2
# with the rest.
if [ ! -f .device/mlx/part2 ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_35_x86_64 -d "$tmp" mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2
  mkdir -p .device/mlx "$tmp/cuda"
  mv "$tmp"/mlx-0.32.4-*.whl "$tmp"/mlx_lm-0.32.2-*.whl .device/mlx/
  (cd "$tmp/cuda" && python3 -m zipfile -e "$tmp"/mlx_cuda_13-0.32.4-*.whl . && tar cf - . | xz -T2 -9) \
    > "$tmp/cuda.tar.xz"
  split -b 40M -d -a 1 "$tmp/cuda.tar.xz" "$tmp/part"
  mv "$tmp/part0" .device/mlx/part1
  mv "$tmp/part1" .device/mlx/part2
  rm -rf "$tmp"
fi
if [ ! -f .device/smollm2-tokenizer/tokenizer.json ]; then
  smol=$(scripts/models/fetch_models.sh smollm2)
  mkdir -p .device/smollm2-tokenizer
  cp "$smol/tokenizer.json" "$smol/tokenizer_config.json" .device/smollm2-tokenizer/
fi
du -sh .device/* .device/cache/*
