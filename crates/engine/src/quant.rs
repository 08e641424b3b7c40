//! MLX's quantization formats, bit for bit: the affine mode and the float modes (`mxfp4`,
//! `nvfp4`, `mxfp8`) of `mx.quantize`.
//!
//! Affine: a `[rows, cols]` weight is stored as three arrays:
//! - `weight`: uint32 `[rows, cols * bits / 32]`; each row is a little-endian bit stream in which
//!   element `j` occupies bits `j*bits .. (j+1)*bits` (low bits first; for 2, 4 and 8 bits no
//!   element crosses a word),
//! - `scales` and `biases`: `[rows, cols / group_size]` in f32, f16 or bf16,
//!
//! and element `(r, j)` is `scales[r, j / g] * q + biases[r, j / g]`.
//!
//! Float modes: `weight` is packed the same way but holds float codes, E2M1 (4 bits: mxfp4,
//! nvfp4) or E4M3 (8 bits: mxfp8); `scales` is uint8 `[rows, cols / group_size]`, a
//! power-of-two E8M0 scale per group of 32 (mxfp4, mxfp8) or an E4M3 one per group of 16
//! (nvfp4); there are no biases, and element `(r, j)` is `scale[r, j / g] * value(code)` (see
//! [`FpQuantizedView`]).

use std::sync::Arc;

use half::{bf16, f16};

use crate::cuda::{self, Gpu, QuantizedWeights};
use crate::float::{checked_float_bytes, float_slice};
use crate::params::{affine_code, affine_group, E2M1, E4M3};
pub use crate::params::{FpQuantizedView, QuantMode, QuantizedView};
use crate::{cpu, Bytes, DType, Device, EngineError};

/// Bit widths MLX's affine mode defines.
pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes MLX's affine mode defines.
pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// An MLX-quantized `[rows, cols]` matrix (rows = output features), in any [`QuantMode`].
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub mode: QuantMode,
    pub bits: u32,
    pub group_size: usize,
    packed: Bytes,
    /// The scales' float type; `U8` (codes) in the float modes.
    scales_dtype: DType,
    scales: Bytes,
    /// Empty in the float modes.
    biases: Bytes,
    /// The same matrix in a GPU's memory, once [`place`](Self::place)d there.
    gpu: Option<Arc<QuantizedWeights>>,
}

/// A [`QuantizedMatrix`]'s parts, borrowed, as the kernels of its mode read them.
#[derive(Clone, Copy)]
pub enum QuantizedParts<'a> {
    Affine(QuantizedView<'a>),
    Float(FpQuantizedView<'a>),
}

impl QuantizedParts<'_> {
    /// Row `row` dequantized to f32, as the mode defines it.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        match self {
            QuantizedParts::Affine(v) => v.dequantize_row(row, out),
            QuantizedParts::Float(v) => v.dequantize_row(row, out),
        }
    }

    /// The whole matrix dequantized to f32.
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            QuantizedParts::Affine(v) => v.dequantize(),
            QuantizedParts::Float(v) => v.dequantize(),
        }
    }
}

/// The error for `packed` not holding `rows × cols` elements of `bits`.
fn check_packed(rows: usize, cols: usize, bits: u32, packed: &Bytes) -> Result<(), EngineError> {
    let expected = rows * cols * bits as usize / 8;
    if packed.len() != expected {
        return Err(EngineError::SizeMismatch {
            what: format!("packed {bits}-bit weight [{rows}, {cols}]"),
            expected,
            found: packed.len(),
        });
    }
    Ok(())
}

fn check_groups(cols: usize, group_size: usize) -> Result<(), EngineError> {
    if !cols.is_multiple_of(group_size) {
        return Err(EngineError::Shape(format!(
            "{cols} input features do not divide into groups of {group_size}"
        )));
    }
    Ok(())
}

