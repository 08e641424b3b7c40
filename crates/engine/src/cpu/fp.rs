//! `y = x · Wᵀ` on MLX's float-quantized weights (mxfp4, nvfp4, mxfp8), without materialising W.
//!
//! - GEMV (a few activation rows, as in decoding): each weight row is read once, straight from
//!   its packed codes; a group's codes are decoded once (on AVX2: E2M1 by a permute of the eight
//!   magnitudes, E4M3 by placing its bits under f32's; portably by the tables of
//!   [`crate::params`]) and meet every activation row, and each group's sum is scaled once, as
//!   MLX sums them: `Σ_groups s · Σ v·x`. Blocks of weight rows go to the pool.
//! - GEMM (many rows, as in prefill): weight panels are dequantized into the shared blocked
//!   kernel's tile (`super::gemm`), as for the affine weights.

use super::gemm::{self, Panels};
use super::pool::{self, SharedMut};
use super::Isa;
use crate::params::{FpQuantizedView, E2M1, E4M3};

/// Up to this many activation rows the GEMV runs; more take the GEMM. Its decoding is paid
/// once per group for all rows, as the affine GEMV's unpacking is, so the affine crossover
/// ([`super::matmul::GEMV_MAX_M`]) is kept.
pub const GEMV_MAX_M: usize = super::matmul::GEMV_MAX_M;

/// Weight rows per pool task: enough to amortise waking a worker, few enough to balance.
const TASK_ROWS: usize = 64;

/// `y[m, rows] = x[m, cols] · Wᵀ` on the packed codes, with the best kernels for this processor.
pub fn matmul(w: &FpQuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    let isa = Isa::best();
    if m <= GEMV_MAX_M {
        gemv(isa, w, x, m, y);
    } else {
        gemm(isa, w, x, m, y);
    }
}

/// [`matmul`] by the GEMV method on the given kernels (panics if the processor lacks them or
/// `m` exceeds 8).
pub fn gemv(isa: Isa, w: &FpQuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    check(isa, w, x, m, y);
    assert!(
        m <= 8,
        "the float-mode GEMV takes up to 8 activation rows, not {m}"
    );
    let rows = w.rows;
    let y = SharedMut::new(y);
    pool::parallel_for_bytes(rows.div_ceil(TASK_ROWS), weight_bytes(w), &|t| {
        let r0 = t * TASK_ROWS;
        let r1 = (r0 + TASK_ROWS).min(rows);
        let mut sums = [[0.0f32; 8]; TASK_ROWS];
        for (r, s) in (r0..r1).zip(sums.iter_mut()) {
            row_dots(isa, w, r, x, &mut s[..m]);
        }
        for i in 0..m {
            // SAFETY: tasks own disjoint row ranges of each output row.
            let out = unsafe { y.range(i * rows + r0, r1 - r0) };
            for (o, s) in out.iter_mut().zip(&sums) {
                *o = s[i];
            }
        }
    });
}

/// [`matmul`] by the GEMM method on the given kernels (panics if the processor lacks them).
pub fn gemm(isa: Isa, w: &FpQuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    check(isa, w, x, m, y);
    gemm::gemm(isa, &FpPanels(w), x, m, y);
}

/// Row `row` dequantized into `out[..cols]`, bit for bit as [`FpQuantizedView::dequantize_row`].
pub fn dequantize_row(isa: Isa, w: &FpQuantizedView, row: usize, out: &mut [f32]) {
    isa.check();
    dequantize_columns(isa, w, row, 0, &mut out[..w.cols]);
}

fn check(isa: Isa, w: &FpQuantizedView, x: &[f32], m: usize, y: &[f32]) {
    isa.check();
    assert!(
        x.len() >= m * w.cols && y.len() >= m * w.rows,
        "quantized matmul of [{m}, {}] by [{}, {}]ᵀ: operands too short",
        w.cols,
        w.rows,
        w.cols
    );
}

/// Bytes one pass over `w` reads: packed codes and scale codes.
fn weight_bytes(w: &FpQuantizedView) -> usize {
    4 * w.packed.len() + w.scales.len()
}

