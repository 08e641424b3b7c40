//! Attention of one query position over a run of cached keys and values, for all the query heads
//! that share one key/value head (grouped-query attention): each key and value is read once for
//! the whole group, which at long contexts is what decoding spends its memory traffic on.

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
