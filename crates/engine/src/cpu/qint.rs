//! The decode GEMV on 4- and 8-bit MLX weights with integer activations: each activation row is
//! quantized once per call, per weight group (`x ≈ dx·xq`), and the packed integers meet it in
//! integer multiplies summed exactly in 32-bit lanes. A group then contributes
//! `s·dx·Σq·xq + b·Σx`, with `Σx` exact in f32, so weights are never converted to float.
//!
//! How exact that is depends on the activations ([`Activations`]):
//! - int8 triples (the default where VNNI multiplies bytes): `x ≈ dx·(a + b/254 + c/254²)`,
//!   three byte products (`vpdpbusd`) per weight against one unpacking into fewer planes than
//!   int16 lanes take. Rounding moves x by at most `max|x|/127·2^-1/254²` (`max|x|·6e-8`) of its
//!   group, about f32's own rounding: `Σ|w·x|`-relative errors match the f32 path's (1.5e-8).
//! - int16 pairs (the default on AVX2 alone, where a byte product takes two instructions):
//!   `x ≈ dx·(h + l/65536)`, two int16 multiplies per weight against one unpacking. Rounding
//!   moves x by at most `max|x|·2^-32` of its group, below f32's own rounding of most elements:
//!   the tiny parity models' logits stay within ~1e-4 of mlx, as on the f32 path.
//! - int16 (`vpmaddwd` / `vpdpwssd`): rounding moves x by up to `max|x|/65534`, which moves
//!   those logits by ~3e-3, over the parity tolerance of 2e-3: only on request.
//! - int8 (`vpmaddubsw` / `vpdpbusd`): fewest instructions, but the rounding (`max|x|/254`)
//!   moves those logits by ~0.1: only on request.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use super::matmul::weight_bytes;
use super::pool::{self, SharedMut};
use super::with_scratch;
#[cfg(target_arch = "x86_64")]
use crate::params::FloatSlice;
use crate::params::QuantizedView;

/// Weight rows handed to one kernel call per activation row: their bytes stay in L1/L2 while
/// every activation row passes over them.
const ROW_BLOCK: usize = 16;

/// Weight rows per pool task.
const TASK_ROWS: usize = 64;

/// How the decode GEMV ([`super::matmul::matmul`] with few activation rows) treats activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 activations against weights converted to float (`matmul::gemv`).
    F32,
    /// Integer activations of the given kind where an integer kernel takes the weights, f32
    /// elsewhere.
    Int(Activations),
}

/// The default: the activations as exact as the f32 path that this processor runs fastest,
/// int8 triples where VNNI takes a byte product in one instruction (a 4-bit weight costs 1.5
/// instructions where pairs take 3; 1.3-1.6× the throughput of pairs on a Sapphire Rapids
/// core, `examples/qgemv_bench`), int16 pairs on AVX2 alone (where `vpmaddubsw` and `vpmaddwd`
/// take two for a byte product, and triples are no faster).
pub fn default_precision() -> Precision {
    let vnni = IntKernel::available().iter().any(|k| k.isa != IntIsa::Avx2);
    Precision::Int(if vnni {
        Activations::I8Triple
    } else {
        Activations::I16Pair
    })
}

/// [`Precision`] as one byte: 0 for f32, else one more than the activations' index;
/// [`DEFAULT_CODE`] until [`set_precision`] is called.
static PRECISION: AtomicU8 = AtomicU8::new(DEFAULT_CODE);

const DEFAULT_CODE: u8 = u8::MAX;

const fn encode(p: Precision) -> u8 {
    match p {
        Precision::F32 => 0,
        Precision::Int(a) => a as u8 + 1,
    }
}

/// Sets the decode GEMV's activation precision for all later calls in the process.
pub fn set_precision(p: Precision) {
    PRECISION.store(encode(p), Ordering::Relaxed);
}

/// The decode GEMV's activation precision ([`default_precision`] unless [`set_precision`] said
/// otherwise).
pub fn precision() -> Precision {
    let code = PRECISION.load(Ordering::Relaxed);
    if code == DEFAULT_CODE {
        return default_precision();
    }
    Activations::ALL
        .into_iter()
        .find(|&a| encode(Precision::Int(a)) == code)
        .map_or(Precision::F32, Precision::Int)
}

/// The integers activations are quantized to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    I8,
    I16,
    /// Two int16 per element: `x ≈ dx·(h + l/65536)`.
    I16Pair,
    /// Three int8 per element: `x ≈ dx·(a + b/254 + c/254²)`.
    I8Triple,
}

