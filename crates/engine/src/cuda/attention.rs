//! Launchers of the key/value cache and attention kernels (`kernels/attention.cu`).
//!
//! Shapes are checked by the callers in [`crate::ops`]; these take buffers of the right lengths,
//! and kernel arguments are raw device addresses, so that an op may read and write one buffer.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::LaunchConfig;

use super::launch::{blocks, elements, int, sliced_blocks, sliced_warps, Result};
use super::matmul::compute_type;
use super::{
    err, group_shift, ring_suffix, Arg, Buffer, DeviceRing, Gpu, GpuPositions, Memory,
    UNASKED_SHARED_BYTES,
};
use crate::{EngineError, KvPrecision};

/// Writes `src[0]` and `src[1]` (keys and values, `[tokens, kv_heads, d]` each) at `positions`
/// (consecutive) of the rings `cache[0]` and `cache[1]` of `capacity` slots (of one precision);
/// the first position is read on the device, so that a replayed decode step writes where its
/// own token goes. Code rings take a warp per group of each head's features.
pub fn kv_write(
    cache: [&mut DeviceRing; 2],
    src: [&Buffer; 2],
    kv_heads: usize,
    d: usize,
    capacity: usize,
    positions: GpuPositions,
) -> Result<()> {
    let g = cache[0].gpu().clone();
    let tokens = src[0].len() / (kv_heads * d);
    let (keys, values) = (cache[0].ptr(), cache[1].ptr());
    match cache[0].precision() {
        KvPrecision::Quantized(q) => {
            let kernel = format!("kv_write_{}", cache[0].suffix());
            launch!(&g, &kernel, elements(&g, 32 * 2 * tokens * kv_heads * (d / q.group));
                keys, values, src[0].ptr(), src[1].ptr(), int(tokens)?, int(kv_heads)?, int(d)?,
                int(capacity)?, positions.ptr(), cache[0].group_shift());
        }
        precision => {
            launch!(&g, "kv_write", elements(&g, src[0].len());
                keys, values, src[0].ptr(), src[1].ptr(), int(tokens)?, int(kv_heads)?, int(d)?,
                int(capacity)?, positions.ptr(), (precision == KvPrecision::F16) as i32);
        }
    }
    Ok(())
}

/// [`kv_write`] of one token for each of several sequences: row `s` of the keys `src[0]` and
/// values `src[1]` into the rings at `rings[s]` and `rings[n + s]` (`capacities[s]` slots, all
/// in `precision`) at `positions[s]`.
#[allow(clippy::too_many_arguments)]
pub fn kv_write_batch(
    rings: &[u64],
    precision: KvPrecision,
    capacities: &[usize],
    src: [&Buffer; 2],
    kv_heads: usize,
    d: usize,
    positions: GpuPositions,
) -> Result<()> {
    let g = src[0].gpu().clone();
    let ptrs = g.addresses(rings)?;
    let caps = g.indices(capacities.iter().copied())?;
    let seqs = int(capacities.len())?;
    match precision {
        KvPrecision::Quantized(q) => {
            let kernel = format!("kv_write_batch_{}", ring_suffix(precision));
            let warps = 2 * capacities.len() * kv_heads * (d / q.group);
            launch!(&g, &kernel, elements(&g, 32 * warps);
                ptrs.ptr(), src[0].ptr(), src[1].ptr(), seqs, int(kv_heads)?, int(d)?, caps.ptr(),
                positions.ptr(), group_shift(precision));
        }
        precision => {
            launch!(&g, "kv_write_batch", elements(&g, src[0].len());
                ptrs.ptr(), src[0].ptr(), src[1].ptr(), seqs, int(kv_heads)?, int(d)?, caps.ptr(),
                positions.ptr(), (precision == KvPrecision::F16) as i32);
        }
    }
    Ok(())
}

