//! Launchers of the products with weight matrices (`kernels/matmul.cu`): GEMVs, tensor-core
//! products from packed weights, cuBLAS on dequantized ones, the fused projections and
//! embedding rows.
//!
//! The float quantization modes (mxfp4, nvfp4, mxfp8) have a GEMV, a gated-MLP GEMV, embedding
//! rows and the dequantization for cuBLAS of their own (`fgemv4`, `fglu`, `frows`, `fdequant`);
//! the tensor-core products, the int16-activation GEMVs and the fused projections are for
//! affine weights, and decline the others, whose callers then take the general path.
//!
//! Shapes are checked by the callers in [`crate::ops`]; these take buffers of the right lengths,
//! and kernel arguments are raw device addresses, so that an op may read and write one buffer.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::LaunchConfig;

use super::elementwise::binary;
use super::launch::{addr, blocks, elements, int, sliced_warps, Result};
use super::{
    err, Arg, Buffer, DenseWeights, DeviceRing, Gpu, GpuPositions, Memory, QuantizedWeights,
};
use crate::params::QuantMode;
use crate::KvPrecision;

/// Up to this many activation rows a matmul may be a GEMV that streams each weight once; more
/// go to the tensor cores: straight from 4- and 8-bit weights up to [`MMA_MAX_ROWS`] (batched
/// decoding), through cuBLAS on dequantized weights beyond (prefill, where cuBLAS's larger
/// tiles run long prompts several times faster than 64-row turns of `qmma`).
/// 4- and 8-bit weights take the tensor cores from [`MMA_MIN_ROWS`] already, and from two rows
/// where the int16 activations do not fit a block (four rows of a 14,336-wide down projection:
/// [`INT_MAX_SHARED_BYTES`]), because the f32-activation GEMV left for those takes about half
/// of a batched decode step on an H200.
pub const GEMV_MAX_ROWS: usize = 8;

/// Activation rows of the tensor-core products from packed weights (8 tiles of 8).
const MMA_MAX_ROWS: usize = 64;

/// Runs of 32 weights a warp of `qmma` takes at once (a turn, one run a lane of each quad): its
/// slices are whole turns, and its activations' rows are padded to them.
pub(super) const MMA_TURN_RUNS: usize = 4;

/// From this many activation rows the tensor cores take the products of 4- and 8-bit weights
/// where f16 operands are allowed, though the int16 GEMVs would fit up to [`GEMV_MAX_ROWS`].
/// From five rows the tensor cores beat the int16 GEMVs on an H200 decoding 4-bit llamas, by
/// more the more rows; at four the GEMVs still win.
const MMA_MIN_ROWS: usize = 5;

/// Warps per multiprocessor the tensor-core products from packed weights aim for, by slicing
/// the runs: more keep more loads in flight, fewer leave fewer slices to add up. On an H200
/// decoding many sequences, 4 or 8 balance the two best; 16 and more lose to the added slices.
const MMA_WARPS_PER_SM: usize = 8;

/// [`MMA_WARPS_PER_SM`] for the products of one tile (5-8 rows, or 2-4 whose int16 activations
/// do not fit a block), whose warps hold fewer registers: slicing to fill more of an SM keeps
/// more loads in flight. On an H200, 16 decodes 6-8 sequences of a 7B-sized llama (every
/// matrix of which takes these products there) a little faster than 32 or 64, and a small
/// llama no differently.
const MMA_ONE_TILE_WARPS_PER_SM: usize = 16;

/// Bytes of f32 weights dequantized at a time for the many-row products: well within the
/// H200's 50 MB of L2, so that the product reads them from there.
const DEQUANT_CHUNK_BYTES: usize = 16 << 20;

/// The most bytes of f32 weights dequantized at a time, where more rows than
/// [`DEQUANT_CHUNK_BYTES`] hold are needed to fill the GPU with output tiles.
const DEQUANT_MAX_BYTES: usize = 128 << 20;

/// The side of cuBLAS's output tiles, as far as filling the GPU goes.
const GEMM_TILE: usize = 128;

/// The shape and format of an MLX-quantized matrix.
#[derive(Clone, Copy, PartialEq)]
pub struct QuantShape {
    pub rows: usize,
    pub cols: usize,
    pub mode: QuantMode,
    pub bits: u32,
    pub group_size: usize,
}

impl QuantShape {
    fn affine(&self) -> bool {
        self.mode == QuantMode::Affine
    }
}

/// Threads per block of the quantized GEMVs: one run of 32 weights each across a row of `cols`,
/// from 32 to 256.
pub(super) fn row_threads(cols: usize) -> u32 {
    (cols / 32).next_power_of_two().clamp(32, 256) as u32
}

