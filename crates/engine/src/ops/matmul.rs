//! Products with weight matrices: matmuls, the fused projections (attention's query, key and
//! value with RoPE and the cache write; the gated MLP's first half), and embedding rows.

use crate::cpu;
use crate::cuda::{self, Buffer};
use crate::kv::{KvPrecision, KvRing, RingStorage};
use crate::quant::QuantizedParts;
use crate::tensor::Storage;
use crate::{DType, Device, FloatMatrix, Positions, QuantizedMatrix, Tensor};

use super::{
    add_inplace, check, gather_rows, glu_inplace, mismatch, rms_norm, scale_inplace,
    scatter_add_rows, with_last, Heads, Result,
};

/// A weight matrix the matmul and row-lookup ops take: MLX-quantized or float.
pub trait WeightMatrix {
    /// `[rows, cols]`: rows are output features.
    fn dims(&self) -> (usize, usize);
    /// `y[m, rows] = x[m, cols] · Wᵀ` on the host.
    fn matmul_host(&self, x: &[f32], m: usize, y: &mut [f32]);
    /// The same on `x`'s GPU, from the copy placed there: a new buffer, or (`AddTo`) a sum
    /// into an existing one.
    fn matmul_gpu(&self, x: &Buffer, m: usize, out: cuda::matmul::Output)
        -> Result<Option<Buffer>>;
    /// Row `i` as f32 on the host.
    fn row_host(&self, i: usize, out: &mut [f32]);
    /// Rows `ids` as f32 on `gpu`.
    fn rows_gpu(&self, gpu: &cuda::Gpu, ids: &[usize]) -> Result<Buffer>;
}

impl WeightMatrix for QuantizedMatrix {
    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn matmul_host(&self, x: &[f32], m: usize, y: &mut [f32]) {
        QuantizedMatrix::matmul(self, x, m, y);
    }
    fn matmul_gpu(
        &self,
        x: &Buffer,
        m: usize,
        out: cuda::matmul::Output,
    ) -> Result<Option<Buffer>> {
        cuda::matmul::quantized_matmul(self.on_gpu(x.gpu())?, self.shape(), x, m, out)
    }
    fn row_host(&self, i: usize, out: &mut [f32]) {
        self.dequantize_row(i, out);
    }
    fn rows_gpu(&self, gpu: &cuda::Gpu, ids: &[usize]) -> Result<Buffer> {
        cuda::matmul::quantized_rows(self.on_gpu(gpu)?, self.shape(), ids)
    }
}

impl WeightMatrix for FloatMatrix {
    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn matmul_host(&self, x: &[f32], m: usize, y: &mut [f32]) {
        FloatMatrix::matmul(self, x, m, y);
    }
    fn matmul_gpu(
        &self,
        x: &Buffer,
        m: usize,
        out: cuda::matmul::Output,
    ) -> Result<Option<Buffer>> {
        let y = cuda::matmul::dense_matmul(self.on_gpu(x.gpu())?, self.rows, self.cols, x, m)?;
        match out {
            cuda::matmul::Output::New => Ok(Some(y)),
            cuda::matmul::Output::AddTo(sum) => {
                cuda::elementwise::binary("add", sum, &y)?;
                Ok(None)
            }
        }
    }
    fn row_host(&self, i: usize, out: &mut [f32]) {
        self.row_to_f32(i, out);
    }
    fn rows_gpu(&self, gpu: &cuda::Gpu, ids: &[usize]) -> Result<Buffer> {
        cuda::matmul::dense_rows(self.on_gpu(gpu)?, self.cols, ids)
    }
}