/// Copies positions `p0..p1` of `dst` from `src`'s positions from `src_first` on, between rings
/// of different capacities (and one precision): each part of a row (a code ring's codes and
/// pairs) as it is.
#[allow(clippy::too_many_arguments)]
pub fn kv_move(
    src: &DeviceRing,
    src_capacity: usize,
    src_first: usize,
    dst: &mut DeviceRing,
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
    let shift = p0 as i64 - src_first as i64;
    for ((from, width, bytes), (to, ..)) in src.row_parts(d).into_iter().zip(dst.row_parts(d)) {
        launch!(&g, "kv_move", elements(&g, (p1 - p0) * kv_heads * width);
            from, int(src_capacity)?, to, int(dst_capacity)?, int(kv_heads)?, int(width)?,
            p0 as i64, p1 as i64, shift, int(bytes)?);
    }
    Ok(())
}

/// What an attention call reads from a cache (see `attention_split` in the kernels).
pub struct KvView<'a> {
    pub keys: &'a DeviceRing,
    pub values: &'a DeviceRing,
    pub kv_heads: usize,
    pub capacity: usize,
    pub start: usize,
    pub end: usize,
    /// `usize::MAX` for full attention.
    pub window: usize,
}

/// What attention does to its scores besides the softmax (see `ops::AttentionOptions`).
pub struct Options<'a> {
    pub scale: f32,
    /// `Some(cap)`: scores become `cap · tanh(s / cap)`.
    pub softcap: Option<f32>,
    /// `Some([heads])`: a logit per query head in each softmax's denominator.
    pub sinks: Option<&'a Buffer>,
}

impl Options<'_> {
    /// The cap as the kernels take it: 0 for none.
    fn softcap(&self) -> f32 {
        self.softcap.unwrap_or(0.0)
    }

    /// The sinks' address as the kernels take it: null for none.
    fn sinks(&self) -> u64 {
        self.sinks.map_or(0, |s| s.ptr())
    }
}

/// Queries from which attention runs as matrix products on cuBLAS (scores in memory) rather
/// than one warp per query: prefill, where the products keep the GPU busy.
const GEMM_ATTENTION_MIN_TOKENS: usize = 16;

/// Bytes of scores one pass of [`attention_gemm`] may hold; longer prompts go in slices.
const SCORE_BYTES: usize = 256 << 20;

/// Decode attention splits each (token, head)'s keys only while there are fewer pairs than
/// this many per multiprocessor; more fill the GPU unsplit.
pub(crate) const SPLIT_QUERY_HEADS_PER_SM: usize = 4;

pub fn attention(
    q: &Buffer,
    heads: usize,
    d: usize,
    positions: GpuPositions,
    kv: &KvView,
    options: &Options,
) -> Result<Buffer> {
    let g = q.gpu().clone();
    let tokens = positions.len();
    if tokens >= GEMM_ATTENTION_MIN_TOKENS {
        return attention_gemm(q, heads, d, positions, kv, options);
    }
    let per_lane = lanes_per_feature(d)?;
    let span = kv.capacity.min(kv.window).max(1);
    let splits = decode_splits(&g, tokens * heads, span);
    let per_split = span.div_ceil(splits).div_ceil(32) * 32;
    let (out, part) = split_outputs(&g, tokens * heads, d, splits)?;
    let window = kv.window.min(i64::MAX as usize) as i64;
    let tiles = per_split / 32;
    if tiles >= GROUPED_MIN_TILES {
        // Long splits: the query heads of a key/value head together, the split's tiles shared
        // among a block's warps.
        let group = heads / kv.kv_heads;
        let per_warp = group_heads(group, per_lane);
        let row = kv.keys.staged_row_bytes(d);
        let warps = tiles
            .min(GROUP_WARPS)
            .min((UNASKED_SHARED_BYTES / kv_tile(row).1).max(1));
        let (stages, units, shared) = kv_tile_stages(row, warps);
        let kernel = format!("attention_heads_{per_lane}_{per_warp}_{}", kv.keys.suffix());
        let cfg = LaunchConfig {
            shared_mem_bytes: shared,
            ..sliced_blocks(
                tokens * kv.kv_heads * group.div_ceil(per_warp),
                splits,
                32 * warps as u32,
            )
        };
        launch!(&g, &kernel, cfg;
            q.ptr(), kv.keys.ptr(), kv.values.ptr(), positions.ptr(), out.ptr(), part.ptr(),
            g.split_counters(), int(heads)?, int(kv.kv_heads)?, int(d)?, int(kv.capacity)?,
            kv.start as i64, window, options.scale, options.softcap(), options.sinks(),
            int(splits)?, int(per_split)?, int(stages)?, int(units)?, kv.keys.group_shift());
        return Ok(out);
    }
    let kernel = format!("attention_{per_lane}_{}", kv.keys.suffix());
    launch!(&g, &kernel, sliced_warps(tokens * heads, splits);
        q.ptr(), kv.keys.ptr(), kv.values.ptr(), positions.ptr(), out.ptr(), part.ptr(),
        g.split_counters(), int(heads)?, int(kv.kv_heads)?, int(d)?, int(kv.capacity)?,
        kv.start as i64, window, options.scale, options.softcap(), options.sinks(), int(splits)?,
        int(per_split)?, kv.keys.group_shift());
    Ok(out)
}