/// Shared memory of the int16-activation GEMVs (`qgemv_int`, `qglu_int`): the activations of
/// `m` rows, rounded per run of 32, in tiles of 32 runs (`quantize_acts`). `None` where they
/// do not apply: activations on an exact handle `g` (the activations' handle decides, as for
/// the cuBLAS products), other bit widths, the float modes, rows the tensor cores take
/// ([`mma_applies`]), or activations over what is left of [`INT_MAX_SHARED_BYTES`] once the
/// kernels' own arrays have theirs (then the f32-activation kernels run, for one row).
fn int_acts_bytes(g: &Gpu, s: QuantShape, m: usize) -> Option<u32> {
    let applies = !g.exact_math() && s.affine() && matches!(s.bits, 4 | 8) && !mma_applies(g, s, m);
    int_acts_fit(s, m).filter(|_| applies)
}

/// The shared memory of [`int_acts_bytes`] where it fits, whatever the handle and bits.
fn int_acts_fit(s: QuantShape, m: usize) -> Option<u32> {
    let runs = s.cols / 32;
    let bytes = m * (runs.div_ceil(32) * 2048 + runs * 8);
    let fits = m <= INT_MAX_ROWS && bytes + INT_STATIC_SHARED_BYTES <= INT_MAX_SHARED_BYTES;
    (fits && int_offsets_fit(s)).then_some(bytes as u32)
}

/// Whether the int16-activation kernels can place every weight run of `s` by 32-bit offsets
/// from the matrix's start (`RowSources` in the kernels): a matrix of at most 2^32 words
/// (16 GiB), as every projection and head of a real model is.
fn int_offsets_fit(s: QuantShape) -> bool {
    s.rows as u64 * (s.cols / 32) as u64 * u64::from(s.bits) <= 1 << 32
}

/// The most shared memory the int16-activation kernels take (their activations and own arrays),
/// past the 48 KiB a kernel gets unasked: 2 rows of a 14,336-wide down projection, or 4 of a
/// 5,632-wide one, take these kernels rather than the tensor cores. On an H200 that decodes 2-4
/// sequences a few percent faster than the unasked 48 KiB, while a limit that lets four
/// 14,336-wide rows (129 KiB) in as well decodes those slower than the tensor cores do.
const INT_MAX_SHARED_BYTES: usize = 100 << 10;

/// Activation rows the int16-activation kernels take at most: from [`MMA_MIN_ROWS`] the tensor
/// cores do, wherever these kernels could.
const INT_MAX_ROWS: usize = MMA_MIN_ROWS - 1;

/// The int16-activation kernels' own shared arrays, at most, rounded up: `qgemv_int`'s partial
/// sums (`shares`, 1 KiB for four rows) and `quantize_acts`' sums of squares (512 bytes).
const INT_STATIC_SHARED_BYTES: usize = 3 << 10;

/// Stages of each lane's pipeline of weight runs in the ring kernels ([`int_ring`];
/// `INT_RING_STAGES` in the kernels).
pub(super) const INT_RING_STAGES: usize = 4;

/// Shared bytes of one lane's pipeline in the ring kernels: per stage, two rows' 16-byte runs
/// of 4-bit weights and the 4-byte words that hold their scales and biases.
const INT_RING_LANE_BYTES: usize = INT_RING_STAGES * 2 * (16 + 4 + 4);

/// Whether the int16-activation kernels for `m` rows of matrix `s` take their weight runs
/// through a pipeline in shared memory (`RunRing` in the kernels, the `r` kernels of
/// [`int_kernel`]) rather than two stages in registers: for two to four rows of a 4-bit matrix
/// of [`RING_MIN_WEIGHTS`] or more, where the GEMV streams long enough for its bytes in flight,
/// rather than its latency, to bound it.
fn int_ring(s: QuantShape, m: usize) -> bool {
    s.bits == 4 && (2..=INT_MAX_ROWS).contains(&m) && s.rows * s.cols >= RING_MIN_WEIGHTS
}

/// The least weights of a matrix whose 2-4-row GEMVs take the ring kernels: 8 MiB at 4 bits.
/// On an H200 the ring speeds up matrices this large (a 7B-sized llama's projections, output
/// heads) and slows smaller ones, against two stages in registers; at one row it is no faster
/// (at 8 bits, twice as slow), so one-row and 8-bit GEMVs keep the registers.
const RING_MIN_WEIGHTS: usize = 1 << 24;

/// The dynamic shared memory of the int16-activation kernel for `m` rows of matrix `s` over
/// `acts` bytes of activations ([`int_acts_bytes`]): those, and where [`int_ring`] holds each
/// lane's pipeline after them (its blocks of [`int_threads`]).
fn int_shared(acts: u32, s: QuantShape, m: usize) -> u32 {
    if !int_ring(s, m) {
        return acts;
    }
    acts.next_multiple_of(16) + (int_threads(s.cols) as usize * INT_RING_LANE_BYTES) as u32
}

// The most a ring kernel takes fits the 227 KiB a block may have on the H100/H200 (blocks of up
// to 512 threads, `int_threads`).
const _: () = assert!(
    INT_MAX_SHARED_BYTES + INT_STATIC_SHARED_BYTES + 512 * INT_RING_LANE_BYTES <= 227 << 10
);

