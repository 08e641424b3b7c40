//! Attention of one query position over a run of cached keys and values, for all the query heads
//! that share one key/value head (grouped-query attention): each key and value is read once for
//! the whole group, which at long contexts is what decoding spends its memory traffic on. The
//! cache may be kept in f32 or f16 ([`KvElem`]): the AVX2 kernels widen each f16 vector as they
//! load it, once for up to four heads; the portable code widens a block at a time.

use std::ops::Range;

use half::f16;

use super::pool::{self, SharedMut};
use super::{with_task_scratch, Isa};
use crate::float::FloatSlice;

/// The element types a cache ring is kept in (see `crate::kv`).
pub trait KvElem: Copy + Send + Sync + sealed::Sealed {
    fn from_f32(x: f32) -> Self;
    /// `src` as f32: itself, or widened into `scratch`.
    fn widen<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32];
    /// The rows as the vector kernels take them.
    fn floats(src: &[Self]) -> FloatSlice<'_>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

impl KvElem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn widen<'a>(src: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        src
    }
    fn floats(src: &[f32]) -> FloatSlice<'_> {
        FloatSlice::F32(src)
    }
}

impl KvElem for f16 {
    /// Rounds to nearest; magnitudes past f16's range saturate at its largest finite value
    /// rather than become infinite, which softmax would turn into NaN.
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x.clamp(-f16::MAX.to_f32(), f16::MAX.to_f32()))
    }
    fn widen<'a>(src: &'a [f16], scratch: &'a mut [f32]) -> &'a [f32] {
        let out = &mut scratch[..src.len()];
        for (o, x) in out.iter_mut().zip(src) {
            *o = x.to_f32();
        }
        out
    }
    fn floats(src: &[f16]) -> FloatSlice<'_> {
        FloatSlice::F16(src)
    }
}

/// One key/value head's rows (`[slots, head_dim]`) and the group's queries (`[group,
/// head_dim]`).
pub struct GroupAttention<'a, T> {
    pub queries: &'a [f32],
    pub keys: &'a [T],
    pub values: &'a [T],
    pub head_dim: usize,
    /// The rows attended, in position order: the second run is where a wrapped ring goes on
    /// from its first slot (empty if it did not wrap).
    pub runs: [Range<usize>; 2],
    pub scale: f32,
}

/// Keys per block: a block's scores and values stay in L1 while every query head of the group
/// passes over them.
const BLOCK: usize = 64;

impl<T: KvElem> GroupAttention<'_, T> {
    /// Softmax-weighted values for each query head into `out` (`[group, head_dim]`).
    pub fn run(&self, isa: Isa, out: &mut [f32]) {
        let group = self.queries.len() / self.head_dim;
        let n = self.len();
        if n == 0 {
            out[..group * self.head_dim].fill(0.0);
            return;
        }
        with_task_scratch(group * n + BLOCK * self.head_dim, |scratch| {
            let (scores, block) = scratch.split_at_mut(group * n);
            self.run_with(isa, scores, block, out)
        });
    }

    /// Rows attended in all.
    fn len(&self) -> usize {
        self.runs.iter().map(|r| r.len()).sum()
    }

    /// The attended rows in blocks of at most [`BLOCK`]: `(index of the first among all
    /// attended, rows)`.
    fn blocks(&self) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        let starts = self.runs.iter().scan(0, |at, r| {
            let first = *at;
            *at += r.len();
            Some(first)
        });
        starts.zip(&self.runs).flat_map(|(first, r)| {
            (r.start..r.end)
                .step_by(BLOCK)
                .map(move |s| (first + s - r.start, s..(s + BLOCK).min(r.end)))
        })
    }

    fn run_with(&self, isa: Isa, scores: &mut [f32], block: &mut [f32], out: &mut [f32]) {
        let d = self.head_dim;
        let n = self.len();
        let group = self.queries.len() / d;
        assert!(
            self.runs.iter().all(|r| r.end * d <= self.keys.len())
                && self.keys.len() == self.values.len()
                && scores.len() >= group * n
                && block.len() >= BLOCK * d
                && out.len() >= group * d
        );
        for (j0, rows) in self.blocks() {
            let keys = &self.keys[rows.start * d..rows.end * d];
            block_scores(
                isa,
                self.queries,
                keys,
                d,
                self.scale,
                &mut scores[j0..],
                n,
                block,
            );
        }
        for s in scores[..group * n].chunks_exact_mut(n) {
            softmax(isa, s);
        }
        out[..group * d].fill(0.0);
        for (j0, rows) in self.blocks() {
            let values = &self.values[rows.start * d..rows.end * d];
            block_values(
                isa,
                &scores[j0..],
                n,
                values,
                d,
                &mut out[..group * d],
                block,
            );
        }
    }
}

/// Heads per call of the vector kernels: their registers hold four heads' sums.
const KERNEL_HEADS: usize = 4;

