// ---- key/value caches -----------------------------------------------------------------------

// Writes new keys and values ([tokens, kv_heads, d] each) at positions[0].. of a cache's two
// rings, laid out [kv_heads, capacity, d], position p in slot p % capacity.
extern "C" __global__ void kv_write(void *keys, void *values, const float *new_keys,
                                    const float *new_values, int tokens, int kv_heads, int d,
                                    int capacity, const int *positions, int half) {
    await_inputs();
    const i64 first = positions[0];
    GRID_STRIDE(i, (i64)tokens * kv_heads * d) {
        const int e = (int)(i % d);
        const i64 th = i / d;
        const int h = (int)(th % kv_heads);
        const i64 t = th / kv_heads;
        const i64 at = ((i64)h * capacity + (first + t) % capacity) * d + e;
        kv_store(keys, at, new_keys[i], half);
        kv_store(values, at, new_values[i], half);
    }
}

// kv_write for one token of each of several sequences: row s of new_keys and new_values
// ([seqs, kv_heads, d]) goes to the rings at rings[s] and rings[seqs + s] (capacity
// capacities[s]) at positions[s].
extern "C" __global__ void kv_write_batch(const unsigned long long *rings, const float *new_keys,
                                          const float *new_values, int seqs, int kv_heads, int d,
                                          const int *capacities, const int *positions, int half) {
    await_inputs();
    GRID_STRIDE(i, (i64)seqs * kv_heads * d) {
        const int e = (int)(i % d);
        const i64 sh = i / d;
        const int h = (int)(sh % kv_heads);
        const int s = (int)(sh / kv_heads);
        const int capacity = capacities[s];
        const i64 at = ((i64)h * capacity + positions[s] % capacity) * d + e;
        kv_store(reinterpret_cast<void *>(rings[s]), at, new_keys[i], half);
        kv_store(reinterpret_cast<void *>(rings[seqs + s]), at, new_values[i], half);
    }
}

// Copies positions p0..p1 from one ring to another of a different capacity, elements of
// `bytes` (4 or 2) as they are; position p comes from the source's position p - shift.
extern "C" __global__ void kv_move(const void *src, int src_capacity, void *dst, int dst_capacity,
                                   int kv_heads, int d, i64 p0, i64 p1, i64 shift, int bytes) {
    await_inputs();
    GRID_STRIDE(i, (p1 - p0) * kv_heads * d) {
        const int e = (int)(i % d);
        const i64 hp = i / d;
        const i64 p = p0 + hp % (p1 - p0);
        const i64 h = hp / (p1 - p0);
        const i64 to = (h * dst_capacity + p % dst_capacity) * d + e;
        const i64 from = (h * src_capacity + (p - shift) % src_capacity) * d + e;
        if (bytes == 2)
            static_cast<u16 *>(dst)[to] = static_cast<const u16 *>(src)[from];
        else
            static_cast<float *>(dst)[to] = static_cast<const float *>(src)[from];
    }
}

// The first `slots` slots of each head of an f16 ring ([kv_heads, capacity, d]) as f32
// ([kv_heads, slots, d]), for prefill's attention products.
extern "C" __global__ void kv_widen(const u16 *ring, float *out, int kv_heads, int capacity,
                                    int slots, int d) {
    await_inputs();
    GRID_STRIDE(i, (i64)kv_heads * slots * d) {
        const int e = (int)(i % d);
        const i64 hj = i / d;
        const i64 h = hj / slots, j = hj % slots;
        out[i] = F16::load(ring, (h * capacity + j) * d + e);
    }
}

// ---- quantized key/value caches ------------------------------------------------------------

// Where a row of new keys and values goes: the ring (keys' or values'), its capacity and the
// row's position.
struct CodeRow {
    void *ring;
    int capacity;
    i64 position;
};

// Quantizes `rows` rows of new keys and values ([rows, kv_heads, d] each) into code rings, one
// warp per (row, head, group) of each: row r's keys go where row_at(r, false) says, its values
// where row_at(r, true) does.
template <int BITS, class RowAt>
__device__ void write_code_rows(const float *new_keys, const float *new_values, i64 rows,
                                int kv_heads, int d, int gshift, RowAt row_at) {
    await_inputs();
    // 32-bit indices: a 64-bit division is a long call, and a step's few warps wait on it.
    const int groups = d >> gshift;
    const int warps = (int)(2 * rows * kv_heads * groups);
    const int stride = (gridDim.x * blockDim.x) >> 5;
    for (int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < warps; w += stride) {
        const bool value = w & 1;
        const int rg = w >> 1, r = rg / groups / kv_heads;
        const int g = rg % groups, h = rg / groups % kv_heads;
        const CodeRow at = row_at(r, value);
        const float *src = (value ? new_values : new_keys) + (r * kv_heads + h) * d + (g << gshift);
        write_code_group<BITS>(src, at.ring, at.capacity, at.position, kv_heads, h, g, d, gshift);
    }
}

// ---- how attention reads a ring ---------------------------------------------------------------

// The attention kernels read a ring through R: `R::P` is a place in it (element e of the ring
// at `ring(base, len, gshift) + e`), `load(p, i)` element i from there and `load4(p, i)` elements
// 4i..4i+3, `prefetch(row, d)` a row into L2. Rows staged in shared memory (`stage_kv_rows`)
// take `units(d)` 16-byte units of elements, read with `unpack_row` (unit u's PER_UNIT elements)
// and `load_row` (one element).

// A ring of f32 or f16 elements (F = F32 or F16): a place in it is a pointer, which nothing the
// kernels write aliases.
template <class F>
struct FloatRing {
    typedef typename F::T T;
    typedef const T *__restrict__ P;
    static constexpr bool CODES = false;
    static constexpr int PER_UNIT = F::PER_UNIT;
    // Rows of floats are read element by element (see CodeRing::whole).
    template <int N>
    static __host__ __device__ constexpr bool whole() {
        return false;
    }
    static __device__ __forceinline__ P ring(const void *base, i64, int) {
        return static_cast<P>(base);
    }
    static __device__ __forceinline__ float load(P p, i64 i) { return F::load(p, i); }
    static __device__ __forceinline__ float4 load4(P p, int i) { return F::load4(p, i); }
    static __device__ __forceinline__ void prefetch(P row, int d) {
        for (int f = 0; f < d; f += 128 / (int)sizeof(T)) l2_prefetch(row + f);
    }
    static __device__ __forceinline__ int units(int d) { return (d * (int)sizeof(T) + 15) / 16; }
    static __device__ __forceinline__ void unpack_row(const uint4 *row, int u, int, int,
                                                      float (&v)[PER_UNIT]) {
        F::unpack(row[u], v);
    }
    static __device__ __forceinline__ float load_row(const unsigned char *row, int f, int, int) {
        return F::load(reinterpret_cast<const T *>(row), f);
    }
};

