//! Backward passes of the ops in [`crate::cpu::elementwise`] and [`crate::cpu::attention`] (and of the linear layers), for training adapters
//! on a frozen model: each takes what its forward saw and the gradient of the loss with respect
//! to the forward's output, and returns the gradient with respect to its input. Weights of the
//! frozen model get no gradient.

use crate::cpu::attention::KvView;
use crate::cpu::dense::dot;
use crate::cpu::elementwise::softmax_inplace;
use crate::cpu::{transposed, Isa};
use crate::{FloatMatrix, QuantizedMatrix};

/// `dx[m, cols] = dy[m, rows] · W` for `y = x · Wᵀ`, on the packed weights.
pub fn quantized_matmul_backward(w: &QuantizedMatrix, dy: &[f32], m: usize, dx: &mut [f32]) {
    transposed::quantized(Isa::best(), &w.view(), dy, m, dx);
}

/// `dx[m, cols] = dy[m, rows] · W` for `y = x · Wᵀ`, on float weights.
pub fn dense_matmul_backward(w: &FloatMatrix, dy: &[f32], m: usize, dx: &mut [f32]) {
    transposed::dense(Isa::best(), &w.view(), dy, m, dx);
}

/// Backward of [`crate::cpu::norm::rms_norm`] for rows of `x`: with `r = 1/sqrt(mean(x²) + eps)` and
/// `g = weight · dy`, `dx = r·g - x·r³·mean(g·x)`.
pub fn rms_norm_backward(x: &[f32], weight: &[f32], eps: f32, dy: &[f32], dx: &mut [f32]) {
    let dim = weight.len();
    let rows = x.chunks_exact(dim).zip(dy.chunks_exact(dim));
    for ((xr, dyr), dxr) in rows.zip(dx.chunks_exact_mut(dim)) {
        let r = 1.0 / (dot(xr, xr) / dim as f32 + eps).sqrt();
        let gx: f32 = xr
            .iter()
            .zip(dyr)
            .zip(weight)
            .map(|((&x, &d), &w)| w * d * x)
            .sum();
        let c = r * r * r * gx / dim as f32;
        for (((o, &x), &d), &w) in dxr.iter_mut().zip(xr).zip(dyr).zip(weight) {
            *o = r * w * d - c * x;
        }
    }
}

/// Backward of [`crate::ops::rope_inplace`], in place: a rotation's gradient is the gradient
/// rotated back by the same angle.
pub fn rope_backward_inplace(
    dx: &mut [f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    inv_freqs: &[f32],
    traditional: bool,
) {
    let half = inv_freqs.len();
    for (t, &pos) in positions.iter().enumerate() {
        for (i, &freq) in inv_freqs.iter().enumerate() {
            let (sin, cos) = (pos as f32 * freq).sin_cos();
            let (a, b) = if traditional {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            for h in 0..heads {
                let v = &mut dx[(t * heads + h) * head_dim..][..head_dim];
                let (d0, d1) = (v[a], v[b]);
                v[a] = d0 * cos + d1 * sin;
                v[b] = d1 * cos - d0 * sin;
            }
        }
    }
}

/// Backward of [`crate::ops::silu_mul_inplace`] (`h = silu(gate) · up`): returns
/// `(dgate, dup)` for the output gradient `dh`.
pub fn silu_mul_backward(gate: &[f32], up: &[f32], dh: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dgate = vec![0.0; gate.len()];
    let mut dup = vec![0.0; gate.len()];
    for i in 0..gate.len() {
        let g = gate[i];
        let sig = 1.0 / (1.0 + (-g).exp());
        dup[i] = dh[i] * g * sig;
        dgate[i] = dh[i] * up[i] * sig * (1.0 + g * (1.0 - sig));
    }
    (dgate, dup)
}

/// Backward of [`crate::ops::gelu_approx_mul_inplace`] (`h = gelu_approx(gate) · up`, GELU's
/// tanh approximation): returns `(dgate, dup)` for the output gradient `dh`.
pub fn gelu_approx_mul_backward(gate: &[f32], up: &[f32], dh: &[f32]) -> (Vec<f32>, Vec<f32>) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044715;
    let mut dgate = vec![0.0; gate.len()];
    let mut dup = vec![0.0; gate.len()];
    for i in 0..gate.len() {
        let x = gate[i];
        let t = (SQRT_2_OVER_PI * (x + CUBIC * x * x * x)).tanh();
        let gelu = 0.5 * x * (1.0 + t);
        let slope = 0.5 * (1.0 + t)
            + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * x * x);
        dup[i] = dh[i] * gelu;
        dgate[i] = dh[i] * up[i] * slope;
    }
    (dgate, dup)
}

