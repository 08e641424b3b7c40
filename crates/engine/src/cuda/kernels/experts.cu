// ---- mixtures of experts --------------------------------------------------------------------
//
// A mixture's decode step on the device, so that a step replays as one graph: the router's
// top-k choice per token (route_top_k), the first slot routed to each chosen expert
// (expert_leaders), each chosen expert's gated MLP over the rows routed to it (experts_glu,
// experts_down: an expert's weights are read once for all its rows), and each token's weighted
// sum of its slots, with a shared expert's output where there is one (experts_sum).
//
// A slot is one of a token's top_k choices, t · top_k + j; `ids` and `weights` hold each slot's
// expert and weight, best first. The experts' matrices are found through tables of device
// addresses, three per expert (packed weights, scales, biases), one table per projection.

// The most experts a router may have (its scores are held in shared memory).
#define ROUTE_MAX_EXPERTS 1024
// The most slots a step may route (expert_leaders takes them in one block).
#define ROUTE_MAX_SLOTS 1024

// Whether (v, i) beats (best, at) for the top-k: higher first, then the lower expert, as the
// host's stable sort orders them; `at` < 0 is no candidate yet.
__device__ __forceinline__ bool better_choice(float v, int i, float best, int at) {
    return at < 0 || v > best || (v == best && i < at);
}

// The block's best (value, index) of every thread's (v, i), in all threads.
__device__ __forceinline__ void block_best(float &v, int &i) {
    __shared__ float values[32];
    __shared__ int indices[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (oi >= 0 && better_choice(ov, oi, v, i)) v = ov, i = oi;
    }
    if (lane == 0) values[warp] = v, indices[warp] = i;
    __syncthreads();
    v = values[0], i = indices[0];
    for (int w = 1; w < warps; w++)
        if (indices[w] >= 0 && better_choice(values[w], indices[w], v, i))
            v = values[w], i = indices[w];
    __syncthreads();
}

// The block's sum or maximum of every thread's v, in all threads.
__device__ __forceinline__ float block_reduce(float v, bool maximum) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = maximum ? warp_max(v) : warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = partial[0];
    for (int w = 1; w < warps; w++) v = maximum ? fmaxf(v, partial[w]) : v + partial[w];
    __syncthreads();
    return v;
}

// One block per token: its router logits (`logits[t, experts]`) become scores (softmax, or each
// expert's sigmoid), the correction bias (if any) joins the scores that choose, only the `keep`
// of `groups` expert groups whose two best scores sum highest stay choosable (when groups > 1;
// the others' choosing scores become 0), and the top_k best are written best first with their
// scores, divided by their sum where `renormalize`, times `scale`.
extern "C" __global__ void __launch_bounds__(256)
    route_top_k(const float *__restrict__ logits, const float *__restrict__ correction,
                int experts, int top_k, int sigmoid, int renormalize, int groups, int keep,
                float scale, int *__restrict__ ids, float *__restrict__ weights) {
    await_inputs();
    __shared__ float score[ROUTE_MAX_EXPERTS], pick[ROUTE_MAX_EXPERTS];
    __shared__ float group_score[ROUTE_MAX_EXPERTS];
    __shared__ int chosen[32];
    const int t = blockIdx.x;
    const float *row = logits + (i64)t * experts;
    float top = -INFINITY;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        score[e] = row[e];
        top = fmaxf(top, score[e]);
    }
    if (!sigmoid) {
        top = block_reduce(top, true);
        float sum = 0.f;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            score[e] = expf(score[e] - top);
            sum += score[e];
        }
        const float inv = 1.f / block_reduce(sum, false);
        for (int e = threadIdx.x; e < experts; e += blockDim.x) score[e] *= inv;
    }
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        if (sigmoid) score[e] = 1.f / (1.f + expf(-score[e]));
        pick[e] = score[e] + (correction ? correction[e] : 0.f);
    }
    __syncthreads();
    if (groups > 1) {
        const int size = experts / groups;
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            float first = -INFINITY, second = -INFINITY;
            for (int e = g * size; e < (g + 1) * size; e++) {
                const float v = pick[e];
                if (v > first) second = first, first = v;
                else if (v > second) second = v;
            }
            group_score[g] = first + second;
        }
        __syncthreads();
        // A group is dropped when fewer than groups - keep others rank below it (lower score,
        // or the same and a lower index), as the host's ascending sort drops the first ones.
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            const int g = e / size;
            int below = 0;
            for (int h = 0; h < groups; h++)
                below += group_score[h] < group_score[g] ||
                         (group_score[h] == group_score[g] && h < g);
            if (below < groups - keep) pick[e] = 0.f;
        }
        __syncthreads();
    }
    for (int j = 0; j < top_k; j++) {
        float v = 0.f;
        int i = -1;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            bool taken = false;
            for (int c = 0; c < j; c++) taken |= chosen[c] == e;
            if (!taken && better_choice(pick[e], e, v, i)) v = pick[e], i = e;
        }
        block_best(v, i);
        if (threadIdx.x == 0) chosen[j] = i;
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    float total = 0.f;
    for (int j = 0; j < top_k; j++) total += score[chosen[j]];
    for (int j = 0; j < top_k; j++) {
        const float w = score[chosen[j]];
        ids[t * top_k + j] = chosen[j];
        weights[t * top_k + j] = (renormalize ? w / total : w) * scale;
    }
}