// A place in a ring of BITS-bit codes: element e's byte and its group's (scale, bias).
template <int BITS>
struct CodePlace {
    const unsigned char *codes;
    const float2 *pairs;
    int gshift;
    __device__ __forceinline__ CodePlace operator+(i64 e) const {
        return {codes + ((e * BITS) >> 3), pairs + (e >> gshift), gshift};
    }
};

// A ring of BITS-bit codes. A staged row is its codes (whole 16-byte units: rows are whole
// groups of 32 or more) followed by its groups' pairs.
template <int BITS>
struct CodeRing {
    typedef CodePlace<BITS> P;
    static constexpr bool CODES = true;
    static constexpr int PER_UNIT = 128 / BITS;
    static constexpr u32 MASK = (1u << BITS) - 1;
    static __device__ __forceinline__ P ring(const void *base, i64 len, int gshift) {
        const unsigned char *b = static_cast<const unsigned char *>(base);
        return {b, reinterpret_cast<const float2 *>(b + code_pairs_at(len, BITS)), gshift};
    }
    static __device__ __forceinline__ u32 code(const unsigned char *codes, i64 i) {
        return BITS == 8 ? codes[i] : (codes[i >> 1] >> ((i & 1) * 4)) & 15;
    }
    static __device__ __forceinline__ float load(P p, i64 i) {
        const float2 sb = p.pairs[i >> p.gshift];
        return fmaf((float)code(p.codes, i), sb.x, sb.y);
    }
    static __device__ __forceinline__ float4 load4(P p, int i) {
        const u32 w = BITS == 8 ? reinterpret_cast<const u32 *>(p.codes)[i]
                                : reinterpret_cast<const u16 *>(p.codes)[i];
        const float2 sb = p.pairs[(4 * i) >> p.gshift];
        float4 v;
        v.x = fmaf((float)(w & MASK), sb.x, sb.y);
        v.y = fmaf((float)(w >> BITS & MASK), sb.x, sb.y);
        v.z = fmaf((float)(w >> 2 * BITS & MASK), sb.x, sb.y);
        v.w = fmaf((float)(w >> 3 * BITS & MASK), sb.x, sb.y);
        return v;
    }
    // Whether `load_n<N>` takes N elements at once: a power of two of at least a byte that
    // divides every group (32 or more), so that the N share one pair.
    template <int N>
    static __host__ __device__ constexpr bool whole() {
        return N * BITS >= 8 && N <= 32 && (N & (N - 1)) == 0;
    }
    // Elements f0..f0 + N (f0 a multiple of N, whole<N>()): their codes in one load of N·BITS
    // bits (32-bit words past four bytes) and their group's pair in another.
    template <int N>
    static __device__ __forceinline__ void load_n(P p, int f0, float (&v)[N]) {
        constexpr int BYTES = N * BITS / 8;
        const unsigned char *c = p.codes + ((f0 * BITS) >> 3);
        const float2 sb = p.pairs[f0 >> p.gshift];
        u32 w[BYTES >= 4 ? BYTES / 4 : 1];
        if constexpr (BYTES == 1) {
            w[0] = *c;
        } else if constexpr (BYTES == 2) {
            w[0] = *reinterpret_cast<const u16 *>(c);
        } else {
#pragma unroll
            for (int i = 0; i < BYTES / 4; i++) w[i] = reinterpret_cast<const u32 *>(c)[i];
        }
        constexpr int PER_WORD = BYTES >= 4 ? 32 / BITS : N;
#pragma unroll
        for (int i = 0; i < N; i++)
            v[i] = fmaf((float)(w[i / PER_WORD] >> (BITS * (i % PER_WORD)) & MASK), sb.x, sb.y);
    }
    static __device__ __forceinline__ void prefetch(P row, int d) {
        for (int b = 0; b < d * BITS / 8; b += 128) l2_prefetch(row.codes + b);
        l2_prefetch(row.pairs);
    }
    static __device__ __forceinline__ int units(int d) { return d * BITS / 128; }
    static __device__ __forceinline__ const float2 *row_pairs(const void *row, int d) {
        return reinterpret_cast<const float2 *>(static_cast<const unsigned char *>(row) +
                                                d * BITS / 8);
    }
    static __device__ __forceinline__ void unpack_row(const uint4 *row, int u, int d, int gshift,
                                                      float (&v)[PER_UNIT]) {
        const uint4 c = row[u];
        const float2 sb = row_pairs(row, d)[(u * PER_UNIT) >> gshift];
        const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 32 / BITS; j++)
                v[i * (32 / BITS) + j] = fmaf((float)(w[i] >> (BITS * j) & MASK), sb.x, sb.y);
    }
    static __device__ __forceinline__ float load_row(const unsigned char *row, int f, int d,
                                                     int gshift) {
        const float2 sb = row_pairs(row, d)[f >> gshift];
        return fmaf((float)code(row, f), sb.x, sb.y);
    }
};

// kv_widen of a code ring: its first `slots` slots of each head, dequantized.
template <int BITS>
__device__ void kv_widen_codes(const unsigned char *ring, float *out, int kv_heads, int capacity,
                               int slots, int d, int gshift) {
    await_inputs();
    typedef CodeRing<BITS> R;
    const typename R::P codes = R::ring(ring, (i64)kv_heads * capacity * d, gshift);
    GRID_STRIDE(i, (i64)kv_heads * slots * d) {
        const i64 hj = i / d;
        out[i] = R::load(codes, (hj / slots * capacity + hj % slots) * d + i % d);
    }
}