/// Gradients of [`crate::ops::attention`] for one sequence at positions `0..n` (causal), with
/// the probabilities recomputed rather than stored: `dq` is `[n, heads, head_dim]` like `q`,
/// `dk` and `dv` are `[kv_heads, n, head_dim]` like the keys and values of `kv`.
pub struct AttentionGrads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// Backward of [`crate::ops::attention`] over `kv` holding exactly the `n` positions of `q`
/// (`kv.capacity == kv.end == n`, from 0; through its window, if any), for the output gradient
/// `dout` (`[n, heads, head_dim]`).
pub fn attention_backward(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    kv: &KvView<&[f32]>,
    scale: f32,
    dout: &[f32],
) -> AttentionGrads {
    let n = kv.end;
    assert!(
        kv.capacity == n && kv.start == 0,
        "attention_backward takes one whole sequence"
    );
    let group = heads / kv.kv_heads;
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; kv.keys.len()];
    let mut dv = vec![0.0; kv.values.len()];
    let mut p = vec![0.0f32; n];
    for t in 0..n {
        // Query `t` sees positions `first..=t`.
        let first = kv.window.map_or(0, |w| (t + 1).saturating_sub(w));
        let visible = t + 1 - first;
        for h in 0..heads {
            let kvh = h / group;
            let at = (t * heads + h) * head_dim;
            let (qv, dov) = (&q[at..at + head_dim], &dout[at..at + head_dim]);
            let seen = (kvh * n + first) * head_dim..(kvh * n + t + 1) * head_dim;
            let keys = &kv.keys[seen.clone()];
            let values = &kv.values[seen.clone()];
            let p = &mut p[..visible];
            for (pj, kj) in p.iter_mut().zip(keys.chunks_exact(head_dim)) {
                *pj = dot(qv, kj) * scale;
            }
            softmax_inplace(p);
            // dp_j = dout·v_j; ds_j = p_j (dp_j - Σ p·dp)
            let dp: Vec<f32> = values
                .chunks_exact(head_dim)
                .map(|vj| dot(dov, vj))
                .collect();
            let mean: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            let dkh = &mut dk[seen.clone()];
            let dvh = &mut dv[seen];
            let dqv = &mut dq[at..at + head_dim];
            for j in 0..visible {
                let ds = p[j] * (dp[j] - mean) * scale;
                let (kj, dkj) = (
                    &keys[j * head_dim..][..head_dim],
                    &mut dkh[j * head_dim..][..head_dim],
                );
                let dvj = &mut dvh[j * head_dim..][..head_dim];
                for d in 0..head_dim {
                    dqv[d] += ds * kj[d];
                    dkj[d] += ds * qv[d];
                    dvj[d] += p[j] * dov[d];
                }
            }
        }
    }
    AttentionGrads { dq, dk, dv }
}

/// `logsumexp(logits) - logits[target]`, in f64 for the sum.
pub fn cross_entropy(logits: &[f32], target: usize) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (max as f64 + sum.ln() - logits[target] as f64) as f32
}

/// Backward of [`cross_entropy`], in place: `logits` becomes `dloss · (softmax(logits) - onehot)`.
pub fn cross_entropy_backward_inplace(logits: &mut [f32], target: usize, dloss: f32) {
    softmax_inplace(logits);
    logits[target] -= 1.0;
    for v in logits.iter_mut() {
        *v *= dloss;
    }
}
