//! Attention of one query position over a run of cached keys and values, for all the query heads
//! that share one key/value head (grouped-query attention): each key and value is read once for
//! the whole group, which at long contexts is what decoding spends its memory traffic on.

use super::dense::dot;
use super::elementwise::softmax_inplace;
use super::pool::{self, SharedMut};
use super::{with_task_scratch, Isa};

/// Keys and values of one KV head laid out `[len, head_dim]`, and the group's queries
/// `[group, head_dim]`.
pub struct GroupAttention<'a> {
    pub queries: &'a [f32],
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub head_dim: usize,
    pub len: usize,
    pub scale: f32,
}

/// Keys per block: a block's scores and values stay in L1 while every query head of the group
/// passes over them.
const BLOCK: usize = 64;

impl GroupAttention<'_> {
    /// Softmax-weighted values for each query head into `out` (`[group, head_dim]`).
    pub fn run(&self, isa: Isa, out: &mut [f32]) {
        let group = self.queries.len() / self.head_dim;
        with_task_scratch(group * self.len, |scores| self.run_with(isa, scores, out));
    }

    fn run_with(&self, isa: Isa, scores: &mut [f32], out: &mut [f32]) {
        let (d, n) = (self.head_dim, self.len);
        let group = self.queries.len() / d;
        assert!(
            self.keys.len() >= n * d
                && self.values.len() >= n * d
                && scores.len() >= group * n
                && out.len() >= group * d
        );
        for j0 in (0..n).step_by(BLOCK) {
            let j1 = (j0 + BLOCK).min(n);
            for (g, q) in self.queries.chunks_exact(d).enumerate() {
                let keys = &self.keys[j0 * d..j1 * d];
                key_scores(
                    isa,
                    q,
                    keys,
                    self.scale,
                    &mut scores[g * n + j0..g * n + j1],
                );
            }
        }
        for s in scores[..group * n].chunks_exact_mut(n) {
            softmax(isa, s);
        }
        out[..group * d].fill(0.0);
        for j0 in (0..n).step_by(BLOCK) {
            let j1 = (j0 + BLOCK).min(n);
            for (g, o) in out.chunks_exact_mut(d).take(group).enumerate() {
                let p = &scores[g * n + j0..g * n + j1];
                axpy_rows(isa, p, &self.values[j0 * d..j1 * d], o);
            }
        }
    }
}

/// `out[j] = scale · q · k_j` for the rows `k_j` of `keys`, `q.len()` apart.
fn key_scores(isa: Isa, q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    match isa {
        // SAFETY: the caller checked the processor; the kernel checks bounds.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx if q.len().is_multiple_of(8) => unsafe {
            super::avx2::scores(q, keys, scale, out)
        },
        _ => {
            for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
                *o = super::dense::dot_with(isa, q, k) * scale;
            }
        }
    }
}

/// `o += Σ_j p[j] · v[j]` for rows `v[j]` of `o.len()` values.
fn axpy_rows(isa: Isa, p: &[f32], v: &[f32], o: &mut [f32]) {
    match isa {
        // SAFETY: the caller checked the processor; the kernel checks bounds.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx if o.len().is_multiple_of(8) => unsafe {
            super::avx2::axpy_rows(p, v, o)
        },
        _ => {
            let d = o.len();
            for (&pj, vj) in p.iter().zip(v.chunks_exact(d)) {
                for (od, &vd) in o.iter_mut().zip(vj) {
                    *od += pj * vd;
                }
            }
        }
    }
}

/// Numerically stable softmax in place; the AVX2 version computes `exp` in vectors (within a
/// few ulp of libm's).
pub fn softmax(isa: Isa, x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum = match isa {
        // SAFETY: the caller checked the processor.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { super::avx2::exp_sub_sum(x, max) },
        _ => {
            let mut sum = 0.0;
            for v in x.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            sum
        }
    };
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

/// Writes `src` (`[tokens, kv_heads, head_dim]`) at positions `first..` of `cache`
/// (`[kv_heads, capacity, head_dim]`, position `p` in slot `p % capacity`).
pub fn kv_write(
    cache: &mut [f32],
    src: &[f32],
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    first: usize,
) {
    let d = head_dim;
    for (t, token) in src.chunks_exact(kv_heads * d).enumerate() {
        let slot = (first + t) % capacity;
        for (h, head) in token.chunks_exact(d).enumerate() {
            let dst = (h * capacity + slot) * d;
            cache[dst..dst + d].copy_from_slice(head);
        }
    }
}

/// Copies `positions` from a ring of `src_capacity` slots to one of `dst_capacity`.
pub fn kv_move(
    src: &[f32],
    src_capacity: usize,
    dst: &mut [f32],
    dst_capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: std::ops::Range<usize>,
) {
    let d = head_dim;
    for h in 0..kv_heads {
        for p in positions.clone() {
            let from = (h * src_capacity + p % src_capacity) * d;
            let to = (h * dst_capacity + p % dst_capacity) * d;
            dst[to..to + d].copy_from_slice(&src[from..from + d]);
        }
    }
}