// kv_write and kv_write_batch into code rings, and kv_widen of one.
#define CODE_CACHE_KERNELS(BITS)                                                                \
    extern "C" __global__ void kv_write_q##BITS(void *keys, void *values, const float *nk,      \
                                                const float *nv, int tokens, int kv_heads,      \
                                                int d, int capacity, const int *positions,      \
                                                int gshift) {                                   \
        write_code_rows<BITS>(nk, nv, tokens, kv_heads, d, gshift, [&](i64 t, bool value) {     \
            return CodeRow{value ? values : keys, capacity, positions[0] + t};                  \
        });                                                                                     \
    }                                                                                           \
    extern "C" __global__ void kv_write_batch_q##BITS(                                          \
        const unsigned long long *rings, const float *nk, const float *nv, int seqs,            \
        int kv_heads, int d, const int *capacities, const int *positions, int gshift) {         \
        write_code_rows<BITS>(nk, nv, seqs, kv_heads, d, gshift, [&](i64 s, bool value) {       \
            void *ring = reinterpret_cast<void *>(rings[value ? seqs + s : s]);                 \
            return CodeRow{ring, capacities[s], positions[s]};                                  \
        });                                                                                     \
    }                                                                                           \
    extern "C" __global__ void kv_widen_q##BITS(const unsigned char *ring, float *out,          \
                                                int kv_heads, int capacity, int slots, int d,   \
                                                int gshift) {                                   \
        kv_widen_codes<BITS>(ring, out, kv_heads, capacity, slots, d, gshift);                  \
    }
CODE_CACHE_KERNELS(8)
CODE_CACHE_KERNELS(4)

// ---- attention -------------------------------------------------------------------------------

// One warp per (query token, head, split of the visible keys), E = ceil(head_dim / 32) output
// features per lane. Query t sees positions lo..hi: lo = max(start, positions[t] + 1 - window),
// hi = positions[t] + 1 (its own key is in the cache already), slot p % capacity. Keys go 32 at
// a time (each row loaded across the warp, each key's score ending in its own lane), with an
// online softmax. Splits of per_split keys past hi have nothing to
// do and return at once. When only the first has keys its output is final; otherwise (max, sum,
// unnormalised output) per split go to `part`, and the split that finishes last (counted in
// counters[th], which it sets back to 0) merges them into `out`: no second launch.
// `th` = token · heads + head, counted from q, positions, out, part and counters.
// The positions [s0, s1) that split `split` of a query at `pos` attends (lo..hi split in runs
// of `per_split`: lo = max(start, pos + 1 - window), hi = pos + 1), and how many of the
// `splits` hold keys (`used`: at least one, so that an empty window still writes zeros).
// False for a split past them, which has nothing to do.
struct SplitKeys {
    i64 s0, s1;
    int used;
};

// A scaled score soft-capped at `cap` (Gemma 2's `cap · tanh(s / cap)`); as it is for cap 0.
__device__ __forceinline__ float soft_cap(float s, float cap) {
    return cap > 0.f ? cap * tanhf(s / cap) : s;
}

// The sink logit of query head h: -inf (none) where `sinks` is null.
__device__ __forceinline__ float sink_of(const float *sinks, int h) {
    return sinks ? sinks[h] : -INFINITY;
}

// What turns an online softmax's unnormalised output (the weights exp(s - m), summing to l)
// into the weighted sum of the values: 1 / l, or with a sink (gpt-oss's: a logit in the
// denominator that weighs no value) exp(m - top) / (l · exp(m - top) + exp(sink - top)),
// top = max(m, sink). 0 where no key was attended.
__device__ __forceinline__ float softmax_norm(float m, float l, float sink) {
    if (sink > -INFINITY) {
        const float top = fmaxf(m, sink), c = expf(m - top);
        return c / (l * c + expf(sink - top));
    }
    return l > 0.f ? 1.f / l : 0.f;
}

__device__ __forceinline__ bool split_keys(i64 pos, i64 start, i64 window, int splits,
                                           int per_split, int split, SplitKeys &k) {
    const i64 hi = pos + 1, lo = min(hi, max(start, pos + 1 - window));
    k.used = (int)max((i64)1, min((i64)splits, (hi - lo + per_split - 1) / per_split));
    k.s0 = lo + (i64)split * per_split;
    k.s1 = min(hi, k.s0 + per_split);
    return split < k.used;
}

// The largest power of two no more than n (n ≥ 1): a count of rows a loop takes at a time that
// divides the 32 keys of a tile and the 64 splits.
__host__ __device__ constexpr int pow2_floor(int n) { return n >= 2 ? 2 * pow2_floor(n / 2) : 1; }

// Merges the first `used` split partials `pp` ([splits, d + 2]: max, sum, unnormalised output)
// of one (token, head) into `out_row`. Lane s takes splits s and s + 32 (at most 64), so that
// the maxima and sums come in one round of loads; then each lane's features (lane + 32e) of
// 64 / E splits at a time, all loaded before any is summed (one round for up to 32 splits of d =
// 64). Loads go through L2, where other blocks' writes are. A `sink` (-inf for none) joins as
// one more split, of sum 1 and no output.
template <int E>
__device__ void combine_splits(const float *pp, float *out_row, int d, int used, int lane,
                               float sink) {
    const int stride = d + 2;
    float ms[2], ws[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int s = lane + 32 * h, at = min(s, used - 1) * stride;
        const float mv = __ldcg(pp + at), wv = __ldcg(pp + at + 1);
        ms[h] = s < used ? mv : -INFINITY;
        ws[h] = s < used ? wv : 0.f;
    }
    const float m = fmaxf(warp_max(fmaxf(ms[0], ms[1])), sink);
    // Each split's weight exp(m_s - m); the softmax's denominator is Σ weight · sum.
    float l = 0.f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float w = ms[h] > -INFINITY ? expf(ms[h] - m) : 0.f;
        l += w * ws[h];
        ws[h] = w;
    }
    l = warp_sum(l);
    if (sink > -INFINITY) l += expf(sink - m);
    TRACE_WARP(TRACE_MERGE_MAXIMA);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    constexpr int ROUND = pow2_floor(64 / E) < 32 ? pow2_floor(64 / E) : 32;
    float v[E];
#pragma unroll
    for (int e = 0; e < E; e++) v[e] = 0.f;
#pragma unroll
    for (int s0 = 0; s0 < 64; s0 += ROUND) {
        if (s0 >= used) break;
        float part[ROUND][E];
#pragma unroll
        for (int j = 0; j < ROUND; j++)
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int s = min(s0 + j, used - 1), f = min(lane + 32 * e, d - 1);
                part[j][e] = __ldcg(pp + s * stride + 2 + f);
            }