/// The output and the per-split partials of a one-warp attention launch over `query_heads`
/// (token, head) pairs.
fn split_outputs(g: &Gpu, query_heads: usize, d: usize, splits: usize) -> Result<(Buffer, Buffer)> {
    let out = g.output(query_heads * d)?;
    let part = g.output(if splits > 1 {
        query_heads * splits * (d + 2)
    } else {
        1
    })?;
    Ok((out, part))
}

/// [`attention`] of one query token for each of several sequences (row `s` of `q` at
/// `positions[s]` over `kvs[s]`, which share their head count and window), in one launch.
pub fn attention_batch(
    q: &Buffer,
    heads: usize,
    d: usize,
    positions: GpuPositions,
    kvs: &[KvView],
    options: &Options,
) -> Result<Buffer> {
    let g = q.gpu().clone();
    let seqs = kvs.len();
    let Some(first) = kvs.first() else {
        return Err(EngineError::Shape("attention over no caches".into()));
    };
    let precision = first.keys.precision();
    if kvs.iter().any(|kv| {
        kv.kv_heads != first.kv_heads
            || kv.window != first.window
            || kv.keys.precision() != precision
            || kv.values.precision() != precision
    }) {
        return Err(EngineError::Shape(
            "a batch's caches differ in heads, window or precision".into(),
        ));
    }
    let per_lane = lanes_per_feature(d)?;
    let span = kvs
        .iter()
        .map(|kv| kv.capacity.min(kv.window).max(1))
        .max()
        .unwrap_or(1);
    let group = heads / first.kv_heads;
    let per_warp = query_heads_per_warp(
        group_heads(group, per_lane),
        seqs * first.kv_heads,
        g.multiprocessors(),
    );
    let warps = seqs * first.kv_heads * group.div_ceil(per_warp);
    let kernel = format!(
        "attention_batch_{per_lane}_{per_warp}_{}",
        first.keys.suffix()
    );
    let (stages, units, shared) = kv_tile_stages(first.keys.staged_row_bytes(d), 1);
    let resident = g.resident_blocks(&kernel, 32, shared)?;
    let splits = batch_splits(&g, resident, warps, span);
    let per_split = span.div_ceil(splits).div_ceil(32) * 32;
    // The rings as kv_write_batch takes them (keys, then values), so that a step uploads the
    // table once for both.
    let rings: Vec<u64> = kvs
        .iter()
        .map(|kv| kv.keys.ptr())
        .chain(kvs.iter().map(|kv| kv.values.ptr()))
        .collect();
    let rings = g.addresses(&rings)?;
    let (keys, values) = (rings.ptr(), rings.ptr() + 8 * seqs as u64);
    let capacities = g.indices(kvs.iter().map(|kv| kv.capacity))?;
    let starts = g.indices(kvs.iter().map(|kv| kv.start))?;
    let (out, part) = split_outputs(&g, seqs * heads, d, splits)?;
    let window = first.window.min(i64::MAX as usize) as i64;
    let cfg = LaunchConfig {
        shared_mem_bytes: shared,
        ..sliced_warps(warps, splits)
    };
    launch!(&g, &kernel, cfg;
        q.ptr(), keys, values, positions.ptr(), out.ptr(), part.ptr(),
        g.split_counters(), int(heads)?, int(first.kv_heads)?, int(d)?, capacities.ptr(),
        starts.ptr(), window, options.scale, options.softcap(), options.sinks(), int(splits)?,
        int(per_split)?, int(stages)?, int(units)?, first.keys.group_shift());
    Ok(out)
}

