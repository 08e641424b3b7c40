//! Launchers of the kernels in `kernels.cu`, one per engine op. Shapes are checked by the
//! callers in [`crate::ops`]; these take buffers of the right lengths.
//!
//! Kernel arguments are raw device addresses, so that an op may read and write one buffer.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::{err, Buffer, DenseWeights, Gpu, QuantizedWeights};
use crate::{EngineError, Positions};

/// Up to this many activation rows a matmul is a GEMV that streams each weight once; more go
/// through cuBLAS on dequantized weights.
pub const GEMV_MAX_ROWS: usize = 8;

type Result<T> = std::result::Result<T, EngineError>;

/// The raw address of a device allocation.
fn addr<T>(gpu: &Gpu, slice: &CudaSlice<T>) -> u64 {
    slice.device_ptr(gpu.stream()).0
}

/// Launches kernel `$name` with `$cfg` and the arguments in order (each an expression of the
/// exact type of the kernel's parameter: u64 for pointers, i32 for int, i64, f32).
macro_rules! launch {
    ($gpu:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let gpu: &Gpu = $gpu;
        let f = gpu.function($name)?;
        let mut builder = gpu.stream().launch_builder(&f);
        $(
            let arg = $arg;
            builder.arg(&arg);
        )*
        // SAFETY: the arguments match the kernel's parameters in number and type, and the
        // callers size the buffers for the indices the kernel computes from them.
        unsafe { builder.launch($cfg) }.map_err(err)?;
    }};
}

fn positions_on_gpu(p: &Positions) -> Result<&CudaSlice<i32>> {
    p.gpu
        .as_ref()
        .ok_or_else(|| EngineError::Device("positions were made for the CPU".into()))
}

fn int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| EngineError::Shape(format!("{v} does not fit the kernels' int")))
}

/// A grid-stride launch over `n` elements.
fn elements(gpu: &Gpu, n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, gpu.multiprocessors() * 16);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn blocks(grid: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

// ---- element-wise ---------------------------------------------------------------------------

pub fn add_row(x: &mut Buffer, row: &Buffer) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, "add_row", elements(&g, x.len()); x.ptr(), row.ptr(), x.len() as i64, int(row.len())?);
    Ok(())
}

pub fn scale(x: &mut Buffer, s: f32) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, "scale", elements(&g, x.len()); x.ptr(), s, x.len() as i64);
    Ok(())
}

pub fn softcap(x: &mut Buffer, cap: f32) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, "softcap", elements(&g, x.len()); x.ptr(), cap, x.len() as i64);
    Ok(())
}

pub fn silu(x: &mut Buffer) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, "silu", elements(&g, x.len()); x.ptr(), x.len() as i64);
    Ok(())
}

/// `x = op(x, y)` for the binary kernels `add`, `silu_mul`, `gelu_mul` and `sigmoid_mul`.
pub fn binary(kernel: &str, x: &mut Buffer, y: &Buffer) -> Result<()> {
    let g = x.gpu().clone();
    launch!(&g, kernel, elements(&g, x.len()); x.ptr(), y.ptr(), x.len() as i64);
    Ok(())
}

/// Columns `start..start + width` of every `cols`-wide row.
pub fn columns(x: &Buffer, cols: usize, start: usize, width: usize) -> Result<Buffer> {
    let g = x.gpu().clone();
    let rows = x.len() / cols;
    let out = g.zeros(rows * width)?;
    launch!(&g, "columns", elements(&g, rows * width);
        x.ptr(), out.ptr(), rows as i64, int(cols)?, int(start)?, int(width)?);
    Ok(out)
}

/// Elements `start..start + len`, copied.
pub fn range(x: &Buffer, start: usize, len: usize) -> Result<Buffer> {
    let g = x.gpu().clone();
    let mut out = g.zeros(len)?;
    if len > 0 {
        g.stream()
            .memcpy_dtod(&x.slice.slice(start..start + len), &mut out.slice)
            .map_err(err)?;
    }
    Ok(out)
}

pub fn gather_rows(x: &Buffer, cols: usize, rows: &[usize]) -> Result<Buffer> {
    let g = x.gpu().clone();
    let idx = g.indices(rows.iter().copied())?;
    let out = g.zeros(rows.len() * cols)?;
    launch!(&g, "gather_rows", elements(&g, rows.len() * cols);
        x.ptr(), addr(&g, &idx), out.ptr(), rows.len() as i64, int(cols)?);
    Ok(out)
}

