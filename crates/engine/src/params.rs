//! Plain parameter types that both backends take: borrowed views of weights in MLX's layout,
//! the affine code and the float modes' codes, and the shapes of ops. They sit at the bottom of
//! the engine, below `cpu`, `cuda` and the dispatch in `ops`, so that no backend imports a layer
//! that calls into it.

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

/// How MLX quantized a matrix: `mode` of `mx.quantize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantMode {
    /// 2- to 8-bit integers with a scale and a bias per group: `scale · q + bias`.
    Affine,
    /// 4-bit E2M1 floats times a power-of-two (E8M0) scale per group of 32 (OCP MXFP4).
    Mxfp4,
    /// 4-bit E2M1 floats times an FP8 E4M3 scale per group of 16 (NVIDIA's NVFP4).
    Nvfp4,
    /// 8-bit E4M3 floats times an E8M0 scale per group of 32 (OCP MXFP8).
    Mxfp8,
}

impl QuantMode {
    pub const ALL: [QuantMode; 4] = [
        QuantMode::Affine,
        QuantMode::Mxfp4,
        QuantMode::Nvfp4,
        QuantMode::Mxfp8,
    ];

    /// The name MLX gives the mode (`"mxfp4"`).
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Nvfp4 => "nvfp4",
            QuantMode::Mxfp8 => "mxfp8",
        }
    }

    pub fn from_name(name: &str) -> Option<QuantMode> {
        QuantMode::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The bits and group size a float mode allows, its only ones; `None` for affine, which
    /// takes several of each.
    pub fn float_format(self) -> Option<(u32, usize)> {
        match self {
            QuantMode::Affine => None,
            QuantMode::Mxfp4 => Some((4, 32)),
            QuantMode::Nvfp4 => Some((4, 16)),
            QuantMode::Mxfp8 => Some((8, 32)),
        }
    }
}

impl std::fmt::Display for QuantMode {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The E2M1 (FP4) values of codes 0-15, as MLX decodes them: sign in bit 3, and -0 for 8.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The E4M3 (FP8, bias 7, no infinities) value of each code, as MLX decodes it: codes 0x7F and
/// 0xFF are NaN, and exponent 0 holds the subnormals `m/8 · 2^-6`.
pub static E4M3: [f32; 256] = e4m3_table();

/// The E8M0 scale of each code, as MLX decodes it: `2^(code - 127)`, code 255 infinite.
pub static E8M0: [f32; 256] = e8m0_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let mag = (code & 0x7F) as u32;
        let v = if mag == 0x7F {
            f32::NAN
        } else if mag < 8 {
            // Subnormal: m/8 · 2^-6.
            mag as f32 / 512.0
        } else {
            // Exponent and mantissa under f32's, the exponent rebased from bias 7 to 127.
            f32::from_bits((mag << 20) + (120 << 23))
        };
        t[code] = if code & 0x80 != 0 { -v } else { v };
        code += 1;
    }
    t
}

const fn e8m0_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        // Code 0 is 2^-127, an f32 subnormal.
        t[code] = f32::from_bits(if code == 0 {
            1 << 22
        } else {
            (code as u32) << 23
        });
        code += 1;
    }
    t
}

/// Borrowed parts of a `QuantizedMatrix` in one of the float modes (mxfp4, nvfp4, mxfp8), as
/// the kernels read them. The codes are packed as the affine integers are (element `j` of a row
/// in bits `j*bits .. (j+1)*bits` of its little-endian bit stream): E2M1 for 4 bits, E4M3 for
/// 8; each group has one scale code and no bias, and element `(r, j)` is
/// `scale[r, j / g] · value(code)`.
#[derive(Clone, Copy)]
pub struct FpQuantizedView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub mode: QuantMode,
    /// 4 or 8, as the mode has it.
    pub bits: u32,
    /// 16 or 32, as the mode has it.
    pub group_size: usize,
    /// `rows * cols * bits / 32` words.
    pub packed: &'a [u32],
    /// `rows * cols / group_size` scale codes.
    pub scales: &'a [u8],
}

impl FpQuantizedView<'_> {
    /// The decoded scale of each code: E4M3 for nvfp4, E8M0 for the mx modes.
    #[inline]
    pub fn scale_table(&self) -> &'static [f32; 256] {
        match self.mode {
            QuantMode::Nvfp4 => &E4M3,
            _ => &E8M0,
        }
    }

    /// The code of element `(row, col)`.
    #[inline]
    pub fn code(&self, row: usize, col: usize) -> u32 {
        let bits = self.bits as usize;
        let bit = (row * self.cols + col) * bits;
        (self.packed[bit / 32] >> (bit % 32)) & ((1u32 << bits) - 1)
    }

    /// The value of an element's code (before its group's scale).
    #[inline]
    pub fn value(&self, code: u32) -> f32 {
        if self.bits == 4 {
            E2M1[code as usize]
        } else {
            E4M3[code as usize]
        }
    }

    /// Row `row` dequantized to f32; the plain definition every kernel is tested against.
    /// `value · scale` is exact in f32 (at most 4 and 3 significant bits, exponents in range),
    /// so this is `mx.dequantize` to f32 bit for bit.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let groups = self.cols / self.group_size;
        let table = self.scale_table();
        for (col, o) in out[..self.cols].iter_mut().enumerate() {
            let scale = table[self.scales[row * groups + col / self.group_size] as usize];
            *o = self.value(self.code(row, col)) * scale;
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

/// How a mixture of experts picks each token's experts from its router's logits: the `top_k`
/// best of `experts` by their scores (softmax, or each expert's sigmoid), plus a correction bias
/// where the caller gives one and only within the best [`ExpertGroups`] where those apply;
/// weighted by their scores, renormalized to sum to 1 where [`ExpertChoice::renormalizes`],
/// times `scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertChoice {
    pub experts: usize,
    pub top_k: usize,
    /// The chosen weights are divided by their sum (`norm_topk_prob`); a sigmoid router's one
    /// choice keeps its score.
    pub norm_topk_prob: bool,
    pub scoring: Scoring,
    pub groups: Option<ExpertGroups>,
    pub scale: f32,
}

impl ExpertChoice {
    /// The top `top_k` of `experts` by a softmax of the logits, renormalized where
    /// `norm_topk_prob`, with no groups and a scale of 1.
    pub fn softmax(experts: usize, top_k: usize, norm_topk_prob: bool) -> Self {
        ExpertChoice {
            experts,
            top_k,
            norm_topk_prob,
            scoring: Scoring::Softmax,
            groups: None,
            scale: 1.0,
        }
    }

    /// Whether the chosen weights are divided by their sum: `norm_topk_prob`, except for one
    /// choice by sigmoid (mlx-lm renormalizes a softmax's single choice to 1).
    pub fn renormalizes(&self) -> bool {
        self.norm_topk_prob && (self.scoring == Scoring::Softmax || self.top_k > 1)
    }
}

/// What a router's logits become before the top-k choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scoring {
    Softmax,
    /// Each expert's own sigmoid (DeepSeek-V3, GLM-4.5).
    Sigmoid,
}

/// Group-limited routing: the experts fall into `count` groups, and only those of the `keep`
/// groups whose two best scores sum highest can be chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertGroups {
    pub count: usize,
    pub keep: usize,
}