/// Warps a block of the long-split decode attention (`attention_heads_E_G`) takes at most: the
/// kernels' `GROUP_WARPS`.
const GROUP_WARPS: usize = 4;

/// Tiles of 32 keys a split holds from which decode takes the grouped attention: on an H100
/// decoding the 0.85B (32 query heads over 8), splits of 8 and 16 tiles (16,384 and 32,768
/// positions) decode 1.3 to 2.1 times as fast as one warp per query head, splits of 2 (4,096)
/// 5 to 17% slower.
const GROUPED_MIN_TILES: usize = 5;

/// A tile of 32 keys' rows and their values' as the grouped attention stages them in shared
/// memory (`stage_kv_rows` in the kernels): rows of `row_bytes` each, in 16-byte units, an odd
/// count of them (so that eight lanes reading a unit each of eight rows fall on distinct banks),
/// keys then values. Returns a row's units and the tile's bytes.
fn kv_tile(row_bytes: usize) -> (usize, usize) {
    let units = row_bytes.div_ceil(16) | 1;
    (units, 2 * 32 * units * 16)
}

/// Shared memory for `warps` warps of the grouped attention, each with its own tiles
/// ([`kv_tile`]): two each, so that one goes up while the other is summed, where they fit the
/// 48 KiB a kernel takes unasked; else one (f32 or f16 head dims of 256 and more, or several
/// warps). Returns the tiles a warp, a row's units and the bytes.
fn kv_tile_stages(row_bytes: usize, warps: usize) -> (usize, usize, u32) {
    let (units, tile) = kv_tile(row_bytes);
    let stages = if 2 * warps * tile <= UNASKED_SHARED_BYTES {
        2
    } else {
        1
    };
    (stages, units, (warps * stages * tile) as u32)
}

/// Query heads of a group that shares a key/value head that one warp of the grouped attention
/// takes at most, with `per_lane` output features a lane: it loads each key and value once for
/// all of them, up to four, holding at most sixteen accumulators a lane (the kernels' G · E <=
/// 16; one head for latent attention's rows of 576).
fn group_heads(group: usize, per_lane: usize) -> usize {
    let most = match group {
        1 => 1,
        2 => 2,
        _ => 4,
    };
    most.min((16 / per_lane).max(1))
}

/// Query heads one warp of the batched attention takes of a group that shares a key/value
/// head (`attention_batch_E_G`'s G), of the `most` [`group_heads`] allows: fewer while the
/// (sequence, key/value head) `pairs` are few beside the GPU's
/// `multiprocessors`, so that more warps share the work, each merging its heads' splits with
/// fewer rounds. On an H200 decoding llamas with groups of 4 over 8 key/value heads, one head a
/// warp wins while the pairs are under an eighth of the multiprocessors, two while they are no
/// more than the multiprocessors; four, at so few pairs, lose up to a tenth.
fn query_heads_per_warp(most: usize, pairs: usize, multiprocessors: usize) -> usize {
    if 8 * pairs <= multiprocessors {
        1
    } else if pairs <= multiprocessors {
        most.min(2)
    } else {
        most
    }
}