/// The int16-activation kernel `base` (`qgemv`, `qgemv3`, `qglu`) for `m` activation rows: the
/// narrowest that holds them (`qgemv_int1_4_bf16` for one, `_int2_` for two, `_int4_` for up to
/// [`INT_MAX_ROWS`]; `_int2r_`, `_int4r_` where [`int_ring`] holds), whose fewer registers let
/// more warps fit an SM: on an H200 they decode 2-4 sequences clearly faster than one kernel
/// sized for eight rows.
fn int_kernel(base: &str, s: QuantShape, scale_type: &str, m: usize) -> String {
    let width = match m {
        1 => "1",
        2 => "2",
        _ => "4",
    };
    let ring = if int_ring(s, m) { "r" } else { "" };
    format!("{base}_int{width}{ring}_{}_{scale_type}", s.bits)
}

/// Threads per block of the int16-activation GEMVs, by the length of their rows (`cols`): 8
/// warps, or 16 for rows of 4,096 weights and more. Each block rounds the activations once for
/// all its rows, so longer rows want more rows a block. The one-row kernels hold about 64
/// registers a thread (4 blocks of 8 warps an SM, or 2 of 16). On an H200, 8 warps suit rows of
/// 2,048 weights and 16 the rows of 4,096 and more: a 7B-sized llama decodes several percent
/// faster than with 8 everywhere, a small one no slower.
fn int_threads(cols: usize) -> u32 {
    if cols >= 4096 {
        512
    } else {
        256
    }
}

/// The launch of an int16-activation GEMV (`qgemv_int`, `qglu_int`) whose work is `work`
/// blocks of `threads` with `shared` bytes: as many blocks as the GPU holds at once (`resident`,
/// [`Gpu::resident_blocks`]), or fewer, each taking its share of the work's blocks (virtual
/// blocks, whose count the kernel takes as its last argument, returned here). A block rounds
/// the activations once for all of its virtual blocks, and its loads run on from one into the
/// next.
fn one_wave(
    resident: usize,
    work: usize,
    threads: u32,
    shared: u32,
) -> Result<(LaunchConfig, Arg)> {
    let grid = work.min(resident);
    let cfg = LaunchConfig {
        shared_mem_bytes: shared,
        ..blocks(grid, threads)
    };
    Ok((cfg, Arg::from(int(work)?)))
}

/// Warps that share each pair of rows in `qgemv_int` (each a share of the rows' tiles of 32
/// runs): four or two where a row has tiles enough and every share still fits one wave of the
/// kernel's `resident_warps`, else one, so that a projection of few, long rows keeps as many
/// loads in flight as a tall one without a second wave. One sequence of the 0.85B llama: its
/// down projection (2,048 rows of 5,632) takes four, its output projection two (rows of two
/// tiles), the head one; the 7.2B's take two, and at two sequences, whose kernel holds fewer
/// warps, one. On an H200 this decodes a few percent faster than two warps for every matrix of
/// fewer than 8,192 rows with two tiles or more.
fn int_parts(s: QuantShape, resident_warps: usize) -> usize {
    let tiles = (s.cols / 32).div_ceil(32);
    let pairs = s.rows.div_ceil(2);
    [4, 2]
        .into_iter()
        .find(|&parts| tiles >= parts && pairs * parts <= resident_warps)
        .unwrap_or(1)
}

/// `y[m, rows] (+)= norm(x)[m, cols] · Wᵀ` through the int16-activation GEMV (`qgemv_int`), one
/// wave of blocks taking the rows' virtual blocks, with `acts` bytes for the activations.
fn int_gemv(
    (w, s): (&QuantizedWeights, QuantShape),
    x: &Buffer,
    m: usize,
    (y, accumulate): (u64, bool),
    acts: u32,
    norm: InputNorm,
) -> Result<()> {
    let g = &w.gpu;
    let threads = int_threads(s.cols);
    let shared = int_shared(acts, s, m);
    let name = int_kernel("qgemv", s, w.scale_type, m);
    let resident = g.resident_blocks(&name, threads, shared)?;
    let parts = int_parts(s, resident * threads as usize / 32);
    let rows_per_block = 2 * threads as usize / 32 / parts;
    let (cfg, virtual_blocks) =
        one_wave(resident, s.rows.div_ceil(rows_per_block), threads, shared)?;
    let [norm_ptr, eps] = norm_args(norm);
    launch!(g, &name, cfg;
        addr(g, &w.packed), addr(g, &w.scales), addr(g, &w.biases), x.ptr(), y,
        int(s.rows)?, int(s.cols)?, int(s.group_size)?, int(m)?, accumulate as i32, int(parts)?,
        virtual_blocks, norm_ptr, eps);
    Ok(())
}

/// What a matmul does with its output: a new buffer, or a sum into an existing one (a residual
/// connection, without a separate add).
pub enum Output<'a> {
    New,
    AddTo(&'a mut Buffer),
}

