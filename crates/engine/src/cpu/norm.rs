//! RMS norm and rotations by position (RoPE) on f32 activations in host memory.

use super::dense::dot;

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`: `x / sqrt(mean(x²) + eps) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = dot(xr, xr) / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// RMSNorm in place.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for xr in x.chunks_exact_mut(dim) {
        let mean_sq = dot(xr, xr) / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// Rotary position embedding, in place, on `x` laid out `[tokens, heads, head_dim]`.
///
/// Token `t` sits at `positions[t]`; pair `i` of the first `2 * inv_freqs.len()` features turns by
/// `positions[t] * inv_freqs[i]` and is scaled by `amplitude`. `traditional` pairs neighbours
/// `(2i, 2i+1)`, otherwise the halves `(i, i + dims/2)` are paired, as `mx.fast.rope` does.
pub fn rope_inplace(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    inv_freqs: &[f32],
    traditional: bool,
    amplitude: f32,
) {
    let half = inv_freqs.len();
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..half {
            let theta = pos as f32 * inv_freqs[i];
            cos[i] = theta.cos() * amplitude;
            sin[i] = theta.sin() * amplitude;
        }
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            let v = &mut x[base..base + head_dim];
            for i in 0..half {
                let (a, b) = if traditional {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * cos[i] - x1 * sin[i];
                v[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}
