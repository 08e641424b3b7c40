// ---- tracing --------------------------------------------------------------------------------

// With OXLM_TRACE defined (`Gpu::take_trace`, cuda/trace.rs), the first thread of each launch's
// first block records when it started, when its inputs were ready (%globaltimer, ns) and the
// launch's %gridid: the second time of a launch and the next one's is how long the launch held
// the chain. Every block then also records its inputs ready, and the int16 GEMVs and one
// sequence's attention their stages (TRACE_WARP, TRACE_BLOCK), into the launch's slot by its
// grid id. TRACE_LAUNCHES, TRACE_SLOTS, TRACE_SHARDS and a TRACE_<NAME> per stage come from
// cuda/trace.rs. Without OXLM_TRACE every hook here is empty.
#ifdef OXLM_TRACE
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
// time a block's inputs were ready, as its complement.
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
// The launch's start, on its first thread.
__device__ __forceinline__ unsigned long long trace_launch_begin() {
    const bool first = threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    return first ? global_ns() : 0;
}
// Its inputs ready: the launch's times on its first thread, every block's readiness.
__device__ __forceinline__ void trace_launch_ready(unsigned long long started) {
    const bool first = threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    if (first) {
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
}
#else
#define TRACE_WARP(stage)
#define TRACE_BLOCK(stage)
__device__ __forceinline__ unsigned long long trace_launch_begin() { return 0; }
__device__ __forceinline__ void trace_launch_ready(unsigned long long) {}
#endif