/// `y[m, rows] = x[m, cols] · Wᵀ` (or `+=` into `out`). The float modes take the plain GEMV
/// (`fgemv4`) or cuBLAS on dequantized weights (`fdequant`), their own kernels of the same
/// shapes as the affine ones; the tensor-core and int16-activation kernels are affine only.
pub fn quantized_matmul(
    w: &QuantizedWeights,
    s: QuantShape,
    x: &Buffer,
    m: usize,
    out: Output,
) -> Result<Option<Buffer>> {
    let g = w.gpu.clone();
    let (packed, scales, biases) = (
        addr(&g, &w.packed),
        addr(&g, &w.scales),
        addr(&g, &w.biases),
    );
    let (y, accumulate) = match out {
        Output::New => (Some(g.output(m * s.rows)?), false),
        Output::AddTo(_) => (None, true),
    };
    let y_ptr = match (&y, &out) {
        (Some(y), _) => y.ptr(),
        (None, Output::AddTo(b)) => b.ptr(),
        (None, Output::New) => unreachable!(),
    };
    if mma_applies(x.gpu(), s, m) {
        let acts = mma_acts(x, m, s.cols, None)?;
        quantized_mma(w, s, &acts, m, (y_ptr, accumulate))?;
        return Ok(y);
    }
    if let Some(shared) = int_acts_bytes(x.gpu(), s, m) {
        int_gemv((w, s), x, m, (y_ptr, accumulate), shared, None)?;
        return Ok(y);
    }
    if m <= GEMV_MAX_ROWS {
        // Four rows per block share each activation load; the block's threads split the row
        // (one run of 32 weights each, as far as the row goes). Tall matrices have blocks
        // enough to fill the GPU with one warp each, which saves the blocks' reductions
        // (40% of a 14336x4096 product's time on an H200).
        let threads = if s.rows >= 8192 {
            32
        } else {
            row_threads(s.cols)
        };
        let cfg = blocks(s.rows.div_ceil(4), threads);
        let (rows, cols, m, acc) = (int(s.rows)?, int(s.cols)?, int(m)?, accumulate as i32);
        if s.affine() {
            let name = format!("qgemv4_{}_{}", s.bits, w.scale_type);
            launch!(&g, &name, cfg;
                packed, scales, biases, x.ptr(), y_ptr, rows, cols, int(s.group_size)?, m, acc);
        } else {
            launch!(&g, &format!("fgemv4_{}", s.mode), cfg;
                packed, scales, x.ptr(), y_ptr, rows, cols, m, acc);
        }
        return Ok(y);
    }
    // Slices of rows dequantized into one scratch, each multiplied before the next overwrites
    // it, so that the scratch stays small whatever the matrix (a vocabulary's head is hundreds
    // of megabytes in f32): as small as L2 holds, so that the f32 weights need not reach
    // memory, unless the product would then have too few output tiles to fill the GPU (a
    // 512-token prompt over 1,024 rows makes 32 of 128x128).
    let row_bytes = 4 * s.cols;
    let filling = (2 * g.multiprocessors() * GEMM_TILE * GEMM_TILE).div_ceil(m);
    let chunk = filling
        .min(DEQUANT_MAX_BYTES / row_bytes)
        .max(DEQUANT_CHUNK_BYTES / row_bytes)
        .clamp(1, s.rows);
    let dense = g.scratch(4 * chunk * s.cols)?;
    for row0 in (0..s.rows).step_by(chunk) {
        let rows = chunk.min(s.rows - row0);
        let cfg = elements(&g, rows * s.cols / 4);
        let (first, count, cols) = (int(row0)?, int(rows)?, int(s.cols)?);
        if s.affine() {
            let name = format!("qdequant_{}_{}", s.bits, w.scale_type);
            launch!(&g, &name, cfg;
                packed, scales, biases, dense.ptr(), first, count, cols, int(s.group_size)?);
        } else {
            launch!(&g, &format!("fdequant_{}", s.mode), cfg;
                packed, scales, dense.ptr(), first, count, cols);
        }
        let y_rows = y_ptr + 4 * row0 as u64;
        gemm(
            &g,
            dense.ptr(),
            rows,
            s.cols,
            x,
            m,
            (y_rows, s.rows),
            accumulate,
        )?;
    }
    Ok(y)
}

/// Whether [`quantized_mma`] takes a product of `m` rows of 4- or 8-bit affine weights on a
/// handle that allows f16 operands: from [`MMA_MIN_ROWS`] up to [`MMA_MAX_ROWS`], or from two
/// rows where the int16 activations do not fit a block.
fn mma_applies(g: &Gpu, s: QuantShape, m: usize) -> bool {
    let rows = m >= MMA_MIN_ROWS || (m > 1 && int_acts_fit(s, m).is_none());
    !g.exact_math() && s.affine() && matches!(s.bits, 4 | 8) && rows && m <= MMA_MAX_ROWS
}

/// The activations of tensor-core products from packed weights (`mma_acts` in the kernels):
/// the rows of `x` (normed first, where given) as f16, each scaled by a power of two so that
/// its largest lands in [2^11, 2^12), in `tiles` of 8 rows, rows past `m` zero. Made once for
/// every matrix that multiplies the same input (a layer's q/k/v, or gate and up).
struct MmaActs {
    xh: Memory,
    row_scale: Memory,
    tiles: usize,
}