#pragma unroll
        for (int j = 0; j < ROUND; j++) {
            const int s = s0 + j;
            const float w = __shfl_sync(0xffffffffu, s < 32 ? ws[0] : ws[1], s & 31);
#pragma unroll
            for (int e = 0; e < E; e++) v[e] += w * part[j][e];
        }
    }
    TRACE_WARP(TRACE_MERGE_SUMMED);
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int f = lane + 32 * e;
        if (f < d) out_row[f] = v[e] * inv;
    }
}

// combine_splits as a call of its own: inlined after attention_group's loop, its loads in
// flight spill that kernel's registers (bounded at 128).
template <int E>
__device__ __noinline__ void combine_splits_call(const float *pp, float *out_row, int d, int used,
                                                 int lane, float sink) {
    combine_splits<E>(pp, out_row, d, used, lane, sink);
}

template <int E, class K>
__device__ void attention_split(const float *__restrict__ q, typename K::P keys,
                                typename K::P values,
                                const int *__restrict__ positions,
                                float *__restrict__ out, float *__restrict__ part,
                                unsigned *__restrict__ counters, int heads, int kv_heads, int d,
                                int capacity, i64 start, i64 window, float scale, float softcap,
                                const float *__restrict__ sinks, int splits, int per_split,
                                int th, int split) {
    typedef typename K::P P;
    const int lane = threadIdx.x;
    const int t = th / heads, h = th % heads;
    const int kvh = h / (heads / kv_heads);
    const P kh = keys + (i64)kvh * capacity * d;
    const P vh = values + (i64)kvh * capacity * d;
    // The positions went up before the step's first kernel, and the keys and values before
    // the query's own were (mostly) written by earlier steps: while the kernel before finishes,
    // the split's rows are fetched into L2 (a hint: the loads after the wait read what is
    // there then), so that those loads do not wait on HBM.
    SplitKeys sk;
    const i64 pos = positions[t];
    const bool has_keys = split_keys(pos, start, window, splits, per_split, split, sk);
    if (has_keys) {
        for (i64 p = sk.s0 + lane; p < min(sk.s1, pos); p += 32) {
            const i64 row = p % capacity * d;
            K::prefetch(kh + row, d);
            K::prefetch(vh + row, d);
        }
    }
    await_inputs();
    if (!has_keys) return;
    // The lane's E features of the query and of each key: lane·E.. (zeros past d).
    const float *qv = q + (i64)th * d;
    // A code ring's rows are read E elements a lane (one load of codes and one of their pair):
    // the value features too are then the lane's lane·E.., where a float ring's are lane + 32e,
    // whose loads across the warp are one run of bytes.
    constexpr bool SHARES = K::CODES && K::template whole<E>();
    auto feature = [&](int e) { return SHARES ? lane * E + e : lane + 32 * e; };
    auto key_share = [&](P kr, float(&v)[E]) {
        const int f0 = lane * E;
        if constexpr (SHARES) {
            // Rows of codes are whole groups of 32 or more: a lane's E lie all within d or
            // all past it.
            if (f0 < d) {
                K::template load_n<E>(kr, f0, v);
            } else {
#pragma unroll
                for (int i = 0; i < E; i++) v[i] = 0.f;
            }
        } else {
            if constexpr (E >= 4) {
                if ((d & 3) == 0) {
#pragma unroll
                    for (int c = 0; c < E / 4; c++) {
                        const bool in = f0 + 4 * c < d;
                        const float4 a = K::load4(kr, in ? f0 / 4 + c : 0);
                        v[4 * c] = in ? a.x : 0.f, v[4 * c + 1] = in ? a.y : 0.f;
                        v[4 * c + 2] = in ? a.z : 0.f, v[4 * c + 3] = in ? a.w : 0.f;
                    }
                    return;
                }
            }
#pragma unroll
            for (int i = 0; i < E; i++) v[i] = f0 + i < d ? K::load(kr, f0 + i) : 0.f;
        }
    };
    float qr[E];
#pragma unroll
    for (int i = 0; i < E; i++) qr[i] = lane * E + i < d ? qv[lane * E + i] : 0.f;
    TRACE_WARP(TRACE_ACTS);
    const i64 s0 = sk.s0, s1 = sk.s1;
    const int used = sk.used;
    float m = -INFINITY, l = 0.f, acc[E];
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] = 0.f;
    // The values of the first VB keys of a tile are loaded with its keys, before the scores
    // that weigh them (they do not depend on them): one round of loads instead of two or three,
    // for a decode step's few warps, each with one tile or two. The rest of the values come in
    // batches whose loads are all issued before any is used. Keys past `count` read the tile's
    // first (written) slot and weigh 0.
    constexpr int VB = E <= 2 ? 32 : 32 / E;
    constexpr int BATCH = E >= 32 ? 1 : 32 / E;
    for (i64 p0 = s0; p0 < s1; p0 += 32) {
        const int count = (int)min((i64)32, s1 - p0);
        // Slots follow p0's without a division per key (positions past the ring's end wrap).
        const int slot0 = (int)(p0 % capacity);
        auto slot_of = [&](int j) {
            int slot = slot0 + (j < count ? j : 0);
            return slot >= capacity ? slot - capacity : slot;
        };
        // The lane's features `feature(e)` of key j's value row (zeros past d).
        auto value_share = [&](int j, float(&v)[E]) {
            const P vr = vh + (i64)slot_of(j) * d;
            if constexpr (SHARES) {
                key_share(vr, v);
            } else {
#pragma unroll
                for (int e = 0; e < E; e++) {
                    const int f = feature(e);
                    v[e] = f < d ? K::load(vr, f) : 0.f;
                }
            }
        };
        float vfirst[VB][E];
#pragma unroll
        for (int j = 0; j < VB; j++) value_share(j, vfirst[j]);
        // Each key row is one load across the warp (the lanes' shares of its features), rather
        // than a row a lane, which takes a cache line per lane and load; the lanes' dot products
        // are then summed so that lane j holds key j's. Keys past `count` read the tile's first
        // slot and score -inf.
        constexpr int KB = E <= 4 ? 32 : pow2_floor(128 / E);
        float dots[32];
#pragma unroll
        for (int j0 = 0; j0 < 32; j0 += KB) {
            float kv[KB][E];
#pragma unroll
            for (int j = 0; j < KB; j++) key_share(kh + (i64)slot_of(j0 + j) * d, kv[j]);
#pragma unroll
            for (int j = 0; j < KB; j++) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < E; i++) dot += qr[i] * kv[j][i];
                dots[j0 + j] = dot;
            }
        }
        const float dot = transpose_sum(dots, lane);
        float s = dot * scale;
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        s = lane < count ? s : -INFINITY;
        TRACE_WARP(TRACE_SCORES);
        const float m_new = fmaxf(m, warp_max(s));
        const float correction = expf(m - m_new);
        const float pr = lane < count ? expf(s - m_new) : 0.f;
        l = l * correction + warp_sum(pr);
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] *= correction;
#pragma unroll
        for (int j = 0; j < VB; j++) {
            const float pj = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
            for (int e = 0; e < E; e++) acc[e] += pj * vfirst[j][e];
        }
