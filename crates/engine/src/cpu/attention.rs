//! Attention of one query position over a run of cached keys and values, for all the query heads
//! that share one key/value head (grouped-query attention): each key and value is read once for
//! the whole group, which at long contexts is what decoding spends its memory traffic on. The
//! cache may be kept in f32 or f16 ([`KvElem`]), whose vectors the AVX2 and AVX-512 kernels widen
//! as they load them, once for up to four heads (the portable code widens a block at a time), or
//! as 4- or 8-bit affine codes ([`QuantRows`]), which the AVX-512 kernels dequantize as they
//! load them (AVX512-VNNI multiplies codes in groups of 64 as integers: see `RoundedQueries`),
//! and the rest a block of rows at a time into scratch that stays in L1 for the f32 kernels.

use std::ops::Range;

use half::f16;

use super::pool::{self, SharedMut};
use super::{with_task_scratch, Isa};
use crate::kv::KvQuant;
use crate::params::FloatSlice;

/// The element types a cache ring is kept in (see `crate::kv`).
pub trait KvElem: Copy + Send + Sync + sealed::Sealed {
    fn from_f32(x: f32) -> Self;
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
    fn floats(src: &[f16]) -> FloatSlice<'_> {
        FloatSlice::F16(src)
    }
}

/// A run of cached rows of `d` elements (a ring, or one key/value head's part of it) as the
/// attention kernels read it: f32 or f16 elements (`&[T]`), or affine codes ([`QuantRows`]).
pub trait KvRows: Copy + Send + Sync {
    /// Whether the rows are the codes the integer kernels read (groups of [`Q8_GROUP`]; the
    /// other AVX-512 kernels dequantize every format as they load it).
    fn kernel_codes(&self) -> bool {
        false
    }
    /// Elements held.
    fn elements(self) -> usize;
    /// Rows `rows` of these.
    fn rows(self, rows: Range<usize>, d: usize) -> Self;
    /// Rows `rows` as the kernels take them.
    fn block(&self, rows: Range<usize>, d: usize) -> Block<'_>;
}

/// A block of rows handed to the kernels.
#[derive(Clone, Copy)]
pub enum Block<'a> {
    Floats(FloatSlice<'a>),
    Codes(QuantRows<'a>),
}

impl Block<'_> {
    /// Rows of `d` elements held.
    fn rows(&self, d: usize) -> usize {
        match self {
            Block::Floats(f) => f.len() / d,
            Block::Codes(q) => q.elements() / d,
        }
    }

    /// Whether these are codes the integer kernels read.
    fn kernel_codes(&self) -> bool {
        matches!(self, Block::Codes(q) if q.kernel_codes())
    }
}

impl<T: KvElem> KvRows for &[T] {
    fn elements(self) -> usize {
        self.len()
    }
    fn rows(self, rows: Range<usize>, d: usize) -> Self {
        &self[rows.start * d..rows.end * d]
    }
    fn block(&self, rows: Range<usize>, d: usize) -> Block<'_> {
        Block::Floats(T::floats(&self[rows.start * d..rows.end * d]))
    }
}

/// Elements kept as affine codes, as `mx.quantize` makes them (see [`KvQuant`]): element `i`
/// is `code(i) · scales[g] + biases[g]`, `g = i / group`, where 4-bit codes are packed two to a
/// byte, the even element in the low half (MLX's little-endian words). Rows are whole groups
/// (the head dim a multiple of the group size).
#[derive(Clone, Copy)]
pub struct QuantRows<'a> {
    pub quant: KvQuant,
    pub codes: &'a [u8],
    pub scales: &'a [f32],
    pub biases: &'a [f32],
}

impl KvRows for QuantRows<'_> {
    fn elements(self) -> usize {
        self.codes.len() * 8 / usize::from(self.quant.bits)
    }
    fn rows(self, rows: Range<usize>, d: usize) -> Self {
        let (bytes, groups) = (self.quant.row_bytes(d), d / self.quant.group);
        QuantRows {
            codes: &self.codes[rows.start * bytes..rows.end * bytes],
            scales: &self.scales[rows.start * groups..rows.end * groups],
            biases: &self.biases[rows.start * groups..rows.end * groups],
            ..self
        }
    }
    fn block(&self, rows: Range<usize>, d: usize) -> Block<'_> {
        Block::Codes(self.rows(rows, d))
    }
    fn kernel_codes(&self) -> bool {
        self.quant.group == Q8_GROUP
    }
}