/// `x · Wᵀ` for `x` of `[…, cols]`: `[…, rows]`, on `x`'s device.
pub fn matmul(w: &impl WeightMatrix, x: &Tensor) -> Result<Tensor> {
    let (rows, cols) = w.dims();
    check(x.cols() == cols, || {
        format!("matmul of {:?} by [{rows}, {cols}]ᵀ", x.shape())
    })?;
    let (m, shape) = (x.rows(), with_last(x.shape(), rows));
    match &x.storage {
        Storage::Host(v) => {
            let mut y = vec![0.0; m * rows];
            w.matmul_host(v, m, &mut y);
            Ok(Tensor::new(shape, y))
        }
        Storage::Cuda(b) => {
            let y = w.matmul_gpu(b, m, cuda::matmul::Output::New)?;
            Ok(Tensor::on_gpu(shape, y.expect("a new output")))
        }
    }
}

/// An RMS norm a product applies to its input rows first, as [`rms_norm`] would: a GPU folds
/// it into the product where it can (a decode step saves a launch a norm).
#[derive(Clone, Copy)]
pub struct InputNorm<'a> {
    pub weight: &'a Tensor,
    pub eps: f32,
}

/// `x`, normed by `norm` if there is one: borrowed as it is, or the new normed tensor.
pub fn normed<'a>(x: &'a Tensor, norm: Option<InputNorm>) -> Result<std::borrow::Cow<'a, Tensor>> {
    Ok(match norm {
        None => std::borrow::Cow::Borrowed(x),
        Some(n) => std::borrow::Cow::Owned(rms_norm(x, n.weight, n.eps)?),
    })
}

/// `norm` as a kernel reading `x` (on a GPU, `cols` wide) can fold it in: `Some(None)` for no
/// norm, `Some(Some(..))` for a weight beside `x` as wide as its rows. `None` for any other
/// norm, which the unfused path then applies through [`rms_norm`] (or refuses there).
fn foldable<'a>(
    x: &Buffer,
    cols: usize,
    norm: Option<InputNorm<'a>>,
) -> Option<cuda::matmul::InputNorm<'a>> {
    let Some(n) = norm else { return Some(None) };
    match &n.weight.storage {
        Storage::Cuda(w) if w.gpu().same(x.gpu()) && w.len() == cols => Some(Some((w, n.eps))),
        _ => None,
    }
}

/// `norm(x) · Wⱼᵀ` for each of `ws` (a layer's q/k/v projections, say): on the CPU one job
/// over all their rows, with the activations quantized once, where all are affine; on a GPU
/// one launch where the int16-activation GEMV applies (the norm folded in); else one matmul
/// each.
pub fn quantized_matmul_group(
    ws: &[&QuantizedMatrix],
    x: &Tensor,
    norm: Option<InputNorm>,
) -> Result<Vec<Tensor>> {
    for w in ws {
        check(x.cols() == w.cols, || {
            format!("matmul of {:?} by [{}, {}]ᵀ", x.shape(), w.rows, w.cols)
        })?;
    }
    let gpu = match &x.storage {
        Storage::Cuda(b) => foldable(b, x.cols(), norm).map(|folded| (b, folded)),
        Storage::Host(_) => None,
    };
    if let Some((b, folded)) = gpu {
        let placed = ws
            .iter()
            .map(|w| Ok((w.on_gpu(b.gpu())?, w.shape())))
            .collect::<Result<Vec<_>>>()?;
        if let Some(ys) = cuda::matmul::quantized_matmul_group(&placed, b, x.rows(), folded)? {
            return Ok(ws
                .iter()
                .zip(ys)
                .map(|(w, y)| Tensor::on_gpu(with_last(x.shape(), w.rows), y))
                .collect());
        }
    }
    let x = &*normed(x, norm)?;
    let Storage::Host(v) = &x.storage else {
        return ws.iter().map(|w| matmul(*w, x)).collect();
    };
    let m = x.rows();
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; m * w.rows]).collect();
    let views: Option<Vec<_>> = ws
        .iter()
        .map(|w| match w.parts() {
            QuantizedParts::Affine(v) => Some(v),
            QuantizedParts::Float(_) => None,
        })
        .collect();
    match views {
        // The affine kernels share one job (and one quantization of the activations).
        Some(views) => {
            let view_refs: Vec<_> = views.iter().collect();
            let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
            cpu::matmul::matmul_group(&view_refs, v, m, &mut outs);
        }
        None => {
            for (w, y) in ws.iter().zip(ys.iter_mut()) {
                w.matmul(v, m, y);
            }
        }
    }
    Ok(ws
        .iter()
        .zip(ys)
        .map(|(w, y)| Tensor::new(with_last(x.shape(), w.rows), y))
        .collect())
}