impl Activations {
    pub const ALL: [Activations; 4] = [
        Activations::I8,
        Activations::I16,
        Activations::I16Pair,
        Activations::I8Triple,
    ];

    /// The largest `|xq|`.
    pub fn max(self) -> f32 {
        match self {
            Activations::I8 | Activations::I8Triple => 127.0,
            Activations::I16 | Activations::I16Pair => 32767.0,
        }
    }

    /// The scale of each element's last integer relative to `dx`, and so of the rounding error:
    /// `1` for one integer, `2^-16` for the low half of a pair, `254^-2` for the last of a
    /// triple.
    pub fn resolution(self) -> f32 {
        self.refinement().powi(self.pieces() as i32 - 1)
    }

    /// The weight of each integer of an element relative to the one before it.
    pub(super) fn refinement(self) -> f32 {
        match self {
            Activations::I16Pair => PAIR_REFINEMENT,
            Activations::I8Triple => TRIPLE_REFINEMENT,
            Activations::I8 | Activations::I16 => 1.0,
        }
    }

    pub(super) fn bits(self) -> usize {
        match self {
            Activations::I8 | Activations::I8Triple => 8,
            Activations::I16 | Activations::I16Pair => 16,
        }
    }

    /// Integers per element.
    pub(super) fn pieces(self) -> usize {
        match self {
            Activations::I8 | Activations::I16 => 1,
            Activations::I16Pair => 2,
            Activations::I8Triple => 3,
        }
    }
}

/// The weight of the low integer of an int16 pair.
pub(super) const PAIR_REFINEMENT: f32 = 1.0 / 65536.0;

/// The weight of each further integer of an int8 triple: each one rounds what the ones before
/// left (at most half a unit) in steps of 1/254, so it stays within ±127.
pub(super) const TRIPLE_REFINEMENT: f32 = 1.0 / 254.0;

/// The instruction sets of the integer kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntIsa {
    /// `vpmaddubsw` / `vpmaddwd` on 256 bits (any AVX2 processor).
    Avx2,
    /// `vpdpbusd` / `vpdpwssd` on 256 bits (AVX-VNNI: Alder Lake, Sapphire Rapids, Zen 5 and
    /// later).
    AvxVnni,
    /// `vpdpbusd` / `vpdpwssd` on 512 bits (AVX512-VNNI: Ice Lake server, Zen 4 and later).
    Avx512Vnni,
}

impl IntIsa {
    /// Whether this processor runs these kernels.
    pub fn is_available(self) -> bool {
        IntKernel::available().iter().any(|k| k.isa == self)
    }
}

/// One integer GEMV kernel: an instruction set and the activations it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntKernel {
    pub isa: IntIsa,
    pub activations: Activations,
}

/// The integer kernels this processor runs, slowest instruction set first.
fn detect() -> Vec<IntKernel> {
    let mut isas = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if super::Isa::Avx2.is_available() {
        isas.push(IntIsa::Avx2);
        if is_x86_feature_detected!("avxvnni") {
            isas.push(IntIsa::AvxVnni);
        }
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
        {
            isas.push(IntIsa::Avx512Vnni);
        }
    }
    isas.into_iter()
        .flat_map(|isa| Activations::ALL.map(|activations| IntKernel { isa, activations }))
        .collect()
}

impl IntKernel {
    /// Every integer kernel this processor runs, slowest instruction set first (measured with
    /// `examples/qgemv_bench`). Detected once.
    pub fn available() -> &'static [IntKernel] {
        static AVAILABLE: OnceLock<Vec<IntKernel>> = OnceLock::new();
        AVAILABLE.get_or_init(detect)
    }

    /// The fastest kernel with `activations` that this processor runs and that takes `w`.
    pub fn best(activations: Activations, w: &QuantizedView) -> Option<IntKernel> {
        IntKernel::available()
            .iter()
            .rev()
            .find(|k| k.activations == activations && k.supports(w))
            .copied()
    }

    /// Bits of packed weights per kernel step.
    fn vector_bits(self) -> usize {
        match self.isa {
            IntIsa::Avx512Vnni => 512,
            IntIsa::Avx2 | IntIsa::AvxVnni => 256,
        }
    }

    /// Whether the kernel takes `w`: 4 or 8 bits, rows a whole number of vectors.
    pub fn supports(self, w: &QuantizedView) -> bool {
        matches!(w.bits, 4 | 8) && (w.cols * w.bits as usize).is_multiple_of(self.vector_bits())
    }

    /// How activations meet one vector ("chunk") of packed `bits`-bit weights: the kernels split
    /// the vector into `P = A/bits` planes of A-bit lanes (A: activation bits), plane `k` holding
    /// the integer at bits `bits·k..` of every lane, so the activations of a chunk are laid out
    /// plane after plane, element `P·l + k` of the chunk at `k·lanes + l` (and for pairs, the
    /// high integers of the chunk, then the low ones). Returns (elements per chunk, P, lanes).
    fn layout(self, bits: usize) -> (usize, usize, usize) {
        let a = self.activations.bits();
        (self.vector_bits() / bits, a / bits, self.vector_bits() / a)
    }

    /// Whether the kernel multiplies `q - 128` rather than `q` (the int8 AVX2 kernel at 8 bits,
    /// since `vpmaddubsw` pairs of `255·127` would saturate).
    fn centres(self, bits: u32) -> bool {
        self.isa == IntIsa::Avx2 && self.activations.bits() == 8 && bits == 8
    }
}

