//! The ops the models are written in, on [`Tensor`]s wherever they live: each checks shapes,
//! then runs the CPU kernels (`crate::cpu`) on host tensors or the CUDA kernels
//! (`crate::cuda`) on GPU tensors. Operands must share a device.

use crate::cpu;
use crate::cuda::{self, Buffer};
use crate::kv::{KvBuffer, KvPrecision, KvStorage};
use crate::tensor::Storage;
use crate::{Device, EngineError, FloatMatrix, Positions, QuantizedMatrix, Tensor};

type Result<T> = std::result::Result<T, EngineError>;

/// Two operands' storage, known to be on one device.
enum Pair<'a> {
    Host(&'a mut Vec<f32>, &'a [f32]),
    Cuda(&'a mut Buffer, &'a Buffer),
}

fn pair<'a>(op: &str, x: &'a mut Tensor, y: &'a Tensor) -> Result<Pair<'a>> {
    match (&mut x.storage, &y.storage) {
        (Storage::Host(a), Storage::Host(b)) => Ok(Pair::Host(a, b)),
        (Storage::Cuda(a), Storage::Cuda(b)) if a.gpu().same(b.gpu()) => Ok(Pair::Cuda(a, b)),
        _ => Err(mismatch(op)),
    }
}

fn mismatch(op: &str) -> EngineError {
    EngineError::Device(format!("{op}: operands are on different devices"))
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(EngineError::Shape(what()))
    }
}

fn same_len(op: &str, x: &Tensor, y: &Tensor) -> Result<()> {
    check(x.len() == y.len(), || {
        format!("{op}: {:?} and {:?} differ in size", x.shape(), y.shape())
    })
}

/// `shape` with its last axis replaced by `last`.
fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    match s.last_mut() {
        Some(l) => *l = last,
        None => s.push(last),
    }
    s
}

// ---- element-wise -------------------------------------------------------------------------------

/// `x = f(x, y)` element by element: the host function or the CUDA kernel of that name.
fn binary(
    op: &str,
    x: &mut Tensor,
    y: &Tensor,
    host: fn(&mut [f32], &[f32]),
    kernel: &str,
) -> Result<()> {
    same_len(op, x, y)?;
    match pair(op, x, y)? {
        Pair::Host(a, b) => {
            host(a, b);
            Ok(())
        }
        Pair::Cuda(a, b) => cuda::ops::binary(kernel, a, b),
    }
}

/// `x += y`.
pub fn add_inplace(x: &mut Tensor, y: &Tensor) -> Result<()> {
    binary("add", x, y, cpu::elementwise::add_inplace, "add")
}

/// `x[r] += row` for every row of `x` (a bias).
pub fn add_row_inplace(x: &mut Tensor, row: &Tensor) -> Result<()> {
    check(x.cols() == row.len(), || {
        format!("bias of {} on rows of {}", row.len(), x.cols())
    })?;
    match pair("add_row", x, row)? {
        Pair::Host(a, b) => {
            for r in a.chunks_exact_mut(b.len()) {
                cpu::elementwise::add_inplace(r, b);
            }
            Ok(())
        }
        Pair::Cuda(a, b) => cuda::ops::add_row(a, b),
    }
}

/// `x = f(x)` element by element, on the host or by a kernel.
fn unary(
    x: &mut Tensor,
    host: impl FnOnce(&mut [f32]),
    gpu: impl FnOnce(&mut Buffer) -> Result<()>,
) -> Result<()> {
    match &mut x.storage {
        Storage::Host(v) => {
            host(v);
            Ok(())
        }
        Storage::Cuda(b) => gpu(b),
    }
}

/// `x *= s`.
pub fn scale_inplace(x: &mut Tensor, s: f32) -> Result<()> {
    unary(
        x,
        |v| cpu::elementwise::scale_inplace(v, s),
        |b| cuda::ops::scale(b, s),
    )
}

/// `x = tanh(x / cap) · cap`.
pub fn softcap_inplace(x: &mut Tensor, cap: f32) -> Result<()> {
    unary(
        x,
        |v| cpu::elementwise::softcap_inplace(v, cap),
        |b| cuda::ops::softcap(b, cap),
    )
}

/// `x = silu(x)`.
pub fn silu_inplace(x: &mut Tensor) -> Result<()> {
    unary(x, cpu::elementwise::silu_inplace, cuda::ops::silu)
}

/// `gate = silu(gate) · up`, the SwiGLU activation.
pub fn silu_mul_inplace(gate: &mut Tensor, up: &Tensor) -> Result<()> {
    binary(
        "silu_mul",
        gate,
        up,
        cpu::elementwise::silu_mul_inplace,
        "silu_mul",
    )
}

/// `gate = gelu_approx(gate) · up`, the GeGLU activation.
pub fn gelu_approx_mul_inplace(gate: &mut Tensor, up: &Tensor) -> Result<()> {
    binary(
        "gelu_mul",
        gate,
        up,
        cpu::elementwise::gelu_approx_mul_inplace,
        "gelu_mul",
    )
}

