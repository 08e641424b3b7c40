//! The MLX affine quantization format, bit for bit.
//!
//! A `[rows, cols]` weight is stored as three arrays:
//! - `weight`: uint32 `[rows, cols * bits / 32]`; each row is a little-endian bit stream in which
//!   element `j` occupies bits `j*bits .. (j+1)*bits` (low bits first; for 2, 4 and 8 bits no
//!   element crosses a word),
//! - `scales` and `biases`: `[rows, cols / group_size]` in f32, f16 or bf16,
//!
//! and element `(r, j)` is `scales[r, j / g] * q + biases[r, j / g]`.

use std::sync::Arc;

use crate::cuda::{self, Gpu, QuantizedWeights};
use crate::float::{checked_float_bytes, float_slice};
pub use crate::params::QuantizedView;
use crate::params::{affine_code, affine_group};
use crate::{cpu, Bytes, DType, Device, EngineError};

/// Bit widths MLX's affine mode defines.
pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes MLX's affine mode defines.
pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// An MLX affine-quantized `[rows, cols]` matrix (rows = output features).
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group_size: usize,
    packed: Bytes,
    scales_dtype: DType,
    scales: Bytes,
    biases: Bytes,
    /// The same matrix in a GPU's memory, once [`place`](Self::place)d there.
    gpu: Option<Arc<QuantizedWeights>>,
}

impl QuantizedMatrix {
    /// Checks every size against `rows`, `cols`, `bits` and `group_size`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
        packed: Bytes,
        scales_dtype: DType,
        scales: Bytes,
        biases: Bytes,
    ) -> Result<Self, EngineError> {
        if !SUPPORTED_BITS.contains(&bits) {
            return Err(EngineError::UnsupportedQuantization(format!(
                "{bits} bits (supported: {SUPPORTED_BITS:?})"
            )));
        }
        if !SUPPORTED_GROUP_SIZES.contains(&group_size) {
            return Err(EngineError::UnsupportedQuantization(format!(
                "group size {group_size} (supported: {SUPPORTED_GROUP_SIZES:?})"
            )));
        }
        if !cols.is_multiple_of(group_size) {
            return Err(EngineError::Shape(format!(
                "{cols} input features do not divide into groups of {group_size}"
            )));
        }
        let expected = rows * cols * bits as usize / 8;
        if packed.len() != expected {
            return Err(EngineError::SizeMismatch {
                what: format!("packed {bits}-bit weight [{rows}, {cols}]"),
                expected,
                found: packed.len(),
            });
        }
        let groups = rows * cols / group_size;
        let scales = checked_float_bytes("quantization scales", scales_dtype, groups, scales)?;
        let biases = checked_float_bytes("quantization biases", scales_dtype, groups, biases)?;
        Ok(QuantizedMatrix {
            rows,
            cols,
            bits,
            group_size,
            packed: packed.aligned(4),
            scales_dtype,
            scales,
            biases,
            gpu: None,
        })
    }

    /// Copies the matrix to `device`'s memory, in its packed form, so that matmuls with
    /// activations there read it (a no-op for the CPU, which reads it in place).
    pub fn place(&mut self, device: &Device) -> Result<(), EngineError> {
        let Device::Cuda(gpu) = device else {
            return Ok(());
        };
        self.gpu = Some(Arc::new(QuantizedWeights {
            packed: gpu.upload_raw(self.packed.view::<u32>())?,
            scales: gpu.upload_raw(self.scales.as_slice())?,
            biases: gpu.upload_raw(self.biases.as_slice())?,
            scale_type: cuda::type_suffix(self.scales_dtype)?,
            gpu: gpu.clone(),
        }));
        Ok(())
    }

    /// The copy on `gpu` that [`place`](Self::place) made.
    pub(crate) fn on_gpu(&self, gpu: &Gpu) -> Result<&QuantizedWeights, EngineError> {
        match &self.gpu {
            Some(w) if w.gpu.same(gpu) => Ok(w),
            _ => Err(cuda::not_placed(self.rows, self.cols, gpu)),
        }
    }

    pub(crate) fn shape(&self) -> cuda::matmul::QuantShape {
        cuda::matmul::QuantShape {
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            group_size: self.group_size,
        }
    }

    pub fn view(&self) -> QuantizedView<'_> {
        QuantizedView {
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            group_size: self.group_size,
            packed: self.packed.view(),
            scales: float_slice(self.scales_dtype, &self.scales),
            biases: float_slice(self.scales_dtype, &self.biases),
        }
    }

    /// Bytes of weights, scales and biases: what one pass over the matrix reads.
    pub fn size_in_bytes(&self) -> usize {
        self.packed.len() + self.scales.len() + self.biases.len()
    }

    /// `y[m, rows] = x[m, cols] · Wᵀ`.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        cpu::matmul::matmul(&self.view(), x, m, y);
    }

    /// Row `row` dequantized to f32 (an embedding lookup).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        self.view().dequantize_row(row, out);
    }
}

/// Quantizes a row-major f32 matrix the way `mx.quantize` does (affine mode), returning the
/// packed words, scales and biases. Used to build test matrices and, later, `convert`/`fuse`.
///
/// Scales and biases come back in f32, as MLX computes them; for f16/bf16 weights MLX then rounds
/// them to the weight dtype (the packed integers are computed from the unrounded f32 values).
pub fn quantize(
    values: &[f32],
    rows: usize,
    cols: usize,
    bits: u32,
    group_size: usize,
) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let levels = ((1u32 << bits) - 1) as f32;
    let groups_per_row = cols / group_size;
    let mut packed = vec![0u32; rows * cols * bits as usize / 32];
    let mut scales = Vec::with_capacity(rows * groups_per_row);
    let mut biases = Vec::with_capacity(rows * groups_per_row);
    let row_words = cols * bits as usize / 32;
    for r in 0..rows {
        for g in 0..groups_per_row {
            let group = &values[r * cols + g * group_size..r * cols + (g + 1) * group_size];
            let (scale, bias) = affine_group(group, levels);
            scales.push(scale);
            biases.push(bias);
            for (i, &v) in group.iter().enumerate() {
                let q = affine_code(v, scale, bias, levels) as u64;
                let col = g * group_size + i;
                let bit = col * bits as usize;
                let word = r * row_words + bit / 32;
                let shift = bit % 32;
                packed[word] |= (q << shift) as u32;
                if shift + bits as usize > 32 {
                    packed[word + 1] |= (q >> (32 - shift)) as u32;
                }
            }
        }
    }
    (packed, scales, biases)
}
