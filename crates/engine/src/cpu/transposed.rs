//! `dx = dy · W`: the product with the weight matrix itself rather than its transpose, which
//! carries gradients back through a linear layer `y = x · Wᵀ`.
//!
//! It runs on the shared blocked GEMM (`super::gemm`) with `Wᵀ` as the weight operand: each panel
//! is a block of W's columns, dequantized (or converted) and transposed into the tile as it is
//! needed, so the packed weights are read in place and no dense copy of W is ever made.

use super::gemm::{self, Panels};
use super::Isa;
use crate::params::DenseView;
use crate::params::{FpQuantizedView, QuantizedView};

/// `dx[m, w.cols] = dy[m, w.rows] · W` on packed weights.
pub fn quantized(isa: Isa, w: &QuantizedView, dy: &[f32], m: usize, dx: &mut [f32]) {
    isa.check();
    gemm::gemm(isa, &QuantTransposed(w), dy, m, dx);
}

/// `dx[m, w.cols] = dy[m, w.rows] · W` on packed float-mode codes.
pub fn float_quantized(isa: Isa, w: &FpQuantizedView, dy: &[f32], m: usize, dx: &mut [f32]) {
    isa.check();
    gemm::gemm(isa, &FpTransposed(w), dy, m, dx);
}

/// `dx[m, w.cols] = dy[m, w.rows] · W` on float weights.
pub fn dense(isa: Isa, w: &DenseView, dy: &[f32], m: usize, dx: &mut [f32]) {
    isa.check();
    gemm::gemm(isa, &DenseTransposed(w), dy, m, dx);
}

/// `Wᵀ` of packed weights, as panels.
struct QuantTransposed<'v, 'a>(&'v QuantizedView<'a>);

// The transpose's rows are W's columns.
#[allow(clippy::misnamed_getters)]
impl Panels for QuantTransposed<'_, '_> {
    fn rows(&self) -> usize {
        self.0.cols
    }

    fn cols(&self) -> usize {
        self.0.rows
    }

    /// Columns `n0..n0 + nc` of W rows `k0..k0 + kc`, a group's scale and bias read once per
    /// row and the integers unpacked from a 64-bit window of the packed words.
    fn panel(&self, _: Isa, n0: usize, nc: usize, k0: usize, kc: usize, tile: &mut [f32]) {
        let w = self.0;
        let (bits, g) = (w.bits as usize, w.group_size);
        let mask = (1u64 << bits) - 1;
        let groups = w.cols / g;
        for i in 0..kc {
            let row = k0 + i;
            let mut col = n0;
            while col < n0 + nc {
                let end = (n0 + nc).min((col / g + 1) * g);
                let group = row * groups + col / g;
                let (s, b) = (w.scales.get(group), w.biases.get(group));
                for c in col..end {
                    let bit = (row * w.cols + c) * bits;
                    let lo = w.packed[bit / 32] as u64;
                    let hi = w.packed.get(bit / 32 + 1).map_or(0, |&v| v as u64);
                    let q = ((lo | hi << 32) >> (bit % 32)) & mask;
                    tile[(c - n0) * kc + i] = s * q as f32 + b;
                }
                col = end;
            }
        }
    }
}

/// `Wᵀ` of float-mode codes, as panels.
struct FpTransposed<'v, 'a>(&'v FpQuantizedView<'a>);

#[allow(clippy::misnamed_getters)]
impl Panels for FpTransposed<'_, '_> {
    fn rows(&self) -> usize {
        self.0.cols
    }

    fn cols(&self) -> usize {
        self.0.rows
    }

    /// Columns `n0..n0 + nc` of W rows `k0..k0 + kc`, each a code's value times its group's
    /// scale.
    fn panel(&self, _: Isa, n0: usize, nc: usize, k0: usize, kc: usize, tile: &mut [f32]) {
        let w = self.0;
        let (g, table) = (w.group_size, w.scale_table());
        let groups = w.cols / g;
        for i in 0..kc {
            let row = k0 + i;
            for c in n0..n0 + nc {
                let s = table[usize::from(w.scales[row * groups + c / g])];
                tile[(c - n0) * kc + i] = w.value(w.code(row, c)) * s;
            }
        }
    }
}

/// `Wᵀ` of float weights, as panels.
struct DenseTransposed<'a>(&'a DenseView<'a>);

#[allow(clippy::misnamed_getters)]
impl Panels for DenseTransposed<'_> {
    fn rows(&self) -> usize {
        self.0.cols
    }

    fn cols(&self) -> usize {
        self.0.rows
    }

    fn panel(&self, _: Isa, n0: usize, nc: usize, k0: usize, kc: usize, tile: &mut [f32]) {
        let (values, cols) = (self.0.values, self.0.cols);
        for i in 0..kc {
            let start = (k0 + i) * cols + n0;
            for j in 0..nc {
                tile[j * kc + i] = values.get(start + j);
            }
        }
    }
}
