//! Plain parameter types that both backends take: borrowed views of weights in MLX's layout,
//! the affine code, and the shapes of ops. They sit at the bottom of the engine, below `cpu`,
//! `cuda` and the dispatch in `ops`, so that no backend imports a layer that calls into it.

use half::{bf16, f16};

// ---- weights ------------------------------------------------------------------------------------

/// A typed view of float weights.
#[derive(Clone, Copy)]
pub enum FloatSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl FloatSlice<'_> {
    /// Converts `range` of the values to f32 into `out`.
    pub fn to_f32(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            FloatSlice::F32(v) => out.copy_from_slice(&v[start..end]),
            FloatSlice::F16(v) => {
                for (o, x) in out.iter_mut().zip(&v[start..end]) {
                    *o = x.to_f32();
                }
            }
            FloatSlice::BF16(v) => {
                for (o, x) in out.iter_mut().zip(&v[start..end]) {
                    *o = x.to_f32();
                }
            }
        }
    }

    /// One value as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            FloatSlice::F32(v) => v[i],
            FloatSlice::F16(v) => v[i].to_f32(),
            FloatSlice::BF16(v) => v[i].to_f32(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            FloatSlice::F32(v) => v.len(),
            FloatSlice::F16(v) => v.len(),
            FloatSlice::BF16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// gpt-oss's clamped SwiGLU: the sigmoid's slope and where the gate and the linear part are
/// clipped (the CUDA kernel spells them out too).
pub const SWIGLU_OAI_ALPHA: f32 = 1.702;
pub const SWIGLU_OAI_LIMIT: f32 = 7.0;

/// A row-major `[rows, cols]` float matrix, borrowed, as the host kernels read it.
#[derive(Clone, Copy)]
pub struct DenseView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub values: FloatSlice<'a>,
}

impl DenseView<'_> {
    /// Row `row` as f32.
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        self.values.to_f32(row * self.cols, &mut out[..self.cols]);
    }
}

/// Borrowed parts of a `QuantizedMatrix`, as the kernels read them.
#[derive(Clone, Copy)]
pub struct QuantizedView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group_size: usize,
    /// `rows * cols * bits / 32` words.
    pub packed: &'a [u32],
    /// `rows * cols / group_size` values each.
    pub scales: FloatSlice<'a>,
    pub biases: FloatSlice<'a>,
}

impl QuantizedView<'_> {
    /// The quantized integer of element `(row, col)`.
    #[inline]
    pub fn q(&self, row: usize, col: usize) -> u32 {
        let bits = self.bits as usize;
        let row_words = self.cols * bits / 32;
        let bit = col * bits;
        let word = row * row_words + bit / 32;
        let shift = bit % 32;
        let mut v = self.packed[word] >> shift;
        if shift + bits > 32 {
            v |= self.packed[word + 1] << (32 - shift);
        }
        v & ((1u32 << bits) - 1)
    }

    /// Row `row` dequantized to f32; the plain definition every kernel is tested against.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let groups = self.cols / self.group_size;
        for (col, o) in out[..self.cols].iter_mut().enumerate() {
            let g = row * groups + col / self.group_size;
            *o = self.scales.get(g) * self.q(row, col) as f32 + self.biases.get(g);
        }
    }

    /// The whole matrix dequantized to f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (row, chunk) in out.chunks_mut(self.cols).enumerate() {
            self.dequantize_row(row, chunk);
        }
        out
    }
}

/// The scale and bias `mx.quantize` (affine mode) gives a group of values with `levels + 1`
/// codes. As MLX: the bias sits on whichever end has the larger magnitude (the "edge"), the
/// scale's sign follows so that the other end is reached, and the scale is then nudged so that
/// the edge is an exact multiple of it, which keeps zero representable.
pub(crate) fn affine_group(group: &[f32], levels: f32) -> (f32, f32) {
    let (lo, hi) = group
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let mut scale = ((hi - lo) / levels).max(1e-7);
    let edge = if lo.abs() > hi.abs() {
        lo
    } else {
        scale = -scale;
        hi
    };
    let q0 = (edge / scale).round_ties_even();
    let bias = if q0 != 0.0 {
        scale = edge / q0;
        edge
    } else {
        0.0
    };
    (scale, bias)
}

/// The code of `v` in a group of `scale` and `bias` (see [`affine_group`]).
pub(crate) fn affine_code(v: f32, scale: f32, bias: f32, levels: f32) -> u32 {
    ((v - bias) / scale).round_ties_even().clamp(0.0, levels) as u32
}

// ---- shapes of ops -------------------------------------------------------------------------------

/// Greedy decoding's pick from a row of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// The first maximum (`ops::argmax`; log-softmax keeps the order).
    pub id: u32,
    /// Its log-probability: the row's log-softmax there.
    pub logprob: f32,
}

/// Attention's heads: `heads` query heads and `kv_heads` key/value heads of `head_dim` features.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Head counts and sizes of one `gated_delta_rule` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleDims {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads: a multiple of `k_heads`; value head `h` reads key head
    /// `h / (v_heads / k_heads)`.
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

impl DeltaRuleDims {
    /// f32s in one sequence's state: `[v_heads, v_dim, k_dim]`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.v_dim * self.k_dim
    }
}
