// ---- MLX affine weights ---------------------------------------------------------------------

// y[r, n] (+)= Σ_k x[r, k] · W[n, k] for r < m (m ≤ 8): one block per ROWS weight rows, its
// threads splitting the row's runs. `accumulate` adds into y (a residual connection) instead of
// overwriting it.
template <int BITS, class S, int ROWS>
__device__ void qgemv(const u32 *__restrict__ w, const typename S::T *__restrict__ scales,
                      const typename S::T *__restrict__ biases, const float *__restrict__ x,
                      float *__restrict__ y, int n, int k, int group, int m, int accumulate) {
    const int row0 = blockIdx.x * ROWS;
    float acc[ROWS][8];
    zero(acc);
    qdot_rows<BITS, S, ROWS>(w, scales, biases, DenseRows{x, k}, row0, n, k, group, m, acc);
    block_sum(acc, m);
    store_rows(acc, DenseOut{y, n}, row0, n, m, accumulate);
}

// out[r, n] = act(x·Gᵀ) · (x·Uᵀ), the gated MLP's first half in one pass: G and U (the gate
// and up projections) share shape and quantization; act is SiLU (0) or tanh-GELU (1). One block
// per 2 rows of each.
template <int BITS, class S>
__device__ void qglu(const u32 *__restrict__ gw, const typename S::T *__restrict__ gs,
                     const typename S::T *__restrict__ gb, const u32 *__restrict__ uw,
                     const typename S::T *__restrict__ us, const typename S::T *__restrict__ ub,
                     const float *__restrict__ x, float *__restrict__ out, int n, int k, int group,
                     int m, int act) {
    glu_rows<BITS, S>(gw, gs, gb, uw, us, ub, DenseRows{x, k}, DenseOut{out, n}, blockIdx.x * 2,
                      n, k, group, m, act);
}

// out[t, :] = W[ids[t], :] dequantized (an embedding lookup): one block per token.
template <int BITS, class S>
__device__ void qrows(const u32 *__restrict__ w, const typename S::T *__restrict__ scales,
                      const typename S::T *__restrict__ biases, const int *__restrict__ ids,
                      float *__restrict__ out, int k, int group) {
    const int runs = k >> 5, groups = k / group;
    const i64 row = ids[blockIdx.x];
    for (int c = threadIdx.x; c < runs; c += blockDim.x) {
        u32 words[BITS];
        load_run<BITS>(w + (row * runs + c) * BITS, words);
        const i64 g = row * groups + (c << 5) / group;
        const float s = S::load(scales, g), b = S::load(biases, g);
        float *o = out + (i64)blockIdx.x * k + (c << 5);
#pragma unroll
        for (int j = 0; j < 32; j++) o[j] = s * run_float<BITS>(words, j) + b;
    }
}

// Rows row0..row0 + rows of the matrix dequantized to f32, row-major, for the tensor-core
// GEMM: one thread per 4 consecutive weights, so that a warp's stores fill whole lines (a
// thread per run of 32 scattered them: about 14 ms a forward of a 0.85B model). The 4 lie in
// one run (32 weights, BITS words), over one word or two.
template <int BITS, class S>
__device__ void qdequant(const u32 *__restrict__ w, const typename S::T *__restrict__ scales,
                         const typename S::T *__restrict__ biases, float *__restrict__ out,
                         int row0, int rows, int k, int group) {
    const int groups = k / group;
    const i64 quads = (i64)rows * (k >> 2), first = (i64)row0 * k;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < quads;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 e = first + 4 * i;
        const i64 row = e / k;
        const int col = (int)(e - row * k);
        const i64 bit = e * BITS;
        const u32 *p = w + (bit >> 5);
        const int shift = (int)(bit & 31);
        unsigned long long v = p[0];
        if (shift + 4 * BITS > 32) v |= (unsigned long long)p[1] << 32;
        v >>= shift;
        const i64 g = row * groups + col / group;
        const float s = S::load(scales, g), b = S::load(biases, g);
        constexpr u32 mask = (1u << BITS) - 1u;
        float4 o;
        o.x = s * small_int_float((u32)v & mask) + b;
        o.y = s * small_int_float((u32)(v >> BITS) & mask) + b;
        o.z = s * small_int_float((u32)(v >> (2 * BITS)) & mask) + b;
        o.w = s * small_int_float((u32)(v >> (3 * BITS)) & mask) + b;
        reinterpret_cast<float4 *>(out)[i] = o;
    }
}

#define QUANTIZED(BITS, S, NAME)                                                                   \
    extern "C" __global__ void qgemv4_##BITS##_##NAME(                                            \
        const u32 *w, const S::T *s, const S::T *b, const float *x, float *y, int n, int k,       \
        int g, int m, int acc) {                                                                  \
        await_inputs();                                                                           \
        qgemv<BITS, S, 4>(w, s, b, x, y, n, k, g, m, acc);                                        \
    }                                                                                             \
    extern "C" __global__ void qglu_##BITS##_##NAME(                                              \
        const u32 *gw, const S::T *gs, const S::T *gb, const u32 *uw, const S::T *us,             \
        const S::T *ub, const float *x, float *out, int n, int k, int g, int m, int act) {        \
        await_inputs();                                                                           \
        qglu<BITS, S>(gw, gs, gb, uw, us, ub, x, out, n, k, g, m, act);                           \
    }                                                                                             \
    extern "C" __global__ void qrows_##BITS##_##NAME(const u32 *w, const S::T *s, const S::T *b,  \
                                                     const int *ids, float *out, int k, int g) {  \
        await_inputs();                                                                           \
        qrows<BITS, S>(w, s, b, ids, out, k, g);                                                  \
    }                                                                                             \
    extern "C" __global__ void qdequant_##BITS##_##NAME(const u32 *w, const S::T *s,              \
                                                        const S::T *b, float *out, int row0,      \
                                                        int rows, int k, int g) {                 \
        await_inputs();                                                                           \
        qdequant<BITS, S>(w, s, b, out, row0, rows, k, g);                                        \
    }

AFFINE_FORMATS(QUANTIZED)

// ---- MLX float-quantized weights (mxfp4, nvfp4, mxfp8) ------------------------------------------
//
// Codes packed as the affine integers are (element j of a row in bits j·BITS of its words), E2M1
// for 4 bits and E4M3 for 8, times one uint8-coded scale per group: E8M0 (2^(code - 127)) per 32
// weights for mxfp4 and mxfp8, E4M3 per 16 for nvfp4; no biases. Codes are decoded with integer
// operations into f32 bits (a table indexed at run time would live in local memory), to exactly
// the values of params.rs's tables. Each group's dot is scaled once, as MLX sums them.

// The E2M1 value of a 4-bit code (bit 3 the sign): magnitude 1 is 0.5, and from 2 on the two
// exponent bits and the mantissa bit go under f32's, the exponent rebased from 1 to 127.
__device__ __forceinline__ float e2m1_float(u32 c) {
    const u32 mag = c & 7u;
    const u32 bits = mag < 2u ? (mag ? 0x3F000000u : 0u) : (mag << 22) + (126u << 23);
    return __uint_as_float(bits | ((c & 8u) << 28));
}

// The E4M3 value of an 8-bit code (bit 7 the sign; bias 7, no infinities, 0x7F NaN): exponent 0
// holds the subnormals m · 2^-9, the rest go under f32's bits, the exponent rebased to 127.
__device__ __forceinline__ float e4m3_float(u32 c) {
    const u32 mag = c & 0x7Fu;
    float v = mag < 8u ? small_int_float(mag) * 0.001953125f
                       : __uint_as_float((mag << 20) + (120u << 23));
    if (mag == 0x7Fu) v = __uint_as_float(0x7FC00000u);
    return (c & 0x80u) ? -v : v;
}

// The E8M0 scale of a code: 2^(code - 127); code 0 is 2^-127, an f32 subnormal, and 255 infinite.
__device__ __forceinline__ float e8m0_float(u32 c) {
    return __uint_as_float(c ? c << 23 : 0x00400000u);
}

// The float modes as the kernels take them: BITS per code, GROUP codes per scale, and the
// decoding of each.
struct Mxfp4 {
    static constexpr int BITS = 4, GROUP = 32;
    static __device__ __forceinline__ float value(u32 c) { return e2m1_float(c); }
    static __device__ __forceinline__ float scale(u32 c) { return e8m0_float(c); }
};

struct Nvfp4 {
    static constexpr int BITS = 4, GROUP = 16;
    static __device__ __forceinline__ float value(u32 c) { return e2m1_float(c); }
    static __device__ __forceinline__ float scale(u32 c) { return e4m3_float(c); }
};

struct Mxfp8 {
    static constexpr int BITS = 8, GROUP = 32;
    static __device__ __forceinline__ float value(u32 c) { return e4m3_float(c); }
    static __device__ __forceinline__ float scale(u32 c) { return e8m0_float(c); }
};

