// ---- rows of MLX affine weights ------------------------------------------------------------
//
// Dot products of activation rows with rows of affine-quantized weights, summed over a block,
// and the gated MLP's activation: what the GEMVs of matmul.cu and the experts' of experts.cu
// share.

// A run of 32 weights is exactly BITS words and lies in one group (groups are 32, 64 or 128).
template <int BITS>
__device__ __forceinline__ void load_run(const u32 *__restrict__ p, u32 (&words)[BITS]) {
    if constexpr (BITS == 4 || BITS == 8) {
#pragma unroll
        for (int i = 0; i < BITS; i += 4) {
            const uint4 v = *reinterpret_cast<const uint4 *>(p + i);
            words[i] = v.x;
            words[i + 1] = v.y;
            words[i + 2] = v.z;
            words[i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < BITS; i++) words[i] = p[i];
    }
}

// Integer `j` (0..31) of a run; `j` is a compile-time constant once unrolled.
template <int BITS>
__device__ __forceinline__ u32 run_value(const u32 (&words)[BITS], int j) {
    const int bit = j * BITS, w = bit >> 5, shift = bit & 31;
    u32 v = words[w] >> shift;
    if (shift + BITS > 32) v |= words[w + 1] << (32 - shift);
    return v & ((1u << BITS) - 1u);
}

// An integer under 2^23 as a float, exactly: its bits under the exponent of 2^23, less 2^23 (an
// OR and a subtraction at full rate, where an int-to-float conversion runs at a quarter).
__device__ __forceinline__ float small_int_float(u32 v) {
    return __uint_as_float(v | 0x4B000000u) - 8388608.f;
}

// Integer `j` of a run as a float.
template <int BITS>
__device__ __forceinline__ float run_float(const u32 (&words)[BITS], int j) {
    return small_int_float(run_value<BITS>(words, j));
}

// Activation rows one after another, `k` apart, as most products take them.
struct DenseRows {
    const float *x;
    int k;
    __device__ __forceinline__ const float *at(int r) const { return x + (i64)r * k; }
};

// acc[i][r] += Σ_k x[r, k] · W[row0 + i, k] over this thread's runs of 32 weights (threads of
// the block take every blockDim-th run), for r < m ≤ 8 and the ROWS rows from row0 (rows past n
// repeat the last); `x.at(r)` is activation row r (DenseRows, or the rows a mixture routed to
// one expert). Each weight byte is read once, in 16-byte loads where the width allows, and
// turned into a float once, whatever m; each activation load serves all ROWS rows, which keeps
// the activation reads (f32, eight times the bytes of 4-bit weights) within what L1 delivers.
template <int BITS, class S, int ROWS, class Rows>
__device__ __forceinline__ void qdot_rows(const u32 *__restrict__ w,
                                          const typename S::T *__restrict__ scales,
                                          const typename S::T *__restrict__ biases, const Rows x,
                                          int row0, int n, int k, int group, int m,
                                          float (&acc)[ROWS][8]) {
    const int runs = k >> 5, groups = k / group;
    for (int c = threadIdx.x; c < runs; c += blockDim.x) {
        u32 words[ROWS][BITS];
        float s[ROWS], b[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int row = min(row0 + i, n - 1);
            load_run<BITS>(w + ((i64)row * runs + c) * BITS, words[i]);
            const i64 g = (i64)row * groups + (c << 5) / group;
            s[i] = S::load(scales, g);
            b[i] = S::load(biases, g);
        }
        float dot[ROWS][8], sum[8];
#pragma unroll
        for (int r = 0; r < 8; r++) {
            sum[r] = 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; i++) dot[i][r] = 0.f;
        }
#pragma unroll
        for (int q = 0; q < 8; q++) {
            float wq[ROWS][4];
#pragma unroll
            for (int i = 0; i < ROWS; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) wq[i][j] = run_float<BITS>(words[i], 4 * q + j);
#pragma unroll
            for (int r = 0; r < 8; r++) {
                if (r >= m) break;
                const float4 v = reinterpret_cast<const float4 *>(x.at(r) + (c << 5))[q];
                sum[r] += (v.x + v.y) + (v.z + v.w);
#pragma unroll
                for (int i = 0; i < ROWS; i++) {
                    dot[i][r] = fmaf(wq[i][0], v.x, dot[i][r]);
                    dot[i][r] = fmaf(wq[i][1], v.y, dot[i][r]);
                    dot[i][r] = fmaf(wq[i][2], v.z, dot[i][r]);
                    dot[i][r] = fmaf(wq[i][3], v.w, dot[i][r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 8; r++) {
            if (r >= m) break;
#pragma unroll
            for (int i = 0; i < ROWS; i++) acc[i][r] += s[i] * dot[i][r] + b[i] * sum[r];
        }
    }
}

// Sums each thread's acc[i][r] over the block into sum[i][r] (valid in thread 0): warps reduce
// with shuffles, then the warps' partials meet in shared memory.
template <int ROWS>
__device__ __forceinline__ void block_sum(float (&acc)[ROWS][8], int m) {
    __shared__ float partial[ROWS * 8][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < ROWS; i++)
#pragma unroll
        for (int r = 0; r < 8; r++) {
            if (r >= m) break;
            const float v = warp_sum(acc[i][r]);
            if (lane == 0) partial[i * 8 + r][warp] = v;
        }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < ROWS; i++)
#pragma unroll
            for (int r = 0; r < 8; r++) {
                if (r >= m) break;
                float v = 0.f;
                for (int j = 0; j < warps; j++) v += partial[i * 8 + r][j];
                acc[i][r] = v;
            }
    }
}

// act(a) · b for the gated MLP's activation `act`: SiLU (0) or tanh-GELU (1).
__device__ __forceinline__ float gated(float a, float b, int act) {
    const float h = act == 0 ? a / (1.f + expf(-a))
                             : 0.5f * a * (1.f + tanhf(0.7978846f * (a + 0.044715f * a * a * a)));
    return h * b;
}

// Output rows one after another, `n` apart.
struct DenseOut {
    float *y;
    int n;
    __device__ __forceinline__ float *at(int r) const { return y + (i64)r * n; }
};

// Thread 0's block sums of rows row0.. (block_sum) into y.at(r)[row0 + i], or added to it with
// `accumulate`.
template <int ROWS, class Out>
__device__ __forceinline__ void store_rows(const float (&acc)[ROWS][8], const Out y, int row0,
                                           int n, int m, int accumulate) {
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int i = 0; i < ROWS; i++) {
        if (row0 + i >= n) break;
#pragma unroll
        for (int r = 0; r < 8; r++) {
            if (r >= m) break;
            float *o = y.at(r) + row0 + i;
            *o = accumulate ? *o + acc[i][r] : acc[i][r];
        }
    }
}

// out.at(r)[row0 + i] = act(x.at(r)·G[row0 + i]) · (x.at(r)·U[row0 + i]) for the block's 2 rows
// of G and U (the gate and up projections, of one shape and quantization) and r < m ≤ 8: act is
// SiLU (0) or tanh-GELU (1).
template <int BITS, class S, class Rows, class Out>
__device__ __forceinline__ void glu_rows(const u32 *__restrict__ gw,
                                         const typename S::T *__restrict__ gs,
                                         const typename S::T *__restrict__ gb,
                                         const u32 *__restrict__ uw,
                                         const typename S::T *__restrict__ us,
                                         const typename S::T *__restrict__ ub, const Rows x,
                                         const Out out, int row0, int n, int k, int group, int m,
                                         int act) {
    float g[2][8], u[2][8];
    zero(g);
    zero(u);
    qdot_rows<BITS, S, 2>(gw, gs, gb, x, row0, n, k, group, m, g);
    qdot_rows<BITS, S, 2>(uw, us, ub, x, row0, n, k, group, m, u);
    block_sum(g, m);
    __syncthreads();
    block_sum(u, m);
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (row0 + i >= n) break;
#pragma unroll
        for (int r = 0; r < 8; r++) {
            if (r >= m) break;
            out.at(r)[row0 + i] = gated(g[i][r], u[i][r], act);
        }
    }
}

// M(BITS, S, NAME) for every affine width and scale type the kernels take: one instance each.
#define AFFINE_FORMATS(M)                                                                          \
    M(2, F32, f32) M(2, F16, f16) M(2, BF16, bf16)                                                 \
    M(3, F32, f32) M(3, F16, f16) M(3, BF16, bf16)                                                 \
    M(4, F32, f32) M(4, F16, f16) M(4, BF16, bf16)                                                 \
    M(5, F32, f32) M(5, F16, f16) M(5, BF16, bf16)                                                 \
    M(6, F32, f32) M(6, F16, f16) M(6, BF16, bf16)                                                 \
    M(8, F32, f32) M(8, F16, f16) M(8, BF16, bf16)