/// `x = x · sigmoid(gate)`.
pub fn sigmoid_mul_inplace(x: &mut Tensor, gate: &Tensor) -> Result<()> {
    binary(
        "sigmoid_mul",
        x,
        gate,
        cpu::elementwise::sigmoid_mul_inplace,
        "sigmoid_mul",
    )
}

// ---- norms and RoPE -----------------------------------------------------------------------------

fn check_norm(x: &Tensor, weight: &Tensor) -> Result<()> {
    check(
        !weight.is_empty() && x.len().is_multiple_of(weight.len()),
        || format!("RMSNorm of width {} over {:?}", weight.len(), x.shape()),
    )
}

/// RMSNorm of each `weight.len()`-wide run of `x`: `x / sqrt(mean(x²) + eps) · weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    check_norm(x, weight)?;
    match (&x.storage, &weight.storage) {
        (Storage::Cuda(b), Storage::Cuda(w)) if b.gpu().same(w.gpu()) => {
            let width = weight.len();
            let out = b.gpu().output(x.len())?;
            cuda::ops::rms_norm(b.ptr(), w, out.ptr(), x.len() / width, width, eps)?;
            Ok(Tensor::on_gpu(x.shape().to_vec(), out))
        }
        _ => {
            let mut out = x.try_clone()?;
            rms_norm_inplace(&mut out, weight, eps)?;
            Ok(out)
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut Tensor, weight: &Tensor, eps: f32) -> Result<()> {
    check_norm(x, weight)?;
    let width = weight.len();
    let rows = x.len() / width;
    match pair("rms_norm", x, weight)? {
        Pair::Host(a, w) => {
            cpu::elementwise::rms_norm_inplace(a, w, eps);
            Ok(())
        }
        Pair::Cuda(a, w) => cuda::ops::rms_norm(a.ptr(), w, a.ptr(), rows, width, eps),
    }
}

/// Rotary position embedding in place on `x` (`[tokens, heads · head_dim]`): token `t` sits at
/// `positions[t]`; pair `i` of the first `2 · inv_freqs.len()` features of each head turns by
/// `positions[t] · inv_freqs[i]`. `traditional` pairs neighbours `(2i, 2i+1)`, otherwise the
/// halves `(i, i + dims/2)`, as `mx.fast.rope` does.
pub fn rope_inplace(
    x: &mut Tensor,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    inv_freqs: &Tensor,
    traditional: bool,
) -> Result<()> {
    check(
        x.len() == positions.len() * heads * head_dim && 2 * inv_freqs.len() <= head_dim,
        || {
            format!(
                "RoPE of {} pairs over {:?} as {} tokens × {heads} heads × {head_dim}",
                inv_freqs.len(),
                x.shape(),
                positions.len()
            )
        },
    )?;
    match pair("rope", x, inv_freqs)? {
        Pair::Host(a, f) => {
            let p = positions.as_slice();
            cpu::elementwise::rope_inplace(a, heads, head_dim, p, f, traditional);
            Ok(())
        }
        Pair::Cuda(a, f) => cuda::ops::rope(a, heads, None, head_dim, positions, f, traditional),
    }
}

/// [`rope_inplace`] of a layer's queries `q` (`heads` a token) and keys `k` (`kv_heads` a
/// token) at the same positions; one launch on a GPU.
#[allow(clippy::too_many_arguments)]
pub fn rope_pair_inplace(
    q: &mut Tensor,
    heads: usize,
    k: &mut Tensor,
    kv_heads: usize,
    head_dim: usize,
    positions: &Positions,
    inv_freqs: &Tensor,
    traditional: bool,
) -> Result<()> {
    if let (Storage::Cuda(qb), Storage::Cuda(kb), Storage::Cuda(f)) =
        (&mut q.storage, &mut k.storage, &inv_freqs.storage)
    {
        let fits = |b: &Buffer, h: usize| b.len() == positions.len() * h * head_dim;
        if fits(qb, heads) && fits(kb, kv_heads) && 2 * f.len() <= head_dim {
            if !(qb.gpu().same(kb.gpu()) && qb.gpu().same(f.gpu())) {
                return Err(mismatch("rope"));
            }
            let y = Some((kb, kv_heads));
            return cuda::ops::rope(qb, heads, y, head_dim, positions, f, traditional);
        }
    }
    rope_inplace(q, heads, head_dim, positions, inv_freqs, traditional)?;
    rope_inplace(k, kv_heads, head_dim, positions, inv_freqs, traditional)
}

// ---- reshaping copies ---------------------------------------------------------------------------

/// Columns `start..start + width` of every row, as a new `[rows, width]` tensor.
pub fn columns(x: &Tensor, start: usize, width: usize) -> Result<Tensor> {
    let cols = x.cols();
    check(start + width <= cols, || {
        format!("columns {start}..{} of {:?}", start + width, x.shape())
    })?;
    let shape = with_last(x.shape(), width);
    match &x.storage {
        Storage::Host(v) => Ok(Tensor::new(
            shape,
            v.chunks_exact(cols)
                .flat_map(|r| &r[start..start + width])
                .copied()
                .collect(),
        )),
        Storage::Cuda(b) => Ok(Tensor::on_gpu(
            shape,
            cuda::ops::columns(b, cols, start, width)?,
        )),
    }
}

/// Rows `start..start + count` (of [`Tensor::cols`] elements), as a new tensor.
pub fn rows(x: &Tensor, start: usize, count: usize) -> Result<Tensor> {
    let cols = x.cols();
    check(start + count <= x.rows(), || {
        format!("rows {start}..{} of {:?}", start + count, x.shape())
    })?;
    let shape = vec![count, cols];
    match &x.storage {
        Storage::Host(v) => Ok(Tensor::new(
            shape,
            v[start * cols..(start + count) * cols].to_vec(),
        )),
        Storage::Cuda(b) => Ok(Tensor::on_gpu(
            shape,
            cuda::ops::range(b, start * cols, count * cols)?,
        )),
    }
}

/// The index of the first maximum of `x` (`mx.argmax`), NaNs passed over; 0 where every
/// element is NaN or -inf.
pub fn argmax(x: &[f32]) -> u32 {
    let (mut best, mut best_value) = (0, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if v > best_value {
            (best, best_value) = (i, v);
        }
    }
    best as u32
}

/// `ln Σ exp(x)`: the exponentials of `x − max` in f32, summed in f64
/// ([`cpu::elementwise::exp_sum`]; NaNs passed over for the maximum), −∞ for a row of −∞.
/// Log-softmax is `x - log_sum_exp(x)`.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + cpu::elementwise::exp_sum(x, 1.0, max).ln() as f32
}