#pragma unroll
        for (int j0 = VB; j0 < 32; j0 += BATCH) {
            float v[BATCH][E];
#pragma unroll
            for (int j = 0; j < BATCH; j++) value_share(j0 + j, v[j]);
#pragma unroll
            for (int j = 0; j < BATCH; j++) {
                const float pj = __shfl_sync(0xffffffffu, pr, j0 + j);
#pragma unroll
                for (int e = 0; e < E; e++) acc[e] += pj * v[j][e];
            }
        }
        m = m_new;
    }
    TRACE_WARP(TRACE_KEYS);
    if (used == 1) {
        const float inv = softmax_norm(m, l, sink_of(sinks, h));
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int f = feature(e);
            if (f < d) out[(i64)th * d + f] = acc[e] * inv;
        }
    } else {
        float *pp = part + ((i64)th * splits + split) * (d + 2);
        if (lane == 0) {
            pp[0] = m;
            pp[1] = l;
        }
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int f = feature(e);
            if (f < d) pp[2 + f] = acc[e];
        }
        // Every lane's partials visible before the count, so that the last split reads them all.
        __threadfence();
        __syncwarp();
        unsigned done = 0;
        if (lane == 0) done = atomicAdd(counters + th, 1u);
        done = __shfl_sync(0xffffffffu, done, 0);
        TRACE_WARP(TRACE_COUNTED);
        if (done == (unsigned)used - 1) {
            combine_splits<E>(part + (i64)th * splits * (d + 2), out + (i64)th * d, d, used, lane,
                              sink_of(sinks, h));
            if (lane == 0) counters[th] = 0;
        }
    }
    TRACE_WARP(TRACE_DONE);
}

// `attention_E_f32` over f32 rings, `_f16` over f16 ones, `_q8` and `_q4` over codes (in groups
// of 1 << gshift).
#define ATTENTION(E, K, NAME)                                                                   \
    extern "C" __global__ void attention_##E##_##NAME(                                          \
        const float *q, const void *keys, const void *values, const int *positions, float *out, \
        float *part, unsigned *counters, int heads, int kv_heads, int d, int capacity,          \
        i64 start, i64 window, float scale, float softcap, const float *sinks, int splits,      \
        int per_split, int gshift) {                                                            \
        const i64 len = (i64)kv_heads * capacity * d;                                           \
        attention_split<E, K>(q, K::ring(keys, len, gshift), K::ring(values, len, gshift),      \
                              positions, out, part, counters, heads, kv_heads, d, capacity,     \
                              start, window, scale, softcap, sinks, splits, per_split,          \
                              blockIdx.x, blockIdx.y);                                          \
    }
#define ATTENTION_RINGS(E)                                                                      \
    ATTENTION(E, FloatRing<F32>, f32)                                                           \
    ATTENTION(E, FloatRing<F16>, f16)                                                           \
    ATTENTION(E, CodeRing<8>, q8) ATTENTION(E, CodeRing<4>, q4)

ATTENTION_RINGS(1)
ATTENTION_RINGS(2)
ATTENTION_RINGS(4)
ATTENTION_RINGS(8)
ATTENTION_RINGS(16)
// Multi-head latent attention's rows of 576 (a latent of 512 and a rotated part of 64).
ATTENTION_RINGS(20)

// The batched attention stages tiles of 32 keys' rows (their keys, then their values) in shared
// memory with cp.async, so that a tile's loads are in flight while the tile before is summed and
// hold no registers. A row's d elements take `K::units(d)` 16-byte units (the last one partly;
// a code ring's row then has its groups' pairs), and its place in a tile `units`, which the
// launch gives (`kv_tile_stages` in cuda/attention.rs, with the shared memory's size): one unit
// more where that count is even, so that eight lanes reading a unit each of eight rows fall on
// distinct banks.

// Copies into `tile` (keys' rows, then values' rows, 32 each of `units` 16-byte units) the rows
// of the tile of positions p0.. whose positions lie in [from, to): ring slot (p0 % capacity) + r,
// wrapping. Rows whose bytes are not whole 16-byte units (odd head dims) go through registers,
// zero-padded to their last unit, so that the padding meets the queries' zeros as zeros.
template <class K>
__device__ __forceinline__ void stage_kv_rows(unsigned char *tile, typename K::P keys,
                                              typename K::P values, int d, int units,
                                              int capacity, i64 p0, i64 from, i64 to) {
    const int lane = threadIdx.x & 31;
    const int r0 = (int)max((i64)0, from - p0), r1 = (int)min((i64)32, to - p0);
    if (r0 >= r1) return;
    const int slot0 = (int)(p0 % capacity), per_row = K::units(d);
    unsigned char *vtile = tile + 32 * units * 16;
    auto slot_of = [&](int r) { return slot0 + r < capacity ? slot0 + r : slot0 + r - capacity; };
    if constexpr (K::CODES) {
        // The codes' units, then a piece of 8 bytes for each group's pair.
        const int pieces = per_row + (d >> keys.gshift);
        for (int x = r0 * pieces + lane; x < r1 * pieces; x += 32) {
            const int r = x / pieces, u = x % pieces;
            const i64 e = (i64)slot_of(r) * d;
            const typename K::P kr = keys + e, vr = values + e;
            unsigned char *kt = tile + r * units * 16, *vt = vtile + r * units * 16;
            if (u < per_row) {
                cp_async16(kt + u * 16, kr.codes + u * 16);
                cp_async16(vt + u * 16, vr.codes + u * 16);
            } else {
                const int g = u - per_row;
                cp_async8(kt + per_row * 16 + g * 8, kr.pairs + g);
                cp_async8(vt + per_row * 16 + g * 8, vr.pairs + g);
            }
        }
    } else {
        typedef typename K::T T;
        if ((d * sizeof(T)) % 16 == 0) {
            const unsigned char *kb = reinterpret_cast<const unsigned char *>(keys);
            const unsigned char *vb = reinterpret_cast<const unsigned char *>(values);
            for (int x = r0 * per_row + lane; x < r1 * per_row; x += 32) {
                const int r = x / per_row, u = x % per_row;
                const i64 at = (i64)slot_of(r) * d * sizeof(T) + u * 16;
                cp_async16(tile + (r * units + u) * 16, kb + at);
                cp_async16(vtile + (r * units + u) * 16, vb + at);
            }
        } else {
            const int padded = per_row * 16 / (int)sizeof(T);
            for (int x = r0 * padded + lane; x < r1 * padded; x += 32) {
                const int r = x / padded, f = x % padded;
                const i64 at = (i64)slot_of(r) * d + f;
                reinterpret_cast<T *>(tile + r * units * 16)[f] = f < d ? keys[at] : (T)0;
                reinterpret_cast<T *>(vtile + r * units * 16)[f] = f < d ? values[at] : (T)0;
            }
        }
    }
}

