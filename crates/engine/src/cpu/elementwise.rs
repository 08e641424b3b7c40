//! Element-wise ops on f32 activations in host memory: norms, RoPE, activations.

use super::dense::dot;
use super::Isa;

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
/// `positions[t] * inv_freqs[i]`. `traditional` pairs neighbours `(2i, 2i+1)`, otherwise the
/// halves `(i, i + dims/2)` are paired, as `mx.fast.rope` does.
pub fn rope_inplace(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    inv_freqs: &[f32],
    traditional: bool,
) {
    let half = inv_freqs.len();
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..half {
            let theta = pos as f32 * inv_freqs[i];
            cos[i] = theta.cos();
            sin[i] = theta.sin();
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

/// `gate = silu(gate) * up`, the SwiGLU activation.
pub fn silu_mul_inplace(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x += y`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `Σ exp(scale · x[i] − shift)`, summed in f64 from f32 exponentials (eight at a time where
/// the processor has AVX2, within 2 ulp of libm's), −∞ entries adding exactly 0: a softmax's
/// normaliser over a vocabulary, with `shift` the largest `scale · x`.
pub fn exp_sum(x: &[f32], scale: f32, shift: f32) -> f64 {
    exp_into_with(Isa::best(), x, scale, shift, &mut [])
}

/// [`exp_sum`], writing each term to `out` (as long as `x`): a softmax's unnormalised weights.
pub fn exp_into(x: &[f32], scale: f32, shift: f32, out: &mut [f32]) -> f64 {
    assert_eq!(
        x.len(),
        out.len(),
        "exp_into needs an output as long as its input"
    );
    exp_into_with(Isa::best(), x, scale, shift, out)
}

/// [`exp_into`] on the given kernels (panics if the processor lacks them), writing nowhere
/// when `out` is empty.
pub fn exp_into_with(isa: Isa, x: &[f32], scale: f32, shift: f32, out: &mut [f32]) -> f64 {
    isa.check();
    match isa {
        // SAFETY: just checked.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
            super::avx2::exp_scaled_sum(x, scale, shift, out)
        },
        _ => {
            let write = out.len() == x.len();
            let mut sum = 0.0;
            for (i, &v) in x.iter().enumerate() {
                let e = if v == f32::NEG_INFINITY {
                    0.0
                } else {
                    v.mul_add(scale, -shift).exp()
                };
                if write {
                    out[i] = e;
                }
                sum += f64::from(e);
            }
            sum
        }
    }
}

/// Numerically stable softmax in place.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `gate = gelu_approx(gate) * up`, the GeGLU activation (GELU with the tanh approximation, as
/// `mlx.nn.gelu_approx`).
pub fn gelu_approx_mul_inplace(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()) * u;
    }
}

/// `x = tanh(x / cap) * cap`: squashes logits smoothly into `(-cap, cap)`.
pub fn softcap_inplace(x: &mut [f32], cap: f32) {
    for v in x.iter_mut() {
        *v = (*v / cap).tanh() * cap;
    }
}

/// `x *= s`.
pub fn scale_inplace(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// `x = silu(x) = x · sigmoid(x)`.
pub fn silu_inplace(x: &mut [f32]) {
    for v in x {
        *v /= 1.0 + (-*v).exp();
    }
}

/// `x = x · sigmoid(gate)`.
pub fn sigmoid_mul_inplace(x: &mut [f32], gate: &[f32]) {
    for (v, &g) in x.iter_mut().zip(gate) {
        *v *= 1.0 / (1.0 + (-g).exp());
    }
}