/// Greedy decoding's pick from a row of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// The first maximum ([`argmax`]; log-softmax keeps the order).
    pub id: u32,
    /// Its log-probability: the row's log-softmax there.
    pub logprob: f32,
}

/// The [`Pick`] of every row of `x`. On a GPU only the picks are copied back (a batch's rows,
/// or one row of a large vocabulary, are megabytes).
pub fn greedy_rows(x: &Tensor) -> Result<Vec<Pick>> {
    let cols = x.cols();
    check(cols > 0, || {
        format!("greedy picks of rows of {:?}", x.shape())
    })?;
    match &x.storage {
        Storage::Host(v) => Ok(v
            .chunks_exact(cols)
            .map(|row| {
                let id = argmax(row);
                Pick {
                    id,
                    logprob: row[id as usize] - log_sum_exp(row),
                }
            })
            .collect()),
        Storage::Cuda(b) => cuda::ops::greedy_rows(b, cols),
    }
}

/// The rows `indices` of `x`, in that order.
pub fn gather_rows(x: &Tensor, indices: &[usize]) -> Result<Tensor> {
    let (n, cols) = (x.rows(), x.cols());
    check(indices.iter().all(|&i| i < n), || {
        format!("row indices past {n} rows")
    })?;
    let shape = vec![indices.len(), cols];
    match &x.storage {
        Storage::Host(v) => Ok(Tensor::new(
            shape,
            indices
                .iter()
                .flat_map(|&i| &v[i * cols..(i + 1) * cols])
                .copied()
                .collect(),
        )),
        Storage::Cuda(b) => Ok(Tensor::on_gpu(
            shape,
            cuda::ops::gather_rows(b, cols, indices)?,
        )),
    }
}

/// `y[indices[i]] += weights[i] · src[i]`, for distinct `indices`.
pub fn scatter_add_rows(
    y: &mut Tensor,
    src: &Tensor,
    indices: &[usize],
    weights: &[f32],
) -> Result<()> {
    let (n, cols) = (y.rows(), y.cols());
    check(
        src.cols() == cols
            && src.rows() == indices.len()
            && weights.len() == indices.len()
            && indices.iter().all(|&i| i < n),
        || format!("scatter of {:?} into {:?}", src.shape(), y.shape()),
    )?;
    match pair("scatter_add_rows", y, src)? {
        Pair::Host(a, s) => {
            for ((&i, &w), row) in indices.iter().zip(weights).zip(s.chunks_exact(cols)) {
                for (o, &v) in a[i * cols..(i + 1) * cols].iter_mut().zip(row) {
                    *o += w * v;
                }
            }
            Ok(())
        }
        Pair::Cuda(a, s) => cuda::ops::scatter_add_rows(a, s, cols, indices, weights),
    }
}

// ---- key/value caches and attention ---------------------------------------------------------------

