// Session 22: the least a chain of kernels can take on this GPU, in the shape of a decode step
// (s22-floor.py launches them). Each link is a programmatic dependent launch that waits for the
// link before it; `read` links then read the n floats the link before wrote (every block all
// of them through L2, as a GEMV's blocks read their activations) and write one float a block;
// `stream` links also stream their own span of `units` 16-byte words, the first four a thread
// loaded before the wait, as the GEMVs load their first weights while the kernel before runs.
typedef unsigned long long u64;

__device__ __forceinline__ void await_link() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ float block_read(const float *x, int n) {
    __shared__ float warp_sums[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
        const float4 a = __ldcg(reinterpret_cast<const float4 *>(x) + i);
        s += a.x + a.y + a.z + a.w;
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) t += warp_sums[w];
    return t;
}

extern "C" __global__ void link_empty(const float *x, float *y, int n) { await_link(); }

extern "C" __global__ void link_read(const float *x, float *y, int n) {
    await_link();
    const float t = block_read(x, n);
    if (threadIdx.x == 0) y[blockIdx.x % n] = t * 1e-30f;
}

extern "C" __global__ void link_stream(const float *x, float *y, int n, const uint4 *w,
                                       long long units, int read) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 a[4];
#pragma unroll
    for (int j = 0; j < 4; j++) a[j] = i + j * stride < units ? __ldcs(w + i + j * stride) : uint4{};
    await_link();
    const float t = read ? block_read(x, n) : 0.f;
    unsigned acc = 0;
    for (;;) {
#pragma unroll
        for (int j = 0; j < 4; j++) acc ^= a[j].x ^ a[j].y ^ a[j].z ^ a[j].w;
        i += 4 * stride;
        if (i >= units) break;
#pragma unroll
        for (int j = 0; j < 4; j++) a[j] = i + j * stride < units ? __ldcs(w + i + j * stride) : uint4{};
    }
    if (threadIdx.x == 0) y[blockIdx.x % n] = t * 1e-30f + (acc == 12345u ? 1.f : 0.f);
}
