//! Backward passes of the ops in [`crate::cpu::elementwise`], [`crate::cpu::attention`] and
//! [`crate::cpu::recurrent`] (and of the linear layers), for training adapters
//! on a frozen model: each takes what its forward saw and the gradient of the loss with respect
//! to the forward's output, and returns the gradient with respect to its input. Weights of the
//! frozen model get no gradient.

use crate::cpu::attention::{KvView, Options};
use crate::cpu::dense::dot;
use crate::cpu::elementwise::softmax_inplace;
use crate::cpu::recurrent::delta_gates;
use crate::cpu::{transposed, Isa};
use crate::params::DeltaRuleDims;
use crate::quant::QuantizedParts;
use crate::{FloatMatrix, QuantizedMatrix};

/// `dx[m, cols] = dy[m, rows] · W` for `y = x · Wᵀ`, on the packed weights.
pub fn quantized_matmul_backward(w: &QuantizedMatrix, dy: &[f32], m: usize, dx: &mut [f32]) {
    match w.parts() {
        QuantizedParts::Affine(v) => transposed::quantized(Isa::best(), &v, dy, m, dx),
        QuantizedParts::Float(v) => transposed::float_quantized(Isa::best(), &v, dy, m, dx),
    }
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
/// rotated back by the same angle (and scaled by the same amplitude).
pub fn rope_backward_inplace(
    dx: &mut [f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    inv_freqs: &[f32],
    traditional: bool,
    amplitude: f32,
) {
    let half = inv_freqs.len();
    for (t, &pos) in positions.iter().enumerate() {
        for (i, &freq) in inv_freqs.iter().enumerate() {
            let (sin, cos) = (pos as f32 * freq).sin_cos();
            let (sin, cos) = (sin * amplitude, cos * amplitude);
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
/// Backward of [`crate::ops::swiglu_oai_mul_inplace`]: returns `(dgate, dup)`; no gradient
/// flows through the clamps where they bite.
pub fn swiglu_oai_mul_backward(gate: &[f32], up: &[f32], dh: &[f32]) -> (Vec<f32>, Vec<f32>) {
    use crate::params::{SWIGLU_OAI_ALPHA as ALPHA, SWIGLU_OAI_LIMIT as LIMIT};
    let mut dgate = vec![0.0; gate.len()];
    let mut dup = vec![0.0; gate.len()];
    for i in 0..gate.len() {
        let g = gate[i].min(LIMIT);
        let u = up[i].clamp(-LIMIT, LIMIT);
        let s = 1.0 / (1.0 + (-ALPHA * g).exp());
        let glu = g * s;
        if up[i].abs() < LIMIT {
            dup[i] = dh[i] * glu;
        }
        if gate[i] < LIMIT {
            dgate[i] = dh[i] * (u + 1.0) * (s + ALPHA * g * s * (1.0 - s));
        }
    }
    (dgate, dup)
}

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
/// `dout` (`[n, heads, head_dim]`). With `options`' soft cap, the gradient goes through the
/// `tanh`; with its sinks, they take their share of each softmax (they get no gradient: they
/// are the frozen model's).
pub fn attention_backward(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    kv: &KvView<&[f32]>,
    options: Options,
    dout: &[f32],
) -> AttentionGrads {
    let n = kv.end;
    assert!(
        kv.capacity == n && kv.start == 0,
        "attention_backward takes one whole sequence"
    );
    assert!(
        options.sinks.is_none_or(|s| s.len() == heads),
        "attention sinks for other than {heads} heads"
    );
    let scale = options.scale;
    let group = heads / kv.kv_heads;
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; kv.keys.len()];
    let mut dv = vec![0.0; kv.values.len()];
    let mut p = vec![0.0f32; n];
    // The derivative of each capped score by the scaled one, `1 - tanh²`.
    let mut slope = vec![1.0f32; n];
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
            let (p, slope) = (&mut p[..visible], &mut slope[..visible]);
            for ((pj, sj), kj) in p
                .iter_mut()
                .zip(&mut *slope)
                .zip(keys.chunks_exact(head_dim))
            {
                *pj = dot(qv, kj) * scale;
                if let Some(cap) = options.softcap {
                    let th = (*pj / cap).tanh();
                    (*pj, *sj) = (cap * th, 1.0 - th * th);
                }
            }
            softmax_with_sink(p, options.sinks.map(|s| s[h]));
            // dp_j = dout·v_j; ds_j = p_j (dp_j - Σ p·dp) (a sink weighs no value: its dp is 0)
            let dp: Vec<f32> = values
                .chunks_exact(head_dim)
                .map(|vj| dot(dov, vj))
                .collect();
            let mean: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            let dkh = &mut dk[seen.clone()];
            let dvh = &mut dv[seen];
            let dqv = &mut dq[at..at + head_dim];
            for j in 0..visible {
                let ds = p[j] * (dp[j] - mean) * slope[j] * scale;
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

/// Softmax in place, with a `sink` logit in the denominator (its weight left out).
fn softmax_with_sink(x: &mut [f32], sink: Option<f32>) {
    let Some(sink) = sink else {
        return softmax_inplace(x);
    };
    let max = x.iter().fold(sink, |m, &v| m.max(v));
    let mut sum = (sink - max).exp();
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
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

/// Backward of [`crate::cpu::recurrent::causal_conv1d`] over one whole sequence from zero state
/// (`x` and `dout` `[tokens, channels]`, `weight` `[channels, kernel]`): the input gradient.
pub fn causal_conv1d_backward(
    dout: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
) -> Vec<f32> {
    let tokens = dout.len() / channels;
    let mut dx = vec![0.0; dout.len()];
    // out[t] reads x[t + j - (kernel - 1)] with weight j.
    for t in 0..tokens {
        for j in 0..kernel {
            let Some(s) = (t + j).checked_sub(kernel - 1) else {
                continue;
            };
            for c in 0..channels {
                dx[s * channels + c] += weight[c * kernel + j] * dout[t * channels + c];
            }
        }
    }
    dx
}

/// Backward of [`crate::cpu::recurrent::delta_gates`]: `(da, db)` for the gradients `dg` and
/// `dbeta` of its outputs.
pub fn delta_gates_backward(
    a: &[f32],
    b: &[f32],
    dt_bias: &[f32],
    neg_a: &[f32],
    dg: &[f32],
    dbeta: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let heads = dt_bias.len();
    let (mut g, mut beta) = (vec![0.0; a.len()], vec![0.0; a.len()]);
    delta_gates(a, b, dt_bias, neg_a, &mut g, &mut beta);
    let mut da = vec![0.0; a.len()];
    let mut db = vec![0.0; a.len()];
    for i in 0..a.len() {
        // softplus' is the sigmoid.
        let sig = 1.0 / (1.0 + (-(a[i] + dt_bias[i % heads])).exp());
        da[i] = dg[i] * g[i] * neg_a[i % heads] * sig;
        db[i] = dbeta[i] * beta[i] * (1.0 - beta[i]);
    }
    (da, db)
}

/// Gradients of [`crate::cpu::recurrent::gated_delta_rule`] over one whole sequence from zero
/// state, shaped as its inputs.
pub struct DeltaRuleGrads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    pub dg: Vec<f32>,
    pub dbeta: Vec<f32>,
}

/// Tokens between the states the backward pass of the delta rule keeps: it runs the rule again
/// from each kept state, a chunk at a time, rather than keep a state per token.
const DELTA_RULE_CHUNK: usize = 64;

/// Backward of [`crate::cpu::recurrent::gated_delta_rule`] over one whole sequence from zero
/// state, for the output gradient `dy` (`[tokens, v_heads · v_dim]`). Each row `s` of a head's
/// state (one value feature) evolves alone: `s' = g·s`, `δ = β(v − s'·k)`, `s ← s' + δk`,
/// `y = s·q`; its gradient flows back through those steps in reverse.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: DeltaRuleDims,
    dy: &[f32],
) -> DeltaRuleGrads {
    let DeltaRuleDims {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    } = dims;
    let tokens = g.len() / v_heads;
    let group = v_heads / k_heads;
    let mut grads = DeltaRuleGrads {
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
        dg: vec![0.0; g.len()],
        dbeta: vec![0.0; beta.len()],
    };
    let state_len = dims.state_len();
    // One step of the rule for token `t` on `state`, as the forward pass takes it.
    let step = |t: usize, state: &mut [f32]| {
        for h in 0..v_heads {
            let kt = &k[(t * k_heads + h / group) * k_dim..][..k_dim];
            let (decay, b) = (g[t * v_heads + h], beta[t * v_heads + h]);
            let rows = state[h * v_dim * k_dim..][..v_dim * k_dim].chunks_exact_mut(k_dim);
            for (row, &vd) in rows.zip(&v[(t * v_heads + h) * v_dim..][..v_dim]) {
                row.iter_mut().for_each(|s| *s *= decay);
                let delta = (vd - dot(row, kt)) * b;
                row.iter_mut().zip(kt).for_each(|(s, &kj)| *s += kj * delta);
            }
        }
    };
    // The state before each chunk.
    let mut kept = Vec::new();
    let mut state = vec![0.0f32; state_len];
    for t in 0..tokens {
        if t % DELTA_RULE_CHUNK == 0 {
            kept.push(state.clone());
        }
        step(t, &mut state);
    }
    let mut ds = vec![0.0f32; state_len];
    let mut before = Vec::new();
    for (c, start) in kept.iter().zip((0..tokens).step_by(DELTA_RULE_CHUNK)).rev() {
        let end = (start + DELTA_RULE_CHUNK).min(tokens);
        // The state before each token of the chunk.
        before.clear();
        let mut state = c.clone();
        for t in start..end {
            before.push(state.clone());
            step(t, &mut state);
        }
        for t in (start..end).rev() {
            let prev = &before[t - start];
            for h in 0..v_heads {
                let at = (t * k_heads + h / group) * k_dim;
                let (qt, kt) = (&q[at..at + k_dim], &k[at..at + k_dim]);
                let gh = t * v_heads + h;
                let (decay, b) = (g[gh], beta[gh]);
                for d in 0..v_dim {
                    let r = (h * v_dim + d) * k_dim;
                    let (s_prev, dsr) = (&prev[r..r + k_dim], &mut ds[r..r + k_dim]);
                    let vd = v[(t * v_heads + h) * v_dim + d];
                    let dyd = dy[(t * v_heads + h) * v_dim + d];
                    // s' = g·s_prev, m = s'·k, δ = β(v − m), s = s' + δk.
                    let m = decay * dot(s_prev, kt);
                    let delta = b * (vd - m);
                    let (dq, dk) = (&mut grads.dq[at..at + k_dim], &mut grads.dk[at..at + k_dim]);
                    // y = s·q.
                    for j in 0..k_dim {
                        let s = decay * s_prev[j] + delta * kt[j];
                        dq[j] += dyd * s;
                        dsr[j] += dyd * qt[j];
                    }
                    let d_delta = dot(dsr, kt);
                    for j in 0..k_dim {
                        dk[j] += delta * dsr[j];
                    }
                    grads.dv[(t * v_heads + h) * v_dim + d] += b * d_delta;
                    grads.dbeta[gh] += d_delta * (vd - m);
                    let dm = -b * d_delta;
                    // ds' = ds + dm·k; dk += dm·s'; ds_prev = g·ds'; dg += ds'·s_prev.
                    let mut dg = 0.0;
                    for j in 0..k_dim {
                        dk[j] += dm * decay * s_prev[j];
                        let ds_mid = dsr[j] + dm * kt[j];
                        dg += ds_mid * s_prev[j];
                        dsr[j] = decay * ds_mid;
                    }
                    grads.dg[gh] += dg;
                }
            }
        }
    }
    grads
}