/// Row `row`'s packed words and scale codes.
fn row_parts<'a>(w: &FpQuantizedView<'a>, row: usize) -> (&'a [u32], &'a [u8]) {
    let (row_words, groups) = (w.cols * w.bits as usize / 32, w.cols / w.group_size);
    (
        &w.packed[row * row_words..(row + 1) * row_words],
        &w.scales[row * groups..(row + 1) * groups],
    )
}

/// `out[i] = Σ_k x[i, k] · W[row, k]` for the `out.len()` activation rows of `x`.
fn row_dots(isa: Isa, w: &FpQuantizedView, row: usize, x: &[f32], out: &mut [f32]) {
    let (words, scales) = row_parts(w, row);
    let (g, cols, table) = (w.group_size, w.cols, w.scale_table());
    match isa {
        Isa::Portable => {
            out.fill(0.0);
            let mut values = [0.0f32; 32];
            for (gi, &code) in scales.iter().enumerate() {
                let values = &mut values[..g];
                decode_group(w.bits, words, gi, values);
                let s = table[usize::from(code)];
                for (i, o) in out.iter_mut().enumerate() {
                    let xg = &x[i * cols + gi * g..][..g];
                    let dot: f32 = values.iter().zip(xg).map(|(v, x)| v * x).sum();
                    *o += s * dot;
                }
            }
        }
        // SAFETY: the callers checked the processor.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
            use super::avx2::fp_row_dots;
            match (w.bits, g) {
                (4, 16) => fp_row_dots::<4, 2>(words, (scales, table), x, cols, out),
                (4, _) => fp_row_dots::<4, 4>(words, (scales, table), x, cols, out),
                _ => fp_row_dots::<8, 4>(words, (scales, table), x, cols, out),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
    }
}

/// The values (unscaled) of group `gi` of a row's codes `words`, by the tables.
fn decode_group(bits: u32, words: &[u32], gi: usize, out: &mut [f32]) {
    let g = out.len();
    if bits == 4 {
        for (word, dst) in words[gi * g / 8..].iter().zip(out.chunks_exact_mut(8)) {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = E2M1[((word >> (4 * j)) & 0xF) as usize];
            }
        }
    } else {
        for (word, dst) in words[gi * g / 4..].iter().zip(out.chunks_exact_mut(4)) {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = E4M3[((word >> (8 * j)) & 0xFF) as usize];
            }
        }
    }
}

/// Columns `k0..k0 + out.len()` (whole groups) of row `row`, dequantized.
fn dequantize_columns(isa: Isa, w: &FpQuantizedView, row: usize, k0: usize, out: &mut [f32]) {
    let g = w.group_size;
    assert!(k0.is_multiple_of(g) && out.len().is_multiple_of(g));
    let (words, scales) = row_parts(w, row);
    let (words, scales) = (
        &words[k0 * w.bits as usize / 32..(k0 + out.len()) * w.bits as usize / 32],
        &scales[k0 / g..(k0 + out.len()) / g],
    );
    let table = w.scale_table();
    match isa {
        Isa::Portable => {
            for (gi, (group, &code)) in out.chunks_exact_mut(g).zip(scales).enumerate() {
                decode_group(w.bits, words, gi, group);
                let s = table[usize::from(code)];
                for v in group {
                    *v *= s;
                }
            }
        }
        // SAFETY: the callers checked the processor.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
            use super::avx2::fp_dequantize;
            match (w.bits, g) {
                (4, 16) => fp_dequantize::<4, 2>(words, (scales, table), out),
                (4, _) => fp_dequantize::<4, 4>(words, (scales, table), out),
                _ => fp_dequantize::<8, 4>(words, (scales, table), out),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
    }
}

/// The weight matrix as panels dequantized into the tile.
struct FpPanels<'v, 'a>(&'v FpQuantizedView<'a>);

impl Panels for FpPanels<'_, '_> {
    fn rows(&self) -> usize {
        self.0.rows
    }

    fn cols(&self) -> usize {
        self.0.cols
    }

    fn panel(&self, isa: Isa, n0: usize, nc: usize, k0: usize, kc: usize, tile: &mut [f32]) {
        for (j, out) in tile.chunks_exact_mut(kc).take(nc).enumerate() {
            dequantize_columns(isa, self.0, n0 + j, k0, out);
        }
    }
}
