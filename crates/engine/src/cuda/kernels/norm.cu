// ---- norms and RoPE -----------------------------------------------------------------------

// out[r] = x[r] / sqrt(mean(x[r]²) + eps) · weight: one block per row (out may be x).
extern "C" __global__ void rms_norm(const float *x, const float *weight, float *out, int cols,
                                    float eps) {
    await_inputs();
    __shared__ float partial[32];
    const float *xr = x + (i64)blockIdx.x * cols;
    float *orow = out + (i64)blockIdx.x * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    ss = warp_sum(ss);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        ss = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
        ss = warp_sum(ss);
        if (lane == 0) partial[0] = ss;
    }
    __syncthreads();
    const float inv = 1.f / sqrtf(partial[0] / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = xr[c] * inv * weight[c];
}

// Row t of x (cols wide) times 1 + beta · ln(1 + floor((positions[t] + shift) / period)):
// Llama 4's query scale beyond the original context.
extern "C" __global__ void scale_by_position(float *x, const int *positions, i64 n, int cols,
                                             float beta, int period, int shift) {
    await_inputs();
    GRID_STRIDE(i, n) {
        x[i] *= 1.f + beta * logf((float)(1 + (positions[i / cols] + shift) / period));
    }
}

// Rotates pairs of x ([tokens, heads, head_dim]) and of y ([tokens, heads_y, head_dim]: a
// layer's keys beside its queries, or nothing with heads_y = 0) by positions[t] · inv_freqs[i],
// scaled by `amplitude`; `traditional` pairs neighbours (2i, 2i+1), otherwise the halves
// (i, i + half).
extern "C" __global__ void rope(float *x, float *y, const int *positions, const float *inv_freqs,
                                int tokens, int heads, int heads_y, int head_dim, int half,
                                int traditional, float amplitude) {
    await_inputs();
    const int all = heads + heads_y;
    GRID_STRIDE(i, (i64)tokens * all * half) {
        const int p = (int)(i % half);
        const i64 th = i / half;
        const int t = (int)(th / all), h = (int)(th % all);
        float s, c;
        sincosf((float)positions[t] * inv_freqs[p], &s, &c);
        s *= amplitude;
        c *= amplitude;
        float *v = h < heads ? x + ((i64)t * heads + h) * head_dim
                             : y + ((i64)t * heads_y + h - heads) * head_dim;
        const int a = traditional ? 2 * p : p, b = traditional ? 2 * p + 1 : p + half;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

