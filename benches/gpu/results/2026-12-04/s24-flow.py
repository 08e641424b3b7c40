# Session 24: a decode step as one persistent kernel (s24-flow.cu, compiled here for sm_90 by
# NVRTC into flow.cubin, carried) against the twenty-second session's floor of one kernel per
# operation (231 us for the 0.85B's 442.7 MB, 45% of 4.277 TB/s). Chains shaped as the 0.85B's
# and 7.2B's steps: the embedding's row, 5 operations a layer (the fused projection, attention
# over 640 f16 keys and values on 32 blocks, the output projection, gate and up, down), the head
# and the pick, each streaming that operation's bytes. Launched back to back (one kernel a
# step, each step's counts above the last's). Usage: python3 s24-flow.py flow.cubin
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
def ck(r):
    assert r == 0, r
ck(cu.cuInit(0))
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ck(cu.cuCtxSetCurrent(ctx))
sms = ctypes.c_int(); ck(cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev))  # multiprocessors
SMS = sms.value
mod = ctypes.c_void_p(); ck(cu.cuModuleLoadData(ctypes.byref(mod), open(sys.argv[1], 'rb').read()))
ACT_WORDS = 4096
def shared(stages, kb):
    return stages * kb * 1024 + 4 * ACT_WORDS + 16 * stages
def fn(cw, stages, kb):
    f = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(f), mod, f"flow{cw}_{stages}x{kb}".encode()))
    ck(cu.cuFuncSetAttribute(f, 8, shared(stages, kb)))  # max dynamic shared bytes
    return f
# (consumer warps, stages, KiB a stage)
CONFIGS = [(16, 6, 32), (8, 6, 32), (16, 12, 16), (16, 3, 64)]
KERNELS = {c: fn(*c) for c in CONFIGS}
stream = ctypes.c_void_p(); ck(cu.cuStreamCreate(ctypes.byref(stream), 1))
MB = 1e6
WEIGHTS = int(4.2e9)
def alloc(n, byte):
    p = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)))
    ck(cu.cuMemsetD8_v2(p, ctypes.c_ubyte(byte), ctypes.c_size_t(n))); return p
w = alloc(WEIGHTS, 0x35)
ACT_STRIDE = 32768
acts = alloc(4 * ACT_STRIDE * 200, 0)
counts = alloc(4 * 200, 0)

class Op(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("slice", ctypes.c_uint32), ("blocks", ctypes.c_int),
                ("in_n", ctypes.c_int), ("out_n", ctypes.c_int)]

def chain(spec):
    """spec: (MB, blocks or None for every SM, in_n, out_n) per operation."""
    ops, offset, total = [], 0, 0
    for mb, blocks, in_n, out_n in spec:
        blocks = blocks or SMS
        slice_ = (int(mb * MB) // blocks + 15) // 16 * 16 if mb else 0
        ops.append(Op(offset, slice_, blocks, in_n, out_n))
        offset += slice_ * blocks; total += slice_ * blocks
        assert offset <= WEIGHTS
    arr = (Op * len(ops))(*ops)
    dev_ops = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(dev_ops), ctypes.c_size_t(ctypes.sizeof(arr))))
    ck(cu.cuMemcpyHtoD_v2(dev_ops, arr, ctypes.c_size_t(ctypes.sizeof(arr))))
    return dev_ops, len(ops), total