// One query token of a sequence for `heads` (at most G) of the query heads that share one
// key/value head, in one block of up to W warps: each key and value is loaded once for all of
// them, where one warp per head loads it once per head (grouped-query attention: 4 times for 32
// heads over 8). `q`, `out` and `part` start at the first head's row, `keys` and `values` at the
// key/value head's ring; `counter` counts this block's splits. Visible keys, splits and the
// merge as in attention_split. The keys and values go through shared memory a tile of 32 at a
// time (`stage_kv_rows`, `stages` buffers of rows of `units` 16-byte units for each warp in the
// launch's dynamic shared memory). The block's warps take the split's tiles in turn, so that a
// long split is a short chain of tiles for each, and merge their softmaxes through shared memory
// at the end, where warp 0 goes on alone. Each lane keeps its own share of every head's softmax
// sum, added up once at the end, and the weights of a tile go through shared memory, [key][head],
// so that one load gives a key's weight for every head.
template <int E, int G, int W, class K>
__device__ void attention_group(const float *__restrict__ q, typename K::P keys,
                                typename K::P values, i64 pos, float *__restrict__ out,
                                float *__restrict__ part, unsigned *__restrict__ counter,
                                int heads, int d, int capacity, i64 start, i64 window,
                                float scale, float softcap, const float *__restrict__ sinks,
                                int splits, int per_split, int split, int stages, int units,
                                int gshift) {
    extern __shared__ __align__(16) unsigned char kv_tiles[];
    __shared__ __align__(16) float qs[G][E * 32];
    __shared__ __align__(16) float ps[W][32][G];
    // The heads' sinks wait here for the end, rather than hold registers through the loop.
    __shared__ float sink_s[G];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int stage_bytes = 2 * 32 * units * 16;
    unsigned char *own = kv_tiles + warp * stages * stage_bytes;
    SplitKeys sk;
    const bool has_keys = split_keys(pos, start, window, splits, per_split, split, sk);
    const i64 s0 = sk.s0, s1 = sk.s1;
    const int tiles = has_keys ? (int)((s1 - s0 + 31) / 32) : 0;
    // The warp's first tile's rows that earlier steps wrote go up while the kernel before
    // finishes (the one before it wrote this step's row, at `pos`); the rest of the tile after
    // the wait.
    const i64 first = s0 + (i64)warp * 32;
    if (warp < tiles)
        stage_kv_rows<K>(own, keys, values, d, units, capacity, first, first, min(s1, pos));
    cp_async_commit();
    await_inputs();
    if (!has_keys) return;
    if (warp < tiles)
        stage_kv_rows<K>(own, keys, values, d, units, capacity, first, max(first, pos), s1);
    cp_async_commit();
    for (int i = threadIdx.x; i < G * E * 32; i += blockDim.x) {
        const int g = i / (E * 32), f = i % (E * 32);
        qs[g][f] = g < heads && f < d ? q[(i64)g * d + f] : 0.f;
    }
    if (threadIdx.x < G)
        sink_s[threadIdx.x] = threadIdx.x < heads ? sink_of(sinks, threadIdx.x) : -INFINITY;
    __syncthreads();
    const int used = sk.used;
    float m[G], l[G], acc[G][E];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) acc[g][e] = 0.f;
    }
    const int per_row = K::units(d);
    // The warp's i-th tile is the split's tile warp + i·warps.
    for (int t = warp, i = 0; t < tiles; t += warps, i++) {
        const i64 p0 = s0 + (i64)t * 32, next = p0 + 32 * warps;
        // With two stages the next tile goes up while this one is summed; with one (rows too
        // long for two in shared memory) it goes up now.
        if (stages > 1) {
            if (t + warps < tiles)
                stage_kv_rows<K>(own + (i + 1) % 2 * stage_bytes, keys, values, d, units,
                                 capacity, next, next, s1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            if (i > 0) stage_kv_rows<K>(own, keys, values, d, units, capacity, p0, p0, s1);
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncwarp();
        const unsigned char *kt = own + (stages > 1 ? i % 2 : 0) * stage_bytes;
        const unsigned char *vt = kt + 32 * units * 16;
        const int count = (int)min((i64)32, s1 - p0);
        float s[G];
#pragma unroll
        for (int g = 0; g < G; g++) s[g] = -INFINITY;
        if (lane < count) {
            const uint4 *kr = reinterpret_cast<const uint4 *>(kt + lane * units * 16);
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; g++) dot[g] = 0.f;
            // A unit's elements meet the queries' (zero past d, as the rows' padding is).
#pragma unroll 2
            for (int u = 0; u < per_row; u++) {
                float k[K::PER_UNIT];
                K::unpack_row(kr, u, d, gshift, k);
#pragma unroll
                for (int g = 0; g < G; g++)
#pragma unroll
                    for (int i = 0; i < K::PER_UNIT; i++)
                        dot[g] += qs[g][u * K::PER_UNIT + i] * k[i];
            }
#pragma unroll
            for (int g = 0; g < G; g++) s[g] = soft_cap(dot[g] * scale, softcap);
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float m_new = fmaxf(m[g], warp_max(s[g]));
            const float correction = expf(m[g] - m_new);
            const float pr = lane < count ? expf(s[g] - m_new) : 0.f;
            l[g] = l[g] * correction + pr;
#pragma unroll
            for (int e = 0; e < E; e++) acc[g][e] *= correction;
            ps[warp][lane][g] = pr;
            m[g] = m_new;
        }
        __syncwarp();
        // Rows past `count` were not staged: they are not read.
        for (int j = 0; j < count; j++) {
            const unsigned char *vr = vt + j * units * 16;
            float pj[G];
#pragma unroll
            for (int g = 0; g < G; g++) pj[g] = ps[warp][j][g];
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int f = lane + 32 * e;
                const float v = f < d ? K::load_row(vr, f, d, gshift) : 0.f;
#pragma unroll
                for (int g = 0; g < G; g++) acc[g][e] += pj[g] * v;
            }
        }
        // Every lane done with the tile's buffer before it is staged again.
        __syncwarp();
    }
