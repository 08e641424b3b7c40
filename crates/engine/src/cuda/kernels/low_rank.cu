
// ---- low-rank updates ----------------------------------------------------------------------

// LoRA adapters' updates of linear layers' outputs, `y += scale · (x · downᵀ) · upᵀ`, for a
// few rows (a decoding step) where each row may take updates of its own: the (row, update)
// pairs of a step run in one launch of each kernel, whichever adapters they belong to (as
// Punica's and S-LoRA's segmented products do), so that a batch of requests through different
// adapters costs what one adapter does; and so do the pairs of layers that read one input.

// An update as the launcher packs it: four 8-byte words.
struct LowRankUpdate {
    const float *down;  // [rank, inputs]
    const float *up;    // [width of its output, rank]
    int rank;
    float scale;
    int output;  // which of the launch's outputs it adds to
    int unused;
};

// One of the outputs of a launch (layers that read the same input: a block's q, k and v).
struct LowRankOutput {
    float *y;  // [rows, width]
    int width;
    int unused;
};

// Ranks a thread sums at once in `low_rank_down`.
#define LOW_RANK_CHUNK 8

// The partial products `partial[p, s, k] = x[pair_row[p], slice s] · down[k, slice s]` for
// each pair p (blockIdx.x), slice s of LOW_RANK_SLICE inputs (blockIdx.y) and k < its rank:
// a decoding step has few pairs, so the inputs are split over blocks too, and every load of a
// block is issued at once rather than one after another. `low_rank_up` sums the slices in
// order (no atomics: a row's result does not depend on the other rows of its batch).
extern "C" __global__ void low_rank_down(const float *x, const LowRankUpdate *updates,
                                         const int *pair_row, const int *pair_update,
                                         float *partial, int inputs, int max_rank) {
    __shared__ float sums[LOW_RANK_THREADS / 32][LOW_RANK_CHUNK];
    await_inputs();
    const int p = blockIdx.x, s = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const LowRankUpdate update = updates[pair_update[p]];
    const float *xr = x + (i64)pair_row[p] * inputs;
    const int begin = s * LOW_RANK_SLICE, end = min(inputs, begin + LOW_RANK_SLICE);
    constexpr int PER_THREAD = LOW_RANK_SLICE / LOW_RANK_THREADS;
    float xv[PER_THREAD];
#pragma unroll
    for (int t = 0; t < PER_THREAD; t++) {
        const int i = begin + t * LOW_RANK_THREADS + threadIdx.x;
        xv[t] = i < end ? xr[i] : 0.f;
    }
    for (int k0 = 0; k0 < update.rank; k0 += LOW_RANK_CHUNK) {
        const int ks = min(LOW_RANK_CHUNK, update.rank - k0);
        float acc[LOW_RANK_CHUNK];
#pragma unroll
        for (int c = 0; c < LOW_RANK_CHUNK; c++) {
            acc[c] = 0.f;
            if (c >= ks) continue;
            const float *d = update.down + (i64)(k0 + c) * inputs;
#pragma unroll
            for (int t = 0; t < PER_THREAD; t++) {
                const int i = begin + t * LOW_RANK_THREADS + threadIdx.x;
                if (i < end) acc[c] += xv[t] * d[i];
            }
        }
#pragma unroll
        for (int c = 0; c < LOW_RANK_CHUNK; c++) acc[c] = warp_sum(acc[c]);
        if (lane == 0)
#pragma unroll
            for (int c = 0; c < LOW_RANK_CHUNK; c++) sums[warp][c] = acc[c];
        __syncthreads();
        if (threadIdx.x < ks) {
            float sum = 0.f;
            for (int w = 0; w < LOW_RANK_THREADS / 32; w++) sum += sums[w][threadIdx.x];
            partial[((i64)p * gridDim.y + s) * max_rank + k0 + threadIdx.x] = sum;
        }
        __syncthreads();
    }
}

// y_o[r, j] += Σ_p Σ_k u[p, k] · up_p[j, k] over the pairs p of row r (row_start[r] up to
// row_start[r + 1], in the order the updates add up) whose update adds to output o, u[p, k]
// being scale_p times the sum over the `slices` partial products of `low_rank_down`, summed
// once a block into shared memory (max_rank floats): a thread per output column, a block row
// (blockIdx.y) per activation row, a block layer (blockIdx.z) per output.
extern "C" __global__ void low_rank_up(const LowRankOutput *outputs, const float *partial,
                                       const LowRankUpdate *updates, const int *row_start,
                                       const int *pair_update, int max_rank, int slices) {
    extern __shared__ float u[];
    await_inputs();
    const int o = blockIdx.z, r = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    const LowRankOutput out = outputs[o];
    const int begin = row_start[r], end = row_start[r + 1];
    float acc = 0.f;
    bool updated = false;
    for (int p = begin; p < end; p++) {
        const LowRankUpdate update = updates[pair_update[p]];
        if (update.output != o) continue;  // the same for the whole block
        updated = true;
        const float *pp = partial + (i64)p * slices * max_rank;
        for (int k = threadIdx.x; k < update.rank; k += blockDim.x) {
            float sum = 0.f;
            for (int s = 0; s < slices; s++) sum += pp[s * max_rank + k];
            u[k] = update.scale * sum;
        }
        __syncthreads();
        if (j < out.width) {
            const float *w = update.up + (i64)j * update.rank;
            for (int k = 0; k < update.rank; k++) acc += u[k] * w[k];
        }
        __syncthreads();
    }
    if (j < out.width && updated) out.y[(i64)r * out.width + j] += acc;
}
