// The kernels of oxlm's CUDA backend, compiled at start-up by NVRTC for the device at hand.
//
// Activations are f32. Weights stay in MLX's quantized layouts: per row, uint32 words holding a
// little-endian bit stream of `bits`-bit codes, with one scale and bias per group of columns
// (f32, f16 or bf16) for affine integers, or one uint8-coded scale per group for the float
// modes' E2M1 and E4M3 codes (matmul.cu). No header is included, so that NVRTC needs no CUDA toolkit beside it:
// half-precision values are converted with PTX or bit shifts.
//
// Entry points are `extern "C"`, one per template instance, named `<kernel>_<variant>`.
//
// This file comes first of the files joined into one source (`KERNELS` in cuda/mod.rs), after
// the constants the launchers share with the kernels (INT_RING_STAGES, MMA_TURN_RUNS, TRACE_*),
// which cuda/mod.rs writes as #defines. Each op family's file uses only what this file and
// trace.cu define.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define INFINITY __int_as_float(0x7f800000)

// ---- launch order ---------------------------------------------------------------------------

// Tracing's hooks around the wait below (trace.cu, joined after this file): empty unless
// OXLM_TRACE is defined.
__device__ __forceinline__ unsigned long long trace_launch_begin();
__device__ __forceinline__ void trace_launch_ready(unsigned long long started);

// From sm_90 every kernel is launched as a programmatic dependent launch (`Op::run`): it may
// start while the kernel before it is still running, so that its launch, and a GEMV's first
// weight loads, overlap that kernel's tail instead of following it. Every kernel therefore
// calls this before it touches memory that other kernels write or read (anything but
// weights): it returns once the previous kernel has finished and its writes are visible (and
// so every earlier one, each having waited in turn), then lets the next kernel launch. Before
// sm_90, and for kernels launched plainly, the stream's order already holds and this is empty
// or returns at once.
__device__ __forceinline__ void await_inputs() {
    const unsigned long long started = trace_launch_begin();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    trace_launch_ready(started);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- floats -------------------------------------------------------------------------------

// `load4(p, i)`: elements 4i..4i+3 (aligned to four), as the caches' f32 and f16 rings are read.
// `unpack(u, v)`: the PER_UNIT elements of a 16-byte unit as floats.
struct F32 {
    typedef float T;
    static constexpr int PER_UNIT = 4;
    static __device__ __forceinline__ void unpack(uint4 u, float (&v)[4]) {
        v[0] = __uint_as_float(u.x), v[1] = __uint_as_float(u.y);
        v[2] = __uint_as_float(u.z), v[3] = __uint_as_float(u.w);
    }
    static __device__ __forceinline__ float load(const float *p, i64 i) { return p[i]; }
    static __device__ __forceinline__ float4 load4(const float *p, int i) {
        return reinterpret_cast<const float4 *>(p)[i];
    }
};

__device__ __forceinline__ float f16_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

struct F16 {
    typedef u16 T;
    static constexpr int PER_UNIT = 8;
    static __device__ __forceinline__ void unpack(uint4 u, float (&v)[8]) {
        const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = f16_float((u16)w[i]);
            v[2 * i + 1] = f16_float((u16)(w[i] >> 16));
        }
    }
    static __device__ __forceinline__ float load(const u16 *p, i64 i) { return f16_float(p[i]); }
    static __device__ __forceinline__ float4 load4(const u16 *p, int i) {
        const uint2 u = reinterpret_cast<const uint2 *>(p)[i];
        float4 v;
        v.x = f16_float((u16)u.x), v.y = f16_float((u16)(u.x >> 16));
        v.z = f16_float((u16)u.y), v.w = f16_float((u16)(u.y >> 16));
        return v;
    }
};

struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const u16 *p, i64 i) {
        return __uint_as_float(((u32)p[i]) << 16);
    }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Σ over the warp of every lane's v[lane]: lane j gets the sum of all lanes' v[j]. Each of five
// exchanges halves the values a lane keeps (31 shuffles in all, where 32 warp sums take 160).
__device__ __forceinline__ float transpose_sum(float (&v)[32], int lane) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const bool upper = lane & o;
        // A constant bound, so that the loops unroll and v stays in registers.
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (i >= o) break;
            const float send = upper ? v[i] : v[i + o];
            const float keep = upper ? v[i + o] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    return v[0];
}

// ---- shared by the families ---------------------------------------------------------------

#define GRID_STRIDE(i, n)                                                  \
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n);    \
         i += (i64)gridDim.x * blockDim.x)

template <int ROWS, int M>
__device__ __forceinline__ void zero(float (&acc)[ROWS][M]) {
#pragma unroll
    for (int i = 0; i < ROWS; i++)
#pragma unroll
        for (int r = 0; r < M; r++) acc[i][r] = 0.f;
}

__device__ __forceinline__ u16 f16_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// A cache's rings hold f32, or f16 (`half`): rounded to nearest once when written, saturating
// at ±65504 as the host's f16 cache does (an infinity would turn softmax into NaN); NaN stays
// NaN. Written once a token, read every step after: the flag is a branch, not a variant.
__device__ __forceinline__ void kv_store(void *ring, i64 i, float v, int half) {
    if (half) {
        const float c = v != v ? v : fminf(fmaxf(v, -65504.f), 65504.f);
        static_cast<u16 *>(ring)[i] = f16_bits(c);
    } else {
        static_cast<float *>(ring)[i] = v;
    }
}

// Asks L2 for the line at p, without waiting or holding a register.
__device__ __forceinline__ void l2_prefetch(const void *p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Copies of 16, 8 and 4 bytes from global into shared memory that the thread does not wait for
// (`.cg`: the 16 bytes bypass L1), in groups it waits for with cp_async_wait.
__device__ __forceinline__ void cp_async16(void *smem, const void *global) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global) : "memory");
}

__device__ __forceinline__ void cp_async4(void *smem, const void *global) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(global) : "memory");
}

__device__ __forceinline__ void cp_async8(void *smem, const void *global) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(global) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most N of the thread's latest cp.async groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