#pragma unroll
    for (int g = 0; g < G; g++) l[g] = warp_sum(l[g]);
    if constexpr (W > 1) {
        // The other warps' softmaxes go to warp 0 through their own tiles' buffers, free once
        // every warp is past its last tile; they hold each head's (max, sum, d outputs): 64
        // rows of at least d / 2 bytes each take more than G · (d + 2) floats.
        const int stride = E * 32 + 2;
        float *mine = reinterpret_cast<float *>(own);
        __syncthreads();
        if (warp > 0) {
#pragma unroll
            for (int g = 0; g < G; g++) {
                if (lane == 0) mine[g * stride] = m[g], mine[g * stride + 1] = l[g];
#pragma unroll
                for (int e = 0; e < E; e++) mine[g * stride + 2 + lane + 32 * e] = acc[g][e];
            }
        }
        __syncthreads();
        if (warp > 0) return;
        for (int w = 1; w < warps; w++) {
            const float *theirs =
                reinterpret_cast<const float *>(kv_tiles + w * stages * stage_bytes);
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float mw = theirs[g * stride], m_new = fmaxf(m[g], mw);
                // A warp without keys (or none yet) has a max of -inf and weighs nothing.
                const float a = m[g] > -INFINITY ? expf(m[g] - m_new) : 0.f;
                const float b = mw > -INFINITY ? expf(mw - m_new) : 0.f;
                l[g] = l[g] * a + theirs[g * stride + 1] * b;
#pragma unroll
                for (int e = 0; e < E; e++)
                    acc[g][e] = acc[g][e] * a + theirs[g * stride + 2 + lane + 32 * e] * b;
                m[g] = m_new;
            }
        }
    }
    if (used == 1) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (g >= heads) break;
            const float inv = softmax_norm(m[g], l[g], sink_s[g]);
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int f = lane + 32 * e;
                if (f < d) out[(i64)g * d + f] = acc[g][e] * inv;
            }
        }
        return;
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (g >= heads) break;
        float *pp = part + ((i64)g * splits + split) * (d + 2);
        if (lane == 0) {
            pp[0] = m[g];
            pp[1] = l[g];
        }
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int f = lane + 32 * e;
            if (f < d) pp[2 + f] = acc[g][e];
        }
    }
    // Every lane's partials visible before the count, so that the last split reads them all.
    __threadfence();
    __syncwarp();
    unsigned done = 0;
    if (lane == 0) done = atomicAdd(counter, 1u);
    if (__shfl_sync(0xffffffffu, done, 0) == (unsigned)used - 1) {
        for (int g = 0; g < heads; g++)
            combine_splits_call<E>(part + (i64)g * splits * (d + 2), out + (i64)g * d, d, used,
                                   lane, sink_s[g]);
        if (lane == 0) *counter = 0;
    }
}

// One query token for each of several sequences, sequence s over the cache at keys[s] and
// values[s] (capacity capacities[s], first kept position starts[s]), one warp per (sequence,
// key/value head, chunk of G of its query heads, split): blockIdx.x = (s · kv_heads + kv head)
// · chunks + chunk, blockIdx.y the split. The last chunk of a group that G does not divide has
// fewer heads. The tables (positions, rings, capacities, starts) went up before the step's
// first kernel that read them, so they are read before the wait. At most 128 registers a
// thread. Rings of f32 (`attention_batch_E_G_f32`), f16 (`_f16`) or codes (`_q8`, `_q4`, in
// groups of 1 << gshift).
#define ATTENTION_BATCH(E, G, K, NAME)                                                          \
    extern "C" __global__ void __launch_bounds__(32, 16) attention_batch_##E##_##G##_##NAME(    \
        const float *q, const unsigned long long *keys, const unsigned long long *values,       \
        const int *positions, float *out, float *part, unsigned *counters, int heads,           \
        int kv_heads, int d, const int *capacities, const int *starts, i64 window, float scale, \
        float softcap, const float *sinks, int splits, int per_split, int stages, int units,    \
        int gshift) {                                                                           \
        const int group = heads / kv_heads, chunks = (group + G - 1) / G;                       \
        const int s = blockIdx.x / (kv_heads * chunks), kvh = blockIdx.x / chunks % kv_heads;   \
        const int chunk = blockIdx.x % chunks;                                                  \
        const int head = kvh * group + chunk * G;                                               \
        const i64 first = (i64)s * heads + head;                                                \
        const i64 len = (i64)kv_heads * capacities[s] * d, ring = (i64)kvh * capacities[s] * d; \
        const void *k = reinterpret_cast<const void *>(keys[s]);                                \
        const void *v = reinterpret_cast<const void *>(values[s]);                              \
        attention_group<E, G, 1, K>(q + first * d, K::ring(k, len, gshift) + ring,              \
                                    K::ring(v, len, gshift) + ring, positions[s],               \
                                    out + first * d, part + first * splits * (d + 2),           \
                                    counters + blockIdx.x, min(G, group - chunk * G), d,        \
                                    capacities[s], starts[s], window, scale, softcap,           \
                                    sinks ? sinks + head : nullptr, splits, per_split,          \
                                    blockIdx.y, stages, units, gshift);                         \
    }

// Warps a block of `attention_heads` takes at most (`GROUP_WARPS` in cuda/attention.rs).
constexpr int GROUP_WARPS = 4;