/// `residual += x · Wᵀ`, in one pass where the device allows (a residual connection).
pub fn matmul_add(w: &impl WeightMatrix, x: &Tensor, residual: &mut Tensor) -> Result<()> {
    let (rows, cols) = w.dims();
    check(
        x.cols() == cols && residual.len() == x.rows() * rows,
        || {
            format!(
                "matmul of {:?} by [{rows}, {cols}]ᵀ into {:?}",
                x.shape(),
                residual.shape()
            )
        },
    )?;
    match (&x.storage, &mut residual.storage) {
        (Storage::Cuda(b), Storage::Cuda(sum)) if b.gpu().same(sum.gpu()) => {
            w.matmul_gpu(b, x.rows(), cuda::matmul::Output::AddTo(sum))?;
            Ok(())
        }
        _ => add_inplace(residual, &matmul(w, x)?),
    }
}

/// A low-rank update of a linear layer's output, as a LoRA adapter adds it:
/// `y += scale · (x · downᵀ) · upᵀ` on the rows `rows` of `x` and `y` (every row where `None`).
#[derive(Clone, Copy)]
pub struct LowRankUpdate<'a> {
    /// `[rank, in]`, f32 (placed on the GPU for a pass there).
    pub down: &'a FloatMatrix,
    /// `[out, rank]`, f32.
    pub up: &'a FloatMatrix,
    pub scale: f32,
    pub rows: Option<&'a [usize]>,
}

/// Up to this many rows a GPU adds low-rank updates by two kernels that take every row's updates
/// at once (a decoding step, whichever adapters its sequences run through), replayed with the
/// step; more rows (a prompt) take each update's two products on the tensor cores.
const LOW_RANK_KERNEL_MAX_ROWS: usize = 64;

/// `y += ` each of `updates`, in order, on the rows of `x` it applies to.
pub fn add_low_rank(x: &Tensor, updates: &[LowRankUpdate], y: &mut Tensor) -> Result<()> {
    add_low_ranks(x, &mut [(updates, y)])
}