/// Splits of each of a batched attention's `warps` (sequence, head chunk) pairs: enough for
/// one wave of the kernel (`resident` warps, which its tiles' shared memory bounds), at most one
/// a tile of 32 keys and 64 in all, and none once the pairs outnumber [`Gpu::split_counters`].
/// Like [`decode_splits`], it follows the capacity (`span`), not the length. One wave is enough:
/// on an H200, aiming at twice the resident warps, or at a fixed 16 an SM, decodes 8 to 64
/// sequences of llamas up to 7% slower.
fn batch_splits(g: &Gpu, resident: usize, warps: usize, span: usize) -> usize {
    if warps >= SPLIT_QUERY_HEADS_PER_SM * g.multiprocessors() {
        return 1;
    }
    resident
        .div_ceil(warps)
        .clamp(1, span.div_ceil(32).clamp(1, 64))
}

/// Output features per lane of the one-warp attention kernels (`attention_E`): a power of two,
/// or 20 for multi-head latent attention's rows of 576.
fn lanes_per_feature(d: usize) -> Result<usize> {
    let lanes = d.div_ceil(32);
    [1, 2, 4, 8, 16, 20]
        .into_iter()
        .find(|&e| e >= lanes)
        .ok_or_else(|| EngineError::Shape(format!("head dim {d} over the GPU attention's 640")))
}

/// Few queries (decoding) split each one's keys over several warps, one tile of 32 keys each
/// up to 64 splits, so the GPU fills up and each warp's chain of loads stays short. The split
/// follows the capacity (`span`), not the length, so a decode step's launch stays the same
/// from one token to the next (a replayed step graph holds it). Only fewer (token, head)
/// pairs than [`Gpu::split_counters`] counts split.
fn decode_splits(g: &Gpu, query_heads: usize, span: usize) -> usize {
    if query_heads < SPLIT_QUERY_HEADS_PER_SM * g.multiprocessors() {
        span.div_ceil(32).clamp(1, 64)
    } else {
        1
    }
}