// acc[i][r] += Σ_k x[r, k] · W[row0 + i, k] for the float mode F, as qdot_rows does for affine
// weights (threads of the block take every blockDim-th run of 32 codes; rows past n repeat the
// last; r < m ≤ 8): a run holds one group, or two of nvfp4's, whose dots are scaled apart.
template <class F, int ROWS>
__device__ __forceinline__ void fdot_rows(const u32 *__restrict__ w,
                                          const unsigned char *__restrict__ scales,
                                          const float *__restrict__ x, int row0, int n, int k,
                                          int m, float (&acc)[ROWS][8]) {
    constexpr int BITS = F::BITS, PER_RUN = 32 / F::GROUP, QUADS = F::GROUP / 4;
    const int runs = k >> 5, groups = k / F::GROUP;
    for (int c = threadIdx.x; c < runs; c += blockDim.x) {
        u32 words[ROWS][BITS];
        float s[ROWS][PER_RUN];
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int row = min(row0 + i, n - 1);
            load_run<BITS>(w + ((i64)row * runs + c) * BITS, words[i]);
#pragma unroll
            for (int p = 0; p < PER_RUN; p++)
                s[i][p] = F::scale(scales[(i64)row * groups + c * PER_RUN + p]);
        }
#pragma unroll
        for (int p = 0; p < PER_RUN; p++) {
            float dot[ROWS][8];
            zero(dot);
#pragma unroll
            for (int qq = 0; qq < QUADS; qq++) {
                const int q = p * QUADS + qq;
                float wq[ROWS][4];
#pragma unroll
                for (int i = 0; i < ROWS; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        wq[i][j] = F::value(run_value<BITS>(words[i], 4 * q + j));
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    if (r >= m) break;
                    const float4 v =
                        reinterpret_cast<const float4 *>(x + (i64)r * k + (c << 5))[q];
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
                for (int i = 0; i < ROWS; i++) acc[i][r] = fmaf(s[i][p], dot[i][r], acc[i][r]);
            }
        }
    }
}

// qgemv for the float mode F.
template <class F, int ROWS>
__device__ void fgemv(const u32 *__restrict__ w, const unsigned char *__restrict__ scales,
                      const float *__restrict__ x, float *__restrict__ y, int n, int k, int m,
                      int accumulate) {
    const int row0 = blockIdx.x * ROWS;
    float acc[ROWS][8];
    zero(acc);
    fdot_rows<F, ROWS>(w, scales, x, row0, n, k, m, acc);
    block_sum(acc, m);
    store_rows(acc, DenseOut{y, n}, row0, n, m, accumulate);
}

// qglu for the float mode F: out = act(x·Gᵀ) · (x·Uᵀ), one block per 2 rows of each.
template <class F>
__device__ void fglu(const u32 *__restrict__ gw, const unsigned char *__restrict__ gs,
                     const u32 *__restrict__ uw, const unsigned char *__restrict__ us,
                     const float *__restrict__ x, float *__restrict__ out, int n, int k, int m,
                     int act) {
    const int row0 = blockIdx.x * 2;
    float g[2][8], u[2][8];
    zero(g);
    zero(u);
    fdot_rows<F, 2>(gw, gs, x, row0, n, k, m, g);
    fdot_rows<F, 2>(uw, us, x, row0, n, k, m, u);
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
            out[(i64)r * n + row0 + i] = gated(g[i][r], u[i][r], act);
        }
    }
}

// qrows for the float mode F: out[t, :] = W[ids[t], :] dequantized, one block per token.
template <class F>
__device__ void frows(const u32 *__restrict__ w, const unsigned char *__restrict__ scales,
                      const int *__restrict__ ids, float *__restrict__ out, int k) {
    constexpr int BITS = F::BITS, PER_RUN = 32 / F::GROUP;
    const int runs = k >> 5, groups = k / F::GROUP;
    const i64 row = ids[blockIdx.x];
    for (int c = threadIdx.x; c < runs; c += blockDim.x) {
        u32 words[BITS];
        load_run<BITS>(w + (row * runs + c) * BITS, words);
        float s[PER_RUN];
#pragma unroll
        for (int p = 0; p < PER_RUN; p++) s[p] = F::scale(scales[row * groups + c * PER_RUN + p]);
        float *o = out + (i64)blockIdx.x * k + (c << 5);
#pragma unroll
        for (int j = 0; j < 32; j++) o[j] = F::value(run_value<BITS>(words, j)) * s[j / F::GROUP];
    }
}

// qdequant for the float mode F: rows row0..row0 + rows to f32, one thread per 4 consecutive
// weights, which lie in one word (16 bits of it for 4-bit codes) and one group.
template <class F>
__device__ void fdequant(const u32 *__restrict__ w, const unsigned char *__restrict__ scales,
                         float *__restrict__ out, int row0, int rows, int k) {
    constexpr int BITS = F::BITS;
    constexpr u32 mask = (1u << BITS) - 1u;
    const i64 quads = (i64)rows * (k >> 2), first = (i64)row0 * k;
    GRID_STRIDE(i, quads) {
        const i64 e = first + 4 * i;
        const i64 bit = e * BITS;
        const u32 v = w[bit >> 5] >> (bit & 31);
        const float s = F::scale(scales[e / F::GROUP]);
        float4 o;
        o.x = F::value(v & mask) * s;
        o.y = F::value((v >> BITS) & mask) * s;
        o.z = F::value((v >> (2 * BITS)) & mask) * s;
        o.w = F::value((v >> (3 * BITS)) & mask) * s;
        reinterpret_cast<float4 *>(out)[i] = o;
    }
}

#define FLOAT_QUANTIZED(F, NAME)                                                                   \
    extern "C" __global__ void fgemv4_##NAME(const u32 *w, const unsigned char *s,                 \
                                             const float *x, float *y, int n, int k, int m,        \
                                             int acc) {                                            \
        await_inputs();                                                                            \
        fgemv<F, 4>(w, s, x, y, n, k, m, acc);                                                     \
    }                                                                                              \
    extern "C" __global__ void fglu_##NAME(const u32 *gw, const unsigned char *gs, const u32 *uw,  \
                                           const unsigned char *us, const float *x, float *out,    \
                                           int n, int k, int m, int act) {                         \
        await_inputs();                                                                            \
        fglu<F>(gw, gs, uw, us, x, out, n, k, m, act);                                             \
    }                                                                                              \
    extern "C" __global__ void frows_##NAME(const u32 *w, const unsigned char *s, const int *ids,  \
                                            float *out, int k) {                                   \
        await_inputs();                                                                            \
        frows<F>(w, s, ids, out, k);                                                               \
    }                                                                                              \
    extern "C" __global__ void fdequant_##NAME(const u32 *w, const unsigned char *s, float *out,   \
                                               int row0, int rows, int k) {                        \
        await_inputs();                                                                            \
        fdequant<F>(w, s, out, row0, rows, k);                                                     \
    }

FLOAT_QUANTIZED(Mxfp4, mxfp4)
FLOAT_QUANTIZED(Nvfp4, nvfp4)
FLOAT_QUANTIZED(Mxfp8, mxfp8)

// The formats of the integer kernels (int16 GEMVs, tensor-core products): 4- and 8-bit weights
// with f32, f16 or bf16 scales and biases; `X(BITS, S, NAME)` instantiated for each.
#define FOR_INT_FORMATS(X) \
    X(4, F32, f32)         \
    X(4, F16, f16)         \
    X(4, BF16, bf16)       \
    X(8, F32, f32)         \
    X(8, F16, f16)         \
    X(8, BF16, bf16)

// ---- tensor-core products of many activation rows ------------------------------------------------

// y[r, :] = x[r, :] · Wᵀ for up to 64 rows r at once (from 5, or from 2 where the int16 GEMVs'
// activations do not fit: `mma_applies` in cuda/matmul.rs) on the tensor cores (mma.sync m16n8k16, f16
// operands, f32 sums), straight from the packed 4- or 8-bit weights: each weight is read once
// for all rows, where dequantizing the matrix for cuBLAS wrote and read it again in f32.
//
// The weights are the products' A (16 output features of a tile), the activation rows their B
// (8 rows of a tile). A warp takes its runs of 32 weights four at a time (a turn): lane t of a
// quad (lane & 3) takes run 4T + t of turn T whole, one 16-byte load a feature for 4 bits (two
// for 8), and eight of its weights make two mma steps. Of the eight weights 8u..8u+7 of a run,
// a lane's register pairs hold {0, 4}, {1, 5} (step 2u) and {2, 6}, {3, 7} (step 2u + 1): the
// order in which a word's nibbles land in the halves of a register with one mask and a shift.
// The sum is over k, so any order serves if the activations follow it: `mma_acts` writes them
// so, and in the order the warp loads them (see `mma_act_index`), 512 bytes a load.
//
// Activations are scaled per row by a power of two that brings the row's largest to 2^12 before
// rounding to f16 (they may exceed f16's range; the scale is exact and undone at the end).
// Weights are dequantized in f16 (s · q + b in one rounding): the operands carry 11 bits,
// about TF32's 10, which the cuBLAS path had.