fn mma_acts(x: &Buffer, m: usize, cols: usize, norm: InputNorm) -> Result<MmaActs> {
    let g = x.gpu().clone();
    let tiles = [1, 2, 4, 8].into_iter().find(|t| 8 * t >= m).unwrap_or(8);
    let xh = g.scratch(2 * 8 * tiles * cols.next_multiple_of(32 * MMA_TURN_RUNS))?;
    let row_scale = g.scratch(4 * 8 * tiles)?;
    let [norm_ptr, eps] = norm_args(norm);
    launch!(&g, "mma_acts", blocks(8 * tiles, 1024);
        x.ptr(), xh.ptr(), row_scale.ptr(), int(m)?, int(cols)?, norm_ptr, eps);
    Ok(MmaActs {
        xh,
        row_scale,
        tiles,
    })
}

/// `y[m, rows] (+)= x[m, cols] · Wᵀ` on the tensor cores from the packed weights (`qmma` in the
/// kernels) and the activations `acts`, for up to [`MMA_MAX_ROWS`] rows. The runs of each row
/// are sliced so that about [`MMA_WARPS_PER_SM`] warps run per multiprocessor
/// ([`MMA_ONE_TILE_WARPS_PER_SM`] for one tile). Over one tile of rows the slices of 32
/// features are the warps of one block (as many as it holds), whose sums meet in its shared
/// memory; over more, blocks of one warp, whose sums `mma_reduce` adds up: those fit beside the
/// kernel before, so that their weights' early requests go up while it runs (`ask_ahead` in the
/// kernels). On an H200 one block's warps beat one-warp blocks and `mma_reduce` by a few
/// percent over one tile of rows, and lose by more over two tiles and beyond.
fn quantized_mma(
    w: &QuantizedWeights,
    s: QuantShape,
    acts: &MmaActs,
    m: usize,
    (y, accumulate): (u64, bool),
) -> Result<()> {
    let g = w.gpu.clone();
    let (packed, scales, biases) = (
        addr(&g, &w.packed),
        addr(&g, &w.scales),
        addr(&g, &w.biases),
    );
    let runs = s.cols / 32;
    let feature_tiles = s.rows.div_ceil(32);
    let (xh, row_scale, tiles) = (&acts.xh, &acts.row_scale, acts.tiles);
    let kernel = format!("qmma_{}_{}_{tiles}", s.bits, w.scale_type);
    // One tile's slices are the warps of a block, as many as it may have (their sums, 32 f32
    // features of each row a slice, take at most 32 KiB); more tiles' are blocks of one warp.
    let in_block = tiles == 1;
    let (per_sm, most) = if in_block {
        let warps = g.max_threads_per_block(&kernel)? / 32;
        (MMA_ONE_TILE_WARPS_PER_SM, warps.min(runs))
    } else {
        (MMA_WARPS_PER_SM, runs)
    };
    let wanted = (per_sm * g.multiprocessors()).div_ceil(feature_tiles);
    let runs_per_slice = runs
        .div_ceil(wanted.clamp(1, most))
        .next_multiple_of(MMA_TURN_RUNS);
    let slices = runs.div_ceil(runs_per_slice);
    let (cfg, part) = if in_block {
        let cfg = LaunchConfig {
            grid_dim: (feature_tiles as u32, 1, 1),
            block_dim: (32 * slices as u32, 1, 1),
            shared_mem_bytes: (slices * 4 * 32 * m) as u32,
        };
        (cfg, None)
    } else {
        let part = (slices > 1)
            .then(|| g.scratch(4 * slices * m * s.rows))
            .transpose()?;
        (sliced_warps(feature_tiles, slices), part)
    };
    launch!(&g, &kernel, cfg;
        packed, scales, biases, xh.ptr(), row_scale.ptr(), y, part.as_ref().map_or(0, |p| p.ptr()),
        int(s.rows)?, int(s.cols)?, int(s.group_size)?, int(m)?, int(runs_per_slice)?,
        accumulate as i32);
    if let Some(part) = part {
        launch!(&g, "mma_reduce", elements(&g, m * s.rows);
            part.ptr(), row_scale.ptr(), y, int(s.rows)?, int(m)?, int(slices)?,
            accumulate as i32);
    }
    Ok(())
}

/// An RMS norm a GEMV applies to its input rows first: the weight's buffer and epsilon.
pub type InputNorm<'a> = Option<(&'a Buffer, f32)>;

fn norm_args(norm: InputNorm) -> [Arg; 2] {
    let (ptr, eps) = norm.map_or((0, 0.0), |(w, eps)| (w.ptr(), eps));
    [Arg::from(ptr), Arg::from(eps)]
}

/// Whether the matrices share input width, mode, bits, group size and scale type, as one launch
/// of the int16-activation kernels over all of them needs.
fn same_format(ws: &[(&QuantizedWeights, QuantShape)]) -> bool {
    let format = |(w, s): &(&QuantizedWeights, QuantShape)| {
        (s.cols, s.mode, s.bits, s.group_size, w.scale_type)
    };
    ws.iter().all(|m| format(m) == format(&ws[0]))
}

