// ---- element-wise ---------------------------------------------------------------------------

extern "C" __global__ void add(float *x, const float *y, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] += y[i];
}

extern "C" __global__ void mul(float *x, const float *y, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] *= y[i];
}

// x[r, c] += row[c]: a bias on every row.
extern "C" __global__ void add_row(float *x, const float *row, i64 n, int cols) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] += row[i % cols];
}

// x[r, c] *= row[c]: a per-feature scale on every row.
extern "C" __global__ void mul_row(float *x, const float *row, i64 n, int cols) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] *= row[i % cols];
}

extern "C" __global__ void scale(float *x, float s, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] *= s;
}

extern "C" __global__ void softcap(float *x, float cap, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] = tanhf(x[i] / cap) * cap;
}

extern "C" __global__ void silu(float *x, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] = x[i] / (1.f + expf(-x[i]));
}

// x = relu(x)²
extern "C" __global__ void relu_squared(float *x, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) {
        const float r = fmaxf(x[i], 0.f);
        x[i] = r * r;
    }
}

// gate = silu(gate) · up
extern "C" __global__ void silu_mul(float *gate, const float *up, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) {
        const float g = gate[i];
        gate[i] = g / (1.f + expf(-g)) * up[i];
    }
}

// gate = gelu_approx(gate) · up (the tanh approximation, as mlx.nn.gelu_approx)
extern "C" __global__ void gelu_mul(float *gate, const float *up, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) {
        const float v = gate[i];
        gate[i] = 0.5f * v * (1.f + tanhf(0.7978846f * (v + 0.044715f * v * v * v))) * up[i];
    }
}

// gpt-oss's clamped SwiGLU: gate = (clip(up, ±limit) + 1) · g · sigmoid(alpha · g), with
// g = min(gate, limit) (alpha 1.702, limit 7, as params.rs has them).
extern "C" __global__ void swiglu_oai_mul(float *gate, const float *up, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) {
        const float g = fminf(gate[i], 7.f);
        const float u = fminf(fmaxf(up[i], -7.f), 7.f);
        gate[i] = (u + 1.f) * g / (1.f + expf(-1.702f * g));
    }
}

// x = x · sigmoid(gate)
extern "C" __global__ void sigmoid_mul(float *x, const float *gate, i64 n) {
    await_inputs();
    GRID_STRIDE(i, n) x[i] *= 1.f / (1.f + expf(-gate[i]));
}

// out[r, j] = x[r, start + j] for j < width
extern "C" __global__ void columns(const float *x, float *out, i64 rows, int cols, int start,
                                   int width) {
    await_inputs();
    GRID_STRIDE(i, rows * width) {
        const i64 r = i / width;
        out[i] = x[r * cols + start + (i - r * width)];
    }
}

// src[rows, width] into columns start..start + width of out[rows, cols].
extern "C" __global__ void place_columns(const float *src, float *out, i64 rows, int cols,
                                         int start, int width) {
    await_inputs();
    GRID_STRIDE(i, rows * width) {
        const i64 r = i / width;
        out[r * cols + start + (i - r * width)] = src[i];
    }
}