/// `scores[h · stride + j] = scale · q_h · k_j` for the query heads `queries` (`[heads, d]`) and
/// the rows `k_j` of `keys` (`[rows, d]`); `scratch` holds a block of rows as f32.
#[allow(clippy::too_many_arguments)]
fn block_scores<T: KvElem>(
    isa: Isa,
    queries: &[f32],
    keys: &[T],
    d: usize,
    scale: f32,
    scores: &mut [f32],
    stride: usize,
    scratch: &mut [f32],
) {
    let (heads, rows) = (queries.len() / d, keys.len() / d);
    assert!(rows == 0 || scores.len() >= (heads - 1) * stride + rows);
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && d.is_multiple_of(8) {
        for h0 in (0..heads).step_by(KERNEL_HEADS) {
            let chunk = KERNEL_HEADS.min(heads - h0);
            let (q, out) = (
                queries[h0 * d..].as_ptr(),
                scores[h0 * stride..].as_mut_ptr(),
            );
            // SAFETY: the caller checked the processor; the lengths were checked above.
            unsafe {
                match T::floats(keys) {
                    FloatSlice::F32(k) => {
                        super::avx2::group_scores(q, chunk, k.as_ptr(), rows, d, scale, out, stride)
                    }
                    FloatSlice::F16(k) => {
                        super::avx2::group_scores(q, chunk, k.as_ptr(), rows, d, scale, out, stride)
                    }
                    FloatSlice::BF16(_) => unreachable!("caches are f32 or f16"),
                }
            }
        }
        return;
    }
    let keys = T::widen(keys, scratch);
    for (h, q) in queries.chunks_exact(d).enumerate() {
        for (o, k) in scores[h * stride..][..rows]
            .iter_mut()
            .zip(keys.chunks_exact(d))
        {
            *o = super::dense::dot_with(isa, q, k) * scale;
        }
    }
}

/// `out[h · d..] += Σ_j p[h · stride + j] · v_j` for the rows `v_j` of `values` (`[rows, d]`);
/// `scratch` holds a block of rows as f32.
fn block_values<T: KvElem>(
    isa: Isa,
    p: &[f32],
    stride: usize,
    values: &[T],
    d: usize,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let (heads, rows) = (out.len() / d, values.len() / d);
    assert!(rows == 0 || p.len() >= (heads - 1) * stride + rows);
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && d.is_multiple_of(8) {
        for h0 in (0..heads).step_by(KERNEL_HEADS) {
            let chunk = KERNEL_HEADS.min(heads - h0);
            let (p, o) = (p[h0 * stride..].as_ptr(), out[h0 * d..].as_mut_ptr());
            // SAFETY: the caller checked the processor; the lengths were checked above.
            unsafe {
                match T::floats(values) {
                    FloatSlice::F32(v) => {
                        super::avx2::group_values(p, stride, chunk, v.as_ptr(), rows, d, o)
                    }
                    FloatSlice::F16(v) => {
                        super::avx2::group_values(p, stride, chunk, v.as_ptr(), rows, d, o)
                    }
                    FloatSlice::BF16(_) => unreachable!("caches are f32 or f16"),
                }
            }
        }
        return;
    }
    let values = T::widen(values, scratch);
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        for (&pj, vj) in p[h * stride..][..rows].iter().zip(values.chunks_exact(d)) {
            for (od, &vd) in o.iter_mut().zip(vj) {
                *od += pj * vd;
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

/// Keys and values of one layer as attention reads them: `[kv_heads, capacity, head_dim]` each,
/// position `p` in slot `p % capacity`, positions `start..end` present.
pub struct KvView<'a, T> {
    pub keys: &'a [T],
    pub values: &'a [T],
    pub kv_heads: usize,
    pub capacity: usize,
    pub start: usize,
    pub end: usize,
    /// `Some(w)`: a sliding window; a query sees the `w` positions ending at its own.
    pub window: Option<usize>,
}

impl<'a, T> KvView<'a, T> {
    /// One whole sequence of `len` positions, `[kv_heads, len, head_dim]` each (training).
    pub fn sequence(keys: &'a [T], values: &'a [T], kv_heads: usize, len: usize) -> Self {
        KvView {
            keys,
            values,
            kv_heads,
            capacity: len,
            start: 0,
            end: len,
            window: None,
        }
    }

    /// The slots a query at `pos` attends, in position order: one run, or two where the ring
    /// wraps.
    fn runs(&self, pos: usize) -> [Range<usize>; 2] {
        let hi = (pos + 1).min(self.end);
        let reach = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let lo = reach.max(self.start).min(hi);
        let first = lo % self.capacity;
        let tail = (first + hi - lo).saturating_sub(self.capacity);
        [first..first + (hi - lo) - tail, 0..tail]
    }
}

/// Scaled dot-product attention of `q` (`[tokens, heads, head_dim]`) over `kv`, writing
/// `[tokens, heads, head_dim]` into `out`. Query `t` sees the positions up to `positions[t]`
/// (causal) within the window, and query head `h` reads key head `h / (heads / kv_heads)`
/// (grouped-query attention).
pub fn attention<T: KvElem>(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kv: &KvView<T>,
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
        let first = (t * heads + kvh * group) * d;
        let head = kvh * kv.capacity * d..(kvh + 1) * kv.capacity * d;
        let job = GroupAttention {
            queries: &q[first..first + group * d],
            keys: &kv.keys[head.clone()],
            values: &kv.values[head],
            head_dim: d,
            runs: kv.runs(positions[t]),
            scale,
        };
        // SAFETY: each task writes its own token's group of heads.
        job.run(isa, unsafe { out.range(first, group * d) });
    });
}

/// Writes `src` (`[tokens, kv_heads, head_dim]`) at positions `first..` of `cache`
/// (`[kv_heads, capacity, head_dim]`, position `p` in slot `p % capacity`).
pub fn kv_write<T: KvElem>(
    cache: &mut [T],
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
            for (c, &x) in cache[dst..dst + d].iter_mut().zip(head) {
                *c = T::from_f32(x);
            }
        }
    }
}

/// Copies `positions` from a ring of `src_capacity` slots to one of `dst_capacity`.
pub fn kv_move<T: Copy>(
    src: &[T],
    src_capacity: usize,
    dst: &mut [T],
    dst_capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: Range<usize>,
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