/// A layer's cached keys and values as attention reads them: `[kv_heads, capacity, head_dim]`
/// each, position `p` in slot `p % capacity`, positions `start..end` present.
pub struct Kv<'a> {
    pub keys: &'a KvBuffer,
    pub values: &'a KvBuffer,
    pub kv_heads: usize,
    pub capacity: usize,
    pub start: usize,
    pub end: usize,
    /// `Some(w)`: a sliding window; a query sees the `w` positions ending at its own.
    pub window: Option<usize>,
}

/// Writes `src` (`[tokens, kv_heads · head_dim]`) into a host ring at positions `first..`.
fn write_host_ring(
    ring: &mut KvBuffer,
    src: &[f32],
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    first: usize,
) -> Result<()> {
    match &mut ring.storage {
        KvStorage::HostF32(c) => {
            cpu::attention::kv_write(c, src, kv_heads, head_dim, capacity, first)
        }
        KvStorage::HostF16(c) => {
            cpu::attention::kv_write(c, src, kv_heads, head_dim, capacity, first)
        }
        KvStorage::HostQ8(q) => {
            if !head_dim.is_multiple_of(cpu::attention::Q8_GROUP) {
                return Err(EngineError::UnsupportedQuantization(format!(
                    "an 8-bit KV cache needs head dims that are multiples of {}; this model's \
                     are {head_dim} (use --kv-cache f16)",
                    cpu::attention::Q8_GROUP
                )));
            }
            let cache = (&mut q.codes[..], &mut q.scales[..], &mut q.biases[..]);
            cpu::attention::kv_write_q8(cache, src, kv_heads, head_dim, capacity, first)
        }
        KvStorage::Cuda(_) => return Err(mismatch("kv_write")),
    }
    Ok(())
}

/// Writes `keys` and `values` (`[tokens, kv_heads · head_dim]` each) of the tokens at
/// `positions` (consecutive) into a cache's two rings, `cache.0` and `cache.1`
/// (`[kv_heads, capacity, head_dim]`, position `p` in slot `p % capacity`); one launch on a GPU.
pub fn kv_write(
    cache: (&mut KvBuffer, &mut KvBuffer),
    keys: &Tensor,
    values: &Tensor,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    positions: &Positions,
) -> Result<()> {
    let row = kv_heads * head_dim;
    let p = positions.as_slice();
    check(
        cache.0.len() == capacity * row
            && cache.1.len() == capacity * row
            && keys.len() == p.len() * row
            && values.len() == p.len() * row
            && p.len() <= capacity
            && p.windows(2).all(|w| w[1] == w[0] + 1),
        || {
            format!(
                "writing {:?} and {:?} into a cache of {capacity} × {row}",
                keys.shape(),
                values.shape()
            )
        },
    )?;
    if p.is_empty() {
        return Ok(());
    }
    match (&keys.storage, &values.storage) {
        (Storage::Host(k), Storage::Host(v)) => {
            write_host_ring(cache.0, k, kv_heads, head_dim, capacity, p[0])?;
            write_host_ring(cache.1, v, kv_heads, head_dim, capacity, p[0])
        }
        (Storage::Cuda(k), Storage::Cuda(v)) => {
            match (&mut cache.0.storage, &mut cache.1.storage) {
                (KvStorage::Cuda(kc), KvStorage::Cuda(vc))
                    if kc.is_half() == vc.is_half()
                        && [vc.gpu(), k.gpu(), v.gpu()]
                            .iter()
                            .all(|g| kc.gpu().same(g)) =>
                {
                    cuda::ops::kv_write([kc, vc], [k, v], kv_heads, head_dim, capacity, positions)
                }
                _ => Err(mismatch("kv_write")),
            }
        }
        _ => Err(mismatch("kv_write")),
    }
}