/// [`attention`] for many queries: per KV head, scores = Q·Kᵀ over the cache's slots (a strided
/// batched product, the group's query heads stacked), masked softmax, then P·V; f32 operands,
/// through TF32 tensor cores unless the GPU handle is exact. The scores are soft-capped and
/// the sinks join the denominators in the softmax.
fn attention_gemm(
    q: &Buffer,
    heads: usize,
    d: usize,
    positions: GpuPositions,
    kv: &KvView,
    options: &Options,
) -> Result<Buffer> {
    let g = q.gpu().clone();
    let tokens = positions.len();
    let group = heads / kv.kv_heads;
    let slots = kv.end.min(kv.capacity);
    let window = kv.window.min(i64::MAX as usize) as i64;
    let out = g.output(tokens * heads * d)?;
    let chunk = (SCORE_BYTES / (4 * heads * slots.max(1))).clamp(1, tokens);
    let compute = compute_type(&g);
    // The products read f32: an f16 or code cache's visible slots are widened first.
    let widened = |ring: &DeviceRing| -> Result<Memory> {
        let wide = g.scratch(4 * kv.kv_heads * slots * d)?;
        let cfg = elements(&g, kv.kv_heads * slots * d);
        let (h, capacity, slots, d) = (int(kv.kv_heads)?, int(kv.capacity)?, int(slots)?, int(d)?);
        match ring.precision() {
            KvPrecision::Quantized(_) => {
                let kernel = format!("kv_widen_{}", ring.suffix());
                launch!(&g, &kernel, cfg;
                    ring.ptr(), wide.ptr(), h, capacity, slots, d, ring.group_shift());
            }
            _ => launch!(&g, "kv_widen", cfg; ring.ptr(), wide.ptr(), h, capacity, slots, d),
        }
        Ok(wide)
    };
    let widened_rings = (kv.keys.precision() != KvPrecision::F32)
        .then(|| Ok((widened(kv.keys)?, widened(kv.values)?)))
        .transpose()?;
    let (keys, values, ring_stride) = match &widened_rings {
        Some((k, v)) => (k.ptr(), v.ptr(), slots * d),
        None => (kv.keys.ptr(), kv.values.ptr(), kv.capacity * d),
    };
    let qt = g.scratch(4 * (chunk * heads * d))?;
    let scores = g.scratch(4 * (chunk * heads * slots))?;
    let ot = g.scratch(4 * (chunk * heads * d))?;
    for t0 in (0..tokens).step_by(chunk) {
        let count = chunk.min(tokens - t0);
        let rows = group * count;
        launch!(&g, "heads_first", elements(&g, count * heads * d);
            q.ptr(), qt.ptr(), int(t0)?, int(count)?, int(heads)?, int(d)?);
        // scores[h, t, j] = scale · q[h, t] · keys[h / group, j]
        batched_gemm(
            &g,
            Gemm {
                transpose_a: true,
                m: slots,
                n: rows,
                k: d,
                alpha: options.scale,
                a: keys,
                lda: d,
                stride_a: ring_stride,
                b: qt.ptr(),
                ldb: d,
                stride_b: rows * d,
                c: scores.ptr(),
                ldc: slots,
                stride_c: rows * slots,
                batches: kv.kv_heads,
                compute,
            },
        )?;
        launch!(&g, "masked_softmax", blocks(heads * count, 256);
            scores.ptr(), positions.ptr(), int(t0)?, int(count)?, int(slots)?,
            int(kv.capacity)?, kv.start as i64, kv.end as i64, window, options.softcap(),
            options.sinks());
        // out[h, t] = Σ_j scores[h, t, j] · values[h / group, j]
        batched_gemm(
            &g,
            Gemm {
                transpose_a: false,
                m: d,
                n: rows,
                k: slots,
                alpha: 1.0,
                a: values,
                lda: d,
                stride_a: ring_stride,
                b: scores.ptr(),
                ldb: slots,
                stride_b: rows * slots,
                c: ot.ptr(),
                ldc: d,
                stride_c: rows * d,
                batches: kv.kv_heads,
                compute,
            },
        )?;
        launch!(&g, "heads_last", elements(&g, count * heads * d);
            ot.ptr(), out.ptr(), int(t0)?, int(count)?, int(heads)?, int(d)?);
    }
    Ok(out)
}

/// One strided batched f32 product `C = alpha · op(A) · B` in cuBLAS's column-major terms
/// (`op` transposes A when asked), batch `i` at `a + i·stride_a` and so on.
struct Gemm {
    transpose_a: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: u64,
    lda: usize,
    stride_a: usize,
    b: u64,
    ldb: usize,
    stride_b: usize,
    c: u64,
    ldc: usize,
    stride_c: usize,
    batches: usize,
    compute: cublasComputeType_t,
}

fn batched_gemm(g: &Gpu, p: Gemm) -> Result<()> {
    let beta = 0.0f32;
    let f32_t = cudaDataType::CUDA_R_32F;
    let op_a = if p.transpose_a {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    };
    // SAFETY: the callers size the buffers for the strides and leading dimensions given.
    g.blas_call(|blas| unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            op_a,
            cublasOperation_t::CUBLAS_OP_N,
            int(p.m)?,
            int(p.n)?,
            int(p.k)?,
            (&p.alpha as *const f32).cast(),
            p.a as *const _,
            f32_t,
            int(p.lda)?,
            p.stride_a as i64,
            p.b as *const _,
            f32_t,
            int(p.ldb)?,
            p.stride_b as i64,
            (&beta as *const f32).cast(),
            p.c as *mut _,
            f32_t,
            int(p.ldc)?,
            p.stride_c as i64,
            int(p.batches)?,
            p.compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(err)
    })
}