// One block of at least `slots` threads: leaders[0] = how many experts the slots chose, and
// leaders[1 + l] = the first slot routed to the l-th of them (in order of those first slots).
extern "C" __global__ void expert_leaders(const int *__restrict__ ids, int slots,
                                          int *__restrict__ leaders) {
    await_inputs();
    __shared__ int counts[32];
    const int s = threadIdx.x, lane = s & 31, warp = s >> 5;
    bool first = s < slots;
    if (first) {
        const int e = ids[s];
        for (int i = 0; i < s && first; i++) first = ids[i] != e;
    }
    const u32 votes = __ballot_sync(0xffffffffu, first);
    if (lane == 0) counts[warp] = __popc(votes);
    __syncthreads();
    int before = __popc(votes & ((1u << lane) - 1u)), total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        before += w < warp ? counts[w] : 0;
        total += counts[w];
    }
    if (first) leaders[1 + before] = s;
    if (s == 0) leaders[0] = total;
}

// The rows a mixture routed to one expert, in and out: `slot[r]`'s row of `x` is slot / per_row
// (a token's input, shared by its top_k slots, or a slot's own hidden row), and its output row
// is the slot's own.
struct RoutedRows {
    const float *x;
    int k;
    const int *slot;
    int per_row;
    __device__ __forceinline__ const float *at(int r) const {
        return x + (i64)(slot[r] / per_row) * k;
    }
};

struct RoutedOut {
    float *y;
    int n;
    const int *slot;
    __device__ __forceinline__ float *at(int r) const { return y + (i64)slot[r] * n; }
};

// This block's expert (the blockIdx.y-th of those `leaders` lists, or -1 past them) and the
// slots routed to it, into `slots` (shared, ROUTE_MAX_SLOTS); returns how many.
__device__ __forceinline__ int expert_slots(const int *__restrict__ ids,
                                            const int *__restrict__ leaders, int count,
                                            int *slots, int &expert) {
    __shared__ int found;
    expert = -1;
    if ((int)blockIdx.y >= leaders[0]) return 0;
    const int lead = leaders[1 + blockIdx.y];
    expert = ids[lead];
    if (threadIdx.x < 32) {
        int n = 0;
        for (int base = lead; base < count; base += 32) {
            const int s = base + threadIdx.x;
            const bool mine = s < count && ids[s] == expert;
            const u32 votes = __ballot_sync(0xffffffffu, mine);
            if (mine) slots[n + __popc(votes & ((1u << threadIdx.x) - 1u))] = s;
            n += __popc(votes);
        }
        if (threadIdx.x == 0) found = n;
    }
    __syncthreads();
    return found;
}