__device__ __forceinline__ u32 f16x2_sub(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 f16x2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ u32 f16x2_splat(float f) {
    const u32 h = f16_bits(f);
    return h | (h << 16);
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The eight weights 8u..8u+7 of a lane's run as the f16 pairs {0, 4}, {1, 5}, {2, 6}, {3, 7}
// (integers, exact): 1024 + q is exact in f16 for q < 1024, and 1024 is taken off. `words` are
// the run's (4 a uint4).
template <int BITS>
__device__ __forceinline__ void eight_weights(const uint4 (&words)[BITS / 4], int u,
                                              u32 (&pairs)[4]) {
    const u32 magic = 0x64006400u;
    auto word = [&](int i) {
        const uint4 v = words[i >> 2];
        const int c = i & 3;
        return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
    };
    if constexpr (BITS == 4) {
        const u32 w = word(u);
#pragma unroll
        for (int s = 0; s < 4; s++)
            pairs[s] = f16x2_sub(((w >> (4 * s)) & 0x000F000Fu) | magic, magic);
    } else {
        // Bytes {0, 1, 4, 5} and {2, 3, 6, 7} of the two words, then each pair's bytes under
        // the magic's.
        const u32 lo = word(2 * u), hi = word(2 * u + 1);
        const u32 near = __byte_perm(lo, hi, 0x5410), far = __byte_perm(lo, hi, 0x7632);
        pairs[0] = f16x2_sub(__byte_perm(near, magic, 0x7250), magic);
        pairs[1] = f16x2_sub(__byte_perm(near, magic, 0x7351), magic);
        pairs[2] = f16x2_sub(__byte_perm(far, magic, 0x7250), magic);
        pairs[3] = f16x2_sub(__byte_perm(far, magic, 0x7351), magic);
    }
}

// Turns of four runs in a row of k tensor-core activations, the last padded with zeros.
__device__ __forceinline__ int mma_turns(int k) {
    return (k / 32 + MMA_TURN_RUNS - 1) / MMA_TURN_RUNS;
}

// The element of an eight (numbered within its run or row) whose value position i holds in the
// pairs' order above: positions 0-7 hold elements 0, 4, 1, 5, 2, 6, 3, 7.
__device__ __forceinline__ int eight_source(int i) {
    return (i & ~7) + ((i & 7) >> 1) + 4 * (i & 1);
}

// Where element c (in the pairs' order above) of row r of the tensor-core activations goes: per
// tile of 8 rows, per turn of 128 elements, per eight of a run, the warp's 32 lanes' (row g,
// run t of the turn) 8 elements in lane order, so that each of the warp's loads reads 512
// contiguous bytes. A row is padded with zeros to whole turns.
__device__ __forceinline__ i64 mma_act_index(int r, int c, int turns) {
    const int run = c >> 5, eighth = (c >> 3) & 3;
    return ((((i64)(r >> 3) * turns + (run >> 2)) * 4 + eighth) * 8 + (r & 7)) * 32 +
           (run & 3) * 8 + (c & 7);
}

// x[rows, k] (f32; where norm is given, RMS-normed first as rms_norm does) into xh, tiles · 8
// rows of whole turns (f16 bits, placed by `mma_act_index`, rows past `rows` and the padding
// zero) and row_scale[r], what undoes the row's scaling; one block of 1024 threads per row of
// xh. Each thread loads its first ACTS_HELD elements once and keeps them (past 1024 ·
// ACTS_HELD, a row is read again), and a run's elements are put in the lanes' order by shuffles
// within the warp that holds the run: one round of loads where three passes over memory each
// waited on theirs.
#define ACTS_HELD 8
extern "C" __global__ void __launch_bounds__(1024) mma_acts(const float *__restrict__ x,
                                                            u16 *__restrict__ xh,
                                                            float *__restrict__ row_scale,
                                                            int rows, int k,
                                                            const float *__restrict__ norm,
                                                            float eps) {
    await_inputs();
    __shared__ float partial[32];
    const int r = blockIdx.x;
    const bool real = r < rows;
    const float *xr = x + (i64)r * k;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int stride = blockDim.x, held_end = ACTS_HELD * stride;
    // The block's sum (or maximum, of values ≥ 0) of each thread's v, for every thread.
    auto block_reduce = [&](float v, bool max) {
        v = max ? warp_max(v) : warp_sum(v);
        if (lane == 0) partial[warp] = v;
        __syncthreads();
        float all = 0.f;
        for (int w = 0; w < warps; w++) all = max ? fmaxf(all, partial[w]) : all + partial[w];
        __syncthreads();
        return all;
    };
    float held[ACTS_HELD];
#pragma unroll
    for (int j = 0; j < ACTS_HELD; j++) {
        const int c = threadIdx.x + j * stride;
        held[j] = real && c < k ? xr[c] : 0.f;
    }
    float inv = 1.f;
    if (norm != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < ACTS_HELD; j++) ss += held[j] * held[j];
        if (real)
            for (int c = threadIdx.x + held_end; c < k; c += stride) ss += xr[c] * xr[c];
        inv = 1.f / sqrtf(block_reduce(ss, false) / k + eps);
    }
    // Element c (whose input is v) as the products take it, normed where asked.
    auto normed = [&](float v, int c) { return norm != nullptr ? v * inv * norm[c] : v; };
    auto value = [&](int c) { return normed(xr[c], c); };
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < ACTS_HELD; j++) {
        const int c = threadIdx.x + j * stride;
        if (c < k) held[j] = normed(held[j], c);
        amax = fmaxf(amax, fabsf(held[j]));
    }
    if (real)
        for (int c = threadIdx.x + held_end; c < k; c += stride)
            amax = fmaxf(amax, fabsf(value(c)));
    amax = block_reduce(amax, true);
    // 2^(12 - e) with amax in [2^(e-1), 2^e): exact, and the row's largest lands in
    // [2^11, 2^12).
    const int e = (int)((__float_as_uint(amax) >> 23) & 0xFFu) - 126;
    const int biased = min(max(127 + 12 - e, 1), 254);
    const float scale = amax > 0.f ? __uint_as_float((u32)biased << 23) : 1.f;
    if (threadIdx.x == 0) row_scale[r] = 1.f / scale;
    // A held element's value comes from lane `from` of the same warp (k is whole runs, and a
    // warp's 32 elements of a round are one run).
    const int turns = mma_turns(k), from = eight_source(lane);
#pragma unroll
    for (int j = 0; j < ACTS_HELD; j++) {
        const int d = threadIdx.x + j * stride;
        if (d >= k) break;
        const float v = __shfl_sync(0xffffffffu, held[j], from);
        xh[mma_act_index(r, d, turns)] = real ? f16_bits(v * scale) : (u16)0;
    }
    for (int d = threadIdx.x + held_end; d < k; d += stride) {
        xh[mma_act_index(r, d, turns)] = real ? f16_bits(value(eight_source(d)) * scale) : (u16)0;
    }
    for (int d = k + threadIdx.x; d < turns * 128; d += stride) xh[mma_act_index(r, d, turns)] = 0;
}

// *y (+)= sum · scale: a tensor-core product's row sum, its activations' scaling undone.
__device__ __forceinline__ void store_scaled(float *y, float sum, float scale, int accumulate) {
    const float v = sum * scale;
    *y = accumulate ? *y + v : v;
}

