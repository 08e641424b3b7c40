//! Element-wise and attention ops on f32 activations.

use crate::cpu::attention::GroupAttention;
use crate::cpu::dense::dot;
use crate::cpu::pool::{self, SharedMut};
use crate::cpu::Isa;

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

/// Keys and values of one layer as attention reads them: `[kv_heads, capacity, head_dim]`, of
/// which the first `len` positions are filled.
pub struct KvView<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub kv_heads: usize,
    pub capacity: usize,
    pub len: usize,
}

/// Scaled dot-product attention of `q` (`[tokens, heads, head_dim]`) over `kv`, writing
/// `[tokens, heads, head_dim]` into `out`. Query `t` sees keys `0..=positions[t]` (causal), and
/// query head `h` reads key head `h / (heads / kv_heads)` (grouped-query attention).
pub fn attention(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kv: &KvView,
    scale: f32,
    out: &mut [f32],
) {
    let group = heads / kv.kv_heads;
    let d = head_dim;
    let isa = Isa::best();
    let out = SharedMut::new(&mut out[..positions.len() * heads * d]);
    // One task per token and KV head: the group's query heads share each key and value read.
    pool::parallel_for(positions.len() * kv.kv_heads, &|task| {
        let (t, kvh) = (task / kv.kv_heads, task % kv.kv_heads);
        let visible = (positions[t] + 1).min(kv.len);
        let first = (t * heads + kvh * group) * d;
        let head = kvh * kv.capacity * d;
        let job = GroupAttention {
            queries: &q[first..first + group * d],
            keys: &kv.keys[head..head + visible * d],
            values: &kv.values[head..head + visible * d],
            head_dim: d,
            len: visible,
            scale,
        };
        // SAFETY: each task writes its own token's group of heads.
        job.run(isa, unsafe { out.range(first, group * d) });
    });
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

/// Keys and values of a sliding-window layer kept in a ring: `[kv_heads, capacity, head_dim]`
/// each, position `p` in slot `p % capacity`, positions `start..end` present. A query sees the
/// `window` positions ending at its own.
pub struct RingKvView<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub kv_heads: usize,
    pub capacity: usize,
    pub start: usize,
    pub end: usize,
    pub window: usize,
}

/// As [`attention`], but over a ring and with a sliding window: query `t` sees positions
/// `positions[t] + 1 - window ..= positions[t]` (from 0 while fewer precede it).
pub fn sliding_window_attention(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kv: &RingKvView,
    scale: f32,
    out: &mut [f32],
) {
    let group = heads / kv.kv_heads;
    let mut scores = vec![0.0f32; kv.window.min(kv.end - kv.start)];
    for (t, &pos) in positions.iter().enumerate() {
        let hi = (pos + 1).min(kv.end);
        let lo = (pos + 1).saturating_sub(kv.window).max(kv.start).min(hi);
        let slots = || (lo..hi).map(|p| p % kv.capacity);
        for h in 0..heads {
            let kvh = h / group;
            let qv = &q[(t * heads + h) * head_dim..][..head_dim];
            let head_keys = &kv.keys[kvh * kv.capacity * head_dim..];
            let head_values = &kv.values[kvh * kv.capacity * head_dim..];
            let s = &mut scores[..hi - lo];
            for (sj, slot) in s.iter_mut().zip(slots()) {
                *sj = dot(qv, &head_keys[slot * head_dim..][..head_dim]) * scale;
            }
            softmax_inplace(s);
            let o = &mut out[(t * heads + h) * head_dim..][..head_dim];
            o.fill(0.0);
            for (&p, slot) in s.iter().zip(slots()) {
                let vj = &head_values[slot * head_dim..][..head_dim];
                for (od, &vd) in o.iter_mut().zip(vj) {
                    *od += p * vd;
                }
            }
        }
    }
}
