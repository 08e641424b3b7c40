// The kernels of oxlm's CUDA backend, compiled at start-up by NVRTC for the device at hand.
//
// Activations are f32. Weights stay in the MLX affine layout: per row, uint32 words holding a
// little-endian bit stream of `bits`-bit integers, and one scale and bias per group of columns
// (f32, f16 or bf16). No header is included, so that NVRTC needs no CUDA toolkit beside it:
// half-precision values are converted with PTX or bit shifts.
//
// Entry points are `extern "C"`, one per template instance, named `<kernel>_<variant>`.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define INFINITY __int_as_float(0x7f800000)

// ---- launch order ---------------------------------------------------------------------------

// From sm_90 every kernel is launched as a programmatic dependent launch (`Op::run`): it may
// start while the kernel before it is still running, so that its launch, and a GEMV's first
// weight loads, overlap that kernel's tail instead of following it. Every kernel therefore
// calls this before it touches memory that other kernels write or read (anything but
// weights): it returns once the previous kernel has finished and its writes are visible (and
// so every earlier one, each having waited in turn), then lets the next kernel launch. Before
// sm_90, and for kernels launched plainly, the stream's order already holds and this is empty
// or returns at once.
//
// With OXLM_TRACE defined (`Gpu::take_trace`), the first thread of each launch's first block
// also records when it started, when its inputs were ready (%globaltimer, ns) and the launch's
// %gridid: the second time of a launch and the next one's is how long the launch held the
// chain. Every block then also records its inputs ready, and the int16 GEMVs and one
// sequence's attention their stages (`trace_stage`), into the launch's slot by its grid id.
#ifdef OXLM_TRACE
#define TRACE_LAUNCHES 65536
__device__ unsigned long long trace_times[3 * TRACE_LAUNCHES];
__device__ unsigned trace_count;
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned long long grid_id() {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    return g;
}
// Per launch (slot gridid % TRACE_SLOTS), per stage, in TRACE_SHARDS copies (so that a launch's
// warps do not all update one address): the latest time the stage was reached, by reductions
// that return nothing, so that recording holds no warp up. The first stage holds the earliest
// time a block's inputs were ready, as its complement. In the order of TRACE_STAGE_NAMES in
// mod.rs.
enum TraceStage {
    TRACE_FIRST_READY,
    TRACE_LAST_READY,
    TRACE_ACTS,    // the int16 GEMVs' activations rounded; one sequence's attention's query loaded
    TRACE_KEYS,    // one sequence's attention's keys and values summed
    TRACE_DONE,    // a warp's end
    TRACE_SCORES,  // one sequence's attention's first tile of scores
    TRACE_COUNTED, // one sequence's attention's split counted
    TRACE_MERGE_MAXIMA, // the merge's maxima and sums loaded and reduced
    TRACE_MERGE_SUMMED, // the merge's outputs summed
    TRACE_STAGES
};
#define TRACE_SLOTS 1024
#define TRACE_SHARDS 8
__device__ unsigned long long trace_stages[TRACE_SLOTS][TRACE_STAGES][TRACE_SHARDS];
__device__ __forceinline__ void trace_stage(int stage, unsigned shard) {
    const unsigned long long t = global_ns();
    atomicMax(&trace_stages[grid_id() % TRACE_SLOTS][stage][shard % TRACE_SHARDS],
              stage == TRACE_FIRST_READY ? ~t : t);
}
#define TRACE_WARP(stage)                                                                          \
    if ((threadIdx.x & 31) == 0) trace_stage(stage, blockIdx.x + (threadIdx.x >> 5))
#define TRACE_BLOCK(stage)                                                                         \
    if (threadIdx.x == 0) trace_stage(stage, blockIdx.x)
#else
#define TRACE_WARP(stage)
#define TRACE_BLOCK(stage)
#endif
__device__ __forceinline__ void await_inputs() {
#ifdef OXLM_TRACE
    const bool traced = threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    const unsigned long long started = traced ? global_ns() : 0;
#endif
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef OXLM_TRACE
    if (traced) {
        const unsigned long long ready = global_ns();
        const unsigned i = atomicAdd(&trace_count, 1u);
        if (i < TRACE_LAUNCHES)
            trace_times[3 * i] = started, trace_times[3 * i + 1] = ready,
            trace_times[3 * i + 2] = grid_id();
    }
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        trace_stage(TRACE_FIRST_READY, blockIdx.x + blockIdx.y);
        trace_stage(TRACE_LAST_READY, blockIdx.x + blockIdx.y);
    }
#endif
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

