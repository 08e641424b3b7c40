// ---- key/value caches of codes ---------------------------------------------------------------
// How mlx-lm's quantized caches lie in a ring and how a row of them is written, for the writes
// of the attention kernels and of the fused projection (qkv_rope in matmul.cu) alike.

// A ring of BITS-bit codes (mlx-lm's quantized cache, `mx.quantize` of each group of a head's
// features) is one allocation: the codes of its `len` elements, element e in bits (e·BITS) mod 8
// of byte e·BITS/8, then at the next 16-byte boundary one (scale, bias) pair per group. Groups are
// 32, 64 or 128 elements (1 << gshift), never straddling two rows.
__device__ __forceinline__ i64 code_pairs_at(i64 len, int bits) {
    return (len * bits / 8 + 15) & ~(i64)15;
}

// Quantizes the `group` values at src as mx.quantize does (the host's `affine_group` and
// `affine_code`, so that both devices keep the same codes), one warp: lane l takes elements
// l·k.. of k = group / 32. They are read through L2, where other blocks of the same launch may
// have written them.
template <int BITS>
__device__ __forceinline__ void quantize_group(const float *src, int group, unsigned char *codes,
                                               float2 *pair) {
    const int lane = threadIdx.x & 31, k = group >> 5;
    const float levels = (float)((1 << BITS) - 1);
    float v[4], lo = INFINITY, hi = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = i < k ? __ldcg(src + lane * k + i) : 0.f;
        if (i < k) lo = fminf(lo, v[i]), hi = fmaxf(hi, v[i]);
    }
    lo = -warp_max(-lo);
    hi = warp_max(hi);
    float scale = fmaxf((hi - lo) / levels, 1e-7f), edge = lo;
    if (!(fabsf(lo) > fabsf(hi))) scale = -scale, edge = hi;
    const float q0 = rintf(edge / scale);
    float bias = 0.f;
    if (q0 != 0.f) scale = edge / q0, bias = edge;
    auto code = [&](float x) { return (u32)fminf(fmaxf(rintf((x - bias) / scale), 0.f), levels); };
    if (BITS == 8) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (i < k) codes[lane * k + i] = (unsigned char)code(v[i]);
    } else if (k == 1) {
        // A byte holds two lanes' codes, the even lane's in its low half.
        const u32 c = code(v[0]), next = __shfl_down_sync(0xffffffffu, c, 1);
        if ((lane & 1) == 0) codes[lane >> 1] = (unsigned char)(c | next << 4);
    } else {
#pragma unroll
        for (int i = 0; i < 4; i += 2)
            if (i < k) codes[(lane * k + i) >> 1] = (unsigned char)(code(v[i]) | code(v[i + 1]) << 4);
    }
    if (lane == 0) *pair = make_float2(scale, bias);
}

// Quantizes the `1 << gshift` values at src into group g of head h's row at `position` of a
// code ring ([kv_heads, capacity, d] elements), one warp.
template <int BITS>
__device__ __forceinline__ void write_code_group(const float *src, void *ring, int capacity,
                                                 i64 position, int kv_heads, int h, int g, int d,
                                                 int gshift) {
    const int slot = (int)position % capacity;
    const i64 e = ((i64)h * capacity + slot) * d + (g << gshift);
    unsigned char *base = static_cast<unsigned char *>(ring);
    const i64 len = (i64)kv_heads * capacity * d;
    float2 *pair = reinterpret_cast<float2 *>(base + code_pairs_at(len, BITS)) + (e >> gshift);
    quantize_group<BITS>(src, 1 << gshift, base + ((e * BITS) >> 3), pair);
}