// Greedy decoding's pick from each row of x[rows, cols]: picks[2r] = the index of the row's
// first maximum (NaNs passed over), as a float (exact below 2^24), and picks[2r + 1] = its
// log-probability (the row's log-softmax there, computed as the host's sampler does). With
// mask_of non-null, a row r whose mask_of[r] is m >= 0 is held to the columns its mask allows
// (bit c % 32 of masks[m * words + c / 32]), the others read as -inf, as the host masks a
// grammar's logits. One block per row, each thread striding the row, in 16-byte loads where the
// row allows, eight of them issued before any is compared (a vocabulary's row in a round or two
// of loads); the second pass, for the sum of exponentials, reads the row again from L2.
extern "C" __global__ void greedy_rows(const float *__restrict__ x, float *__restrict__ picks,
                                       int cols, const unsigned *__restrict__ masks,
                                       const int *__restrict__ mask_of, int words) {
    await_inputs();
    __shared__ float best_of[32], sum_of[32];
    __shared__ int index_of[32];
    const float *row = x + (i64)blockIdx.x * cols;
    const int m = mask_of ? mask_of[blockIdx.x] : -1;
    const unsigned *mask = m >= 0 ? masks + (i64)m * words : nullptr;
    auto value = [&](float v, int c) {
        return mask && !((mask[c >> 5] >> (c & 31)) & 1u) ? -INFINITY : v;
    };
    const bool by_four = (cols & 3) == 0;
    const float4 *row4 = reinterpret_cast<const float4 *>(row);
    float best = -INFINITY;
    int index = 0x7fffffff;
    // Each thread meets its indices in increasing order, so a strict > keeps the first maximum.
    auto consider = [&](float v, int c) {
        v = value(v, c);
        if (v > best) {
            best = v;
            index = c;
        }
    };
    if (by_four) {
#pragma unroll 8
        for (int c = threadIdx.x; c < cols >> 2; c += blockDim.x) {
            const float4 v = row4[c];
            consider(v.x, 4 * c);
            consider(v.y, 4 * c + 1);
            consider(v.z, 4 * c + 2);
            consider(v.w, 4 * c + 3);
        }
    } else {
#pragma unroll 8
        for (int c = threadIdx.x; c < cols; c += blockDim.x) consider(row[c], c);
    }
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    auto warp_best = [&]() {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float b = __shfl_xor_sync(0xffffffffu, best, o);
            const int i = __shfl_xor_sync(0xffffffffu, index, o);
            if (b > best || (b == best && i < index)) {
                best = b;
                index = i;
            }
        }
    };
    warp_best();
    if (lane == 0) best_of[warp] = best, index_of[warp] = index;
    __syncthreads();
    best = lane < warps ? best_of[lane] : -INFINITY;
    index = lane < warps ? index_of[lane] : 0x7fffffff;
    // Every warp reduces the warps' picks alike, so every thread ends with the row's.
    warp_best();
    float sum = 0.f;
    if (by_four) {
#pragma unroll 8
        for (int c = threadIdx.x; c < cols >> 2; c += blockDim.x) {
            const float4 v = row4[c];
            const int i = 4 * c;
            sum += expf(value(v.x, i) - best) + expf(value(v.y, i + 1) - best) +
                   expf(value(v.z, i + 2) - best) + expf(value(v.w, i + 3) - best);
        }
    } else {
#pragma unroll 8
        for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += expf(value(row[c], c) - best);
    }
    sum = warp_sum(sum);
    if (lane == 0) sum_of[warp] = sum;
    __syncthreads();
    if (threadIdx.x >= 32) return;
    sum = warp_sum(lane < warps ? sum_of[lane] : 0.f);
    if (threadIdx.x == 0) {
        picks[2 * blockIdx.x] = index == 0x7fffffff ? 0.f : (float)index;
        picks[2 * blockIdx.x + 1] = best - (best + logf(sum));
    }
}

// out[i, :] = x[idx[i], :]
extern "C" __global__ void gather_rows(const float *x, const int *idx, float *out, i64 n,
                                       int cols) {
    await_inputs();
    GRID_STRIDE(i, n * cols) {
        const i64 r = i / cols;
        out[i] = x[(i64)idx[r] * cols + (i - r * cols)];
    }
}

// y[idx[i], :] += weight[i] · src[i, :] (the indices of one call are distinct)
extern "C" __global__ void scatter_add_rows(float *y, const float *src, const int *idx,
                                            const float *weight, i64 n, int cols) {
    await_inputs();
    GRID_STRIDE(i, n * cols) {
        const i64 r = i / cols;
        y[(i64)idx[r] * cols + (i - r * cols)] += weight[r] * src[i];
    }
}