/// `y[rows[i]] += weights[i] · src[i]` (distinct rows).
pub fn scatter_add_rows(
    y: &mut Buffer,
    src: &Buffer,
    cols: usize,
    rows: &[usize],
    weights: &[f32],
) -> Result<()> {
    let g = y.gpu().clone();
    let idx = g.indices(rows.iter().copied())?;
    let w = g.upload(weights)?;
    launch!(&g, "scatter_add_rows", elements(&g, rows.len() * cols);
        y.ptr(), src.ptr(), addr(&g, &idx), w.ptr(), rows.len() as i64, int(cols)?);
    Ok(())
}

// ---- norms, RoPE ------------------------------------------------------------------------------

/// RMSNorm of each `cols`-wide row of `x` into `out` (which may be `x`'s own address).
pub fn rms_norm(
    x: u64,
    weight: &Buffer,
    out: u64,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let g = weight.gpu().clone();
    let threads = if cols >= 1024 { 512 } else { 128 };
    launch!(&g, "rms_norm", blocks(rows, threads); x, weight.ptr(), out, int(cols)?, eps);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut Buffer,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    inv_freqs: &Buffer,
    traditional: bool,
) -> Result<()> {
    let g = x.gpu().clone();
    let pos = positions_on_gpu(positions)?;
    let half = inv_freqs.len();
    let pairs = positions.len() * heads * half;
    launch!(&g, "rope", elements(&g, pairs);
        x.ptr(), addr(&g, pos), inv_freqs.ptr(), int(positions.len())?, int(heads)?,
        int(head_dim)?, int(half)?, traditional as i32);
    Ok(())
}

// ---- caches and attention -----------------------------------------------------------------------

/// Writes `src` (`[tokens, kv_heads, d]`) at positions `first..` of a ring of `capacity` slots.
pub fn kv_write(
    cache: &mut Buffer,
    src: &Buffer,
    kv_heads: usize,
    d: usize,
    capacity: usize,
    first: usize,
) -> Result<()> {
    let g = cache.gpu().clone();
    let tokens = src.len() / (kv_heads * d);
    launch!(&g, "kv_write", elements(&g, src.len());
        cache.ptr(), src.ptr(), int(tokens)?, int(kv_heads)?, int(d)?, int(capacity)?, first as i64);
    Ok(())
}

/// Copies positions `p0..p1` between rings of different capacities.
#[allow(clippy::too_many_arguments)]
pub fn kv_move(
    src: &Buffer,
    src_capacity: usize,
    dst: &mut Buffer,
    dst_capacity: usize,
    kv_heads: usize,
    d: usize,
    p0: usize,
    p1: usize,
) -> Result<()> {
    if p1 <= p0 {
        return Ok(());
    }
    let g = src.gpu().clone();
    launch!(&g, "kv_move", elements(&g, (p1 - p0) * kv_heads * d);
        src.ptr(), int(src_capacity)?, dst.ptr(), int(dst_capacity)?, int(kv_heads)?, int(d)?,
        p0 as i64, p1 as i64);
    Ok(())
}

/// What an attention call reads from a cache (see `attention_split` in the kernels).
pub struct KvRing<'a> {
    pub keys: &'a Buffer,
    pub values: &'a Buffer,
    pub kv_heads: usize,
    pub capacity: usize,
    pub start: usize,
    pub end: usize,
    /// `usize::MAX` for full attention.
    pub window: usize,
}