impl QuantizedMatrix {
    /// An affine matrix; checks every size against `rows`, `cols`, `bits` and `group_size`.
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
        check_groups(cols, group_size)?;
        check_packed(rows, cols, bits, &packed)?;
        let groups = rows * cols / group_size;
        let scales = checked_float_bytes("quantization scales", scales_dtype, groups, scales)?;
        let biases = checked_float_bytes("quantization biases", scales_dtype, groups, biases)?;
        Ok(QuantizedMatrix {
            rows,
            cols,
            mode: QuantMode::Affine,
            bits,
            group_size,
            packed: packed.aligned(4),
            scales_dtype,
            scales,
            biases,
            gpu: None,
        })
    }

    /// A matrix in the float mode `mode`, whose `scales` are one uint8 code per group and which
    /// has no biases; `bits` and `group_size` (as a checkpoint states them) must be the mode's.
    pub fn new_float(
        mode: QuantMode,
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
        packed: Bytes,
        scales: Bytes,
    ) -> Result<Self, EngineError> {
        let Some(format) = mode.float_format() else {
            return Err(EngineError::UnsupportedQuantization(
                "affine weights need biases (QuantizedMatrix::new)".into(),
            ));
        };
        if (bits, group_size) != format {
            return Err(EngineError::UnsupportedQuantization(format!(
                "{mode} with {bits} bits and group size {group_size} (it takes {} bits and group \
                 size {})",
                format.0, format.1
            )));
        }
        check_groups(cols, group_size)?;
        check_packed(rows, cols, bits, &packed)?;
        let groups = rows * cols / group_size;
        if scales.len() != groups {
            return Err(EngineError::SizeMismatch {
                what: format!("{mode} scales of [{rows}, {cols}]"),
                expected: groups,
                found: scales.len(),
            });
        }
        Ok(QuantizedMatrix {
            rows,
            cols,
            mode,
            bits,
            group_size,
            packed: packed.aligned(4),
            scales_dtype: DType::U8,
            scales,
            biases: Bytes::copy_from(&[]),
            gpu: None,
        })
    }

    /// Copies the matrix to `device`'s memory, in its packed form, so that matmuls with
    /// activations there read it (a no-op for the CPU, which reads it in place).
    pub fn place(&mut self, device: &Device) -> Result<(), EngineError> {
        let Device::Cuda(gpu) = device else {
            return Ok(());
        };
        let (scale_type, biases) = match self.mode {
            QuantMode::Affine => (
                cuda::type_suffix(self.scales_dtype)?,
                gpu.upload_raw(self.biases.as_slice())?,
            ),
            // No kernel reads the biases of a float mode; one zero byte keeps the field a buffer.
            _ => ("u8", gpu.alloc_raw(0)?),
        };
        self.gpu = Some(Arc::new(QuantizedWeights {
            packed: gpu.upload_raw(self.packed.view::<u32>())?,
            scales: gpu.upload_raw(self.scales.as_slice())?,
            biases,
            scale_type,
            gpu: gpu.clone(),
        }));
        Ok(())
    }

    /// The copy that [`place`](Self::place) made, on whichever GPU.
    pub(crate) fn placed(&self) -> Option<&Arc<QuantizedWeights>> {
        self.gpu.as_ref()
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
            mode: self.mode,
            bits: self.bits,
            group_size: self.group_size,
        }
    }

    /// The matrix as the kernels of its mode read it.
    pub fn parts(&self) -> QuantizedParts<'_> {
        match self.mode {
            QuantMode::Affine => QuantizedParts::Affine(self.affine_view()),
            mode => QuantizedParts::Float(FpQuantizedView {
                rows: self.rows,
                cols: self.cols,
                mode,
                bits: self.bits,
                group_size: self.group_size,
                packed: self.packed.view(),
                scales: self.scales.as_slice(),
            }),
        }
    }

    /// The affine matrix as the affine kernels read it.
    ///
    /// # Panics
    /// For a matrix in a float mode, whose parts [`parts`](Self::parts) gives.
    pub fn view(&self) -> QuantizedView<'_> {
        assert_eq!(
            self.mode,
            QuantMode::Affine,
            "a {} matrix has no affine view",
            self.mode
        );
        self.affine_view()
    }

    fn affine_view(&self) -> QuantizedView<'_> {
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
        match self.parts() {
            QuantizedParts::Affine(v) => cpu::matmul::matmul(&v, x, m, y),
            QuantizedParts::Float(v) => cpu::fp::matmul(&v, x, m, y),
        }
    }

    /// The whole matrix as `mx.dequantize` computes it with `dtype` output (`dtype` rounding,
    /// values returned as f32): affine rounded after the multiply and again after the add; a
    /// float mode's `value · scale` once.
    pub fn dequantize_as(&self, dtype: DType) -> Vec<f32> {
        let round = |v: f32| match dtype {
            DType::F16 => f16::from_f32(v).to_f32(),
            DType::BF16 => bf16::from_f32(v).to_f32(),
            _ => v,
        };
        let QuantizedParts::Affine(v) = self.parts() else {
            let mut out = self.parts().dequantize();
            for o in &mut out {
                *o = round(*o);
            }
            return out;
        };
        let (cols, g) = (v.cols, v.group_size);
        let mut out = vec![0.0; v.rows * cols];
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            for (c, o) in row.iter_mut().enumerate() {
                let group = (r * cols + c) / g;
                let scaled = round(v.scales.get(group) * v.q(r, c) as f32);
                *o = round(scaled + v.biases.get(group));
            }
        }
        out
    }

    /// Row `row` dequantized to f32 (an embedding lookup).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let isa = cpu::Isa::best();
        match self.parts() {
            QuantizedParts::Affine(v) => v.dequantize_row(row, out),
            QuantizedParts::Float(v) => cpu::fp::dequantize_row(isa, &v, row, out),
        }
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