/// The integer the activations of a kernel are stored as.
pub(super) trait ActInt: bytemuck::Pod + Sync {}

impl ActInt for i8 {}

impl ActInt for i16 {}

/// A weight matrix and one quantized activation row, as the kernels take them.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) struct IntRows<'a, T> {
    pub cols: usize,
    pub group_size: usize,
    pub packed: &'a [u8],
    pub scales: &'a [T],
    pub biases: &'a [T],
    /// The bytes of the activations' integers, each chunk laid out as [`IntKernel::layout`]
    /// says.
    pub xq: &'a [u8],
    /// Per group: the activation scale, the exact sum of x, and the integer sum the centred
    /// kernel leaves out (`128·Σxq`, zero otherwise).
    pub dx: &'a [f32],
    pub sums: &'a [f32],
    pub corr: &'a [f32],
}

/// One quantized activation row and its per-group figures.
struct Act<'a, X> {
    xq: &'a [X],
    dx: &'a [f32],
    sums: &'a [f32],
    corr: &'a [f32],
}

/// An activation row being quantized.
struct ActMut<'a, X> {
    xq: &'a mut [X],
    dx: &'a mut [f32],
    sums: &'a mut [f32],
    corr: &'a mut [f32],
}

/// One group of activations quantized: `x ≈ scale·q` (`q` the integers of an element, each
/// weighted by the refinement to the power of its place).
pub(super) struct Quantized {
    pub scale: f32,
    /// `Σx`, and `Σq` (exact in f32 for one integer an element).
    pub sum: f32,
    pub int_sum: f32,
}

/// Quantizes `x` per group of `g` for `kernel` on `bits`-bit weights, through `natural` (as
/// long as `x` for each piece: the first integers, then the next), which receives the integers
/// in their own order first.
fn quantize_row<X: ActInt>(
    kernel: IntKernel,
    bits: u32,
    g: usize,
    x: &[f32],
    natural: &mut [X],
    a: ActMut<X>,
) {
    let acts = kernel.activations;
    let centred = kernel.centres(bits);
    // Each piece's groups, in turn (at most three pieces; the rest stay empty).
    let mut piece_rows = natural.chunks_exact_mut(x.len());
    let mut groups_of = || piece_rows.next().map(|p| p.chunks_exact_mut(g));
    let mut pieces = [groups_of(), groups_of(), groups_of()];
    for (gi, group) in x.chunks_exact(g).enumerate() {
        let mut outs: [&mut [X]; 3] = Default::default();
        for (out, piece) in outs.iter_mut().zip(pieces.iter_mut().flatten()) {
            *out = piece.next().expect("a group of each piece");
        }
        let outs = &mut outs[..acts.pieces()];
        // SAFETY: integer kernels run only where AVX2 and FMA are present.
        #[cfg(target_arch = "x86_64")]
        let q =
            unsafe { super::x86_int::quantize_group(group, acts.max(), acts.refinement(), outs) };
        #[cfg(not(target_arch = "x86_64"))]
        let q: Quantized = unreachable!("no integer kernels off x86-64: {group:?} {outs:?}");
        a.dx[gi] = q.scale;
        a.sums[gi] = q.sum;
        a.corr[gi] = if centred { 128.0 * q.int_sum } else { 0.0 };
    }
    let (per_chunk, per_lane, lanes) = kernel.layout(bits as usize);
    let pieces = kernel.activations.pieces();
    for (piece, nat) in natural.chunks_exact(x.len()).enumerate() {
        let chunks = a.xq.chunks_exact_mut(pieces * per_chunk);
        for (out, nat) in chunks.zip(nat.chunks_exact(per_chunk)) {
            let out = &mut out[piece * per_chunk..(piece + 1) * per_chunk];
            match per_lane {
                1 => out.copy_from_slice(nat),
                2 => planes::<2, X>(out, nat, lanes),
                _ => planes::<4, X>(out, nat, lanes),
            }
        }
    }
}