/// Features per group of the codes the integer kernels read: mlx-lm's default group size.
pub const Q8_GROUP: usize = 64;

/// `out[i] = code(i) · scale + bias` of each group of `q`.
pub fn dequantize(isa: Isa, q: QuantRows, out: &mut [f32]) {
    let group = q.quant.group;
    assert!(
        out.len() == q.elements() && q.scales.len() * group == out.len(),
        "dequantizing {} codes in {} groups into {}",
        q.elements(),
        q.scales.len(),
        out.len()
    );
    let groups = out
        .chunks_exact_mut(group)
        .zip(q.codes.chunks_exact(q.quant.row_bytes(group)));
    for ((o, c), (&scale, &bias)) in groups.zip(q.scales.iter().zip(q.biases)) {
        match (q.quant.bits, isa) {
            // SAFETY: the caller checked the processor (AVX-512 ones have AVX2); a group is
            // `group` of each. Off the AVX-512 decode path (whose kernels read codes
            // themselves), eight lanes are enough.
            #[cfg(target_arch = "x86_64")]
            (8, Isa::Avx2 | Isa::Avx512 | Isa::Amx) => unsafe {
                super::avx2::dequantize_u8(c.as_ptr(), group, scale, bias, o.as_mut_ptr())
            },
            (8, _) => {
                for (o, &c) in o.iter_mut().zip(c) {
                    *o = f32::from(c).mul_add(scale, bias);
                }
            }
            // Plain products and sums, which the compiler vectorizes (`mul_add` without FMA in
            // the baseline is a call per element).
            _ => {
                for (o, &c) in o.chunks_exact_mut(2).zip(c) {
                    o[0] = f32::from(c & 15) * scale + bias;
                    o[1] = f32::from(c >> 4) * scale + bias;
                }
            }
        }
    }
}

/// Quantizes `src` (whole groups) into `codes`, `scales` and `biases` as `mx.quantize` does at
/// `quant`'s bits and group size.
pub fn quantize(
    quant: KvQuant,
    src: &[f32],
    codes: &mut [u8],
    scales: &mut [f32],
    biases: &mut [f32],
) {
    let (group, levels) = (quant.group, quant.levels());
    let groups = src
        .chunks_exact(group)
        .zip(codes.chunks_exact_mut(quant.row_bytes(group)));
    for ((group, codes), (scale, bias)) in groups.zip(scales.iter_mut().zip(biases.iter_mut())) {
        let (s, b) = crate::params::affine_group(group, levels);
        (*scale, *bias) = (s, b);
        let code = |v: f32| crate::params::affine_code(v, s, b, levels) as u8;
        if quant.bits == 8 {
            for (c, &v) in codes.iter_mut().zip(group) {
                *c = code(v);
            }
        } else {
            for (c, pair) in codes.iter_mut().zip(group.chunks_exact(2)) {
                *c = code(pair[0]) | (code(pair[1]) << 4);
            }
        }
    }
}

/// What attention does to its scores besides the softmax: the scale of each query·key dot
/// product, and optionally Gemma 2's soft cap and gpt-oss's sinks.
#[derive(Clone, Copy, Debug)]
pub struct Options<'a> {
    /// What each query·key dot product is multiplied by.
    pub scale: f32,
    /// `Some(cap)`: each scaled score `s` becomes `cap · tanh(s / cap)` before the mask and the
    /// softmax (Gemma 2's `attn_logit_softcapping`).
    pub softcap: Option<f32>,
    /// `Some(sinks)` (one per query head): head `h`'s softmax has `sinks[h]` among its logits
    /// (not scaled), a key that weighs no value, so its weights sum to less than 1 (gpt-oss's
    /// attention sinks, `mx.fast.scaled_dot_product_attention(..., sinks=)`).
    pub sinks: Option<&'a [f32]>,
}

impl<'a> Options<'a> {
    /// Plain scaled dot-product attention.
    pub fn scaled(scale: f32) -> Self {
        Options {
            scale,
            softcap: None,
            sinks: None,
        }
    }

    /// These with scores soft-capped at `cap`.
    pub fn with_softcap(self, cap: f32) -> Self {
        Options {
            softcap: Some(cap),
            ..self
        }
    }

    /// These with one sink logit per query head.
    pub fn with_sinks(self, sinks: &'a [f32]) -> Self {
        Options {
            sinks: Some(sinks),
            ..self
        }
    }
}