// Decode over long spans: the query tokens of one sequence (a few, as attention_split takes),
// one block of up to GROUP_WARPS warps per (token, key/value head, chunk of G of its query heads,
// split): blockIdx.x = (t · kv_heads + kv head) · chunks + chunk, blockIdx.y the split. Where
// attention_split reads a key/value head's rows once for each of its query heads in a chain of
// per_split / 32 tiles, this reads them once for the chunk, the block's warps sharing the
// chain. At most 128 registers a thread. Rings as attention_batch's.
#define ATTENTION_HEADS(E, G, K, NAME)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * GROUP_WARPS, 16 / GROUP_WARPS)            \
        attention_heads_##E##_##G##_##NAME(                                                     \
            const float *q, const void *keys, const void *values, const int *positions,        \
            float *out, float *part, unsigned *counters, int heads, int kv_heads, int d,        \
            int capacity, i64 start, i64 window, float scale, float softcap,                    \
            const float *sinks, int splits, int per_split, int stages, int units, int gshift) { \
        const int group = heads / kv_heads, chunks = (group + G - 1) / G;                       \
        const int t = blockIdx.x / (kv_heads * chunks), kvh = blockIdx.x / chunks % kv_heads;   \
        const int chunk = blockIdx.x % chunks;                                                  \
        const int head = kvh * group + chunk * G;                                               \
        const i64 first = (i64)t * heads + head;                                                \
        const i64 len = (i64)kv_heads * capacity * d, ring = (i64)kvh * capacity * d;           \
        attention_group<E, G, GROUP_WARPS, K>(                                                  \
            q + first * d, K::ring(keys, len, gshift) + ring, K::ring(values, len, gshift) + ring, \
            positions[t], out + first * d, part + first * splits * (d + 2),                     \
            counters + blockIdx.x, min(G, group - chunk * G), d, capacity, start, window,       \
            scale, softcap, sinks ? sinks + head : nullptr, splits, per_split, blockIdx.y,      \
            stages, units, gshift);                                                             \
    }
#define ATTENTION_GROUP(E, G, K, NAME) ATTENTION_BATCH(E, G, K, NAME) ATTENTION_HEADS(E, G, K, NAME)
#define ATTENTION_GROUP_RINGS(E, G)                                                             \
    ATTENTION_GROUP(E, G, FloatRing<F32>, f32)                                                  \
    ATTENTION_GROUP(E, G, FloatRing<F16>, f16)                                                  \
    ATTENTION_GROUP(E, G, CodeRing<8>, q8) ATTENTION_GROUP(E, G, CodeRing<4>, q4)
// G · E <= 16: at most sixteen accumulators a lane (but for latent attention's rows of 576).
ATTENTION_GROUP_RINGS(1, 1)
ATTENTION_GROUP_RINGS(1, 2)
ATTENTION_GROUP_RINGS(1, 4)
ATTENTION_GROUP_RINGS(2, 1)
ATTENTION_GROUP_RINGS(2, 2)
ATTENTION_GROUP_RINGS(2, 4)
ATTENTION_GROUP_RINGS(4, 1)
ATTENTION_GROUP_RINGS(4, 2)
ATTENTION_GROUP_RINGS(4, 4)
ATTENTION_GROUP_RINGS(8, 1)
ATTENTION_GROUP_RINGS(8, 2)
ATTENTION_GROUP_RINGS(16, 1)
ATTENTION_GROUP_RINGS(20, 1)

// Attention of many queries (prefill) as two batched matrix products with the scores between
// them: heads_first lays queries out per head, masked_softmax turns each head's scores into
// weights, heads_last puts the output back in token order.

// out[h, t, :] = x[t0 + t, h, :] for t < count
extern "C" __global__ void heads_first(const float *x, float *out, int t0, int count, int heads,
                                       int d) {
    await_inputs();
    GRID_STRIDE(i, (i64)count * heads * d) {
        const int e = (int)(i % d);
        const i64 ht = i / d;
        const int t = (int)(ht % count), h = (int)(ht / count);
        out[i] = x[((i64)(t0 + t) * heads + h) * d + e];
    }
}

// out[t0 + t, h, :] = x[h, t, :] for t < count
extern "C" __global__ void heads_last(const float *x, float *out, int t0, int count, int heads,
                                      int d) {
    await_inputs();
    GRID_STRIDE(i, (i64)count * heads * d) {
        const int e = (int)(i % d);
        const i64 ht = i / d;
        const int t = (int)(ht % count), h = (int)(ht / count);
        out[((i64)(t0 + t) * heads + h) * d + e] = x[i];
    }
}

// Softmax in place of each row of scores ([heads · count, slots], row (h, t) for query
// t0 + t), over the slots query t may see: slot j holds position p(j), the one position in
// [end - slots, end) that is j modulo capacity; visible when start <= p <= positions[t0 + t] and
// p > positions[t0 + t] - window. Visible scores are soft-capped first where `softcap` > 0, and
// head h's sink (where `sinks` is not null) joins the denominator. One block per row.
extern "C" __global__ void masked_softmax(float *scores, const int *positions, int t0, int count,
                                          int slots, int capacity, i64 start, i64 end,
                                          i64 window, float softcap, const float *sinks) {
    await_inputs();
    __shared__ float partial[32];
    float *row = scores + (i64)blockIdx.x * slots;
    const i64 pos = positions[t0 + blockIdx.x % count];
    const float sink = sink_of(sinks, blockIdx.x / count);
    const i64 first = end - slots;
    const int shift = (int)(first % capacity);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    auto visible = [&](int j) {
        const i64 p = first + (j - shift + capacity) % capacity;
        return p >= start && p <= pos && p > pos - window;
    };
    // Each thread caps the scores it reads again below.
    float m = -INFINITY;
    for (int j = threadIdx.x; j < slots; j += blockDim.x)
        if (visible(j)) {
            float s = row[j];
            if (softcap > 0.f) row[j] = s = soft_cap(s, softcap);
            m = fmaxf(m, s);
        }
    m = warp_max(m);
    if (lane == 0) partial[warp] = m;
    __syncthreads();
    m = fmaxf(warp_max(lane < warps ? partial[lane] : -INFINITY), sink);
    __syncthreads();
    float sum = 0.f;
    for (int j = threadIdx.x; j < slots; j += blockDim.x) {
        const float e = visible(j) ? expf(row[j] - m) : 0.f;
        row[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    sum = warp_sum(lane < warps ? partial[lane] : 0.f);
    if (sink > -INFINITY) sum += expf(sink - m);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int j = threadIdx.x; j < slots; j += blockDim.x) row[j] *= inv;
}