/// [`kv_write`] of one token for each of several sequences: row `i` of `keys` and `values`
/// (`[sequences, kv_heads · head_dim]`) into the rings `key_rings[i]` and `value_rings[i]`
/// (`[kv_heads, capacities[i], head_dim]`) at `positions[i]`, in one launch on a GPU.
#[allow(clippy::too_many_arguments)]
pub fn kv_write_batch(
    key_rings: &mut [&mut KvBuffer],
    value_rings: &mut [&mut KvBuffer],
    capacities: &[usize],
    keys: &Tensor,
    values: &Tensor,
    kv_heads: usize,
    head_dim: usize,
    positions: &Positions,
) -> Result<()> {
    let row = kv_heads * head_dim;
    let n = key_rings.len();
    check(
        value_rings.len() == n
            && capacities.len() == n
            && positions.len() == n
            && keys.len() == n * row
            && values.len() == n * row
            && key_rings
                .iter()
                .chain(value_rings.iter())
                .zip(capacities.iter().chain(capacities))
                .all(|(c, &cap)| cap > 0 && c.len() == cap * row),
        || {
            format!(
                "writing {:?} into {n} caches of {capacities:?} × {row}",
                keys.shape()
            )
        },
    )?;
    match (&keys.storage, &values.storage) {
        (Storage::Host(k), Storage::Host(v)) => {
            let rings = key_rings.iter_mut().zip(value_rings.iter_mut());
            for (i, (kr, vr)) in rings.enumerate() {
                let (p, cap) = (positions.as_slice()[i], capacities[i]);
                let rows = i * row..(i + 1) * row;
                write_host_ring(kr, &k[rows.clone()], kv_heads, head_dim, cap, p)?;
                write_host_ring(vr, &v[rows], kv_heads, head_dim, cap, p)?;
            }
            Ok(())
        }
        (Storage::Cuda(kb), Storage::Cuda(vb)) if kb.gpu().same(vb.gpu()) => {
            // Key rings' addresses, then value rings', all of one precision.
            let half = key_rings.first().map(|r| r.precision() == KvPrecision::F16);
            let ptrs = key_rings
                .iter()
                .chain(value_rings.iter())
                .map(|c| match &c.storage {
                    KvStorage::Cuda(r) if r.gpu().same(kb.gpu()) && Some(r.is_half()) == half => {
                        Ok(r.ptr())
                    }
                    _ => Err(mismatch("kv_write_batch")),
                })
                .collect::<Result<Vec<u64>>>()?;
            let half = half.unwrap_or(false);
            cuda::ops::kv_write_batch(
                &ptrs,
                half,
                capacities,
                [kb, vb],
                kv_heads,
                head_dim,
                positions,
            )
        }
        _ => Err(mismatch("kv_write_batch")),
    }
}

/// Attention's heads: `heads` query heads and `kv_heads` key/value heads of `head_dim` features.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// A rotation by position (RoPE), as [`rope_pair_inplace`] applies it: one frequency per pair
/// of features; neighbours paired with `traditional`, else the halves of each head.
#[derive(Clone, Copy)]
pub struct Rotation<'a> {
    pub inv_freqs: &'a Tensor,
    pub traditional: bool,
}

/// Where a token's keys and values go: a cache's two rings of `capacity` slots, as
/// [`kv_write`] writes them.
pub struct KvTarget<'a> {
    pub keys: &'a mut KvBuffer,
    pub values: &'a mut KvBuffer,
    pub capacity: usize,
}

/// Attention's projections of one token, its rotation and its cache write in one launch on a
/// GPU: `ws` are the query, key and value projections of `x` (normed first by `norm`), each
/// with its bias if it has one, the queries and keys rotated at `positions` by `rope`, the keys
/// and values written into `cache`. The same numbers as [`quantized_matmul_group`],
/// [`add_row_inplace`], [`rope_pair_inplace`] and [`kv_write`] in turn. Returns the rotated
/// queries, or `None` where the fused kernel does not apply (the host, more than one token,
/// widths other than 4 and 8 bits, an exact GPU handle, a rotation of part of each head),
/// having written nothing: the caller then takes those steps.
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
    let (Storage::Cuda(xb), Storage::Cuda(freqs), KvStorage::Cuda(keys), KvStorage::Cuda(values)) = (
        &x.storage,
        &rope.inv_freqs.storage,
        &mut cache.keys.storage,
        &mut cache.values.storage,
    ) else {
        return Ok(None);
    };
    if x.rows() != 1 || positions.len() != 1 || 2 * freqs.len() != head_dim {
        return Ok(None);
    }
    let ring = cache.capacity * rows[1];
    check(keys.len() == ring && values.len() == ring, || {
        format!("a cache of {} slots × {}", cache.capacity, rows[1])
    })?;
    if keys.is_half() != values.is_half()
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
    let q = cuda::ops::qkv_rope_write(
        placed,
        xb,
        folded,
        shape,
        (freqs, rope.traditional),
        positions,
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
    cuda::ops::QuantShape,
    Option<&'a Buffer>,
)> {
    let bias = match bias.map(|b| &b.storage) {
        None => None,
        Some(Storage::Cuda(b)) if b.gpu().same(gpu) => Some(b),
        Some(_) => return Err(mismatch("qkv_rope_write")),
    };
    Ok((w.on_gpu(gpu)?, w.shape(), bias))
}