// One warp per 32 output features (two A tiles) and one slice of the runs (whole turns), over
// TILES · 8 activation rows of xh: y = or += rows · Wᵀ, undoing the rows' scales. A tile's
// slices are either the warps of its block (blockIdx.x the tile), whose sums meet in the
// launch's dynamic shared memory ([slice][row][32 features]) and which the block adds up in
// the slices' order, or blocks of one warp (blockIdx.y the slice), whose sums go to
// part[slice, row, feature] for `mma_reduce`. One slice's output is final.
template <int BITS, class S, int TILES>
__device__ void qmma(const u32 *__restrict__ w, const typename S::T *__restrict__ scales,
                     const typename S::T *__restrict__ biases, const u16 *__restrict__ xh,
                     const float *__restrict__ row_scale, float *__restrict__ y,
                     float *__restrict__ part, int n, int k, int group, int rows,
                     int runs_per_slice, int accumulate) {
    extern __shared__ float slice_sums[];
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, tile = blockIdx.x;
    const int slice = (threadIdx.x >> 5) + blockIdx.y, slices = (blockDim.x >> 5) * gridDim.y;
    const bool in_block = blockDim.x > 32;
    const int runs = k >> 5, groups = k / group, turns = mma_turns(k);
    const int r0 = slice * runs_per_slice, r1 = min(runs, r0 + runs_per_slice);
    // Features of this lane: tile i, half h (rows g and g + 8 of the A tile).
    int feature[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) feature[i][h] = min(n - 1, tile * 32 + 16 * i + 8 * h + g);
    float acc[2][TILES][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < TILES; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    // With more than one tile, turn r's weights (this lane's run of each of its features) are
    // asked of L2 ahead of their loads, which then wait on L2 rather than memory: the first
    // turn's before the kernel waits for its inputs (while the kernel before it runs), with its
    // scales and biases, each next turn's while this one's are multiplied. Registers would hold
    // them too, but they are what keeps warps on an SM. It pays from two tiles on (large
    // batches on the 7.2B llama gain about a tenth); one tile's 32 warps an SM already load
    // enough, and there the early requests only slow the kernel before it.
    constexpr bool ask_ahead = TILES > 1;
    // This lane's run of the turn at r (past the slice's last, the last), the run's words of
    // feature (i, h), and the index of their scale and bias.
    auto lane_run = [&](int r) { return min(r + t, r1 - 1); };
    auto run_words = [&](int i, int h, int run) {
        return w + ((i64)feature[i][h] * runs + run) * BITS;
    };
    auto group_index = [&](int i, int h, int run) {
        return (i64)feature[i][h] * groups + (run << 5) / group;
    };
    auto prefetch = [&](int r, bool groups_too) {
        const int run = lane_run(r);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                l2_prefetch(run_words(i, h, run));
                if (groups_too) {
                    l2_prefetch(scales + group_index(i, h, run));
                    l2_prefetch(biases + group_index(i, h, run));
                }
            }
    };
    if (ask_ahead) prefetch(r0, true);
    await_inputs();
    for (int r = r0; r < r1; r += 4) {
        if (ask_ahead && r + 4 < r1) prefetch(r + 4, false);
        // Past the slice's last run, the weights are zeros (scale and bias 0) and the
        // activations the padding's zeros or the next slice's, which they multiply.
        const bool live = r + t < r1;
        const int run = lane_run(r);
        uint4 words[2][2][BITS / 4];
        u32 sc[2][2], bi[2][2];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4 *src = reinterpret_cast<const uint4 *>(run_words(i, h, run));
#pragma unroll
                for (int q = 0; q < BITS / 4; q++) words[i][h][q] = __ldg(src + q);
                const i64 gi = group_index(i, h, run);
                sc[i][h] = live ? f16x2_splat(S::load(scales, gi)) : 0u;
                bi[i][h] = live ? f16x2_splat(S::load(biases, gi)) : 0u;
            }
        const uint4 *acts = reinterpret_cast<const uint4 *>(xh) + (i64)(r >> 2) * 128 + lane;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            uint4 b[TILES];
#pragma unroll
            for (int j = 0; j < TILES; j++) b[j] = __ldg(acts + ((i64)j * turns * 4 + u) * 32);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                u32 p[2][4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    eight_weights<BITS>(words[i][h], u, p[h]);
#pragma unroll
                    for (int s = 0; s < 4; s++) p[h][s] = f16x2_fma(p[h][s], sc[i][h], bi[i][h]);
                }
                const u32 first[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
                const u32 second[4] = {p[0][2], p[1][2], p[0][3], p[1][3]};
#pragma unroll
                for (int j = 0; j < TILES; j++) {
                    mma_f16(acc[i][j], first, b[j].x, b[j].y);
                    mma_f16(acc[i][j], second, b[j].z, b[j].w);
                }
            }
        }
    }
    // acc[i][j]: features (tile i) rows g, g + 8 (elements 0-1, 2-3), activation rows 8j + 2t
    // and + 1.
    const bool whole = slices == 1;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < TILES; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int feature = 16 * i + 8 * (e >> 1) + g, f = tile * 32 + feature;
                const int row = 8 * j + 2 * t + (e & 1);
                if (f >= n || row >= rows) continue;
                if (whole) {
                    store_scaled(y + (i64)row * n + f, acc[i][j][e], row_scale[row], accumulate);
                } else if (in_block) {
                    slice_sums[(slice * rows + row) * 32 + feature] = acc[i][j][e];
                } else {
                    part[((i64)slice * rows + row) * n + f] = acc[i][j][e];
                }
            }
    if (!in_block) return;
    __syncthreads();
    for (int e = threadIdx.x; e < rows * 32; e += blockDim.x) {
        const int row = e >> 5, f = tile * 32 + (e & 31);
        if (f >= n) continue;
        float v = 0.f;
        for (int s = 0; s < slices; s++) v += slice_sums[(s * rows + row) * 32 + (e & 31)];
        store_scaled(y + (i64)row * n + f, v, row_scale[row], accumulate);
    }
}

// y[row, f] (+)= row_scale[row] · Σ_slices part[slice, row, f], in the slices' order.
extern "C" __global__ void mma_reduce(const float *__restrict__ part,
                                      const float *__restrict__ row_scale, float *__restrict__ y,
                                      int n, int rows, int slices, int accumulate) {
    await_inputs();
    const i64 total = (i64)rows * n;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < slices; s++) v += part[(i64)s * total + i];
        store_scaled(y + i, v, row_scale[i / n], accumulate);
    }
}

#define QMMA(BITS, S, NAME, TILES)                                                                 \
    extern "C" __global__ void qmma_##BITS##_##NAME##_##TILES(                                    \
        const u32 *w, const S::T *s, const S::T *b, const u16 *xh, const float *row_scale,        \
        float *y, float *part, int n, int k, int g, int rows, int runs_per_slice, int acc) {      \
        qmma<BITS, S, TILES>(w, s, b, xh, row_scale, y, part, n, k, g, rows, runs_per_slice,      \
                             acc);                                                                \
    }

#define QMMA_TILES(BITS, S, NAME) \
    QMMA(BITS, S, NAME, 1)        \
    QMMA(BITS, S, NAME, 2)        \
    QMMA(BITS, S, NAME, 4)        \
    QMMA(BITS, S, NAME, 8)

FOR_INT_FORMATS(QMMA_TILES)

// ---- 4- and 8-bit weights against int16 activations (decode GEMVs) ----------------------------
//
// Each block first rounds the activations to int16, per run of 32 with its own scale (x ≈
// dx·xq, |xq| ≤ 32767: a relative error of at most 2^-16 of the run's largest value), into
// shared memory, in the order dp2a meets the weights' bytes. The weights are then only masked,
// never turned into floats: 3 integer operations and 4 dp2a per 8 weights of 4 bits, where the
// float path spends 4 operations per weight. The bias term uses the exact sum of each run.

__device__ __forceinline__ u32 pack16(int lo, int hi) {
    return ((u32)lo & 0xffffu) | ((u32)hi << 16);
}

// d + a.lo16·b.byte0 + a.hi16·b.byte1 (lo) or ·b.byte2, ·b.byte3 (hi), a signed, b unsigned.
__device__ __forceinline__ int dp2a_lo(u32 a, u32 b, int d) {
    int r;
    asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(d));
    return r;
}

__device__ __forceinline__ int dp2a_hi(u32 a, u32 b, int d) {
    int r;
    asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(d));
    return r;
}

// The activations of one block: per row r < m and run c, 4 chunks of 16 bytes, chunk q at
// uint4 index (r·tiles + c/32)·128 + q·32 + c%32 (the lanes of a warp read consecutive
// chunks), then (dx, sum) at stats[r·runs + c].
struct QActs {
    const uint4 *xs;
    const float2 *stats;
    int runs, tiles;
};

// The 8 activations x[r, c·32 + 8j ..] as the rounding takes them.
__device__ __forceinline__ void load8(const float *__restrict__ x, i64 at, float (&f)[8]) {
    const float4 *x4 = reinterpret_cast<const float4 *>(x + at);
    const float4 v0 = x4[0], v1 = x4[1];
    f[0] = v0.x, f[1] = v0.y, f[2] = v0.z, f[3] = v0.w;
    f[4] = v1.x, f[5] = v1.y, f[6] = v1.z, f[7] = v1.w;
}