/// [`add_low_rank`] into each of `outputs`, layers that read the same input `x` (a block's q, k
/// and v projections): on a GPU, for a few rows, in one pair of launches for them all.
pub fn add_low_ranks(x: &Tensor, outputs: &mut [(&[LowRankUpdate], &mut Tensor)]) -> Result<()> {
    let m = x.rows();
    for (updates, y) in outputs.iter() {
        for u in *updates {
            let fits = u.down.cols == x.cols()
                && u.up.rows == y.cols()
                && u.up.cols == u.down.rows
                && y.rows() == m
                && u.rows.is_none_or(|rows| rows.iter().all(|&r| r < m));
            check(fits, || {
                format!(
                    "low-rank update [{}, {}]ᵀ·[{}, {}]ᵀ of {:?} into {:?}",
                    u.down.rows,
                    u.down.cols,
                    u.up.rows,
                    u.up.cols,
                    x.shape(),
                    y.shape()
                )
            })?;
            check(
                u.down.dtype == DType::F32 && u.up.dtype == DType::F32,
                || format!("low-rank update in {} (f32 only)", u.down.dtype),
            )?;
        }
    }
    if let Storage::Cuda(xb) = &x.storage {
        if m <= LOW_RANK_KERNEL_MAX_ROWS {
            let g = xb.gpu();
            let (mut weights, mut pairs, mut ys) = (Vec::new(), Vec::new(), Vec::new());
            for (output, (updates, y)) in outputs.iter_mut().enumerate() {
                for u in updates.iter() {
                    let i = weights.len();
                    match u.rows {
                        None => pairs.extend((0..m).map(|r| (r, i))),
                        Some(rows) => pairs.extend(rows.iter().map(|&r| (r, i))),
                    }
                    weights.push(cuda::low_rank::LowRankWeights {
                        down: u.down.on_gpu(g)?,
                        up: u.up.on_gpu(g)?,
                        rank: u.down.rows,
                        scale: u.scale,
                        output,
                    });
                }
                let width = y.cols();
                match &mut y.storage {
                    Storage::Cuda(yb) if yb.gpu().same(g) => ys.push((yb, width)),
                    _ => return Err(mismatch("add_low_rank")),
                }
            }
            // Stable: each row's updates stay in their order.
            pairs.sort_by_key(|&(row, _)| row);
            return cuda::low_rank::add_low_rank(xb, x.cols(), &weights, &pairs, &mut ys);
        }
    }
    for (updates, y) in outputs.iter_mut() {
        for u in updates.iter() {
            let low_rank = |x: &Tensor| -> Result<Tensor> {
                let mut t = matmul(u.down, x)?;
                scale_inplace(&mut t, u.scale)?;
                Ok(t)
            };
            match u.rows {
                None => matmul_add(u.up, &low_rank(x)?, y)?,
                Some(rows) => {
                    let update = matmul(u.up, &low_rank(&gather_rows(x, rows)?)?)?;
                    scatter_add_rows(y, &update, rows, &vec![1.0; rows.len()])?;
                }
            }
        }
    }
    Ok(())
}

/// The activation between the gate and up projections of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
    /// GeGLU: `gelu_approx(gate) · up`.
    GeluApprox,
    /// gpt-oss's clamped SwiGLU (see [`swiglu_oai_mul_inplace`]).
    SwigluOai,
}

/// `act(norm(x) · Gᵀ) · (norm(x) · Uᵀ)`: one pass over both matrices on a GPU when they share
/// shape and quantization and `x` has few rows (the norm folded in where the int16-activation
/// kernel runs), else the norm, the two matmuls and the activation.
pub fn quantized_glu(
    gate: &QuantizedMatrix,
    up: &QuantizedMatrix,
    x: &Tensor,
    norm: Option<InputNorm>,
    act: Activation,
) -> Result<Tensor> {
    let same_format = gate.shape() == up.shape();
    let gpu = match &x.storage {
        Storage::Cuda(b) if same_format && x.cols() == gate.cols => {
            foldable(b, x.cols(), norm).map(|folded| (b, folded))
        }
        _ => None,
    };
    let kind = match act {
        Activation::Silu => Some(cuda::matmul::Glu::Silu),
        Activation::GeluApprox => Some(cuda::matmul::Glu::GeluApprox),
        Activation::SwigluOai => None,
    };
    if let (Some((b, folded)), Some(kind)) = (gpu, kind) {
        let (g, u) = (gate.on_gpu(b.gpu())?, up.on_gpu(b.gpu())?);
        let (s, m) = (gate.shape(), x.rows());
        if let Some(out) = cuda::matmul::quantized_glu(g, u, s, b, m, kind, folded)? {
            return Ok(Tensor::on_gpu(with_last(x.shape(), gate.rows), out));
        }
    }
    let x = &*normed(x, norm)?;
    let mut pair = quantized_matmul_group(&[gate, up], x, None)?.into_iter();
    let (mut h, u) = (pair.next().unwrap(), pair.next().unwrap());
    glu_inplace(&mut h, &u, act)?;
    Ok(h)
}

