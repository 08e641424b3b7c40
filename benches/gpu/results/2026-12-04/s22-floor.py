# Session 22: the floor of a decode step made of one kernel per operation. Runs s22-floor.cu's
# links (compiled here for sm_90 by NVRTC into floor.cubin, carried) through the driver API,
# captured into one CUDA graph per step and replayed: microseconds a step and a link, for
# chains shaped as the 0.85B and 7.2B llamas' steps (5 kernels a layer, then the head and the
# pick, each streaming that kernel's bytes). Usage: python3 s22-floor.py floor.cubin
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
def ck(r):
    assert r == 0, r
ck(cu.cuInit(0))
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ck(cu.cuCtxSetCurrent(ctx))
mod = ctypes.c_void_p(); ck(cu.cuModuleLoadData(ctypes.byref(mod), open(sys.argv[1], 'rb').read()))
def fn(name):
    f = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(f), mod, name)); return f
EMPTY, READ, STREAM = fn(b"link_empty"), fn(b"link_read"), fn(b"link_stream")
stream = ctypes.c_void_p(); ck(cu.cuStreamCreate(ctypes.byref(stream), 1))
MB = 1e6
WEIGHTS = int(4.2e9)
w = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(w), ctypes.c_size_t(WEIGHTS)))
ck(cu.cuMemsetD8_v2(w, ctypes.c_ubyte(1), ctypes.c_size_t(WEIGHTS)))
N = 8192
bufs = []
for _ in range(2):
    b = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(4 * N)))
    ck(cu.cuMemsetD8_v2(b, ctypes.c_ubyte(0), ctypes.c_size_t(4 * N))); bufs.append(b)

class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]
class Config(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("nattrs", ctypes.c_uint)]
attr = Attr(); attr.id = 6; attr.value = 1  # programmatic stream serialization

def launch(f, grid, threads, args, pdl):
    keep = [a for a in args]
    ptrs = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in keep])
    cfg = Config(grid, 1, 1, threads, 1, 1, 0, stream, ctypes.pointer(attr) if pdl else None, 1 if pdl else 0)
    ck(cu.cuLaunchKernelEx(ctypes.byref(cfg), f, ptrs, None))
    return keep

def step_graph(links, pdl):
    """links: (kernel, grid, threads, bytes streamed or None, read)."""
    ck(cu.cuStreamBeginCapture_v2(stream, 0))
    offset = 0
    for k, (f, grid, threads, nbytes, read) in enumerate(links):
        x, y = bufs[k % 2], bufs[(k + 1) % 2]
        n = ctypes.c_int(2048)
        if f is STREAM:
            units = nbytes // 16
            args = [ctypes.c_uint64(x.value), ctypes.c_uint64(y.value), n,
                    ctypes.c_uint64(w.value + offset), ctypes.c_longlong(units), ctypes.c_int(read)]
            offset += units * 16
            assert offset <= WEIGHTS
        else:
            args = [ctypes.c_uint64(x.value), ctypes.c_uint64(y.value), n]
        launch(f, grid, threads, args, pdl)
    g = ctypes.c_void_p(); ck(cu.cuStreamEndCapture(stream, ctypes.byref(g)))
    ex = ctypes.c_void_p(); ck(cu.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_ulonglong(0)))
    return ex

e0, e1 = ctypes.c_void_p(), ctypes.c_void_p()
ck(cu.cuEventCreate(ctypes.byref(e0), 0)); ck(cu.cuEventCreate(ctypes.byref(e1), 0))
def us_per_step(ex, reps=100):
    for _ in range(5): ck(cu.cuGraphLaunch(ex, stream))
    ck(cu.cuEventRecord(e0, stream))
    for _ in range(reps): ck(cu.cuGraphLaunch(ex, stream))
    ck(cu.cuEventRecord(e1, stream)); ck(cu.cuEventSynchronize(e1))
    ms = ctypes.c_float(); ck(cu.cuEventElapsedTime(ctypes.byref(ms), e0, e1))
    return ms.value * 1000 / reps

def shape(layer_mb, head_mb, layers):
    sizes = [0.004]  # the embedding row
    for _ in range(layers): sizes += layer_mb
    return sizes + [head_mb, 0.128]

# Bytes each kernel reads, 4-bit MLX g64 (0.5625 bytes a weight) and an f16 cache of 640 keys.
LLAMA_085 = shape([3.539, 1.311, 2.359, 12.976, 6.488], 36.864, 16)
LLAMA_72 = shape([14.156, 2.621, 9.437, 66.060, 33.030], 73.728, 32)

big = step_graph([(STREAM, 528, 256, int(442.7 * MB), 0)], True)
t = us_per_step(big, 50)
bw = 442.7 * MB / (t * 1e-6) / 1e12
print(f"one kernel streaming 442.7 MB: {t:.1f} us, {bw:.3f} TB/s")
for grid, threads in ((528, 256), (264, 512), (132, 256)):
    for f, name in ((EMPTY, "empty"), (READ, "read 8 KB")):
        for pdl in (True, False):
            ex = step_graph([(f, grid, threads, None, 1)] * 83, pdl)
            t = us_per_step(ex)
            print(f"83 links {name:9s} grid {grid}x{threads} pdl={int(pdl)}: {t:7.1f} us a step, {t / 83:.2f} us a link")
for label, sizes in (("0.85B", LLAMA_085), ("7.2B", LLAMA_72)):
    total = sum(sizes) * MB
    for grid, threads in ((528, 256), (264, 512)):
        for read in (1, 0):
            ex = step_graph([(STREAM, grid, threads, int(s * MB), read) for s in sizes], True)
            t = us_per_step(ex, 50)
            print(f"{label} step: {len(sizes)} links streaming {total / MB:.1f} MB, read={read}, grid {grid}x{threads}: "
                  f"{t:.1f} us, {1e6 / t:.0f} steps/s, {total / (t * 1e-6) / 4.277e12 * 100:.1f}% of 4.277 TB/s, "
                  f"{total / (t * 1e-6) / (bw * 1e12) * 100:.1f}% of the one kernel's rate")