pub fn attention(
    q: &Buffer,
    heads: usize,
    d: usize,
    positions: &Positions,
    kv: &KvRing,
    scale: f32,
) -> Result<Buffer> {
    let g = q.gpu().clone();
    let tokens = positions.len();
    let lanes = d.div_ceil(32);
    let per_lane = [1, 2, 4, 8, 16]
        .into_iter()
        .find(|&e| e >= lanes)
        .ok_or_else(|| EngineError::Shape(format!("head dim {d} over the GPU attention's 512")))?;
    let pos = positions_on_gpu(positions)?;
    // Few queries (decoding) split each one's keys over several warps so the GPU fills up.
    let visible = (kv.end - kv.start).min(kv.window);
    let splits = if tokens * heads < 4 * g.multiprocessors() {
        visible.div_ceil(256).clamp(1, 32)
    } else {
        1
    };
    let per_split = visible.div_ceil(splits).div_ceil(32) * 32;
    let out = g.zeros(tokens * heads * d)?;
    let part = g.zeros(if splits > 1 {
        tokens * heads * splits * (d + 2)
    } else {
        1
    })?;
    let window = kv.window.min(i64::MAX as usize) as i64;
    let cfg = LaunchConfig {
        grid_dim: ((tokens * heads) as u32, splits as u32, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(&g, &format!("attention_{per_lane}"), cfg;
        q.ptr(), kv.keys.ptr(), kv.values.ptr(), addr(&g, pos), out.ptr(), part.ptr(),
        int(heads)?, int(kv.kv_heads)?, int(d)?, int(kv.capacity)?, kv.start as i64,
        kv.end as i64, window, scale, int(splits)?, int(per_split)?);
    if splits > 1 {
        launch!(&g, "attention_combine", blocks(tokens * heads, 32);
            part.ptr(), out.ptr(), int(d)?, int(splits)?);
    }
    Ok(out)
}

// ---- recurrent layers ---------------------------------------------------------------------------

pub fn causal_conv1d(
    x: &Buffer,
    weight: &Buffer,
    state: &mut Buffer,
    channels: usize,
    kernel: usize,
) -> Result<Buffer> {
    if kernel > 8 {
        return Err(EngineError::Shape(format!(
            "conv1d kernel {kernel} over the GPU's 8"
        )));
    }
    let g = x.gpu().clone();
    let tokens = x.len() / channels;
    let out = g.zeros(x.len())?;
    launch!(&g, "causal_conv1d", blocks(channels.div_ceil(128), 128);
        x.ptr(), weight.ptr(), state.ptr(), out.ptr(), int(tokens)?, int(channels)?, int(kernel)?);
    Ok(out)
}

pub fn delta_gates(
    a: &Buffer,
    b: &Buffer,
    dt_bias: &Buffer,
    neg_a: &Buffer,
) -> Result<(Buffer, Buffer)> {
    let g = a.gpu().clone();
    let (decay, beta) = (g.zeros(a.len())?, g.zeros(a.len())?);
    launch!(&g, "delta_gates", elements(&g, a.len());
        a.ptr(), b.ptr(), dt_bias.ptr(), neg_a.ptr(), decay.ptr(), beta.ptr(), a.len() as i64,
        int(dt_bias.len())?);
    Ok((decay, beta))
}

#[allow(clippy::too_many_arguments)]
pub fn gated_delta(
    q: &Buffer,
    k: &Buffer,
    v: &Buffer,
    decay: &Buffer,
    beta: &Buffer,
    state: &mut Buffer,
    dims: crate::recurrent::DeltaRuleDims,
) -> Result<Buffer> {
    let g = q.gpu().clone();
    let tokens = decay.len() / dims.v_heads;
    let per_lane = [1, 2, 4, 8]
        .into_iter()
        .find(|&e| 32 * e >= dims.k_dim)
        .ok_or_else(|| {
            EngineError::Shape(format!("key head dim {} over the GPU's 256", dims.k_dim))
        })?;
    let y = g.zeros(v.len())?;
    let rows = dims.v_heads * dims.v_dim;
    launch!(&g, &format!("gated_delta_{per_lane}"), blocks(rows.div_ceil(4), 128);
        q.ptr(), k.ptr(), v.ptr(), decay.ptr(), beta.ptr(), state.ptr(), y.ptr(), int(tokens)?,
        int(dims.k_heads)?, int(dims.v_heads)?, int(dims.k_dim)?, int(dims.v_dim)?);
    Ok(y)
}

// ---- matmuls and embeddings ---------------------------------------------------------------------

/// The shape of an MLX-quantized matrix.
#[derive(Clone, Copy)]
pub struct QuantShape {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group_size: usize,
}

/// `y[m, rows] = x[m, cols] · Wᵀ`.
pub fn quantized_matmul(
    w: &QuantizedWeights,
    s: QuantShape,
    x: &Buffer,
    m: usize,
) -> Result<Buffer> {
    let g = w.gpu.clone();
    let y = g.zeros(m * s.rows)?;
    let (packed, scales, biases) = (
        addr(&g, &w.packed),
        addr(&g, &w.scales),
        addr(&g, &w.biases),
    );
    if m <= GEMV_MAX_ROWS {
        // Two rows per warp share each activation load once there are rows enough to fill the GPU.
        let rows_per_warp = if s.rows >= 4096 { 2 } else { 1 };
        let name = format!("qgemv{rows_per_warp}_{}_{}", s.bits, w.scale_type);
        launch!(&g, &name, blocks(s.rows.div_ceil(4 * rows_per_warp), 128);
            packed, scales, biases, x.ptr(), y.ptr(), int(s.rows)?, int(s.cols)?,
            int(s.group_size)?, int(m)?);
        return Ok(y);
    }
    let exact = x.gpu().exact_gemm();
    let kind = if exact { "f32" } else { "bf16" };
    let width = if exact { 4 } else { 2 };
    let dense = g.alloc_raw::<u8>(s.rows * s.cols * width)?;
    let name = format!("qdequant_{kind}_{}_{}", s.bits, w.scale_type);
    launch!(&g, &name, elements(&g, s.rows * s.cols / 32);
        packed, scales, biases, addr(&g, &dense), int(s.rows)?, int(s.cols)?, int(s.group_size)?);
    gemm(&g, addr(&g, &dense), !exact, s.rows, s.cols, x, m, &y)?;
    Ok(y)
}

pub fn dense_matmul(
    w: &DenseWeights,
    rows: usize,
    cols: usize,
    x: &Buffer,
    m: usize,
) -> Result<Buffer> {
    let g = w.gpu.clone();
    let y = g.zeros(m * rows)?;
    let data = addr(&g, &w.data);
    if m <= GEMV_MAX_ROWS {
        launch!(&g, &format!("dgemv_{}", w.dtype), blocks(rows.div_ceil(4), 128);
            data, x.ptr(), y.ptr(), int(rows)?, int(cols)?, int(m)?);
        return Ok(y);
    }
    if x.gpu().exact_gemm() {
        let all: Vec<usize> = (0..rows).collect();
        let f32_weights = dense_rows(w, cols, &all)?;
        gemm(&g, f32_weights.ptr(), false, rows, cols, x, m, &y)?;
    } else {
        let converted = g.alloc_raw::<u16>(rows * cols)?;
        launch!(&g, &format!("to_bf16_{}", w.dtype), elements(&g, rows * cols);
            data, addr(&g, &converted), (rows * cols) as i64);
        gemm(&g, addr(&g, &converted), true, rows, cols, x, m, &y)?;
    }
    Ok(y)
}

/// `y[m, n] = x[m, k] · Wᵀ` by cuBLAS, `W` row-major `[n, k]` in bf16 or f32 at `w`; bf16
/// weights meet x rounded to bf16, f32 accumulation either way.
#[allow(clippy::too_many_arguments)]
fn gemm(
    g: &Gpu,
    w: u64,
    bf16: bool,
    n: usize,
    k: usize,
    x: &Buffer,
    m: usize,
    y: &Buffer,
) -> Result<()> {
    let x_bf16;
    let (x_ptr, ty) = if bf16 {
        x_bf16 = g.alloc_raw::<u16>(m * k)?;
        launch!(g, "f32_to_bf16", elements(g, m * k); x.ptr(), addr(g, &x_bf16), (m * k) as i64);
        (addr(g, &x_bf16), cudaDataType::CUDA_R_16BF)
    } else {
        (x.ptr(), cudaDataType::CUDA_R_32F)
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // Row-major y[m, n] is column-major yᵀ[n, m] = W · xᵀ, with W column-major [k, n] transposed.
    // SAFETY: the pointers address buffers of n·k, m·k and m·n elements of the stated types.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *g.blas().handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            int(n)?,
            int(m)?,
            int(k)?,
            (&alpha as *const f32).cast(),
            w as *const _,
            ty,
            int(k)?,
            x_ptr as *const _,
            ty,
            int(k)?,
            (&beta as *const f32).cast(),
            y.ptr() as *mut _,
            cudaDataType::CUDA_R_32F,
            int(n)?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(err)
}

/// Rows `ids` of the matrix, dequantized: `[ids.len(), cols]`.
pub fn quantized_rows(w: &QuantizedWeights, s: QuantShape, ids: &[usize]) -> Result<Buffer> {
    let g = w.gpu.clone();
    let idx = g.indices(ids.iter().copied())?;
    let out = g.zeros(ids.len() * s.cols)?;
    if !ids.is_empty() {
        launch!(&g, &format!("qrows_{}_{}", s.bits, w.scale_type), blocks(ids.len(), 128);
            addr(&g, &w.packed), addr(&g, &w.scales), addr(&g, &w.biases), addr(&g, &idx),
            out.ptr(), int(s.cols)?, int(s.group_size)?);
    }
    Ok(out)
}

pub fn dense_rows(w: &DenseWeights, cols: usize, ids: &[usize]) -> Result<Buffer> {
    let g = w.gpu.clone();
    let idx = g.indices(ids.iter().copied())?;
    let out = g.zeros(ids.len() * cols)?;
    if !ids.is_empty() {
        launch!(&g, &format!("drows_{}", w.dtype), blocks(ids.len(), 256);
            addr(&g, &w.data), addr(&g, &idx), out.ptr(), int(cols)?);
    }
    Ok(out)
}