/// `y_i[m, rows_i] = norm(x)[m, cols] · W_iᵀ` for one to three matrices of one format in one
/// launch (attention's projections, or an output head with the final norm), when the
/// int16-activation GEMV applies, or in one tensor-core product each from activations made
/// once where those apply; `None` otherwise (the caller norms and multiplies one matrix at a
/// time). One matrix (an output head) takes the one-wave GEMV ([`int_gemv`]), whose blocks each
/// round the activations once for all their rows; two or three `qgemv3`, a block per 2 rows a
/// warp. On an H200 the one-wave GEMV decodes with a 152K-row head up to a tenth faster than
/// `qgemv3` would, and with a 32K-row one as fast.
pub fn quantized_matmul_group(
    ws: &[(&QuantizedWeights, QuantShape)],
    x: &Buffer,
    m: usize,
    norm: InputNorm,
) -> Result<Option<Vec<Buffer>>> {
    let Some(&(first, s)) = ws.first() else {
        return Ok(None);
    };
    let g = first.gpu.clone();
    let fits = same_format(ws) && (1..=3).contains(&ws.len());
    let offsets_fit = ws.iter().all(|&(_, t)| int_offsets_fit(t));
    if fits && mma_applies(x.gpu(), s, m) {
        let acts = mma_acts(x, m, s.cols, norm)?;
        let outs = ws.iter().map(|&(w, t)| {
            let y = g.output(m * t.rows)?;
            quantized_mma(w, t, &acts, m, (y.ptr(), false))?;
            Ok(y)
        });
        return outs.collect::<Result<Vec<_>>>().map(Some);
    }
    let Some(shared) = int_acts_bytes(x.gpu(), s, m).filter(|_| fits && offsets_fit) else {
        return Ok(None);
    };
    if let [(w, s)] = ws {
        let y = g.output(m * s.rows)?;
        int_gemv((w, *s), x, m, (y.ptr(), false), shared, norm)?;
        return Ok(Some(vec![y]));
    }
    let threads = int_threads(s.cols);
    let shared = int_shared(shared, s, m);
    let per_block = 2 * threads as usize / 32;
    let outs = ws
        .iter()
        .map(|(_, t)| g.output(m * t.rows))
        .collect::<Result<Vec<_>>>()?;
    let mut args = Vec::with_capacity(19);
    let mut blocks_total = 0;
    for i in 0..3 {
        match (ws.get(i), outs.get(i)) {
            (Some((w, t)), Some(y)) => {
                args.extend([
                    Arg::from(addr(&g, &w.packed)),
                    Arg::from(addr(&g, &w.scales)),
                    Arg::from(addr(&g, &w.biases)),
                    Arg::from(y.ptr()),
                    Arg::from(int(t.rows)?),
                ]);
                blocks_total += t.rows.div_ceil(per_block);
            }
            _ => args.extend(
                [0u64, 0, 0, 0]
                    .map(Arg::from)
                    .into_iter()
                    .chain([Arg::from(0i32)]),
            ),
        }
    }
    args.extend([
        Arg::from(x.ptr()),
        Arg::from(int(s.cols)?),
        Arg::from(int(s.group_size)?),
        Arg::from(int(m)?),
    ]);
    args.extend(norm_args(norm));
    let cfg = LaunchConfig {
        shared_mem_bytes: shared,
        ..blocks(blocks_total, threads)
    };
    g.launch(&int_kernel("qgemv3", s, first.scale_type, m), cfg, &args)?;
    Ok(Some(outs))
}