// Rounds x[m, k] into shared memory (all threads of the block take part): four threads per
// run, each with 8 activations, which make exactly one 16-byte chunk of the run in either
// order (for 4 bits a word's 8 weights, for 8 bits two words' 4). With `norm` the rows are
// RMS-normed as the rms_norm kernel does (x · 1/sqrt(mean(x²) + eps) · norm[col]) in the same
// pass: what is rounded is x · norm[col], whose codes are the normed row's (a row's factor
// scales each run's largest alike), and the row's factor, known once the block has summed its
// squares, goes to `row_scale` for qdot_jobs to multiply the row's sums by. Each block reads the
// whole of x anyway, so a norm before a GEMV costs neither a launch nor a second pass.
template <int BITS, int M>
__device__ QActs quantize_acts(const float *__restrict__ x, int k, int m,
                               const float *__restrict__ norm, float eps,
                               float (&row_scale)[M]) {
    extern __shared__ uint4 smem[];
    __shared__ float warp_squares[32][M];
    const int runs = k >> 5, tiles = (runs + 31) >> 5;
    float2 *stats = reinterpret_cast<float2 *>(smem + m * tiles * 128);
    float squares[M];
#pragma unroll
    for (int r = 0; r < M; r++) squares[r] = 0.f;
    for (int t = threadIdx.x; t < m * runs * 4; t += blockDim.x) {
        const int run = t >> 2, j = t & 3;
        const int r = run / runs, c = run - r * runs;
        float f[8];
        load8(x, (i64)r * k + (c << 5) + 8 * j, f);
        if (norm) {
            float w[8];
            load8(norm, (c << 5) + 8 * j, w);
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                s += f[e] * f[e];
                f[e] *= w[e];
            }
#pragma unroll
            for (int rr = 0; rr < M; rr++)
                if (rr == r) squares[rr] += s;
        }
        float amax = 0.f, sum = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            amax = fmaxf(amax, fabsf(f[e]));
            sum += f[e];
        }
        // The run's four threads are neighbours, all active or all not.
        const u32 lanes = __activemask();
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(lanes, amax, o));
            sum += __shfl_xor_sync(lanes, sum, o);
        }
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int q[8];
#pragma unroll
        for (int e = 0; e < 8; e++) q[e] = __float2int_rn(f[e] * inv);
        uint4 chunk;
        if constexpr (BITS == 4) {
            // The word's masked bytes are its even weights (w & 0x0F0F0F0F) and its odd ones
            // ((w >> 4) & 0x0F0F0F0F): pairs (0,2) (4,6) (1,3) (5,7).
            chunk = {pack16(q[0], q[2]), pack16(q[4], q[6]), pack16(q[1], q[3]), pack16(q[5], q[7])};
        } else {
            chunk = {pack16(q[0], q[1]), pack16(q[2], q[3]), pack16(q[4], q[5]), pack16(q[6], q[7])};
        }
        smem[(r * tiles + (c >> 5)) * 128 + 32 * j + (c & 31)] = chunk;
        if (j == 0) {
            const float2 st = {amax / 32767.f, sum};
            stats[run] = st;
        }
    }
    if (norm) {
#pragma unroll
        for (int r = 0; r < M; r++) {
            if (r >= m) break;
            const float v = warp_sum(squares[r]);
            if ((threadIdx.x & 31) == 0) warp_squares[threadIdx.x >> 5][r] = v;
        }
    }
    __syncthreads();
    if (norm) {
#pragma unroll
        for (int r = 0; r < M; r++) {
            float ss = 0.f;
            if (r < m)
                for (int w = 0; w < (int)(blockDim.x >> 5); w++) ss += warp_squares[w][r];
            row_scale[r] = 1.f / sqrtf(ss / k + eps);
        }
    }
    QActs a = {smem, stats, runs, tiles};
    return a;
}

// The uint4 units of shared memory that quantize_acts fills for m rows of k activations; the
// runs' pipeline (RunRing) follows them.
__device__ __forceinline__ int acts_units(int k, int m) {
    const int runs = k >> 5, tiles = (runs + 31) >> 5;
    return m * tiles * 128 + (m * runs + 1) / 2;
}

// The stages of each lane's pipeline of weight runs in shared memory (RunRing); cuda/matmul.rs's
// `INT_RING_STAGES` (from cuda/matmul.rs, which sizes the launches' shared memory by it).

// The R matrices whose rows each set of qdot_jobs takes (one matrix twice for qgemv_int's
// pairs of rows): row j of matrix i has its words at w[i] + j·words, its scales and biases at
// s[i] + j·groups and b[i] + j·groups. A run's place is found with 32-bit offsets from these
// bases (cuda/matmul.rs's `int_acts_fit` keeps every matrix under 2^32 words): 64-bit products of rows
// and lengths took most of a refill's instructions (qgemv_int1_4_bf16: 62 of 145 a run).
template <int BITS, class S, int R>
struct RowSources {
    const u32 *w[R];
    const typename S::T *s[R], *b[R];
    u32 words, groups;

    // Where run c of row `row` of matrix i starts, in words; and its group, in scales.
    __device__ __forceinline__ u32 word_at(u32 row, int c) const { return row * words + c * BITS; }
    __device__ __forceinline__ u32 group_at(u32 row, int c, int gshift) const {
        return row * groups + (u32)(c >> gshift);
    }
};

// One run of R weight rows, in registers: its words, and its group's scale and bias per row.
template <int BITS, class S, int R>
struct RunWeights {
    u32 words[R][BITS];
    float scale[R], bias[R];

    // Run c of row[i] of each matrix of `src`; groups hold 2^gshift runs.
    __device__ __forceinline__ void load(const RowSources<BITS, S, R> &src, const u32 (&row)[R],
                                         int c, int gshift) {
#pragma unroll
        for (int i = 0; i < R; i++) {
            load_run<BITS>(src.w[i] + src.word_at(row[i], c), words[i]);
            const u32 g = src.group_at(row[i], c, gshift);
            scale[i] = S::load(src.s[i], g);
            bias[i] = S::load(src.b[i], g);
        }
    }
};

// The scale or bias at p, from the 4-byte word of shared memory that a copy of the aligned word
// holding it filled.
template <class S>
__device__ __forceinline__ float group_value(u32 word, const typename S::T *p) {
    if constexpr (sizeof(typename S::T) == 4) {
        return __uint_as_float(word);
    } else {
        const u16 h = (u16)(reinterpret_cast<size_t>(p) & 2 ? word >> 16 : word);
        return S::load(&h, 0);
    }
}

// Each lane's pipeline of runs of R rows in shared memory: per stage and row, the run's BITS/4
// 16-byte units, then the 4-byte words that hold its scale and bias, copied by cp.async so
// that the bytes in flight are not bounded by registers. Every array is strided by the block's
// threads, so that a warp's lanes touch consecutive words and each lane reads only what it
// copied (a wait for its own groups, no barrier).
template <int BITS, class S, int R>
struct RunRing {
    static constexpr int UNITS = BITS / 4;
    uint4 *units;
    u32 *words;
    int threads, tid;

    __device__ __forceinline__ RunRing(uint4 *base, int stages)
        : units(base), words(reinterpret_cast<u32 *>(base + stages * R * UNITS * blockDim.x)),
          threads(blockDim.x), tid(threadIdx.x) {}

    // Starts copying run c of row[i] of each matrix of `src` (groups hold 2^gshift runs) into
    // stage `st`.
    __device__ __forceinline__ void fetch(int st, const RowSources<BITS, S, R> &src,
                                          const u32 (&row)[R], int c, int gshift) {
#pragma unroll
        for (int i = 0; i < R; i++) {
            const u32 *w = src.w[i] + src.word_at(row[i], c);
#pragma unroll
            for (int u = 0; u < UNITS; u++)
                cp_async16(units + ((st * R + i) * UNITS + u) * threads + tid, w + 4 * u);
            const u32 g = src.group_at(row[i], c, gshift);
            cp_async4(words + (st * R + i) * 2 * threads + tid, aligned_word(src.s[i] + g));
            cp_async4(words + ((st * R + i) * 2 + 1) * threads + tid, aligned_word(src.b[i] + g));
        }
    }

    // Stage `st`, once its copies have landed, as run c of row[i] of each matrix of `src`.
    __device__ __forceinline__ void read(int st, RunWeights<BITS, S, R> &rw,
                                         const RowSources<BITS, S, R> &src, const u32 (&row)[R],
                                         int c, int gshift) const {
#pragma unroll
        for (int i = 0; i < R; i++) {
            const u32 g = src.group_at(row[i], c, gshift);
#pragma unroll
            for (int u = 0; u < UNITS; u++) {
                const uint4 v = units[((st * R + i) * UNITS + u) * threads + tid];
                rw.words[i][4 * u] = v.x;
                rw.words[i][4 * u + 1] = v.y;
                rw.words[i][4 * u + 2] = v.z;
                rw.words[i][4 * u + 3] = v.w;
            }
            rw.scale[i] = group_value<S>(words[(st * R + i) * 2 * threads + tid], src.s[i] + g);
            rw.bias[i] =
                group_value<S>(words[((st * R + i) * 2 + 1) * threads + tid], src.b[i] + g);
        }
    }

    static __device__ __forceinline__ const void *aligned_word(const typename S::T *p) {
        return reinterpret_cast<const void *>(reinterpret_cast<size_t>(p) & ~(size_t)3);
    }
};