// h[s, n] = act(x[s / top_k] · G_eᵀ) · (x[s / top_k] · U_eᵀ) for every slot s routed to this
// block's expert e, 8 slots at a time; one block per 2 rows (blockIdx.x) and chosen expert
// (blockIdx.y).
template <int BITS, class S>
__device__ void experts_glu(const u64 *__restrict__ gate, const u64 *__restrict__ up,
                            const float *__restrict__ x, const int *__restrict__ ids,
                            const int *__restrict__ leaders, float *__restrict__ h, int n, int k,
                            int group, int top_k, int count, int act) {
    __shared__ int slots[ROUTE_MAX_SLOTS];
    int e;
    const int routed = expert_slots(ids, leaders, count, slots, e);
    if (e < 0) return;
    const u32 *gw = (const u32 *)gate[3 * e], *uw = (const u32 *)up[3 * e];
    const typename S::T *gs = (const typename S::T *)gate[3 * e + 1],
                        *gb = (const typename S::T *)gate[3 * e + 2],
                        *us = (const typename S::T *)up[3 * e + 1],
                        *ub = (const typename S::T *)up[3 * e + 2];
    for (int r0 = 0; r0 < routed; r0 += 8) {
        glu_rows<BITS, S>(gw, gs, gb, uw, us, ub, RoutedRows{x, k, slots + r0, top_k},
                          RoutedOut{h, n, slots + r0}, blockIdx.x * 2, n, k, group,
                          min(8, routed - r0), act);
        __syncthreads();
    }
}

// out[s, n] = h[s] · D_eᵀ for every slot s routed to this block's expert e, 8 slots at a time;
// one block per 4 rows (blockIdx.x) and chosen expert (blockIdx.y).
template <int BITS, class S>
__device__ void experts_down(const u64 *__restrict__ down, const float *__restrict__ h,
                             const int *__restrict__ ids, const int *__restrict__ leaders,
                             float *__restrict__ out, int n, int k, int group, int count) {
    __shared__ int slots[ROUTE_MAX_SLOTS];
    int e;
    const int routed = expert_slots(ids, leaders, count, slots, e);
    if (e < 0) return;
    const u32 *w = (const u32 *)down[3 * e];
    const typename S::T *s = (const typename S::T *)down[3 * e + 1],
                        *b = (const typename S::T *)down[3 * e + 2];
    const int row0 = blockIdx.x * 4;
    for (int r0 = 0; r0 < routed; r0 += 8) {
        const int m = min(8, routed - r0);
        float acc[4][8];
        zero(acc);
        qdot_rows<BITS, S, 4>(w, s, b, RoutedRows{h, k, slots + r0, 1}, row0, n, k, group, m,
                              acc);
        block_sum(acc, m);
        store_rows(acc, RoutedOut{out, n, slots + r0}, row0, n, m, 0);
        __syncthreads();
    }
}

// y[t, c] = Σ_j weights[t, j] · out[t · top_k + j, c], plus shared[t, c] times the sigmoid of
// shared_gate[t] where those are given (a shared expert, gated or not): one thread per value.
extern "C" __global__ void experts_sum(const float *__restrict__ out,
                                       const float *__restrict__ weights,
                                       const float *__restrict__ shared,
                                       const float *__restrict__ shared_gate,
                                       float *__restrict__ y, int tokens, int dim, int top_k) {
    await_inputs();
    const i64 total = (i64)tokens * dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / dim, c = i - t * dim;
        float v = 0.f;
        for (int j = 0; j < top_k; j++) {
            const i64 slot = t * top_k + j;
            v += weights[slot] * out[slot * dim + c];
        }
        if (shared) {
            const float g = shared_gate ? 1.f / (1.f + expf(-shared_gate[t])) : 1.f;
            v += g * shared[i];
        }
        y[i] = v;
    }
}

#define EXPERTS(BITS, S, NAME)                                                                     \
    extern "C" __global__ void experts_glu_##BITS##_##NAME(                                       \
        const u64 *gate, const u64 *up, const float *x, const int *ids, const int *leaders,       \
        float *h, int n, int k, int g, int top_k, int count, int act) {                           \
        await_inputs();                                                                           \
        experts_glu<BITS, S>(gate, up, x, ids, leaders, h, n, k, g, top_k, count, act);           \
    }                                                                                             \
    extern "C" __global__ void experts_down_##BITS##_##NAME(                                      \
        const u64 *down, const float *h, const int *ids, const int *leaders, float *out, int n,   \
        int k, int g, int count) {                                                                \
        await_inputs();                                                                           \
        experts_down<BITS, S>(down, h, ids, leaders, out, n, k, g, count);                        \
    }

AFFINE_FORMATS(EXPERTS)
