// ---- recurrent layers ------------------------------------------------------------------------

// Causal depthwise conv1d of channel c of x ([tokens, channels]) continuing from state
// ([kernel-1, channels], oldest first), weight [channels, kernel]; kernel ≤ 8.
__device__ void conv1d_channel(const float *x, const float *weight, float *state, float *out,
                               int tokens, int channels, int kernel, int c) {
    float window[8], w[8];
    for (int j = 0; j < kernel; j++) w[j] = weight[(i64)c * kernel + j];
    for (int j = 0; j < kernel - 1; j++) window[j] = state[(i64)j * channels + c];
    for (int t = 0; t < tokens; t++) {
        window[kernel - 1] = x[(i64)t * channels + c];
        float acc = 0.f;
        for (int j = 0; j < kernel; j++) acc += w[j] * window[j];
        out[(i64)t * channels + c] = acc;
        for (int j = 0; j + 1 < kernel; j++) window[j] = window[j + 1];
    }
    for (int j = 0; j < kernel - 1; j++) state[(i64)j * channels + c] = window[j];
}

// One sequence's tokens; one thread per channel.
extern "C" __global__ void causal_conv1d(const float *x, const float *weight, float *state,
                                         float *out, int tokens, int channels, int kernel) {
    await_inputs();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    conv1d_channel(x, weight, state, out, tokens, channels, kernel, c);
}

// One token of each sequence (blockIdx.y): row s of x continues from the state at states[s].
extern "C" __global__ void causal_conv1d_batch(const float *x, const float *weight,
                                               const unsigned long long *states, float *out,
                                               int channels, int kernel) {
    await_inputs();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const i64 row = (i64)blockIdx.y * channels;
    float *state = reinterpret_cast<float *>(states[blockIdx.y]);
    conv1d_channel(x + row, weight, state, out + row, 1, channels, kernel, c);
}

// Per token and value head: decay g = exp(neg_a · softplus(a + dt_bias)) and write strength
// beta = sigmoid(b), as mlx-lm's `compute_g` (in f32).
extern "C" __global__ void delta_gates(const float *a, const float *b, const float *dt_bias,
                                       const float *neg_a, float *g, float *beta, i64 n,
                                       int v_heads) {
    await_inputs();
    GRID_STRIDE(i, n) {
        const int h = (int)(i % v_heads);
        const float z = a[i] + dt_bias[h];
        const float softplus = fmaxf(z, 0.f) + log1pf(expf(-fabsf(z)));
        g[i] = expf(neg_a[h] * softplus);
        beta[i] = 1.f / (1.f + expf(-b[i]));
    }
}

// Per token and head: Mamba-2's step dt = clip(softplus(a + dt_bias), lo, hi) and decay
// g = exp(neg_a · dt), as mlx-lm's `compute_dt` (in f32).
extern "C" __global__ void ssm_gates(const float *a, const float *dt_bias, const float *neg_a,
                                     float *g, float *dt, i64 n, int heads, float lo, float hi) {
    await_inputs();
    GRID_STRIDE(i, n) {
        const int h = (int)(i % heads);
        const float z = a[i] + dt_bias[h];
        const float step = fminf(fmaxf(fmaxf(z, 0.f) + log1pf(expf(-fabsf(z))), lo), hi);
        dt[i] = step;
        g[i] = expf(neg_a[h] * step);
    }
}

// The gated delta rule over every token of a chunk: one warp per (value head, row i of the
// [v_dim, k_dim] state), the row held in registers (E = ceil(k_dim / 32) per lane):
//   S ← g·S;  δ = β·(v − S k);  S ← S + δ kᵀ;  y = S q
// With SSM, Mamba-2's selective scan instead (w the step Δ, not β; `skip` the heads' D):
//   S ← g·S + Δ·v kᵀ;  y = S q + D·v
template <int E, bool SSM>
__device__ void recurrent_scan(const float *__restrict__ q, const float *__restrict__ k,
                               const float *__restrict__ v, const float *__restrict__ g,
                               const float *__restrict__ w, const float *__restrict__ skip,
                               float *__restrict__ state, float *__restrict__ y, int tokens,
                               int k_heads, int v_heads, int k_dim, int v_dim) {
    const int lane = threadIdx.x & 31;
    const i64 hr = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (hr >= (i64)v_heads * v_dim) return;
    const int h = (int)(hr / v_dim), i = (int)(hr % v_dim);
    const int kh = h / (v_heads / k_heads);
    float *row = state + hr * k_dim;
    float s[E];
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int j = lane + 32 * e;
        s[e] = j < k_dim ? row[j] : 0.f;
    }
    for (int t = 0; t < tokens; t++) {
        const float *kt = k + ((i64)t * k_heads + kh) * k_dim;
        const float *qt = q + ((i64)t * k_heads + kh) * k_dim;
        const float decay = g[(i64)t * v_heads + h], b = w[(i64)t * v_heads + h];
        const float vi = v[((i64)t * v_heads + h) * v_dim + i];
        float kk[E], kv = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = lane + 32 * e;
            kk[e] = j < k_dim ? kt[j] : 0.f;
            s[e] *= decay;
            if (!SSM) kv += s[e] * kk[e];
        }
        float delta = b * vi;
        if (!SSM) delta = (vi - warp_sum(kv)) * b;
        float out = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = lane + 32 * e;
            s[e] += kk[e] * delta;
            out += s[e] * (j < k_dim ? qt[j] : 0.f);
        }
        out = warp_sum(out);
        if (SSM) out += skip[h] * vi;
        if (lane == 0) y[((i64)t * v_heads + h) * v_dim + i] = out;
    }
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int j = lane + 32 * e;
        if (j < k_dim) row[j] = s[e];
    }
}

// `NAME_E`: one sequence's tokens; `NAME_batch_E`: one token of each sequence (blockIdx.y), row
// s of the inputs updating the state at states[s]. `skip` is null for the delta rule.
#define RECURRENT_SCAN(E, SSM, NAME)                                                          \
    extern "C" __global__ void NAME##_##E(                                                    \
        const float *q, const float *k, const float *v, const float *g, const float *w,       \
        const float *skip, float *state, float *y, int tokens, int k_heads, int v_heads,      \
        int k_dim, int v_dim) {                                                               \
        await_inputs();                                                                       \
        recurrent_scan<E, SSM>(q, k, v, g, w, skip, state, y, tokens, k_heads, v_heads,       \
                               k_dim, v_dim);                                                 \
    }                                                                                         \
    extern "C" __global__ void NAME##_batch_##E(                                              \
        const float *q, const float *k, const float *v, const float *g, const float *w,       \
        const float *skip, const unsigned long long *states, float *y, int k_heads,           \
        int v_heads, int k_dim, int v_dim) {                                                  \
        await_inputs();                                                                       \
        const i64 s = blockIdx.y, qk = s * k_heads * k_dim, vy = s * v_heads * v_dim;         \
        float *state = reinterpret_cast<float *>(states[s]);                                  \
        recurrent_scan<E, SSM>(q + qk, k + qk, v + vy, g + s * v_heads, w + s * v_heads,      \
                               skip, state, y + vy, 1, k_heads, v_heads, k_dim, v_dim);       \
    }
#define RECURRENT_SCANS(E) RECURRENT_SCAN(E, false, gated_delta) RECURRENT_SCAN(E, true, ssm_scan)

RECURRENT_SCANS(1)
RECURRENT_SCANS(2)
RECURRENT_SCANS(4)
RECURRENT_SCANS(8)