/// One key/value head's rows (`[slots, head_dim]`) and the group's queries (`[group,
/// head_dim]`).
pub struct GroupAttention<'a, R> {
    pub queries: &'a [f32],
    pub keys: R,
    pub values: R,
    pub head_dim: usize,
    /// The rows attended, in position order: the second run is where a wrapped ring goes on
    /// from its first slot (empty if it did not wrap).
    pub runs: [Range<usize>; 2],
    pub scale: f32,
    /// Scores soft-capped at this (see [`Options::softcap`]).
    pub softcap: Option<f32>,
    /// The group's query heads' sink logits (see [`Options::sinks`]), one per head.
    pub sinks: Option<&'a [f32]>,
    /// `Some(counts)`: query row `r` attends only the first `counts[r]` of the runs' rows (the
    /// queries of several tokens stacked, each seeing the positions up to its own); `None`:
    /// every row attends them all.
    pub visible: Option<&'a [usize]>,
}

/// Keys per block: a block's scores and values stay in L1 while every query head of the group
/// passes over them.
const BLOCK: usize = 64;

impl<R: KvRows> GroupAttention<'_, R> {
    /// Softmax-weighted values for each query head into `out` (`[group, head_dim]`).
    pub fn run(&self, isa: Isa, out: &mut [f32]) {
        let group = self.queries.len() / self.head_dim;
        let n = self.len();
        if n == 0 {
            out[..group * self.head_dim].fill(0.0);
            return;
        }
        let d = self.head_dim;
        let rounded = if self.keys.kernel_codes() && int_codes(isa, d) {
            group * (d / 2 + 2 * d / Q8_GROUP)
        } else {
            0
        };
        with_task_scratch(group * n + 2 * BLOCK * d + rounded, |scratch| {
            let (scores, rest) = scratch.split_at_mut(group * n);
            let (block, rest) = rest.split_at_mut(BLOCK * d);
            let (widened, rest) = rest.split_at_mut(BLOCK * d);
            let rounded = (rounded > 0).then(|| round_queries(self.queries, d, rest));
            self.run_with(isa, scores, (block, widened), rounded, out)
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

    /// `scratch.0` holds a block's rows where codes are dequantized ahead of the
    /// kernels, `scratch.1` where the portable code widens f16 (`BLOCK · head_dim` each);
    /// `rounded` are the queries for the integer kernels on 8-bit keys, where they run.
    fn run_with(
        &self,
        isa: Isa,
        scores: &mut [f32],
        (block, widened): (&mut [f32], &mut [f32]),
        rounded: Option<RoundedQueries>,
        out: &mut [f32],
    ) {
        let d = self.head_dim;
        let n = self.len();
        let group = self.queries.len() / d;
        assert!(
            self.sinks.is_none_or(|s| s.len() == group)
                && self
                    .visible
                    .is_none_or(|v| v.len() == group && v.iter().all(|&c| c <= n))
                && self.runs.iter().all(|r| r.end * d <= self.keys.elements())
                && self.keys.elements() == self.values.elements()
                && scores.len() >= group * n
                && block.len() >= BLOCK * d
                && widened.len() >= BLOCK * d
                && out.len() >= group * d
        );
        for (j0, rows) in self.blocks() {
            let keys = self.keys.block(rows, d);
            block_scores(
                isa,
                (self.queries, rounded),
                keys,
                d,
                self.scale,
                &mut scores[j0..],
                n,
                (block, widened),
            );
        }
        if let Some(cap) = self.softcap {
            super::elementwise::softcap_inplace(&mut scores[..group * n], cap);
        }
        for (h, s) in scores[..group * n].chunks_exact_mut(n).enumerate() {
            // Rows a query does not see weigh exactly 0, adding nothing to its values' sums.
            let seen = self.visible.map_or(n, |v| v[h]);
            softmax(isa, &mut s[..seen], self.sinks.map(|sinks| sinks[h]));
            s[seen..].fill(0.0);
        }
        out[..group * d].fill(0.0);
        for (j0, rows) in self.blocks() {
            let values = self.values.block(rows, d);
            block_values(
                isa,
                &scores[j0..],
                n,
                values,
                d,
                &mut out[..group * d],
                (block, widened),
            );
        }
    }
}

/// Heads per call of the vector kernels: their registers hold four heads' sums.
const KERNEL_HEADS: usize = 4;

/// Runs `$body` with `$rows` bound to `$block` as the AVX-512 kernels read it: f32 or f16 rows
/// as they are, 8- or 4-bit codes to be dequantized as they are loaded (`$d` elements a row).
#[cfg(target_arch = "x86_64")]
macro_rules! with_wide_rows {
    ($block:expr, $d:expr, $rows:ident => $body:expr) => {{
        use super::avx512::Plain;
        match $block {
            Block::Floats(FloatSlice::F32(v)) => {
                let $rows = Plain {
                    ptr: v.as_ptr(),
                    d: $d,
                };
                $body
            }
            Block::Floats(FloatSlice::F16(v)) => {
                let $rows = Plain {
                    ptr: v.as_ptr(),
                    d: $d,
                };
                $body
            }
            Block::Floats(FloatSlice::BF16(_)) => unreachable!("caches are f32, f16 or codes"),
            Block::Codes(q) if q.quant.bits == 8 => {
                let $rows = codes(q, $d);
                $body
            }
            Block::Codes(q) => {
                let $rows = super::avx512::Nibbles(codes(q, $d));
                $body
            }
        }
    }};
}

/// `scores[h · stride + j] = scale · q_h · k_j` for the query heads `queries` (`[heads, d]`) and
/// the rows `k_j` of `keys` (`[rows, d]`). With the queries `rounded`, the integer kernels take
/// 8-bit keys; the AVX-512 kernels take heads of whole 64s in any format; elsewhere codes
/// are dequantized into `scratch.0`, and the portable code widens f16 into `scratch.1` (a block
/// of rows as f32 each).
#[allow(clippy::too_many_arguments)]
fn block_scores(
    isa: Isa,
    (queries, rounded): (&[f32], Option<RoundedQueries>),
    keys: Block,
    d: usize,
    scale: f32,
    scores: &mut [f32],
    stride: usize,
    scratch: (&mut [f32], &mut [f32]),
) {
    let (heads, rows) = (queries.len() / d, keys.rows(d));
    assert!(rows == 0 || scores.len() >= (heads - 1) * stride + rows);
    #[cfg(target_arch = "x86_64")]
    if let (Block::Codes(k), Some(rounded)) = (keys, rounded) {
        for h0 in (0..heads).step_by(KERNEL_HEADS) {
            let chunk = KERNEL_HEADS.min(heads - h0);
            // SAFETY: `rounded` exists where `int_codes` found the processor and head dim; the
            // lengths were checked above.
            unsafe {
                super::avx512::q8_group_scores(
                    rounded.heads(h0, d),
                    chunk,
                    int_rows(k, d),
                    rows,
                    d,
                    scale,
                    scores[h0 * stride..].as_mut_ptr(),
                    stride,
                )
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && d.is_multiple_of(8) {
        let narrow = (!wide(isa, d)).then(|| floats(isa, keys, scratch.0));
        for h0 in (0..heads).step_by(KERNEL_HEADS) {
            let chunk = KERNEL_HEADS.min(heads - h0);
            let (q, out) = (
                queries[h0 * d..].as_ptr(),
                scores[h0 * stride..].as_mut_ptr(),
            );
            // SAFETY: the caller checked the processor, `wide` the head dim; the lengths were
            // checked above.
            unsafe {
                match narrow {
                    None => with_wide_rows!(keys, d, k => super::avx512::group_scores(
                        q, chunk, k, rows, d, scale, out, stride
                    )),
                    Some(FloatSlice::F32(k)) => {
                        super::avx2::group_scores(q, chunk, k.as_ptr(), rows, d, scale, out, stride)
                    }
                    Some(FloatSlice::F16(k)) => {
                        super::avx2::group_scores(q, chunk, k.as_ptr(), rows, d, scale, out, stride)
                    }
                    Some(FloatSlice::BF16(_)) => unreachable!("caches are f32, f16 or codes"),
                }
            }
        }
        return;
    }
    let keys = floats(isa, keys, scratch.0);
    let keys = widen(keys, scratch.1);
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
/// kernels and `scratch` as [`block_scores`]'.
fn block_values(
    isa: Isa,
    p: &[f32],
    stride: usize,
    values: Block,
    d: usize,
    out: &mut [f32],
    scratch: (&mut [f32], &mut [f32]),
) {
    let (heads, rows) = (out.len() / d, values.rows(d));
    assert!(rows == 0 || p.len() >= (heads - 1) * stride + rows);
    #[cfg(target_arch = "x86_64")]
    if let (Block::Codes(v), true) = (values, values.kernel_codes() && int_codes(isa, d)) {
        assert!(rows <= super::avx512::Q8_VALUE_ROWS);
        for h0 in (0..heads).step_by(KERNEL_HEADS) {
            let chunk = KERNEL_HEADS.min(heads - h0);
            let (p, o) = (p[h0 * stride..].as_ptr(), out[h0 * d..].as_mut_ptr());
            // SAFETY: `int_codes` checked the processor and the head dim; the lengths were
            // checked above.
            unsafe { super::avx512::q8_group_values(p, stride, chunk, int_rows(v, d), rows, d, o) }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && d.is_multiple_of(8) {
        let narrow = (!wide(isa, d)).then(|| floats(isa, values, scratch.0));
        for h0 in (0..heads).step_by(KERNEL_HEADS) {
            let chunk = KERNEL_HEADS.min(heads - h0);
            let (p, o) = (p[h0 * stride..].as_ptr(), out[h0 * d..].as_mut_ptr());
            // SAFETY: the caller checked the processor, `wide` the head dim; the lengths were
            // checked above.
            unsafe {
                match narrow {
                    None => with_wide_rows!(values, d, v => super::avx512::group_values(
                        p, stride, chunk, v, rows, d, o
                    )),
                    Some(FloatSlice::F32(v)) => {
                        super::avx2::group_values(p, stride, chunk, v.as_ptr(), rows, d, o)
                    }
                    Some(FloatSlice::F16(v)) => {
                        super::avx2::group_values(p, stride, chunk, v.as_ptr(), rows, d, o)
                    }
                    Some(FloatSlice::BF16(_)) => unreachable!("caches are f32, f16 or codes"),
                }
            }
        }
        return;
    }
    let values = floats(isa, values, scratch.0);
    let values = widen(values, scratch.1);
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        for (&pj, vj) in p[h * stride..][..rows].iter().zip(values.chunks_exact(d)) {
            for (od, &vd) in o.iter_mut().zip(vj) {
                *od += pj * vd;
            }
        }
    }
}

/// Whether the AVX-512 kernels take heads of `d`: whole 64s, in any format; the AVX2 kernels
/// take whole 8s of f32 or f16 (codes dequantized a block of rows at a time).
#[cfg(target_arch = "x86_64")]
fn wide(isa: Isa, d: usize) -> bool {
    isa >= Isa::Avx512 && d.is_multiple_of(64)
}

/// Whether the integer kernels take 8-bit rows of `d`: AVX512-VNNI, and heads the AVX-512
/// kernels take.
fn int_codes(isa: Isa, d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return wide(isa, d) && super::qint::IntIsa::Avx512Vnni.is_available();
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// A group's queries as the integer kernels on 8-bit keys take them: per head, int16 codes of
/// each group of [`Q8_GROUP`] features (`q ≈ code · scale`, rounded against the group's largest
/// magnitude), and per head and group (`[head, group]`) the scale and the exact sum of the
/// queries. Keys' scales then multiply integer dot products, and their biases the sums.
#[derive(Clone, Copy)]
struct RoundedQueries<'a> {
    codes: &'a [i16],
    scales: &'a [f32],
    sums: &'a [f32],
}

impl RoundedQueries<'_> {
    /// Heads from `h0` on, as the kernels take them.
    #[cfg(target_arch = "x86_64")]
    fn heads(&self, h0: usize, d: usize) -> super::avx512::QueryCodes {
        let groups = d / Q8_GROUP;
        super::avx512::QueryCodes {
            codes: self.codes[h0 * d..].as_ptr(),
            scales: self.scales[h0 * groups..].as_ptr(),
            sums: self.sums[h0 * groups..].as_ptr(),
        }
    }
}

/// Rounds `queries` (`[heads, d]`, `d` a multiple of [`Q8_GROUP`]) into `scratch` (at least
/// `heads · (d / 2 + 2 · d / Q8_GROUP)` floats).
fn round_queries<'a>(queries: &[f32], d: usize, scratch: &'a mut [f32]) -> RoundedQueries<'a> {
    let (heads, groups) = (queries.len() / d, d / Q8_GROUP);
    let (codes, rest) = scratch.split_at_mut(heads * d / 2);
    let (scales, rest) = rest.split_at_mut(heads * groups);
    let sums = &mut rest[..heads * groups];
    let codes: &mut [i16] = bytemuck::cast_slice_mut(codes);
    let runs = queries
        .chunks_exact(Q8_GROUP)
        .zip(codes.chunks_exact_mut(Q8_GROUP));
    for ((q, c), (scale, sum)) in runs.zip(scales.iter_mut().zip(sums.iter_mut())) {
        // The GEMV's rounding of an activation group to one int16 an element.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: rounded queries exist only where `int_codes` found AVX-512 (and so AVX2);
        // a group is 64 of each.
        let rounded = unsafe { super::x86_int::quantize_group(q, 32767.0, 1.0, &mut [c]) };
        #[cfg(not(target_arch = "x86_64"))]
        let rounded: super::qint::Quantized = unreachable!("the integer kernels are x86's");
        (*scale, *sum) = (rounded.scale, rounded.sum);
    }
    RoundedQueries {
        codes,
        scales,
        sums,
    }
}

/// The AVX-512 kernels' view of rows of `d` codes (of 4 bits: their bytes, as [`Nibbles`]
/// reads them).
///
/// [`Nibbles`]: super::avx512::Nibbles
#[cfg(target_arch = "x86_64")]
fn codes(q: QuantRows, d: usize) -> super::avx512::Codes {
    super::avx512::Codes {
        codes: q.codes.as_ptr(),
        scales: q.scales.as_ptr(),
        biases: q.biases.as_ptr(),
        d,
        group: q.quant.group,
    }
}

/// The integer kernels' view of rows of `d` codes in groups of [`Q8_GROUP`].
#[cfg(target_arch = "x86_64")]
fn int_rows(q: QuantRows, d: usize) -> super::avx512::IntCodes {
    debug_assert!(q.kernel_codes());
    super::avx512::IntCodes {
        codes: codes(q, d),
        nibbles: q.quant.bits == 4,
    }
}

/// `rows` as floats: themselves, or codes dequantized into `scratch`.
fn floats<'a>(isa: Isa, rows: Block<'a>, scratch: &'a mut [f32]) -> FloatSlice<'a> {
    match rows {
        Block::Floats(f) => f,
        Block::Codes(q) => {
            let out = &mut scratch[..q.elements()];
            dequantize(isa, q, out);
            FloatSlice::F32(out)
        }
    }
}

/// `rows` as f32: themselves, or widened into `scratch`.
fn widen<'a>(rows: FloatSlice<'a>, scratch: &'a mut [f32]) -> &'a [f32] {
    match rows {
        FloatSlice::F32(v) => v,
        other => {
            let out = &mut scratch[..other.len()];
            other.to_f32(0, out);
            out
        }
    }
}

/// Numerically stable softmax in place; the AVX2 version computes `exp` in vectors (within a
/// few ulp of libm's). A `sink` logit joins the denominator (its weight is left out of `x`).
pub fn softmax(isa: Isa, x: &mut [f32], sink: Option<f32>) {
    let with_sink = |max: f32| sink.map_or(max, |s| max.max(s));
    let sink_term = |max: f32| sink.map_or(0.0, |s| (s - max).exp());
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: the caller checked the processor.
        unsafe {
            let max = with_sink(super::avx2::max(x));
            let sum = super::avx2::exp_sub_sum(x, max) + sink_term(max);
            super::avx2::scale(x, 1.0 / sum);
        }
        return;
    }
    let max = with_sink(x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)));
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    super::elementwise::scale_inplace(x, 1.0 / (sum + sink_term(max)));
}

/// Keys and values of one layer as attention reads them: `[kv_heads, capacity, head_dim]` each,
/// position `p` in slot `p % capacity`, positions `start..end` present.
pub struct KvView<R> {
    pub keys: R,
    pub values: R,
    pub kv_heads: usize,
    pub capacity: usize,
    pub start: usize,
    pub end: usize,
    /// `Some(w)`: a sliding window; a query sees the `w` positions ending at its own.
    pub window: Option<usize>,
}

impl<R> KvView<R> {
    /// One whole sequence of `len` positions, `[kv_heads, len, head_dim]` each (training).
    pub fn sequence(keys: R, values: R, kv_heads: usize, len: usize) -> Self {
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

    /// The same positions seen through `window` (a sliding-window layer's), or causally.
    pub fn within(self, window: Option<usize>) -> Self {
        KvView { window, ..self }
    }

    /// The positions a query at `pos` attends.
    fn span(&self, pos: usize) -> Range<usize> {
        let hi = (pos + 1).min(self.end);
        let reach = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        reach.max(self.start).min(hi)..hi
    }

    /// The slots a query at `pos` attends, in position order: one run, or two where the ring
    /// wraps.
    fn runs(&self, pos: usize) -> [Range<usize>; 2] {
        self.slots(self.span(pos))
    }

    /// The slots of `positions` (kept ones), in their order.
    fn slots(&self, positions: Range<usize>) -> [Range<usize>; 2] {
        let (lo, hi) = (positions.start, positions.end);
        let first = lo % self.capacity;
        let tail = (first + hi - lo).saturating_sub(self.capacity);
        [first..first + (hi - lo) - tail, 0..tail]
    }
}

/// Scaled dot-product attention of `q` (`[tokens, heads, head_dim]`) over `kv`, writing
/// `[tokens, heads, head_dim]` into `out`. Query `t` sees the positions up to `positions[t]`
/// (causal) within the window, and query head `h` reads key head `h / (heads / kv_heads)`
/// (grouped-query attention); `options` scale (and may soft-cap) the scores and may add sinks.
pub fn attention<R: KvRows>(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kv: &KvView<R>,
    options: Options,
    out: &mut [f32],
) {
    if positions.len() > 1 {
        return attend_stacked(q, heads, head_dim, positions, kv, options, out);
    }
    attend_tokens(
        q,
        heads,
        head_dim,
        positions,
        kv.kv_heads,
        |_| kv,
        options,
        out,
    );
}

/// Query rows a task of [`attend_stacked`] takes (its tokens' query heads of one key/value
/// head): each block of keys and values meets them all while it is in L1, and their scores
/// (rows × attended positions) stay within L2 up to 16,384 positions.
const STACKED_ROWS: usize = 32;

/// [`attend_tokens`] for several tokens over one cache (a prompt): the tokens whose attended
/// positions start at the same place (all of a causal prompt's; a sliding window's move on by
/// one a token) go in runs of up to [`STACKED_ROWS`] query rows, whose queries are stacked and
/// each masked to the positions up to its own, so that a run reads the cache once rather than
/// once a token. A row's sums are the ones its token alone would take: the rows past its own
/// weigh exactly 0.
fn attend_stacked<R: KvRows>(
    q: &[f32],
    heads: usize,
    d: usize,
    positions: &[usize],
    kv: &KvView<R>,
    options: Options,
    out: &mut [f32],
) {
    assert!(
        options.sinks.is_none_or(|s| s.len() == heads),
        "attention sinks for other than {heads} heads"
    );
    let (kv_heads, group) = (kv.kv_heads, heads / kv.kv_heads);
    let per_run = (STACKED_ROWS / group).max(1);
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (t, &pos) in positions.iter().enumerate() {
        match runs.last_mut() {
            Some(run)
                if run.len() < per_run
                    && kv.span(positions[run.start]).start == kv.span(pos).start =>
            {
                run.end = t + 1
            }
            _ => runs.push(t..t + 1),
        }
    }
    let isa = Isa::best();
    let out = SharedMut::new(&mut out[..positions.len() * heads * d]);
    pool::parallel_for(runs.len() * kv_heads, &|task| {
        let (tokens, kvh) = (runs[task / kv_heads].clone(), task % kv_heads);
        let spans: Vec<Range<usize>> = tokens.clone().map(|t| kv.span(positions[t])).collect();
        let lo = spans[0].start;
        let hi = spans.iter().map(|s| s.end).max().unwrap_or(lo);
        let first = |t: usize| (t * heads + kvh * group) * d;
        let queries: Vec<f32> = tokens
            .clone()
            .flat_map(|t| &q[first(t)..first(t) + group * d])
            .copied()
            .collect();
        let visible: Vec<usize> = spans
            .iter()
            .flat_map(|s| std::iter::repeat_n(s.end - lo, group))
            .collect();
        let sinks: Option<Vec<f32>> = options
            .sinks
            .map(|s| s[kvh * group..(kvh + 1) * group].repeat(tokens.len()));
        let head = kvh * kv.capacity..(kvh + 1) * kv.capacity;
        let job = GroupAttention {
            queries: &queries,
            keys: kv.keys.rows(head.clone(), d),
            values: kv.values.rows(head, d),
            head_dim: d,
            runs: kv.slots(lo..hi),
            scale: options.scale,
            softcap: options.softcap,
            sinks: sinks.as_deref(),
            visible: Some(&visible),
        };
        let mut stacked = vec![0.0; queries.len()];
        job.run(isa, &mut stacked);
        for (t, rows) in tokens.zip(stacked.chunks_exact(group * d)) {
            // SAFETY: each task writes its own tokens' groups of heads.
            unsafe { out.range(first(t), group * d) }.copy_from_slice(rows);
        }
    });
}

/// [`attention`] of one query token for each of several sequences: token `s` (row `s` of `q`)
/// at `positions[s]` over `kvs[s]`, all of `kvs` of one layer (the same head counts). One pool
/// job for the whole batch, where a job per sequence would cost a dispatch each.
pub fn attention_batch<R: KvRows>(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kvs: &[KvView<R>],
    options: Options,
    out: &mut [f32],
) {
    let Some(first) = kvs.first() else { return };
    assert!(
        kvs.len() == positions.len() && kvs.iter().all(|kv| kv.kv_heads == first.kv_heads),
        "a batch's caches differ in heads, or are not one per token"
    );
    let kv_heads = first.kv_heads;
    attend_tokens(
        q,
        heads,
        head_dim,
        positions,
        kv_heads,
        |t| &kvs[t],
        options,
        out,
    );
}

/// Attention of each token `t` of `q` at `positions[t]` over `kv_of(t)`.
#[allow(clippy::too_many_arguments)]
fn attend_tokens<'k, R: KvRows + 'k>(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kv_heads: usize,
    kv_of: impl Fn(usize) -> &'k KvView<R> + Sync,
    options: Options,
    out: &mut [f32],
) {
    assert!(
        options.sinks.is_none_or(|s| s.len() == heads),
        "attention sinks for other than {heads} heads"
    );
    let group = heads / kv_heads;
    let d = head_dim;
    let isa = Isa::best();
    let out = SharedMut::new(&mut out[..positions.len() * heads * d]);
    // One task per token and KV head: the group's query heads share each key and value read.
    pool::parallel_for(positions.len() * kv_heads, &|task| {
        let (t, kvh) = (task / kv_heads, task % kv_heads);
        let kv = kv_of(t);
        let first = (t * heads + kvh * group) * d;
        let head = kvh * kv.capacity..(kvh + 1) * kv.capacity;
        let job = GroupAttention {
            queries: &q[first..first + group * d],
            keys: kv.keys.rows(head.clone(), d),
            values: kv.values.rows(head, d),
            head_dim: d,
            runs: kv.runs(positions[t]),
            scale: options.scale,
            softcap: options.softcap,
            sinks: options.sinks.map(|s| &s[kvh * group..(kvh + 1) * group]),
            visible: None,
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

/// [`kv_write`] into a ring of `quant`'s codes (`head_dim` a multiple of its group size): each
/// group of a head's features quantized as `mx.quantize` does.
pub fn kv_write_quant(
    cache: (&mut [u8], &mut [f32], &mut [f32]),
    quant: KvQuant,
    src: &[f32],
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    first: usize,
) {
    let (d, bytes, groups) = (head_dim, quant.row_bytes(head_dim), head_dim / quant.group);
    let (codes, scales, biases) = cache;
    for (t, token) in src.chunks_exact(kv_heads * d).enumerate() {
        let slot = (first + t) % capacity;
        for (h, head) in token.chunks_exact(d).enumerate() {
            let row = h * capacity + slot;
            let (c, g) = (
                row * bytes..(row + 1) * bytes,
                row * groups..(row + 1) * groups,
            );
            quantize(
                quant,
                head,
                &mut codes[c],
                &mut scales[g.clone()],
                &mut biases[g],
            );
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
    let first = positions.start;
    kv_copy(
        src,
        src_capacity,
        first,
        dst,
        dst_capacity,
        kv_heads,
        head_dim,
        positions,
    );
}

/// [`kv_move`] from other positions: position `p` of `positions` in `dst` takes position
/// `src_first + (p - positions.start)` of `src`.
#[allow(clippy::too_many_arguments)]
pub fn kv_copy<T: Copy>(
    src: &[T],
    src_capacity: usize,
    src_first: usize,
    dst: &mut [T],
    dst_capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: Range<usize>,
) {
    let d = head_dim;
    for h in 0..kv_heads {
        for (i, p) in positions.clone().enumerate() {
            let from = (h * src_capacity + (src_first + i) % src_capacity) * d;
            let to = (h * dst_capacity + p % dst_capacity) * d;
            dst[to..to + d].copy_from_slice(&src[from..from + d]);
        }
    }
}