/// Rows `ids` of `w` as f32 on `device` (an embedding lookup).
pub fn matrix_rows(w: &impl WeightMatrix, ids: &[usize], device: &Device) -> Result<Tensor> {
    let (rows, cols) = w.dims();
    check(ids.iter().all(|&i| i < rows), || {
        format!("row index past the {rows} rows of the table")
    })?;
    let shape = vec![ids.len(), cols];
    match device {
        Device::Cpu => {
            let mut out = vec![0.0; ids.len() * cols];
            for (&i, row) in ids.iter().zip(out.chunks_exact_mut(cols)) {
                w.row_host(i, row);
            }
            Ok(Tensor::new(shape, out))
        }
        Device::Cuda(gpu) => Ok(Tensor::on_gpu(shape, w.rows_gpu(gpu, ids)?)),
    }
}

/// A rotation by position (RoPE), as [`rope_pair_inplace`] applies it: one frequency per pair
/// of features; neighbours paired with `traditional`, else the halves of each head; the turned
/// features multiplied by `amplitude` (YaRN's and LongRoPE's mscale; 1 for plain RoPE).
#[derive(Clone, Copy)]
pub struct Rotation<'a> {
    pub inv_freqs: &'a Tensor,
    pub traditional: bool,
    pub amplitude: f32,
}

/// Where a token's keys and values go: a cache's two rings of `capacity` slots, as
/// [`kv_write`] writes them.
pub struct KvTarget<'a> {
    pub keys: &'a mut KvRing,
    pub values: &'a mut KvRing,
    pub capacity: usize,
}

/// Attention's projections of one token, its rotation and its cache write in one launch on a
/// GPU: `ws` are the query, key and value projections of `x` (normed first by `norm`), each
/// with its bias if it has one, the queries and keys rotated at `positions` by `rope`, the keys
/// and values written into `cache`. The same numbers as [`quantized_matmul_group`],
/// [`add_row_inplace`], [`rope_pair_inplace`] and [`kv_write`] in turn. Returns the rotated
/// queries, or `None` where the fused kernel does not apply (the host, more than one token,
/// widths other than 4 and 8 bits or modes other than affine, an exact GPU handle, a rotation
/// of part of each head or with an amplitude, code rings of more than
/// [`cuda::CODE_WRITE_KV_HEADS`] key/value heads), having written nothing: the caller then
/// takes those steps.
pub fn qkv_rope_write(
    ws: [(&QuantizedMatrix, Option<&Tensor>); 3],
    x: &Tensor,
    norm: Option<InputNorm>,
    shape: Heads,
    rope: Rotation,
    positions: &Positions,
    cache: KvTarget,
) -> Result<Option<Tensor>> {
    let Heads {
        heads,
        kv_heads,
        head_dim,
    } = shape;
    let rows = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim];
    check(
        ws.iter().zip(rows).all(|((w, bias), r)| {
            w.rows == r && w.cols == x.cols() && bias.is_none_or(|b| b.len() == r)
        }),
        || format!("q/k/v projections of {:?} into {shape:?}", x.shape()),
    )?;
    cache.keys.check_head_dim(head_dim)?;
    let (
        Storage::Cuda(xb),
        Storage::Cuda(freqs),
        RingStorage::Cuda(keys),
        RingStorage::Cuda(values),
    ) = (
        &x.storage,
        &rope.inv_freqs.storage,
        &mut cache.keys.storage,
        &mut cache.values.storage,
    )
    else {
        return Ok(None);
    };
    let whole_heads = 2 * freqs.len() == head_dim && rope.amplitude == 1.0;
    // Code rings count each head's warps in a table of CODE_WRITE_KV_HEADS.
    let codes = matches!(keys.precision(), KvPrecision::Quantized(_));
    if x.rows() != 1
        || positions.len() != 1
        || !whole_heads
        || (codes && kv_heads > cuda::CODE_WRITE_KV_HEADS)
    {
        return Ok(None);
    }
    let ring = cache.capacity * rows[1];
    check(keys.len() == ring && values.len() == ring, || {
        format!("a cache of {} slots × {}", cache.capacity, rows[1])
    })?;
    if keys.precision() != values.precision()
        || ![freqs.gpu(), keys.gpu(), values.gpu()]
            .iter()
            .all(|g| xb.gpu().same(g))
    {
        return Err(mismatch("qkv_rope_write"));
    }
    let Some(folded) = foldable(xb, x.cols(), norm) else {
        return Ok(None);
    };
    let gpu = xb.gpu();
    let placed = [
        on_gpu_with_bias(ws[0], gpu)?,
        on_gpu_with_bias(ws[1], gpu)?,
        on_gpu_with_bias(ws[2], gpu)?,
    ];
    let q = cuda::matmul::qkv_rope_write(
        placed,
        xb,
        folded,
        shape,
        (freqs, rope.traditional),
        positions.on_gpu()?,
        (keys, values, cache.capacity),
    )?;
    Ok(q.map(|q| Tensor::on_gpu(with_last(x.shape(), rows[0]), q)))
}