// acc[i][r] += Σ over run c of x[r, ·] · W_i[·], for the loaded run `rw`.
template <int BITS, class S, int R, int M>
__device__ __forceinline__ void qdot_run(const RunWeights<BITS, S, R> &rw, const QActs &a, int c,
                                         int m, float (&acc)[R][M]) {
    const uint4 *xc = a.xs + (c >> 5) * 128 + (c & 31);
#pragma unroll
    for (int r = 0; r < M; r++) {
        if (r >= m) break;
        const uint4 *xr = xc + r * a.tiles * 128;
        u32 p[16];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint4 v = xr[32 * j];
            p[4 * j] = v.x;
            p[4 * j + 1] = v.y;
            p[4 * j + 2] = v.z;
            p[4 * j + 3] = v.w;
        }
        const float2 st = a.stats[r * a.runs + c];
#pragma unroll
        for (int i = 0; i < R; i++) {
            int d = 0;
            if constexpr (BITS == 4) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const u32 even = rw.words[i][j] & 0x0F0F0F0Fu;
                    const u32 odd = (rw.words[i][j] >> 4) & 0x0F0F0F0Fu;
                    d = dp2a_lo(p[4 * j], even, d);
                    d = dp2a_hi(p[4 * j + 1], even, d);
                    d = dp2a_lo(p[4 * j + 2], odd, d);
                    d = dp2a_hi(p[4 * j + 3], odd, d);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    d = dp2a_lo(p[2 * j], rw.words[i][j], d);
                    d = dp2a_hi(p[2 * j + 1], rw.words[i][j], d);
                }
            }
            acc[i][r] += rw.scale[i] * (st.x * (float)d) + rw.bias[i] * st.y;
        }
    }
}

// Σ_k x[r, k] · W_i[k] for a sequence of `jobs` sets of R weight rows, each set's sums handed
// to done(job, acc) (acc[i][r]: this lane's share of row i's sum with x[r, ·]; done sums the
// warp). rows(job, row) names a set's rows: row[i] of matrix i of `src`. The
// warp takes share `part` of `parts` of each set (tiles part, part + parts, ... of the rows'
// tiles of 32 runs), each lane one run of each tile, and every lane as many runs of a set (those
// past the row's end skipped), so that the warp finishes each set together. The lane's runs of
// all the sets are one sequence through a D-stage pipeline: the first D are loaded before the
// kernel waits for its inputs (so, launched early, while the previous kernel still runs) and
// before the block rounds x[m, k] into shared memory (once, however many sets follow); each
// stage, once summed, is refilled with the run D ahead, the next set's first while a set's last
// are summed. The stages are registers (two: a third is no faster and costs registers, which
// more warps an SM put to better use) or, with RING,
// shared memory past the activations (RunRing, INT_RING_STAGES of them), which keeps more
// bytes in flight with fewer registers. ready() runs once the inputs are, before the
// activations are rounded, for loads of its own to fly with theirs.
template <int BITS, class S, int R, int M, bool RING, class Rows, class Done, class Ready>
__device__ __forceinline__ void qdot_jobs(const RowSources<BITS, S, R> &src, const Rows &rows,
                                          const Done &done, const Ready &ready, int jobs,
                                          const float *__restrict__ x, int k, int group, int m,
                                          const float *__restrict__ norm, float eps, int part,
                                          int parts) {
    constexpr int D = RING ? INT_RING_STAGES : 2;
    extern __shared__ uint4 smem[];
    const int runs = k >> 5, gshift = __ffs(group) - 6, step = 32 * parts;
    const int first = (threadIdx.x & 31) + 32 * part;
    const int per_job = (((runs + 31) >> 5) - part + parts - 1) / parts;
    const int items = jobs * per_job;
    RunWeights<BITS, S, R> stage[RING ? 1 : D];
    RunRing<BITS, S, R> ring(smem + acts_units(k, m), D);
    // Run i of set `job` into stage `st`, where there is one; with RING a group of copies
    // either way, so that every item's are the D-th group before its turn.
    auto fetch = [&](int st, int job, int i) {
        const int c = first + i * step;
        if (job < jobs && c < runs) {
            u32 row[R];
            rows(job, row);
            if constexpr (RING)
                ring.fetch(st, src, row, c, gshift);
            else
                stage[st].load(src, row, c, gshift);
        }
        if constexpr (RING) cp_async_commit();
    };
    auto advance = [&](int &job, int &i) {
        if (++i == per_job) i = 0, job++;
    };
    int fetch_job = 0, fetch_i = 0;
#pragma unroll
    for (int d = 0; d < D; d++) {
        fetch(d, fetch_job, fetch_i);
        advance(fetch_job, fetch_i);
    }
    await_inputs();
    ready();
    float row_scale[M];
    const QActs a = quantize_acts<BITS, M>(x, k, m, norm, eps, row_scale);
    TRACE_BLOCK(TRACE_ACTS);
    float acc[R][M];
    zero(acc);
    int job = 0, i = 0;
    // Item t's run through stage st: summed, the stage refilled, the set's sums handed over.
    auto item = [&](int st) {
        const int c = first + i * step;
        if constexpr (RING) {
            cp_async_wait<D - 1>();
            if (c < runs) {
                u32 row[R];
                rows(job, row);
                ring.read(st, stage[0], src, row, c, gshift);
                qdot_run<BITS, S, R, M>(stage[0], a, c, m, acc);
            }
        } else if (c < runs) {
            qdot_run<BITS, S, R, M>(stage[st], a, c, m, acc);
        }
        // After the sums, which used what the stage held: a refill cannot overtake them.
        fetch(st, fetch_job, fetch_i);
        advance(fetch_job, fetch_i);
        if (i == per_job - 1) {
            if (norm)
#pragma unroll
                for (int ii = 0; ii < R; ii++)
#pragma unroll
                    for (int r = 0; r < M; r++) acc[ii][r] *= row_scale[r];
            done(job, acc);
            zero(acc);
        }
        advance(job, i);
    };
    if constexpr (RING) {
        for (int t = 0; t < items; t++) item(t % D);
    } else {
        for (int t0 = 0; t0 < items; t0 += D) {
#pragma unroll
            for (int d = 0; d < D; d++)
                if (t0 + d < items) item(d);
        }
    }
}

// The sets of virtual blocks `block`, `block + step`, ... below `blocks` (the same for every
// warp of a block).
__device__ __forceinline__ int jobs_of(int block, int step, int blocks) {
    return block < blocks ? (blocks - block + step - 1) / step : 0;
}

// y[r, n] (+)= Σ_k x[r, k] · W[n, k] for r < m. The rows go in virtual blocks of 2 · warps /
// parts rows: each warp takes a share (`parts` shares) of the runs of 2 rows, the block's warps
// consecutive pairs of rows, `parts` warps a pair; the shares' sums meet in shared memory.
// Splitting rows between warps gives a matrix of few, long rows (a down projection) warps enough
// to keep the memory busy. A block takes virtual blocks `block`, `block + step`, ... below
// `blocks`: launched with as many blocks as the GPU holds at once, it rounds the activations
// once for all of them and keeps its loads flowing from one pair of rows into the next. The
// launch gives the activations their shared memory (`int_acts_bytes` in cuda/matmul.rs).
template <int BITS, class S, int M, bool RING>
__device__ void qgemv_int(const u32 *__restrict__ w, const typename S::T *__restrict__ scales,
                          const typename S::T *__restrict__ biases, const float *__restrict__ x,
                          float *__restrict__ y, int n, int k, int group, int m, int accumulate,
                          int block, int step, int blocks, int parts,
                          const float *__restrict__ norm, float eps) {
    __shared__ float shares[32][2][M];
    const int warp = threadIdx.x >> 5, part = warp % parts;
    const int rows_per_block = 2 * (blockDim.x >> 5) / parts;
    // The warp's pair of rows within its block's, divided out once: inside first_row the
    // division by `parts` was made again for every run a lane loaded.
    const int pair_row = warp / parts * 2;
    const RowSources<BITS, S, 2> src = {
        {w, w}, {scales, scales}, {biases, biases}, (u32)(k >> 5) * BITS, (u32)(k / group)};
    // The first of the warp's rows in its set `job`: past n for warps past the last row, which
    // still take part in rounding the activations (and read the last row).
    auto first_row = [&](int job) { return (block + job * step) * rows_per_block + pair_row; };
    auto rows = [&](int job, u32 (&row)[2]) {
        row[0] = min(first_row(job), n - 1);
        row[1] = min(first_row(job) + 1, n - 1);
    };
    // The lane that writes a set's sums.
    auto writes = [&](int job) {
        return (threadIdx.x & 31) == 0 && part == 0 && first_row(job) < n;
    };
    // For one or two rows only: it makes one sequence's decode a few percent faster, and the
    // wider kernels have no registers to spare for it.
    constexpr bool EARLY = M <= 2;
    float prior[2][M];
    auto done = [&](int job, float (&acc)[2][M]) {
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int r = 0; r < M; r++) acc[i][r] = r < m ? warp_sum(acc[i][r]) : 0.f;
        if (parts > 1) {
            if (job > 0) __syncthreads(); // the previous set's shares have been read
            if ((threadIdx.x & 31) == 0)
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int r = 0; r < M; r++) shares[warp][i][r] = acc[i][r];
            __syncthreads();
            if (part == 0)
                for (int p = 1; p < parts; p++)
#pragma unroll
                    for (int i = 0; i < 2; i++)
#pragma unroll
                        for (int r = 0; r < M; r++) acc[i][r] += shares[warp + p][i][r];
        }
        const int row0 = first_row(job);
        if (!writes(job)) return;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int r = 0; r < M; r++) {
                if (r >= m) break;
                if (row0 + i < n) {
                    float *o = y + (i64)r * n + row0 + i;
                    const float before = EARLY && job == 0 ? prior[i][r] : *o;
                    *o = accumulate ? before + acc[i][r] : acc[i][r];
                }
            }
    };
    // What the first set's rows add to, loaded with the activations rather than after the sums.
    auto ready = [&] {
        if (!EARLY || !accumulate || !writes(0)) return;
        const int row0 = first_row(0);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int r = 0; r < M; r++)
                if (r < m && row0 + i < n) prior[i][r] = y[(i64)r * n + row0 + i];
    };
    qdot_jobs<BITS, S, 2, M, RING>(src, rows, done, ready, jobs_of(block, step, blocks), x, k, group,
                                   m, norm, eps, part, parts);
    TRACE_WARP(TRACE_DONE);
}

