// Session 21's second call: every block reads `vec` floats through L2 (__ldcg) `iters` times,
// one iteration after another; all blocks the same floats (replicas = 1) or one of `replicas`
// copies, to see whether a GEMV's blocks, all reading one activation row at once, queue at L2.
extern "C" __global__ void hot(const float *x, int replicas, int vec, int iters, float *out) {
    float s = 0.f;
    const float4 *v = reinterpret_cast<const float4 *>(x + (long long)(blockIdx.x % replicas) * vec);
    for (int it = 0; it < iters; it++) {
        for (int i = threadIdx.x; i < vec / 4; i += blockDim.x) {
            float4 a = __ldcg(v + i);
            s += a.x + a.y + a.z + a.w;
        }
        __syncthreads();
    }
    if (s == 12345.f) out[0] = s;
}