/// A projection's copy on `gpu`, its shape and its bias's buffer there.
fn on_gpu_with_bias<'a>(
    (w, bias): (&'a QuantizedMatrix, Option<&'a Tensor>),
    gpu: &cuda::Gpu,
) -> Result<(
    &'a cuda::QuantizedWeights,
    cuda::matmul::QuantShape,
    Option<&'a Buffer>,
)> {
    let bias = match bias.map(|b| &b.storage) {
        None => None,
        Some(Storage::Cuda(b)) if b.gpu().same(gpu) => Some(b),
        Some(_) => return Err(mismatch("qkv_rope_write")),
    };
    Ok((w.on_gpu(gpu)?, w.shape(), bias))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Bytes;

    /// Updates add in order on their rows: `y += scale · (x · downᵀ) · upᵀ`, worked by hand.
    /// Matrices that do not fit `x` and `y`, rows past `x`'s and matrices not in f32 are
    /// refused with what was asked.
    #[test]
    fn low_rank_updates_add_on_their_rows_and_refuse_what_does_not_fit() {
        // Rank 1: down [1, 2], up [3, 1].
        let down = FloatMatrix::from_f32(1, 2, &[1.0, 2.0]).unwrap();
        let up = FloatMatrix::from_f32(3, 1, &[1.0, 0.0, -1.0]).unwrap();
        let x = Tensor::new(vec![2, 2], vec![1.0, 1.0, 2.0, 0.0]);
        let mut y = Tensor::new(vec![2, 3], vec![0.0; 6]);
        let all = LowRankUpdate {
            down: &down,
            up: &up,
            scale: 2.0,
            rows: None,
        };
        let second = LowRankUpdate {
            scale: 0.5,
            rows: Some(&[1]),
            ..all
        };
        add_low_rank(&x, &[all, second], &mut y).unwrap();
        // Row 0: x·down = 3, times 2; row 1: x·down = 2, times 2 + 0.5.
        assert_eq!(y.data(), [6.0, 0.0, -6.0, 5.0, 0.0, -5.0]);

        let wide = FloatMatrix::from_f32(1, 3, &[1.0; 3]).unwrap();
        let mut err = |u: LowRankUpdate| add_low_rank(&x, &[u], &mut y).unwrap_err().to_string();
        let mismatched = err(LowRankUpdate { down: &wide, ..all });
        assert!(
            mismatched.contains("low-rank update [1, 3]"),
            "{mismatched}"
        );
        let past = err(LowRankUpdate {
            rows: Some(&[2]),
            ..all
        });
        assert!(past.contains("into [2, 3]"), "{past}");
        let half = FloatMatrix::new(1, 2, DType::F16, Bytes::from_values(&[0u16; 2])).unwrap();
        let f16 = err(LowRankUpdate { down: &half, ..all });
        assert!(f16.contains("f32 only"), "{f16}");
    }
}