/// Attention's projections of one token (each with its f32 bias, if any), RoPE and the cache
/// write in one launch (`qkv_rope` in the kernels): the rotated queries, the keys and values
/// written into `rings` (of `capacity` slots) at the token's position. `None` where the
/// int16-activation GEMV does not apply or the three matrices differ in format (the caller
/// takes the steps one by one).
pub fn qkv_rope_write(
    ws: [(&QuantizedWeights, QuantShape, Option<&Buffer>); 3],
    x: &Buffer,
    norm: InputNorm,
    shape: crate::params::Heads,
    (inv_freqs, traditional): (&Buffer, bool),
    positions: GpuPositions,
    (keys, values, capacity): (&mut DeviceRing, &mut DeviceRing, usize),
) -> Result<Option<Buffer>> {
    let (first, s, _) = ws[0];
    let formats = ws.map(|(w, s, _)| (w, s));
    let offsets_fit = formats.iter().all(|&(_, t)| int_offsets_fit(t));
    let Some(shared) =
        int_acts_bytes(x.gpu(), s, 1).filter(|_| same_format(&formats) && offsets_fit)
    else {
        return Ok(None);
    };
    let g = first.gpu.clone();
    // About 72 registers a thread: blocks of 8 warps, so that three fit an SM (one of 16 did).
    let threads = 256;
    let warps = threads as usize / 32;
    let half = shape.head_dim / 2;
    let grid = (shape.heads * half).div_ceil(warps) + 2 * (shape.kv_heads * half).div_ceil(warps);
    let q = g.output(shape.heads * shape.head_dim)?;
    let mut args = Vec::with_capacity(31);
    for (w, _, bias) in ws {
        args.extend([
            Arg::from(addr(&g, &w.packed)),
            Arg::from(addr(&g, &w.scales)),
            Arg::from(addr(&g, &w.biases)),
            Arg::from(bias.map_or(0, |b| b.ptr())),
        ]);
    }
    args.extend([
        Arg::from(x.ptr()),
        Arg::from(int(s.cols)?),
        Arg::from(int(s.group_size)?),
    ]);
    args.extend(norm_args(norm));
    args.extend([
        Arg::from(q.ptr()),
        Arg::from(keys.ptr()),
        Arg::from(values.ptr()),
        Arg::from(int(capacity)?),
        Arg::from(positions.ptr()),
        Arg::from(inv_freqs.ptr()),
        Arg::from(int(shape.heads)?),
        Arg::from(int(shape.kv_heads)?),
        Arg::from(int(shape.head_dim)?),
        Arg::from(traditional as i32),
        Arg::from((keys.precision() == KvPrecision::F16) as i32),
    ]);
    // Code rings: the features staged for the heads' last warps to quantize.
    match keys.precision() {
        KvPrecision::Quantized(quant) => {
            let staged = g.output(2 * shape.kv_heads * shape.head_dim)?;
            args.extend([
                Arg::from(i32::from(quant.bits)),
                Arg::from(keys.group_shift()),
                Arg::from(staged.ptr()),
                Arg::from(g.code_arrivals()),
            ]);
        }
        _ => args.extend([
            Arg::from(0i32),
            Arg::from(0i32),
            Arg::from(0u64),
            Arg::from(0u64),
        ]),
    }
    let cfg = LaunchConfig {
        shared_mem_bytes: shared,
        ..blocks(grid, threads)
    };
    g.launch(&int_kernel("qkv_rope", s, first.scale_type, 1), cfg, &args)?;
    Ok(Some(q))
}

/// The activation of a gated MLP, as the `qglu` kernel numbers them.
#[derive(Clone, Copy)]
pub enum Glu {
    Silu = 0,
    GeluApprox = 1,
}

/// `act(x·Gᵀ) · (x·Uᵀ)` in one pass for up to [`GEMV_MAX_ROWS`] rows, or in two tensor-core
/// products from one set of activations where those apply, when the gate and up projections
/// share their shape and quantization (`s` is both's); `None` otherwise (the caller composes).
/// A `norm` is folded in where the int16-activation kernel or the tensor cores run; elsewhere
/// it is `None` too (the caller norms first). The float modes take the one-pass `fglu`.
#[allow(clippy::too_many_arguments)]
pub fn quantized_glu(
    gate: &QuantizedWeights,
    up: &QuantizedWeights,
    s: QuantShape,
    x: &Buffer,
    m: usize,
    act: Glu,
    norm: InputNorm,
) -> Result<Option<Buffer>> {
    if gate.scale_type != up.scale_type {
        return Ok(None);
    }
    if mma_applies(x.gpu(), s, m) {
        let g = gate.gpu.clone();
        let acts = mma_acts(x, m, s.cols, norm)?;
        let (mut h, u) = (g.output(m * s.rows)?, g.output(m * s.rows)?);
        quantized_mma(gate, s, &acts, m, (h.ptr(), false))?;
        quantized_mma(up, s, &acts, m, (u.ptr(), false))?;
        let kernel = match act {
            Glu::Silu => "silu_mul",
            Glu::GeluApprox => "gelu_mul",
        };
        binary(kernel, &mut h, &u)?;
        return Ok(Some(h));
    }
    if m > GEMV_MAX_ROWS {
        return Ok(None);
    }
    let shared = int_acts_bytes(x.gpu(), s, m);
    if norm.is_some() && shared.is_none() {
        return Ok(None);
    }
    let g = gate.gpu.clone();
    let out = g.output(m * s.rows)?;
    let [gw, gs, gb, uw, us, ub] = [
        addr(&g, &gate.packed),
        addr(&g, &gate.scales),
        addr(&g, &gate.biases),
        addr(&g, &up.packed),
        addr(&g, &up.scales),
        addr(&g, &up.biases),
    ];
    if let Some(acts) = shared {
        let threads = int_threads(s.cols);
        let shared = int_shared(acts, s, m);
        let name = int_kernel("qglu", s, gate.scale_type, m);
        let (cfg, virtual_blocks) = one_wave(
            g.resident_blocks(&name, threads, shared)?,
            s.rows.div_ceil(threads as usize / 32),
            threads,
            shared,
        )?;
        let [norm_ptr, eps] = norm_args(norm);
        launch!(&g, &name, cfg;
            gw, gs, gb, uw, us, ub, x.ptr(), out.ptr(),
            int(s.rows)?, int(s.cols)?, int(s.group_size)?, int(m)?, act as i32, norm_ptr, eps,
            virtual_blocks);
        return Ok(Some(out));
    }
    let cfg = blocks(s.rows.div_ceil(2), row_threads(s.cols));
    let (rows, cols, m, act) = (int(s.rows)?, int(s.cols)?, int(m)?, act as i32);
    if s.affine() {
        launch!(&g, &format!("qglu_{}_{}", s.bits, gate.scale_type), cfg;
            gw, gs, gb, uw, us, ub, x.ptr(), out.ptr(), rows, cols, int(s.group_size)?, m, act);
    } else {
        launch!(&g, &format!("fglu_{}", s.mode), cfg;
            gw, gs, uw, us, x.ptr(), out.ptr(), rows, cols, m, act);
    }
    Ok(Some(out))
}