// Attention's projections of one token, its RoPE and its cache write in one launch: queries
// (`heads` · d rows of wq), keys and values (`kv_heads` · d rows of wk, wv) from x (RMS-normed
// with `norm` if non-null); queries and keys rotated at positions[0] as the rope kernel rotates
// them (d/2 frequencies), queries into q_out, keys and values into the rings at slot
// positions[0] % capacity (laid out as kv_write's, f16 if `half_cache`, or `code_bits`-bit
// codes in groups of 1 << gshift when that is not 0); each projection's bias (addq, addk, addv:
// f32, null for none) is added to its sums before the rotation. Each warp takes the two rows
// that one rotation pairs (features i and i + d/2 of a head, or 2i and 2i + 1 with
// `traditional`), so that it holds both sums; the blocks take the queries, then the keys, then
// the values. A group of codes needs every feature of its head, which warps of several blocks
// hold: they put their features in `staged` ([2, kv_heads, d]: keys, values) and count
// themselves in `arrivals` (2 · kv_heads, zero between launches), and the head's last warp
// quantizes the head's groups and sets its count back to 0.
template <int BITS, class S>
__device__ void qkv_rope(const u32 *wq, const typename S::T *sq, const typename S::T *bq,
                         const float *addq, const u32 *wk, const typename S::T *sk,
                         const typename S::T *bk, const float *addk, const u32 *wv,
                         const typename S::T *sv, const typename S::T *bv, const float *addv,
                         const float *__restrict__ x, int k,
                         int group, const float *__restrict__ norm, float eps,
                         float *__restrict__ q_out, void *__restrict__ keys,
                         void *__restrict__ values, int capacity,
                         const int *__restrict__ positions, const float *__restrict__ inv_freqs,
                         int heads, int kv_heads, int d, int traditional, int half_cache,
                         int code_bits, int gshift, float *__restrict__ staged,
                         unsigned *__restrict__ arrivals) {
    const int warps = blockDim.x >> 5, half = d >> 1;
    const int q_pairs = heads * half, kv_pairs = kv_heads * half;
    const int q_blocks = (q_pairs + warps - 1) / warps, kv_blocks = (kv_pairs + warps - 1) / warps;
    const int blk = blockIdx.x;
    const int which = blk < q_blocks ? 0 : blk < q_blocks + kv_blocks ? 1 : 2;
    const int pairs = which == 0 ? q_pairs : kv_pairs;
    const int first = which == 0 ? 0 : which == 1 ? q_blocks : q_blocks + kv_blocks;
    const int pair = (blk - first) * warps + (threadIdx.x >> 5);
    // Warps past the last pair still take part in rounding the activations.
    const int p = min(pair, pairs - 1), head = p / half, i = p % half;
    const bool neighbours = which == 2 || traditional;
    const int a = neighbours ? 2 * p : head * d + i;
    const int rows[2] = {a, neighbours ? a + 1 : a + half};
    // Selected, not indexed: an array indexed at run time would live in local memory.
    const u32 *w = which == 0 ? wq : which == 1 ? wk : wv;
    const typename S::T *sc = which == 0 ? sq : which == 1 ? sk : sv;
    const typename S::T *bi = which == 0 ? bq : which == 1 ? bk : bv;
    const float *add = which == 0 ? addq : which == 1 ? addk : addv;
    const RowSources<BITS, S, 2> src = {
        {w, w}, {sc, sc}, {bi, bi}, (u32)(k >> 5) * BITS, (u32)(k / group)};
    auto both = [&](int, u32 (&row)[2]) { row[0] = rows[0], row[1] = rows[1]; };
    float v0, v1;
    auto sums = [&](int, float (&acc)[2][1]) {
        v0 = warp_sum(acc[0][0]);
        v1 = warp_sum(acc[1][0]);
    };
    qdot_jobs<BITS, S, 2, 1, false>(src, both, sums, [] {}, 1, x, k, group, 1, norm, eps, 0, 1);
    TRACE_WARP(TRACE_DONE);
    const int lane = threadIdx.x & 31;
    if (pair >= pairs) return;
    if (add) {
        v0 += add[rows[0]];
        v1 += add[rows[1]];
    }
    const int pos = positions[0];
    const int e0 = rows[0] - head * d, e1 = rows[1] - head * d;
    float r0 = v0, r1 = v1;
    if (which < 2) {
        float sn, cs;
        sincosf((float)pos * inv_freqs[i], &sn, &cs);
        r0 = v0 * cs - v1 * sn, r1 = v0 * sn + v1 * cs;
    }
    if (which == 0) {
        if (lane == 0) q_out[rows[0]] = r0, q_out[rows[1]] = r1;
        return;
    }
    void *ring = which == 1 ? keys : values;
    if (code_bits == 0) {
        const i64 slot = ((i64)head * capacity + pos % capacity) * d;
        if (lane == 0) {
            kv_store(ring, slot + e0, r0, half_cache);
            kv_store(ring, slot + e1, r1, half_cache);
        }
        return;
    }
    const int row = (which - 1) * kv_heads + head;
    float *features = staged + (i64)row * d;
    unsigned arrived = 0;
    if (lane == 0) {
        features[e0] = r0;
        features[e1] = r1;
        // The features visible to whichever warp counts last.
        __threadfence();
        arrived = atomicAdd(arrivals + row, 1u);
    }
    if (__shfl_sync(0xffffffffu, arrived, 0) != (unsigned)half - 1) return;
    __threadfence();
    for (int g = 0; g < d >> gshift; g++) {
        const float *src = features + (g << gshift);
        if (code_bits == 8)
            write_code_group<8>(src, ring, capacity, pos, kv_heads, head, g, d, gshift);
        else
            write_code_group<4>(src, ring, capacity, pos, kv_heads, head, g, d, gshift);
    }
    if (lane == 0) arrivals[row] = 0;
}

// The gated MLP's first half (see qglu) on int16 activations: each warp takes one row of the
// gate and the same row of the up projection, a block `warps` of them in a virtual block; a
// block takes virtual blocks blockIdx.x, + gridDim.x, ... below `blocks`, as qgemv_int's do.
template <int BITS, class S, int M, bool RING>
__device__ void qglu_int(const u32 *__restrict__ gw, const typename S::T *__restrict__ gs,
                         const typename S::T *__restrict__ gb, const u32 *__restrict__ uw,
                         const typename S::T *__restrict__ us, const typename S::T *__restrict__ ub,
                         const float *__restrict__ x, float *__restrict__ out, int n, int k,
                         int group, int m, int act, const float *__restrict__ norm, float eps,
                         int blocks) {
    const int warps = blockDim.x >> 5;
    const RowSources<BITS, S, 2> src = {
        {gw, uw}, {gs, us}, {gb, ub}, (u32)(k >> 5) * BITS, (u32)(k / group)};
    // Past n for warps past the last row, which still take part in rounding the activations.
    auto row_of = [&](int job) { return (blockIdx.x + job * gridDim.x) * warps + (threadIdx.x >> 5); };
    auto rows = [&](int job, u32 (&row)[2]) { row[0] = row[1] = min(row_of(job), n - 1); };
    auto done = [&](int job, float (&acc)[2][M]) {
        const int row = row_of(job);
#pragma unroll
        for (int r = 0; r < M; r++) {
            if (r >= m) break;
            const float g = warp_sum(acc[0][r]), u = warp_sum(acc[1][r]);
            if ((threadIdx.x & 31) == 0 && row < n) {
                const float h = act == 0 ? g / (1.f + expf(-g))
                                         : 0.5f * g * (1.f + tanhf(0.7978846f * (g + 0.044715f * g * g * g)));
                out[(i64)r * n + row] = h * u;
            }
        }
    };
    qdot_jobs<BITS, S, 2, M, RING>(src, rows, done, [] {}, jobs_of(blockIdx.x, gridDim.x, blocks),
                                   x, k, group, m, norm, eps, 0, 1);
    TRACE_WARP(TRACE_DONE);
}

