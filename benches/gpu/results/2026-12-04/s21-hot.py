# Runs s21-hot.cu's kernel (compiled here for sm_90 by NVRTC into hot.cubin, carried) through
# the driver API: nanoseconds an iteration (220 iterations less 20, 20 launches each), by the
# row's length, the grid and the copies read. Usage: python3 s21-hot.py hot.cubin
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
def ck(r):
    assert r == 0, r
ck(cu.cuInit(0))
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ck(cu.cuCtxSetCurrent(ctx))
mod = ctypes.c_void_p(); ck(cu.cuModuleLoadData(ctypes.byref(mod), open(sys.argv[1], 'rb').read()))
fn = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"hot"))
buf = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(buf), 600 * 1024 * 32 * 4))
ck(cu.cuMemsetD8_v2(buf, 0, 600 * 1024 * 32 * 4))
outp = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(outp), 64))
e0, e1 = ctypes.c_void_p(), ctypes.c_void_p()
ck(cu.cuEventCreate(ctypes.byref(e0), 0)); ck(cu.cuEventCreate(ctypes.byref(e1), 0))
def launch(grid, threads, replicas, vec, iters):
    args = [ctypes.c_uint64(buf.value), ctypes.c_int(replicas), ctypes.c_int(vec), ctypes.c_int(iters), ctypes.c_uint64(outp.value)]
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    ck(cu.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, 0, None, ptrs, None))
def per_iter(grid, threads, replicas, vec):
    res = []
    for iters in (20, 220):
        launch(grid, threads, replicas, vec, iters)
        ck(cu.cuEventRecord(e0, None))
        for _ in range(20): launch(grid, threads, replicas, vec, iters)
        ck(cu.cuEventRecord(e1, None)); ck(cu.cuEventSynchronize(e1))
        ms = ctypes.c_float(); ck(cu.cuEventElapsedTime(ctypes.byref(ms), e0, e1))
        res.append(ms.value * 1000 / 20)
    return (res[1] - res[0]) / 200
for vec in (2048, 5632):
    for grid, threads in ((1, 256), (132, 256), (264, 256), (528, 256), (132, 512)):
        row = []
        for replicas in (1, 2, 4, 8, 16, 64, grid):
            if replicas > grid: continue
            row.append(f"r{replicas}={per_iter(grid, threads, replicas, vec)*1000:.0f}ns")
        print(f"vec {vec} grid {grid}x{threads}:", " ".join(row), flush=True)