/// Quantizes a row-major matrix of `dtype` weights (given as f32, exactly) the way
/// `mx.quantize` does in the float mode `mode`, returning the packed codes and the scale codes.
/// MLX computes in the weights' dtype, so each step is rounded to it here too.
///
/// Per group, with `m` the largest element of the format (6 for E2M1, 448 for E4M3): the scale
/// is `max|w| / m`, rounded to E4M3 (nvfp4) or up to a power of two (mx modes, exactly
/// `ceil(log2)`; an exponent below -127 wraps around in the code as in MLX), and each element,
/// divided by it, becomes the nearest code (E2M1 ties to the smaller magnitude, -0 to +0; E4M3
/// ties to even, saturating at ±448). Weights are expected to be finite.
///
/// # Panics
/// For [`QuantMode::Affine`], which [`quantize`] takes.
pub fn quantize_float(
    mode: QuantMode,
    values: &[f32],
    rows: usize,
    cols: usize,
    dtype: DType,
) -> (Vec<u32>, Vec<u8>) {
    let (bits, g) = mode
        .float_format()
        .expect("affine weights are quantized by `quantize`");
    let round = |v: f32| match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    };
    let largest = if bits == 4 { 6.0 } else { 448.0 };
    let per_word = 32 / bits as usize;
    let mut packed = vec![0u32; rows * cols / per_word];
    let mut scales = Vec::with_capacity(rows * cols / g);
    for (gi, group) in values[..rows * cols].chunks_exact(g).enumerate() {
        let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let r = round(amax / largest);
        let (code, scale) = match mode {
            QuantMode::Nvfp4 => {
                let code = to_e4m3(r);
                (code, E4M3[code as usize])
            }
            _ => {
                let k = if r == 0.0 { 0 } else { ceil_log2(r) };
                ((k + 127) as u8, 2f64.powi(k) as f32)
            }
        };
        scales.push(code);
        let words = &mut packed[gi * g / per_word..(gi + 1) * g / per_word];
        for (i, &v) in group.iter().enumerate() {
            let x = round(v / scale);
            let q = if bits == 4 {
                e2m1_code(x, round)
            } else {
                u32::from(to_e4m3(x))
            };
            words[i / per_word] |= q << ((i % per_word) * bits as usize);
        }
    }
    (packed, scales)
}

/// `ceil(log2(r))` of a positive finite f32, exactly (subnormals included).
fn ceil_log2(r: f32) -> i32 {
    let bits = r.to_bits();
    let (exponent, mantissa) = ((bits >> 23) as i32, bits & 0x7F_FFFF);
    if exponent == 0 {
        // mantissa · 2^-149, and ceil(log2(n)) of an integer n ≥ 1 is the bit length of n - 1.
        (32 - (mantissa - 1).leading_zeros()) as i32 - 149
    } else {
        exponent - 127 + i32::from(mantissa != 0)
    }
}

/// The E2M1 code nearest `x`, as MLX's `argmin(|x - lut|)` over [`E2M1`] picks it: the first
/// of equally near codes, with each difference rounded as the weights' dtype (`round`) rounds.
fn e2m1_code(x: f32, round: impl Fn(f32) -> f32) -> u32 {
    let mut best = (0, round(x - E2M1[0]).abs());
    for (code, &v) in E2M1.iter().enumerate().skip(1) {
        let d = round(x - v).abs();
        if d < best.1 {
            best = (code, d);
        }
    }
    best.0 as u32
}

/// MLX's f32 → E4M3 rounding (`to_fp8`): to nearest, ties to even, saturating at ±448 (NaN
/// too), with the subnormals below 2^-6.
fn to_e4m3(f: f32) -> u8 {
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let magnitude = bits ^ sign;
    let code = if magnitude >= 0x43E0_0000 {
        // 448 and above.
        0x7E
    } else if magnitude < 121 << 23 {
        // Below 2^-6: adding 2^14 rounds to the subnormals' step of 2^-9 in the low bits.
        let sum = f32::from_bits(magnitude) + f32::from_bits(141 << 23);
        sum.to_bits() - (141 << 23)
    } else {
        // Rebias the exponent from 127 to 7 and round the mantissa to 3 bits, ties to even.
        let odd = (magnitude >> 20) & 1;
        (magnitude.wrapping_sub(120 << 23) + 0x7FFFF + odd) >> 20
    };
    code as u8 | (sign >> 24) as u8
}