// Each kernel comes in three widths: for up to 4 activation rows (`qgemv_int4_4_bf16`; from 5
// the tensor cores take them), 2 (`qgemv_int2_4_bf16`) and one (`qgemv_int1_4_bf16`), which
// decoding a single sequence runs; holding fewer rows' sums takes fewer registers than the 8-row
// kernels that took them before (4-bit, bf16 scales, sm_90: qgemv 80, 83, 64 against 113; qglu
// 79, 69, 55 against 107), so more warps fit an SM.
#define QUANTIZED_INT(BITS, S, NAME, M, TAG, RING, BOUNDS)                                         \
    /* A non-null norm RMS-norms the input first (an output head's final norm).              */ \
    extern "C" __global__ void BOUNDS qgemv_int##TAG##_##BITS##_##NAME(                           \
        const u32 *w, const S::T *s, const S::T *b, const float *x, float *y, int n, int k,       \
        int g, int m, int acc, int parts, int blocks, const float *norm, float eps) {             \
        qgemv_int<BITS, S, M, RING>(w, s, b, x, y, n, k, g, m, acc, blockIdx.x, gridDim.x, blocks,\
                                    parts, norm, eps);                                            \
    }                                                                                             \
    /* Two or three matrices of one input (attention's q, k and v), the blocks in their      */ \
    /* order; n2 = 0 leaves the third out. A non-null norm RMS-norms the input first.         */ \
    extern "C" __global__ void qgemv3_int##TAG##_##BITS##_##NAME(                                 \
        const u32 *w0, const S::T *s0, const S::T *b0, float *y0, int n0, const u32 *w1,          \
        const S::T *s1, const S::T *b1, float *y1, int n1, const u32 *w2, const S::T *s2,         \
        const S::T *b2, float *y2, int n2, const float *x, int k, int g, int m,                   \
        const float *norm, float eps) {                                                           \
        const int per_block = 2 * (blockDim.x >> 5);                                              \
        const int nb0 = (n0 + per_block - 1) / per_block, nb1 = (n1 + per_block - 1) / per_block; \
        const int blk = blockIdx.x, which = blk < nb0 ? 0 : blk < nb0 + nb1 ? 1 : 2;              \
        const int b = blk - (which > 0 ? nb0 : 0) - (which > 1 ? nb1 : 0);                        \
        /* One call of the inlined GEMV, on the chosen matrix: one virtual block, its own. */     \
        qgemv_int<BITS, S, M, RING>(which == 0 ? w0 : which == 1 ? w1 : w2,                       \
                              which == 0 ? s0 : which == 1 ? s1 : s2,                             \
                              which == 0 ? b0 : which == 1 ? b1 : b2, x,                          \
                              which == 0 ? y0 : which == 1 ? y1 : y2,                             \
                              which == 0 ? n0 : which == 1 ? n1 : n2, k, g, m, 0, b, 1, b + 1, 1, \
                              norm, eps);                                                         \
    }                                                                                             \
    extern "C" __global__ void qglu_int##TAG##_##BITS##_##NAME(                                   \
        const u32 *gw, const S::T *gs, const S::T *gb, const u32 *uw, const S::T *us,             \
        const S::T *ub, const float *x, float *out, int n, int k, int g, int m, int act,          \
        const float *norm, float eps, int blocks) {                                               \
        qglu_int<BITS, S, M, RING>(gw, gs, gb, uw, us, ub, x, out, n, k, g, m, act, norm, eps,    \
                                   blocks);                                                       \
    }

// The one-row 4-bit GEMV held to 64 registers, so that two blocks of 512 threads fit an SM: left
// to itself it took 71 once its runs were placed by 32-bit offsets (RowSources). The 8-bit one
// holds more than 64 either way and fits one block of 512.
#define INT1_BOUNDS_4 __launch_bounds__(512, 2)
#define INT1_BOUNDS_8

#define QUANTIZED_INT_WIDTHS(BITS, S, NAME)                                                        \
    QUANTIZED_INT(BITS, S, NAME, 4, 4, false, )                                                    \
    QUANTIZED_INT(BITS, S, NAME, 2, 2, false, )                                                    \
    QUANTIZED_INT(BITS, S, NAME, 1, 1, false, INT1_BOUNDS_##BITS)                                  \
    extern "C" __global__ void qkv_rope_int1_##BITS##_##NAME(                                     \
        const u32 *wq, const S::T *sq, const S::T *bq, const float *addq, const u32 *wk,          \
        const S::T *sk, const S::T *bk, const float *addk, const u32 *wv, const S::T *sv,         \
        const S::T *bv, const float *addv, const float *x, int k, int g, const float *norm,       \
        float eps, float *q_out, void *keys, void *values, int capacity, const int *positions,    \
        const float *inv_freqs, int heads, int kv_heads, int d, int traditional,                  \
        int half_cache, int code_bits, int gshift, float *staged, unsigned *arrivals) {           \
        qkv_rope<BITS, S>(wq, sq, bq, addq, wk, sk, bk, addk, wv, sv, bv, addv, x, k, g, norm,    \
                          eps, q_out, keys, values, capacity, positions, inv_freqs, heads,        \
                          kv_heads, d, traditional, half_cache, code_bits, gshift, staged,        \
                          arrivals);                                                              \
    }

FOR_INT_FORMATS(QUANTIZED_INT_WIDTHS)

// The kernels of 2 and of up to 4 rows of 4-bit weights again, with their weight runs through
// shared memory (RING), as `qgemv_int2r_4_bf16` and so on (cuda/matmul.rs's `int_ring` chooses them).
#define QUANTIZED_INT_RING(BITS, S, NAME)                                                          \
    QUANTIZED_INT(BITS, S, NAME, 4, 4r, true, )                                                    \
    QUANTIZED_INT(BITS, S, NAME, 2, 2r, true, )
#define FOR_INT4_FORMATS(X) \
    X(4, F32, f32)          \
    X(4, F16, f16)          \
    X(4, BF16, bf16)
FOR_INT4_FORMATS(QUANTIZED_INT_RING)

// ---- float weights --------------------------------------------------------------------------

// y[r, n] = Σ_k x[r, k] · W[n, k] for r < m (m ≤ 8), W in f32, f16 or bf16: one warp per row.
template <class S>
__device__ void dgemv(const typename S::T *__restrict__ w, const float *__restrict__ x,
                      float *__restrict__ y, int n, int k, int m) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n) return;
    float acc[8];
#pragma unroll
    for (int r = 0; r < 8; r++) acc[r] = 0.f;
    for (int c = lane; c < k; c += 32) {
        const float wv = S::load(w, (i64)row * k + c);
#pragma unroll
        for (int r = 0; r < 8; r++) {
            if (r >= m) break;
            acc[r] += wv * x[(i64)r * k + c];
        }
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
        if (r >= m) break;
        const float v = warp_sum(acc[r]);
        if (lane == 0) y[(i64)r * n + row] = v;
    }
}

template <class S>
__device__ void drows(const typename S::T *__restrict__ w, const int *__restrict__ ids,
                      float *__restrict__ out, int k) {
    const i64 row = ids[blockIdx.x];
    for (int c = threadIdx.x; c < k; c += blockDim.x)
        out[(i64)blockIdx.x * k + c] = S::load(w, row * k + c);
}

#define DENSE(S, NAME)                                                                          \
    extern "C" __global__ void dgemv_##NAME(const S::T *w, const float *x, float *y, int n,     \
                                            int k, int m) {                                     \
        await_inputs();                                                                         \
        dgemv<S>(w, x, y, n, k, m);                                                             \
    }                                                                                           \
    extern "C" __global__ void drows_##NAME(const S::T *w, const int *ids, float *out, int k) { \
        await_inputs();                                                                         \
        drows<S>(w, ids, out, k);                                                               \
    }

DENSE(F32, f32)
DENSE(F16, f16)
DENSE(BF16, bf16)