/// Copies positions `positions` from a ring of `src_capacity` slots to one of `dst_capacity`
/// of the same precision.
pub fn kv_move(
    src: &KvBuffer,
    src_capacity: usize,
    dst: &mut KvBuffer,
    dst_capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: std::ops::Range<usize>,
) -> Result<()> {
    let row = kv_heads * head_dim;
    check(
        src.len() == src_capacity * row && dst.len() == dst_capacity * row,
        || "kv_move between caches of other shapes".into(),
    )?;
    let (h, d, p) = (kv_heads, head_dim, positions.clone());
    match (&src.storage, &mut dst.storage) {
        (KvStorage::HostF32(s), KvStorage::HostF32(t)) => {
            cpu::attention::kv_move(s, src_capacity, t, dst_capacity, h, d, p);
            Ok(())
        }
        (KvStorage::HostF16(s), KvStorage::HostF16(t)) => {
            cpu::attention::kv_move(s, src_capacity, t, dst_capacity, h, d, p);
            Ok(())
        }
        (KvStorage::HostQ8(s), KvStorage::HostQ8(t)) => {
            let groups = d / cpu::attention::Q8_GROUP;
            let (sc, dc) = (src_capacity, dst_capacity);
            cpu::attention::kv_move(&s.codes, sc, &mut t.codes, dc, h, d, p.clone());
            cpu::attention::kv_move(&s.scales, sc, &mut t.scales, dc, h, groups, p.clone());
            cpu::attention::kv_move(&s.biases, sc, &mut t.biases, dc, h, groups, p);
            Ok(())
        }
        (KvStorage::Cuda(s), KvStorage::Cuda(t))
            if s.gpu().same(t.gpu()) && s.is_half() == t.is_half() =>
        {
            let (p0, p1) = (p.start, p.end);
            cuda::ops::kv_move(s, src_capacity, t, dst_capacity, h, d, p0, p1)
        }
        _ => Err(mismatch("kv_move")),
    }
}

/// Scaled dot-product attention of `q` (`[tokens, heads · head_dim]`) over `kv`: query `t`
/// sees positions up to `positions[t]` (causal) within the window, and query head `h` reads
/// key head `h / (heads / kv_heads)` (grouped-query attention). Returns `[tokens, heads ·
/// head_dim]`.
pub fn attention(
    q: &Tensor,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    kv: &Kv,
    scale: f32,
) -> Result<Tensor> {
    check_kv(q, positions.len(), heads, head_dim, kv)?;
    let shape = vec![positions.len(), heads * head_dim];
    let p = positions.as_slice();
    match &q.storage {
        Storage::Host(q) => {
            let mut out = vec![0.0; q.len()];
            host_attention(q, heads, head_dim, p, kv, scale, &mut out)?;
            Ok(Tensor::new(shape, out))
        }
        Storage::Cuda(qb) => {
            let ring = kv_ring(qb, kv)?;
            let out = cuda::ops::attention(qb, heads, head_dim, positions, &ring, scale)?;
            Ok(Tensor::on_gpu(shape, out))
        }
    }
}

