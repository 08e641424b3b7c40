"""Registers, spills and shared memory of every CUDA kernel, as ptxas reports them when NVRTC
compiles oxlm's kernel source (printed by the engine's `kernel_source` example) for a GPU
architecture: no GPU needed, only libnvrtc (the PyPI package nvidia-cuda-nvrtc that
scripts/test.sh installs into the oracle venv).

usage: $(scripts/oracle/venv.sh) benches/gpu/ptxas_report.py [--arch sm_90] [--filter REGEX]
(about a minute on 2 cores)
"""

import argparse
import ctypes
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernel_source() -> bytes:
    example = ["cargo", "run", "-q", "--release", "-p", "oxlm-engine", "--example", "kernel_source"]
    return subprocess.run(example, cwd=ROOT, check=True, capture_output=True).stdout


def nvrtc():
    import nvidia.cu13

    lib = os.path.join(list(nvidia.cu13.__path__)[0], "lib")
    # NVRTC opens its builtins by name: loaded first, they need no LD_LIBRARY_PATH.
    ctypes.CDLL(os.path.join(lib, "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(os.path.join(lib, "libnvrtc.so.13"))


def compile_log(arch: str) -> str:
    nv = nvrtc()
    prog = ctypes.c_void_p()
    src = kernel_source()
    check = lambda rc, what: rc == 0 or sys.exit(f"{what} failed: {rc}")
    check(nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None), "create")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    text = log.value.decode()
    if rc != 0:
        sys.exit(text)
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--filter", default="")
    args = ap.parse_args()
    name, spill, rows = None, "", []
    for line in compile_log(args.arch).splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        used = re.search(r"Used (\d+) registers", line)
        if entry:
            name, spill = entry.group(1), ""
        elif frame and name:
            spill = f"stack {frame.group(1)} spill {frame.group(2)}/{frame.group(3)}"
        elif used and name:
            smem = re.search(r"(\d+) bytes smem", line)
            rows.append((name, int(used.group(1)), smem.group(1) if smem else "0", spill))
            name = None
    for name, regs, smem, spill in rows:
        if re.search(args.filter, name):
            print(f"{name:40s} {regs:4d} regs  smem {smem:>6s}  {spill}")


if __name__ == "__main__":
    main()