e0, e1 = ctypes.c_void_p(), ctypes.c_void_p()
ck(cu.cuEventCreate(ctypes.byref(e0), 0)); ck(cu.cuEventCreate(ctypes.byref(e1), 0))
def us_per_step(config, dev_ops, nops, mode, reps=200):
    f = KERNELS[config]
    cw = config[0]
    ck(cu.cuMemsetD8_v2(counts, ctypes.c_ubyte(0), ctypes.c_size_t(4 * 200)))
    def launch(epoch):
        args = [ctypes.c_uint64(w.value), ctypes.c_uint64(dev_ops.value), ctypes.c_int(nops),
                ctypes.c_uint64(acts.value), ctypes.c_int(ACT_STRIDE), ctypes.c_uint64(counts.value),
                ctypes.c_uint32(epoch), ctypes.c_int(mode)]
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        ck(cu.cuLaunchKernel(f, SMS, 1, 1, (cw + 1) * 32, 1, 1, shared(*config[1:]), stream, ptrs, None))
    for e in range(10): launch(e)
    ck(cu.cuEventRecord(e0, stream))
    for e in range(10, 10 + reps): launch(e)
    ck(cu.cuEventRecord(e1, stream)); ck(cu.cuEventSynchronize(e1))
    ms = ctypes.c_float(); ck(cu.cuEventElapsedTime(ctypes.byref(ms), e0, e1))
    return ms.value * 1000 / reps

def step(hidden, qkv, attn_out, inter, layer_mb, head_mb, vocab, layers):
    spec = [(hidden * 0.5625 / MB, 1, 0, hidden)]  # the embedding's row
    q, a, o, gu, d = layer_mb
    for _ in range(layers):
        spec += [(q, None, hidden, qkv), (a, 32, qkv, attn_out), (o, None, attn_out, hidden),
                 (gu, None, hidden, inter), (d, None, inter, hidden)]
    # The pick: the head's blocks leave each its slice's best (value, index); one block takes
    # the best of those.
    return spec + [(head_mb, None, hidden, vocab), (0, 1, 2 * SMS, 1)]

# Bytes each kernel reads, 4-bit MLX g64 (0.5625 bytes a weight) and an f16 cache of 640 keys,
# as s22-floor.py.
LLAMA_085 = step(2048, 3072, 2304, 5632, [3.539, 1.311, 2.359, 12.976, 6.488], 36.864, 32000, 16)
LLAMA_72 = step(4096, 6144, 4352, 14336, [14.156, 2.621, 9.437, 66.060, 33.030], 73.728, 32000, 32)

import os
if os.environ.get("FLOW_PARTS"):
    # What each part of an operation's fixed cost takes, on the 0.85B's chain.
    PARTS = ((1, "dataflow"), (1 | 8, "dataflow, no fence"), (1 | 16, "dataflow, no input or output"),
             (1 | 8 | 16, "dataflow, neither"), (1 | 4 | 8 | 16, "dataflow, neither, weights not read"),
             (4 | 8 | 16, "no waits, neither, weights not read"), (0, "no waits"))
    ops, n, total = chain(LLAMA_085)
    for config in ((16, 6, 32), (16, 12, 16)):
        for mode, name in PARTS:
            t = us_per_step(config, ops, n, mode, 200)
            print(f"0.85B: {n} operations, {total / MB:.1f} MB, {config}, {name}: {t:.1f} us a step, "
                  f"{total / (t * 1e-6) / 4.277e12 * 100:.1f}% of 4.277 TB/s, {t / n:.2f} us an operation", flush=True)
    sys.exit()
one, n1, b1 = chain([(442.7, None, 0, 1)])
for config in CONFIGS:
    for mode, name in ((0, "summed"), (4, "not read")):
        t = us_per_step(config, one, n1, mode, 50)
        print(f"one operation streaming {b1 / MB:.1f} MB, {config}, {name}: {t:.1f} us, {b1 / (t * 1e-6) / 1e12:.3f} TB/s", flush=True)
MODES = ((1, "dataflow, copies ahead"), (3, "dataflow, copies after the wait"), (0, "no waits"),
         (5, "dataflow, copies ahead, not read"), (4, "no waits, not read"))
for label, spec in (("0.85B", LLAMA_085), ("7.2B", LLAMA_72)):
    ops, n, total = chain(spec)
    for config in CONFIGS:
        for mode, name in MODES:
            t = us_per_step(config, ops, n, mode, 200 if label == "0.85B" else 50)
            print(f"{label}: {n} operations, {total / MB:.1f} MB, {config}, {name}: {t:.1f} us a step, "
                  f"{total / (t * 1e-6) / 4.277e12 * 100:.1f}% of 4.277 TB/s, {t / n:.2f} us an operation", flush=True)
