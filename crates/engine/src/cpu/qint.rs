//! The decode GEMV on 4- and 8-bit MLX weights with int8 activations: each activation row is
//! quantized once per call, per weight group (`x ≈ dx·xq`, `|xq| ≤ 127`), and the packed
//! integers meet it in 8-bit multiplies, four products summed per 32-bit lane. A group then
//! contributes `s·dx·Σq·xq + b·Σx`, with `Σx` exact in f32.
//!
//! This takes about half the instructions of the f32 path (which converts every weight to
//! float), so it is faster wherever the GEMV is compute-bound (weights in cache). The price is
//! activation rounding, up to `dx/2` per element: on the tiny parity models it moves logits by
//! ~0.1, 50× the tolerance the f32 path meets, so it is off unless [`set_enabled`] turns it on.

use std::sync::atomic::{AtomicBool, Ordering};

use super::pool::{self, SharedMut};
use super::{with_scratch, Isa};
#[cfg(target_arch = "x86_64")]
use crate::float::FloatSlice;
use crate::quant::QuantizedView;

/// Packed bytes per kernel step: 64 weights at 4 bits, 32 at 8.
pub(super) const CHUNK_BYTES: usize = 32;

/// Weight rows handed to one kernel call per activation row: their bytes stay in L1/L2 while
/// every activation row passes over them.
const ROW_BLOCK: usize = 16;

/// Weight rows per pool task.
const TASK_ROWS: usize = 64;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Routes [`super::qmatmul::matmul`]'s GEMV through the integer kernels (where the processor and
/// the weights allow) for all later calls in the process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether [`set_enabled`] turned the integer GEMV on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The integer kernels a processor may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntKernel {
    /// `vpmaddubsw` + `vpmaddwd` (any AVX2 processor).
    Avx2,
    /// `vpdpbusd` (AVX-VNNI: Alder Lake, Sapphire Rapids, Zen 5 and later).
    Vnni,
}

impl IntKernel {
    /// The fastest integer kernels this processor runs, if any.
    pub fn best() -> Option<IntKernel> {
        IntKernel::available().pop()
    }

    /// Every integer kernel set this processor runs, slowest first.
    pub fn available() -> Vec<IntKernel> {
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.is_available() {
            out.push(IntKernel::Avx2);
            if is_x86_feature_detected!("avxvnni") {
                out.push(IntKernel::Vnni);
            }
        }
        out
    }
}

/// Whether the integer GEMV takes `w`: 4 or 8 bits, rows a whole number of 32-byte chunks.
pub fn supports(w: &QuantizedView) -> bool {
    matches!(w.bits, 4 | 8) && (w.cols * w.bits as usize).is_multiple_of(CHUNK_BYTES * 8)
}

/// A weight matrix and one quantized activation row, as the kernels take them.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) struct IntRows<'a, T> {
    pub cols: usize,
    pub group_size: usize,
    pub packed: &'a [u8],
    pub scales: &'a [T],
    pub biases: &'a [T],
    /// `cols` int8 activations; at 4 bits each 64 are reordered evens first, then odds, to meet
    /// the low and high nibbles of 32 packed bytes.
    pub xq: &'a [i8],
    /// Per group: the activation scale, the exact sum of x, and the integer sum the 8-bit AVX2
    /// kernel leaves out (`128·Σxq`, zero otherwise).
    pub dx: &'a [f32],
    pub sums: &'a [f32],
    pub corr: &'a [f32],
}

/// Quantizes one activation row per group of `g` into `xq`, `dx`, `sums` and `corr`.
#[allow(clippy::too_many_arguments)]
fn quantize_row(
    x: &[f32],
    g: usize,
    bits: u32,
    centred: bool,
    xq: &mut [i8],
    dx: &mut [f32],
    sums: &mut [f32],
    corr: &mut [f32],
) {
    for (gi, group) in x.chunks_exact(g).enumerate() {
        let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut isum = 0i32;
        for (i, &v) in group.iter().enumerate() {
            // Adding and removing 1.5·2^23 rounds to nearest even without a libm call.
            const MAGIC: f32 = 12_582_912.0;
            let q = ((v * inv + MAGIC) - MAGIC) as i8;
            isum += q as i32;
            // At 4 bits each 64 elements go evens first, then odds (a chunk may span two
            // groups of 32).
            let e = gi * g + i;
            let at = if bits == 4 {
                e / 64 * 64 + e % 64 / 2 + 32 * (e % 2)
            } else {
                e
            };
            xq[at] = q;
        }
        dx[gi] = d;
        sums[gi] = group.iter().sum();
        corr[gi] = if centred { 128.0 * isum as f32 } else { 0.0 };
    }
}

