#!/usr/bin/env bash
# Prints the path of the benchmark's python (llama-cpp-python built from its sdist, mistralrs, gguf),
# creating the venv on first use. The llama.cpp build takes ~16 min of CPU on 2 vCPUs.
# Usage: PY=$(benches/venv.sh)
set -euo pipefail
cache="${OXLM_CACHE:-$HOME/.cache/oxlm}"
venv="$cache/bench-venv"
stamp="$venv/.oxlm-pins-3"
# The processor's own instruction sets (as -march=native would pick) except AMX: its tiles fault
# in some VMs (llama.cpp segfaulted on every quantized model on a Xeon VM that lists amx_int8).
llama_cpp_cmake_args() {
  local flags args="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF"
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  local f opt
  for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
           avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    opt=OFF
    case "$flags" in *" ${f%%:*} "*) opt=ON ;; esac
    args="$args -DGGML_${f##*:}=$opt"
  done
  echo "$args"
}

if [ ! -f "$stamp" ]; then
  mkdir -p "$cache"
  python3 -m venv "$venv" >&2
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" "numpy<3" "gguf==0.19.0" "mistralrs==0.9.5" "tokenizers==0.23.3" >&2
  # A local copy of the sdist skips the 77 MB download. `--no-binary :all:` would also build cmake
  # itself from source, so only llama-cpp-python is forced to build (and not from pip's wheel
  # cache, which ignores CMAKE_ARGS). Multimodal (mtmd) is not needed.
  sdist="$cache/downloads/llama_cpp_python-0.3.36.tar.gz"
  [ -f "$sdist" ] || sdist="llama-cpp-python==0.3.36"
  CMAKE_ARGS="$(llama_cpp_cmake_args)" "${pip[@]}" --no-cache-dir --no-binary llama-cpp-python "$sdist" >&2
  touch "$stamp"
fi
echo "$venv/bin/python"