pub fn dense_matmul(
    w: &DenseWeights,
    rows: usize,
    cols: usize,
    x: &Buffer,
    m: usize,
) -> Result<Buffer> {
    let g = w.gpu.clone();
    let y = g.output(m * rows)?;
    let data = addr(&g, &w.data);
    if m <= GEMV_MAX_ROWS {
        launch!(&g, &format!("dgemv_{}", w.dtype), blocks(rows.div_ceil(4), 128);
            data, x.ptr(), y.ptr(), int(rows)?, int(cols)?, int(m)?);
        return Ok(y);
    }
    if w.dtype == "f32" {
        gemm(&g, data, rows, cols, x, m, (y.ptr(), rows), false)?;
    } else {
        let all: Vec<usize> = (0..rows).collect();
        let f32_weights = dense_rows(w, cols, &all)?;
        gemm(
            &g,
            f32_weights.ptr(),
            rows,
            cols,
            x,
            m,
            (y.ptr(), rows),
            false,
        )?;
    }
    Ok(y)
}

/// The precision of the many-row products: f32 throughout on an exact handle, else TF32
/// tensor cores (f32 storage, operands rounded to 10-bit mantissas, f32 accumulation).
pub(super) fn compute_type(g: &Gpu) -> cublasComputeType_t {
    if g.exact_math() {
        cublasComputeType_t::CUBLAS_COMPUTE_32F
    } else {
        cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    }
}

/// `y[m, n] (+)= x[m, k] · Wᵀ` by cuBLAS, `W` row-major `[n, k]` f32 at `w`; `y` is the
/// address of the output and the distance between its rows, `n` or more (columns of a wider
/// output).
#[allow(clippy::too_many_arguments)]
fn gemm(
    g: &Gpu,
    w: u64,
    n: usize,
    k: usize,
    x: &Buffer,
    m: usize,
    (y, y_stride): (u64, usize),
    accumulate: bool,
) -> Result<()> {
    let f32_t = cudaDataType::CUDA_R_32F;
    let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
    // Row-major y[m, n] is column-major yᵀ[n, m] = W · xᵀ, with W column-major [k, n] transposed.
    // SAFETY: the pointers address buffers of n·k, m·k and m·n floats.
    g.blas_call(|blas| unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            int(n)?,
            int(m)?,
            int(k)?,
            (&alpha as *const f32).cast(),
            w as *const _,
            f32_t,
            int(k)?,
            x.ptr() as *const _,
            f32_t,
            int(k)?,
            (&beta as *const f32).cast(),
            y as *mut _,
            f32_t,
            int(y_stride)?,
            compute_type(x.gpu()),
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(err)
    })
}

/// Rows `ids` of the matrix, dequantized: `[ids.len(), cols]`.
pub fn quantized_rows(w: &QuantizedWeights, s: QuantShape, ids: &[usize]) -> Result<Buffer> {
    let g = w.gpu.clone();
    let idx = g.indices(ids.iter().copied())?;
    let out = g.output(ids.len() * s.cols)?;
    if ids.is_empty() {
        return Ok(out);
    }
    let (packed, scales, cfg) = (
        addr(&g, &w.packed),
        addr(&g, &w.scales),
        blocks(ids.len(), 128),
    );
    if s.affine() {
        launch!(&g, &format!("qrows_{}_{}", s.bits, w.scale_type), cfg;
            packed, scales, addr(&g, &w.biases), idx.ptr(), out.ptr(), int(s.cols)?,
            int(s.group_size)?);
    } else {
        launch!(&g, &format!("frows_{}", s.mode), cfg;
            packed, scales, idx.ptr(), out.ptr(), int(s.cols)?);
    }
    Ok(out)
}

pub fn dense_rows(w: &DenseWeights, cols: usize, ids: &[usize]) -> Result<Buffer> {
    let g = w.gpu.clone();
    let idx = g.indices(ids.iter().copied())?;
    let out = g.output(ids.len() * cols)?;
    if !ids.is_empty() {
        launch!(&g, &format!("drows_{}", w.dtype), blocks(ids.len(), 256);
            addr(&g, &w.data), idx.ptr(), out.ptr(), int(cols)?);
    }
    Ok(out)
}