/// Host caches as the CPU attention kernels read them, all of one precision.
enum HostViews<'a> {
    F32(Vec<cpu::attention::KvView<&'a [f32]>>),
    F16(Vec<cpu::attention::KvView<&'a [half::f16]>>),
    Q8(Vec<cpu::attention::KvView<cpu::attention::Q8Rows<'a>>>),
}

impl<'a> HostViews<'a> {
    /// `kvs` as views; an error for `op` where one is not on the host in the first's precision.
    fn of(kvs: &[Kv<'a>], op: &str) -> Result<Self> {
        fn views<'a, R: cpu::attention::KvRows>(
            kvs: &[Kv<'a>],
            op: &str,
            rows: impl Fn(&'a KvStorage) -> Option<R>,
        ) -> Result<Vec<cpu::attention::KvView<R>>> {
            kvs.iter()
                .map(|kv| {
                    Ok(cpu::attention::KvView {
                        keys: rows(&kv.keys.storage).ok_or_else(|| mismatch(op))?,
                        values: rows(&kv.values.storage).ok_or_else(|| mismatch(op))?,
                        kv_heads: kv.kv_heads,
                        capacity: kv.capacity,
                        start: kv.start,
                        end: kv.end,
                        window: kv.window,
                    })
                })
                .collect()
        }
        Ok(match kvs.first().map(|kv| &kv.keys.storage) {
            Some(KvStorage::HostF32(_)) => HostViews::F32(views(kvs, op, |s| match s {
                KvStorage::HostF32(v) => Some(&v[..]),
                _ => None,
            })?),
            Some(KvStorage::HostF16(_)) => HostViews::F16(views(kvs, op, |s| match s {
                KvStorage::HostF16(v) => Some(&v[..]),
                _ => None,
            })?),
            Some(KvStorage::HostQ8(_)) => HostViews::Q8(views(kvs, op, |s| match s {
                KvStorage::HostQ8(v) => Some(v.rows()),
                _ => None,
            })?),
            _ => return Err(mismatch(op)),
        })
    }
}

/// [`attention`] on the host into `out`, over rings of any host precision.
fn host_attention(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kv: &Kv,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let (h, d, p) = (heads, head_dim, positions);
    match HostViews::of(std::slice::from_ref(kv), "attention")? {
        HostViews::F32(v) => cpu::attention::attention(q, h, d, p, &v[0], scale, out),
        HostViews::F16(v) => cpu::attention::attention(q, h, d, p, &v[0], scale, out),
        HostViews::Q8(v) => cpu::attention::attention(q, h, d, p, &v[0], scale, out),
    }
    Ok(())
}

/// [`attention_batch`] on the host into `out`: every cache in the first one's precision.
fn host_attention_batch(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kvs: &[Kv],
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let Some(first) = kvs.first() else {
        return Ok(());
    };
    check(kvs.iter().all(|kv| kv.kv_heads == first.kv_heads), || {
        "a batch's caches differ in heads".into()
    })?;
    let (h, d, p) = (heads, head_dim, positions);
    match HostViews::of(kvs, "attention_batch")? {
        HostViews::F32(v) => cpu::attention::attention_batch(q, h, d, p, &v, scale, out),
        HostViews::F16(v) => cpu::attention::attention_batch(q, h, d, p, &v, scale, out),
        HostViews::Q8(v) => cpu::attention::attention_batch(q, h, d, p, &v, scale, out),
    }
    Ok(())
}

/// Refuses a cache that `tokens` queries of `q` (`heads` of `head_dim`) cannot attend over.
fn check_kv(q: &Tensor, tokens: usize, heads: usize, head_dim: usize, kv: &Kv) -> Result<()> {
    let row = kv.kv_heads * head_dim;
    check(
        q.len() == tokens * heads * head_dim
            && kv.kv_heads > 0
            && heads.is_multiple_of(kv.kv_heads)
            && kv.keys.len() == kv.capacity * row
            && kv.values.len() == kv.capacity * row
            && kv.start <= kv.end
            && kv.end - kv.start <= kv.capacity,
        || {
            format!(
                "attention of {:?} ({heads} heads of {head_dim}) over {} KV heads × {}",
                q.shape(),
                kv.kv_heads,
                kv.capacity
            )
        },
    )
}

/// `kv` as the CUDA attention kernels read it, when it is on `q`'s GPU.
fn kv_ring<'a>(q: &Buffer, kv: &Kv<'a>) -> Result<cuda::ops::KvRing<'a>> {
    match (&kv.keys.storage, &kv.values.storage) {
        (KvStorage::Cuda(k), KvStorage::Cuda(v))
            if q.gpu().same(k.gpu()) && q.gpu().same(v.gpu()) && k.is_half() == v.is_half() =>
        {
            Ok(cuda::ops::KvRing {
                keys: k,
                values: v,
                kv_heads: kv.kv_heads,
                capacity: kv.capacity,
                start: kv.start,
                end: kv.end,
                window: kv.window.unwrap_or(usize::MAX),
            })
        }
        _ => Err(mismatch("attention")),
    }
}

/// [`attention`] of one query token for each of several sequences: row `i` of `q`
/// (`[sequences, heads · head_dim]`) sits at `positions[i]` and attends over `kvs[i]`; one
/// launch on a GPU.
pub fn attention_batch(
    q: &Tensor,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    kvs: &[Kv],
    scale: f32,
) -> Result<Tensor> {
    let n = kvs.len();
    check(positions.len() == n, || {
        format!("{} positions for {n} caches", positions.len())
    })?;
    for kv in kvs {
        check_kv(q, n, heads, head_dim, kv)?;
    }
    match &q.storage {
        Storage::Host(q) => {
            let mut out = vec![0.0; q.len()];
            host_attention_batch(
                q,
                heads,
                head_dim,
                positions.as_slice(),
                kvs,
                scale,
                &mut out,
            )?;
            Ok(Tensor::new(vec![n, heads * head_dim], out))
        }
        Storage::Cuda(qb) => {
            let rings = kvs
                .iter()
                .map(|kv| kv_ring(qb, kv))
                .collect::<Result<Vec<_>>>()?;
            let out = cuda::ops::attention_batch(qb, heads, head_dim, positions, &rings, scale)?;
            Ok(Tensor::on_gpu(vec![n, heads * head_dim], out))
        }
    }
}

// ---- matmuls and embeddings ---------------------------------------------------------------------

/// A weight matrix the matmul and row-lookup ops take: MLX-quantized or float.
pub trait WeightMatrix {
    /// `[rows, cols]`: rows are output features.
    fn dims(&self) -> (usize, usize);
    /// `y[m, rows] = x[m, cols] · Wᵀ` on the host.
    fn matmul_host(&self, x: &[f32], m: usize, y: &mut [f32]);
    /// The same on `x`'s GPU, from the copy placed there: a new buffer, or (`AddTo`) a sum
    /// into an existing one.
    fn matmul_gpu(&self, x: &Buffer, m: usize, out: cuda::ops::Output) -> Result<Option<Buffer>>;
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
        cpu::qmatmul::matmul(&self.view(), x, m, y);
    }
    fn matmul_gpu(&self, x: &Buffer, m: usize, out: cuda::ops::Output) -> Result<Option<Buffer>> {
        cuda::ops::quantized_matmul(self.on_gpu(x.gpu())?, self.shape(), x, m, out)
    }
    fn row_host(&self, i: usize, out: &mut [f32]) {
        self.dequantize_row(i, out);
    }
    fn rows_gpu(&self, gpu: &cuda::Gpu, ids: &[usize]) -> Result<Buffer> {
        cuda::ops::quantized_rows(self.on_gpu(gpu)?, self.shape(), ids)
    }
}

impl WeightMatrix for FloatMatrix {
    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn matmul_host(&self, x: &[f32], m: usize, y: &mut [f32]) {
        cpu::dense::matmul(self, x, m, y);
    }
    fn matmul_gpu(&self, x: &Buffer, m: usize, out: cuda::ops::Output) -> Result<Option<Buffer>> {
        let y = cuda::ops::dense_matmul(self.on_gpu(x.gpu())?, self.rows, self.cols, x, m)?;
        match out {
            cuda::ops::Output::New => Ok(Some(y)),
            cuda::ops::Output::AddTo(sum) => {
                cuda::ops::binary("add", sum, &y)?;
                Ok(None)
            }
        }
    }
    fn row_host(&self, i: usize, out: &mut [f32]) {
        self.row_to_f32(i, out);
    }
    fn rows_gpu(&self, gpu: &cuda::Gpu, ids: &[usize]) -> Result<Buffer> {
        cuda::ops::dense_rows(self.on_gpu(gpu)?, self.cols, ids)
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
            let y = w.matmul_gpu(b, m, cuda::ops::Output::New)?;
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
) -> Option<cuda::ops::InputNorm<'a>> {
    let Some(n) = norm else { return Some(None) };
    match &n.weight.storage {
        Storage::Cuda(w) if w.gpu().same(x.gpu()) && w.len() == cols => Some(Some((w, n.eps))),
        _ => None,
    }
}

/// `norm(x) · Wⱼᵀ` for each of `ws` (a layer's q/k/v projections, say): on the CPU one job
/// over all their rows, with the activations quantized once; on a GPU one launch where the
/// int16-activation GEMV applies (the norm folded in), else one matmul each.
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
        if let Some(ys) = cuda::ops::quantized_matmul_group(&placed, b, x.rows(), folded)? {
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
    let views: Vec<_> = ws.iter().map(|w| w.view()).collect();
    let view_refs: Vec<_> = views.iter().collect();
    let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
    cpu::qmatmul::matmul_group(&view_refs, v, m, &mut outs);
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
            w.matmul_gpu(b, x.rows(), cuda::ops::Output::AddTo(sum))?;
            Ok(())
        }
        _ => add_inplace(residual, &matmul(w, x)?),
    }
}

