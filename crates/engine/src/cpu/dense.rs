//! `y = x · Wᵀ` on float (f32, f16, bf16) weights, and the f32 dot product.
//!
//! Few activation rows (GEMV) stream each weight row once, converting in registers, with four
//! rows sharing each activation load. Many rows (GEMM) go through the shared blocked kernel
//! (`super::gemm`), which converts panels of weights into an f32 tile.

use super::gemm::{self, Panels};
use super::{with_scratch, Isa};
use crate::params::DenseView;
use crate::params::FloatSlice;

/// Up to this many activation rows the GEMV path beats the blocked GEMM.
pub const GEMV_MAX_M: usize = 4;

/// `y[m, rows] = x[m, cols] · Wᵀ` for float weights, with the best kernels for this processor.
pub fn matmul(w: &DenseView, x: &[f32], m: usize, y: &mut [f32]) {
    let isa = Isa::best();
    if m <= GEMV_MAX_M {
        gemv(isa, w, x, m, y);
    } else {
        gemm(isa, w, x, m, y);
    }
}

/// [`matmul`] by the GEMV method on the given kernels (panics if the processor lacks them).
pub fn gemv(isa: Isa, w: &DenseView, x: &[f32], m: usize, y: &mut [f32]) {
    check(isa, w, x, m, y);
    match isa {
        Isa::Portable => gemv_portable(w, x, m, y),
        // SAFETY: `check` found AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
            match w.values {
                FloatSlice::F32(v) => gemv_avx2(v, w.rows, w.cols, x, m, y),
                FloatSlice::F16(v) => gemv_avx2(v, w.rows, w.cols, x, m, y),
                FloatSlice::BF16(v) => gemv_avx2(v, w.rows, w.cols, x, m, y),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
    }
}

/// [`matmul`] by the GEMM method on the given kernels (panics if the processor lacks them).
pub fn gemm(isa: Isa, w: &DenseView, x: &[f32], m: usize, y: &mut [f32]) {
    check(isa, w, x, m, y);
    gemm::gemm(isa, w, x, m, y);
}

/// Dot product of `a` with the first `a.len()` values of `b`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(Isa::best(), a, b)
}

/// [`dot`] on the given kernels (panics if the processor lacks them).
pub fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        Isa::Portable => dot_portable(a, b),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => {
            isa.check();
            // SAFETY: just checked.
            unsafe { super::avx2::dot(a, b) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => {
            isa.check();
            unreachable!()
        }
    }
}

/// Dot product with eight accumulators so that the compiler vectorises it for any target.
pub(super) fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let b = &b[..a.len()];
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn check(isa: Isa, w: &DenseView, x: &[f32], m: usize, y: &[f32]) {
    isa.check();
    assert!(
        x.len() >= m * w.cols && y.len() >= m * w.rows,
        "matmul of [{m}, {}] by [{}, {}]ᵀ: operands too short",
        w.cols,
        w.rows,
        w.cols
    );
}

/// Converts one weight row at a time and takes its dot product with every activation row.
fn gemv_portable(w: &DenseView, x: &[f32], m: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    with_scratch(cols, |row| {
        for r in 0..rows {
            w.row_to_f32(r, row);
            for i in 0..m {
                y[i * rows + r] = dot_portable(&x[i * cols..(i + 1) * cols], row);
            }
        }
    })
}

/// # Safety
/// The processor must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
unsafe fn gemv_avx2<T: super::avx2::Elem>(
    w: &[T],
    rows: usize,
    cols: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) {
    use super::avx2::dense_rows;
    const ROWS: usize = 4;
    for r0 in (0..rows).step_by(ROWS) {
        let rr = ROWS.min(rows - r0);
        let w = &w[r0 * cols..(r0 + rr) * cols];
        // The block's rows stay in cache while every activation row passes over them.
        for i in 0..m {
            let xi = &x[i * cols..(i + 1) * cols];
            let out = &mut y[i * rows + r0..][..rr];
            match rr {
                4 => out.copy_from_slice(&dense_rows::<T, 4>(w, cols, xi)),
                3 => out.copy_from_slice(&dense_rows::<T, 3>(w, cols, xi)),
                2 => out.copy_from_slice(&dense_rows::<T, 2>(w, cols, xi)),
                _ => out.copy_from_slice(&dense_rows::<T, 1>(w, cols, xi)),
            }
        }
    }
}

impl Panels for DenseView<'_> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn panel(&self, isa: Isa, n0: usize, nc: usize, k0: usize, kc: usize, tile: &mut [f32]) {
        let values = self.values;
        for (j, out) in tile.chunks_exact_mut(kc).take(nc).enumerate() {
            let start = (n0 + j) * self.cols + k0;
            match isa {
                Isa::Portable => values.to_f32(start, out),
                // SAFETY: the caller checked the processor.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
                    super::avx2::convert_slice(values, start, out)
                },
                #[cfg(not(target_arch = "x86_64"))]
                Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
            }
        }
    }
}
