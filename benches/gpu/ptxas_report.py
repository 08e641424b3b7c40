"""Registers, spills and shared memory of every kernel in kernels.cu, as ptxas reports them when
NVRTC compiles the file for a GPU architecture: no GPU needed, only libnvrtc (the PyPI package
nvidia-cuda-nvrtc that scripts/test.sh installs into the oracle venv).

usage: python benches/gpu/ptxas_report.py [--arch sm_90] [--filter REGEX]
"""

import argparse
import ctypes
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "crates/engine/src/cuda/kernels.cu")


def nvrtc():
    import nvidia.cu13

    lib = os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so.13")
    return ctypes.CDLL(lib)


def compile_log(arch: str) -> str:
    nv = nvrtc()
    prog = ctypes.c_void_p()
    src = open(SOURCE, "rb").read()
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
    name, rows = None, []
    for line in compile_log(args.arch).splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            spill = ""
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spill = f"stack {m.group(1)} spill {m.group(2)}/{m.group(3)}"
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if not m:
            m2 = re.search(r"Used (\d+) registers", line)
            m = m2
        if m and name:
            smem = re.search(r"(\d+) bytes smem", line)
            rows.append((name, int(m.group(1)), smem.group(1) if smem else "0", spill))
            name = None
    for name, regs, smem, spill in rows:
        if re.search(args.filter, name):
            print(f"{name:40s} {regs:4d} regs  smem {smem:>6s}  {spill}")


if __name__ == "__main__":
    main()