/// The activation between the gate and up projections of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
    /// GeGLU: `gelu_approx(gate) · up`.
    GeluApprox,
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
    let same_format = (gate.rows, gate.cols, gate.bits, gate.group_size)
        == (up.rows, up.cols, up.bits, up.group_size);
    let gpu = match &x.storage {
        Storage::Cuda(b) if same_format && x.cols() == gate.cols => {
            foldable(b, x.cols(), norm).map(|folded| (b, folded))
        }
        _ => None,
    };
    if let Some((b, folded)) = gpu {
        let kind = match act {
            Activation::Silu => cuda::ops::Glu::Silu,
            Activation::GeluApprox => cuda::ops::Glu::GeluApprox,
        };
        let (g, u) = (gate.on_gpu(b.gpu())?, up.on_gpu(b.gpu())?);
        let (s, m) = (gate.shape(), x.rows());
        if let Some(out) = cuda::ops::quantized_glu(g, u, s, b, m, kind, folded)? {
            return Ok(Tensor::on_gpu(with_last(x.shape(), gate.rows), out));
        }
    }
    let x = &*normed(x, norm)?;
    let mut pair = quantized_matmul_group(&[gate, up], x, None)?.into_iter();
    let (mut h, u) = (pair.next().unwrap(), pair.next().unwrap());
    match act {
        Activation::Silu => silu_mul_inplace(&mut h, &u)?,
        Activation::GeluApprox => gelu_approx_mul_inplace(&mut h, &u)?,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_take_the_first_maximum_and_pass_over_nans() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 2.0]), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN]), 0);
        let x = Tensor::new(vec![2, 3], vec![0.0, -1.0, 0.0, -5.0, -4.0, -4.0]);
        let picks = greedy_rows(&x).unwrap();
        assert_eq!(picks.iter().map(|p| p.id).collect::<Vec<_>>(), [0, 1]);
        // Two maxima of 0 beside e^-1: each has probability 1 / (2 + e^-1).
        let expected = -(2.0 + (-1.0f64).exp()).ln() as f32;
        assert!((picks[0].logprob - expected).abs() < 1e-6, "{picks:?}");
        let empty_rows = Tensor::new(vec![2, 0], vec![]);
        assert!(greedy_rows(&empty_rows).is_err());
    }
}