/// Element `P·l + k` of `natural` (one chunk) to `k·lanes + l` of `out`.
fn planes<const P: usize, X: Copy>(out: &mut [X], natural: &[X], lanes: usize) {
    for (k, plane) in out.chunks_exact_mut(lanes).enumerate() {
        for (o, n) in plane.iter_mut().zip(natural.chunks_exact(P)) {
            *o = n[k];
        }
    }
}

/// `y[m, rows] = x[m, cols] · Wᵀ` with integer activations on `kernel` (which the processor must
/// run and [`IntKernel::supports`] must accept `w`).
pub fn gemv(kernel: IntKernel, w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    gemv_group(kernel, &[w], x, m, &mut [y]);
}

/// [`gemv`] of several matrices of one input width and format against the same activations
/// (a layer's q/k/v, or gate and up): the activations are quantized once and all the matrices'
/// rows go to the pool as one job, which wakes the workers once.
pub fn gemv_group(
    kernel: IntKernel,
    ws: &[&QuantizedView],
    x: &[f32],
    m: usize,
    ys: &mut [&mut [f32]],
) {
    let first = ws[0];
    assert!(
        ws.len() == ys.len(),
        "{} matrices, {} outputs",
        ws.len(),
        ys.len()
    );
    for (w, y) in ws.iter().zip(ys.iter()) {
        assert!(
            IntKernel::available().contains(&kernel)
                && kernel.supports(w)
                && (w.cols, w.bits, w.group_size) == (first.cols, first.bits, first.group_size),
            "{kernel:?} integer GEMV on {}-bit [{}, {}]",
            w.bits,
            w.rows,
            w.cols
        );
        assert!(x.len() >= m * w.cols && y.len() >= m * w.rows);
    }
    match kernel.activations.bits() {
        8 => gemv_with::<i8>(kernel, ws, x, m, ys),
        _ => gemv_with::<i16>(kernel, ws, x, m, ys),
    }
}

fn gemv_with<X: ActInt>(
    kernel: IntKernel,
    ws: &[&QuantizedView],
    x: &[f32],
    m: usize,
    ys: &mut [&mut [f32]],
) {
    let w0 = ws[0];
    let (cols, g) = (w0.cols, w0.group_size);
    let groups = cols / g;
    let ints = cols * kernel.activations.pieces();
    let xq_floats = (ints * size_of::<X>()).div_ceil(4);
    with_scratch((m + 1) * xq_floats + 3 * m * groups, |s| {
        let (xq, s) = s.split_at_mut(m * xq_floats);
        let xq: &mut [X] = &mut bytemuck::cast_slice_mut(xq)[..m * ints];
        let (natural, s) = s.split_at_mut(xq_floats);
        let natural: &mut [X] = &mut bytemuck::cast_slice_mut(natural)[..ints];
        let (dx, s) = s.split_at_mut(m * groups);
        let (sums, corr) = s.split_at_mut(m * groups);
        for i in 0..m {
            let gs = i * groups..(i + 1) * groups;
            let act = ActMut {
                xq: &mut xq[i * ints..(i + 1) * ints],
                dx: &mut dx[gs.clone()],
                sums: &mut sums[gs.clone()],
                corr: &mut corr[gs],
            };
            quantize_row(
                kernel,
                w0.bits,
                g,
                &x[i * cols..(i + 1) * cols],
                natural,
                act,
            );
        }
        let (xq, dx, sums, corr) = (&*xq, &*dx, &*sums, &*corr);
        // Task `t` is task `t - starts[j]` of matrix `j`.
        let mut starts = Vec::with_capacity(ws.len() + 1);
        starts.push(0);
        for w in ws {
            starts.push(starts.last().unwrap() + w.rows.div_ceil(TASK_ROWS));
        }
        let outs: Vec<SharedMut<f32>> = ys.iter_mut().map(|y| SharedMut::new(y)).collect();
        let bytes = ws.iter().map(|w| weight_bytes(w)).sum();
        pool::parallel_for_bytes(*starts.last().unwrap(), bytes, &|t| {
            let j = starts.partition_point(|&s| s <= t) - 1;
            let (w, y, t) = (ws[j], &outs[j], t - starts[j]);
            let end = (t * TASK_ROWS + TASK_ROWS).min(w.rows);
            for r0 in (t * TASK_ROWS..end).step_by(ROW_BLOCK) {
                let r1 = (r0 + ROW_BLOCK).min(end);
                for i in 0..m {
                    let gs = i * groups..(i + 1) * groups;
                    let act = Act {
                        xq: &xq[i * ints..(i + 1) * ints],
                        dx: &dx[gs.clone()],
                        sums: &sums[gs.clone()],
                        corr: &corr[gs],
                    };
                    // SAFETY: tasks own disjoint row ranges of each output row.
                    let out = unsafe { y.range(i * w.rows + r0, r1 - r0) };
                    rows(kernel, w, &act, r0, r1, out);
                }
            }
        });
    })
}