/// `y[m, rows] = x[m, cols] · Wᵀ` with int8 activations on `kernel` (which the processor must
/// run; see [`IntKernel::available`]), for weights [`supports`] accepts.
pub fn gemv(kernel: IntKernel, w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(
        IntKernel::available().contains(&kernel) && supports(w),
        "{kernel:?} integer GEMV on {}-bit [{}, {}]",
        w.bits,
        w.rows,
        w.cols
    );
    assert!(x.len() >= m * w.cols && y.len() >= m * w.rows);
    let (cols, g) = (w.cols, w.group_size);
    let groups = cols / g;
    // The AVX2 kernel centres 8-bit weights; VNNI multiplies them unsigned.
    let centred = w.bits == 8 && kernel == IntKernel::Avx2;
    let xq_floats = cols.div_ceil(4);
    with_scratch(m * (xq_floats + 4 * groups), |s| {
        let (xq, s) = s.split_at_mut(m * xq_floats);
        let xq: &mut [i8] = &mut bytemuck::cast_slice_mut(xq)[..m * cols];
        let (dx, s) = s.split_at_mut(m * groups);
        let (sums, s) = s.split_at_mut(m * groups);
        let (corr, _) = s.split_at_mut(m * groups);
        for i in 0..m {
            let gs = i * groups..(i + 1) * groups;
            quantize_row(
                &x[i * cols..(i + 1) * cols],
                g,
                w.bits,
                centred,
                &mut xq[i * cols..(i + 1) * cols],
                &mut dx[gs.clone()],
                &mut sums[gs.clone()],
                &mut corr[gs],
            );
        }
        let (xq, dx, sums, corr) = (&*xq, &*dx, &*sums, &*corr);
        let y = SharedMut::new(y);
        pool::parallel_for(w.rows.div_ceil(TASK_ROWS), &|t| {
            let end = (t * TASK_ROWS + TASK_ROWS).min(w.rows);
            for r0 in (t * TASK_ROWS..end).step_by(ROW_BLOCK) {
                let r1 = (r0 + ROW_BLOCK).min(end);
                for i in 0..m {
                    let gs = i * groups..(i + 1) * groups;
                    let act = Act {
                        xq: &xq[i * cols..(i + 1) * cols],
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

/// One quantized activation row.
struct Act<'a> {
    xq: &'a [i8],
    dx: &'a [f32],
    sums: &'a [f32],
    corr: &'a [f32],
}

/// Rows `r0..r1` of `w` against one activation row.
#[cfg(target_arch = "x86_64")]
fn rows(kernel: IntKernel, w: &QuantizedView, a: &Act, r0: usize, r1: usize, y: &mut [f32]) {
    #[allow(clippy::too_many_arguments)]
    fn run<T: super::avx2::Elem>(
        kernel: IntKernel,
        w: &QuantizedView,
        scales: &[T],
        biases: &[T],
        a: &Act,
        r0: usize,
        r1: usize,
        y: &mut [f32],
    ) {
        let rows = IntRows {
            cols: w.cols,
            group_size: w.group_size,
            packed: bytemuck::cast_slice(w.packed),
            scales,
            biases,
            xq: a.xq,
            dx: a.dx,
            sums: a.sums,
            corr: a.corr,
        };
        use super::avx2_int::{rows_avx2, rows_vnni};
        // SAFETY: `gemv` checked that the processor runs `kernel`; the kernels check bounds.
        unsafe {
            match (kernel, w.bits) {
                (IntKernel::Avx2, 4) => rows_avx2::<T, 4>(&rows, r0, r1, y),
                (IntKernel::Avx2, _) => rows_avx2::<T, 8>(&rows, r0, r1, y),
                (IntKernel::Vnni, 4) => rows_vnni::<T, 4>(&rows, r0, r1, y),
                (IntKernel::Vnni, _) => rows_vnni::<T, 8>(&rows, r0, r1, y),
            }
        }
    }
    match (w.scales, w.biases) {
        (FloatSlice::F32(s), FloatSlice::F32(b)) => run(kernel, w, s, b, a, r0, r1, y),
        (FloatSlice::F16(s), FloatSlice::F16(b)) => run(kernel, w, s, b, a, r0, r1, y),
        (FloatSlice::BF16(s), FloatSlice::BF16(b)) => run(kernel, w, s, b, a, r0, r1, y),
        _ => unreachable!("scales and biases share a dtype"),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn rows(_: IntKernel, _: &QuantizedView, _: &Act, _: usize, _: usize, _: &mut [f32]) {
    unreachable!("no integer kernels off x86-64")
}