/// Rows `r0..r1` of `w` against one activation row.
#[cfg(target_arch = "x86_64")]
fn rows<X: ActInt>(
    kernel: IntKernel,
    w: &QuantizedView,
    a: &Act<X>,
    r0: usize,
    r1: usize,
    y: &mut [f32],
) {
    fn run<T: super::avx2::Elem, X: ActInt>(
        kernel: IntKernel,
        w: &QuantizedView,
        (scales, biases): (&[T], &[T]),
        a: &Act<X>,
        (r0, r1): (usize, usize),
        y: &mut [f32],
    ) {
        let rows = IntRows {
            cols: w.cols,
            group_size: w.group_size,
            packed: bytemuck::cast_slice(w.packed),
            scales,
            biases,
            xq: bytemuck::cast_slice(a.xq),
            dx: a.dx,
            sums: a.sums,
            corr: a.corr,
        };
        use super::x86_int::*;
        /// `$kernel::<T, bits, group size, pieces>` for the runtime bits and group size.
        macro_rules! by_shape {
            ($kernel:ident, $pieces:literal) => {
                match (w.bits, w.group_size) {
                    (4, 32) => $kernel::<T, 4, 32, $pieces>(&rows, r0, r1, y),
                    (4, 64) => $kernel::<T, 4, 64, $pieces>(&rows, r0, r1, y),
                    (4, _) => $kernel::<T, 4, 128, $pieces>(&rows, r0, r1, y),
                    (_, 32) => $kernel::<T, 8, 32, $pieces>(&rows, r0, r1, y),
                    (_, 64) => $kernel::<T, 8, 64, $pieces>(&rows, r0, r1, y),
                    _ => $kernel::<T, 8, 128, $pieces>(&rows, r0, r1, y),
                }
            };
        }
        /// The instruction set's int8 or int16 kernel with as many pieces as the activations.
        macro_rules! by_activations {
            ($i8:ident, $i16:ident) => {
                match kernel.activations {
                    Activations::I8 => by_shape!($i8, 1),
                    Activations::I8Triple => by_shape!($i8, 3),
                    Activations::I16 => by_shape!($i16, 1),
                    Activations::I16Pair => by_shape!($i16, 2),
                }
            };
        }
        // SAFETY: `gemv` checked that the processor runs `kernel` and that it takes `w`; the
        // kernels check bounds.
        unsafe {
            match kernel.isa {
                IntIsa::Avx2 => by_activations!(avx2_i8, avx2_i16),
                IntIsa::AvxVnni => by_activations!(vnni_i8, vnni_i16),
                IntIsa::Avx512Vnni => by_activations!(avx512_i8, avx512_i16),
            }
        }
    }
    let rows = (r0, r1);
    match (w.scales, w.biases) {
        (FloatSlice::F32(s), FloatSlice::F32(b)) => run(kernel, w, (s, b), a, rows, y),
        (FloatSlice::F16(s), FloatSlice::F16(b)) => run(kernel, w, (s, b), a, rows, y),
        (FloatSlice::BF16(s), FloatSlice::BF16(b)) => run(kernel, w, (s, b), a, rows, y),
        _ => unreachable!("scales and biases share a dtype"),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn rows<X: ActInt>(_: IntKernel, _: &QuantizedView, _: &Act<X>, _: usize, _: usize, _: &mut [f32]) {
    unreachable!("no integer kernels off x86-64")
}
