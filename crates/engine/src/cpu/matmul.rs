//! `y = x · Wᵀ` on MLX affine-quantized weights, without materialising W.
//!
//! - GEMV (a few activation rows, as in decoding): each group contributes
//!   `s · Σ q·x + b · Σ x`, so the packed integers meet x directly and the bias costs one multiply
//!   per group (`Σ x` per group is computed once per call). On 4- and 8-bit weights [`matmul`]
//!   takes the integer kernels of [`super::qint`] (int8-triple or int16-pair activations by
//!   default, as exact as these); the f32-activation kernels here take the rest. The integers are isolated by bit plane,
//!   one AND per plane (`avx2::qrows_pow2` for 2, 4 and 8 bits, `avx2::qrows_spread` for 3, 5
//!   and 6), against a copy of x laid out and pre-scaled to match once per call; the portable
//!   kernels do the same in eight-lane arrays.
//! - GEMM (many rows, as in prefill): weight panels are dequantized into an f32 tile that stays in
//!   L1 and go through the shared register-blocked kernel (`super::gemm`), so unpacking is paid
//!   once per panel rather than once per activation row.

use super::gemm::{self, Panels};
use super::pool::{self, SharedMut};
use super::{qint, with_scratch, with_task_scratch, Isa};
use crate::params::FloatSlice;
use crate::params::QuantizedView;

/// Up to this many activation rows the f32-activation GEMV beats dequantizing panels: the
/// crossover lies at 7-8 rows for 2-, 4- and 8-bit weights and at 5 for 3-, 5- and 6-bit ones.
pub const GEMV_MAX_M: usize = 6;

/// Up to this many activation rows the integer GEMV ([`qint`]) beats dequantizing panels: it
/// decodes batches of sequences. Against panels dequantized by rows and transposed after, it
/// still wins at 12 sequences of a small 4-bit model on a 2-vCPU Xeon and loses at 16. Where
/// AVX-512 dequantizes straight into the panels, [`INT_GEMV_MAX_M_AVX512`] applies.
pub const INT_GEMV_MAX_M: usize = 12;

/// [`INT_GEMV_MAX_M`] where the panels are AVX-512's, dequantized in registers
/// (`avx512::dequantize_column_major`): on the same machine and model those panels draw level
/// with the GEMV at 8 sequences and pull ahead from 9.
pub const INT_GEMV_MAX_M_AVX512: usize = 8;

/// Weight rows the GEMV walks together; the AVX2 kernels share each activation load among them.
const GEMV_ROWS: usize = 4;

/// `y[m, rows] = x[m, cols] · Wᵀ` on the packed weights, with the best kernels for this processor.
pub fn matmul(w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    let isa = Isa::best();
    match int_kernel(w, m) {
        Some(kernel) => qint::gemv(kernel, w, x, m, y),
        None if m <= GEMV_MAX_M => gemv(isa, w, x, m, y),
        None => gemm(isa, w, x, m, y),
    }
}

/// [`matmul`] of several matrices against the same activations, `ys[j]` from `ws[j]`: one pool
/// job for all of them where they share input width and format and the integer GEMV takes
/// them (decoding), else one matmul each.
pub fn matmul_group(ws: &[&QuantizedView], x: &[f32], m: usize, ys: &mut [&mut [f32]]) {
    let format = |w: &QuantizedView| (w.cols, w.bits, w.group_size);
    match int_kernel(ws[0], m) {
        Some(k)
            if ws
                .iter()
                .all(|w| format(w) == format(ws[0]) && k.supports(w)) =>
        {
            qint::gemv_group(k, ws, x, m, ys)
        }
        _ => {
            for (w, y) in ws.iter().zip(ys.iter_mut()) {
                matmul(w, x, m, y);
            }
        }
    }
}

/// The most activation rows the integer GEMV takes on this processor.
fn int_gemv_max_m() -> usize {
    if Isa::best() >= Isa::Avx512 {
        INT_GEMV_MAX_M_AVX512
    } else {
        INT_GEMV_MAX_M
    }
}

/// The integer GEMV kernel that takes `m` rows against `w`, where one does.
fn int_kernel(w: &QuantizedView, m: usize) -> Option<qint::IntKernel> {
    match qint::precision() {
        qint::Precision::Int(a) if m <= int_gemv_max_m() => qint::IntKernel::best(a, w),
        _ => None,
    }
}

/// [`matmul`] by the GEMV method on the given kernels (panics if the processor lacks them).
pub fn gemv(isa: Isa, w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    check(isa, w, x, m, y);
    gemv_rows(isa, w, x, m, y);
}

/// [`matmul`] by the GEMM method on the given kernels (panics if the processor lacks them).
pub fn gemm(isa: Isa, w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    check(isa, w, x, m, y);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && super::amx::supports(w, m) {
        return super::amx::gemm(w, x, m, y);
    }
    gemm::gemm(isa, &QuantPanels(w), x, m, y);
}

/// Row `row` dequantized into `out[..cols]`, bit for bit as [`QuantizedView::dequantize_row`].
pub fn dequantize_row(isa: Isa, w: &QuantizedView, row: usize, out: &mut [f32]) {
    isa.check();
    dequantize_columns(isa, w, row, 0, &mut out[..w.cols]);
}

fn check(isa: Isa, w: &QuantizedView, x: &[f32], m: usize, y: &[f32]) {
    isa.check();
    assert!(
        x.len() >= m * w.cols && y.len() >= m * w.rows,
        "quantized matmul of [{m}, {}] by [{}, {}]ᵀ: operands too short",
        w.cols,
        w.rows,
        w.cols
    );
}

/// Columns `k0..k0 + out.len()` (whole groups) of row `row`, dequantized.
fn dequantize_columns(isa: Isa, w: &QuantizedView, row: usize, k0: usize, out: &mut [f32]) {
    match isa {
        Isa::Portable => dequantize_portable(w, row, k0, out),
        // SAFETY: the callers checked the processor.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx if matches!(w.bits, 4 | 8) && w.group_size.is_multiple_of(16) => unsafe {
            use super::avx512::dequantize;
            match w.bits {
                4 => dequantize::<4>(w, row, k0, out),
                _ => dequantize::<8>(w, row, k0, out),
            }
        },
        // SAFETY: the callers checked the processor.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
            use super::avx2::dequantize;
            match w.bits {
                2 => dequantize::<2>(w, row, k0, out),
                3 => dequantize::<3>(w, row, k0, out),
                4 => dequantize::<4>(w, row, k0, out),
                5 => dequantize::<5>(w, row, k0, out),
                6 => dequantize::<6>(w, row, k0, out),
                8 => dequantize::<8>(w, row, k0, out),
                b => unreachable!("{b}-bit weights passed construction"),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
    }
}

/// The weight matrix as panels dequantized into the tile.
struct QuantPanels<'v, 'a>(&'v QuantizedView<'a>);

impl Panels for QuantPanels<'_, '_> {
    fn rows(&self) -> usize {
        self.0.rows
    }

    fn cols(&self) -> usize {
        self.0.cols
    }

    fn panel(&self, isa: Isa, n0: usize, nc: usize, k0: usize, kc: usize, tile: &mut [f32]) {
        for (j, out) in tile.chunks_exact_mut(kc).take(nc).enumerate() {
            dequantize_columns(isa, self.0, n0 + j, k0, out);
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn column_panel(
        &self,
        isa: Isa,
        n0: usize,
        nc: usize,
        k0: usize,
        kc: usize,
        tile: &mut [f32],
        panel: &mut [f32],
    ) {
        let w = self.0;
        if matches!(w.bits, 4 | 8) && w.group_size.is_multiple_of(16) {
            // SAFETY: the column-major panels are the AVX-512 kernels'; the caller checked
            // the processor.
            return unsafe {
                match w.bits {
                    4 => super::avx512::dequantize_column_major::<4>(w, n0, nc, k0, kc, panel),
                    _ => super::avx512::dequantize_column_major::<8>(w, n0, nc, k0, kc, panel),
                }
            };
        }
        gemm::column_panel_via_tile(self, isa, (n0, nc, k0, kc), tile, panel);
    }
}

/// `out[i] = Σ x[i*g..(i+1)*g]`.
fn group_sums(x: &[f32], g: usize, out: &mut [f32]) {
    for (o, group) in out.iter_mut().zip(x.chunks_exact(g)) {
        *o = group.iter().sum();
    }
}

/// The eight integers of elements `8*blk..8*blk + 8` of row `row`, read from the u32 words (so
/// independent of the host's byte order). Eight elements start on a byte and span at most 64 bits.
fn unpack8(w: &QuantizedView, row: usize, blk: usize) -> [u32; 8] {
    let bits = w.bits as usize;
    let bit = (row * w.cols + blk * 8) * bits;
    let (word, shift) = (bit / 32, bit % 32);
    let lo = w.packed[word] as u64;
    let hi = w.packed.get(word + 1).map_or(0, |&v| v as u64);
    let v = (lo | hi << 32) >> shift;
    let mask = (1u64 << bits) - 1;
    std::array::from_fn(|i| ((v >> (i * bits)) & mask) as u32)
}

fn dequantize_portable(w: &QuantizedView, row: usize, k0: usize, out: &mut [f32]) {
    let g = w.group_size;
    assert!(k0.is_multiple_of(g) && out.len().is_multiple_of(g));
    let first_group = row * (w.cols / g) + k0 / g;
    for (gi, group) in out.chunks_exact_mut(g).enumerate() {
        let (s, b) = (
            w.scales.get(first_group + gi),
            w.biases.get(first_group + gi),
        );
        let block0 = (k0 + gi * g) / 8;
        for (i, dst) in group.chunks_exact_mut(8).enumerate() {
            for (d, q) in dst.iter_mut().zip(unpack8(w, row, block0 + i)) {
                *d = s * q as f32 + b;
            }
        }
    }
}

/// Lays an activation row out as the 2/4/8-bit plane kernels read it: for each chunk `c` of eight
/// packed words (`e = 32 / bits` columns each), plane `k` holds columns `8ec + le + k` for lanes
/// `l = 0..8`, times `2^(-bits*k)` except on the top plane. Columns past the row are zero.
fn permute_planes(x: &[f32], bits: usize, out: &mut [f32]) {
    let e = 32 / bits;
    for (c, chunk) in out.chunks_exact_mut(8 * e).enumerate() {
        for (k, plane) in chunk.chunks_exact_mut(8).enumerate() {
            let scale = if k + 1 < e {
                2f32.powi(-((bits * k) as i32))
            } else {
                1.0
            };
            for (l, p) in plane.iter_mut().enumerate() {
                *p = x.get(8 * e * c + l * e + k).map_or(0.0, |v| v * scale);
            }
        }
    }
}

/// Lays an activation row out as the 3/5/6-bit spread kernels read it: for each chunk of 32
/// columns, plane `k` holds columns `4l + k` for lanes `l = 0..8`, times `2^-(4lB mod 8 + Bk)`.
fn permute_spread(x: &[f32], bits: usize, out: &mut [f32]) {
    for (xc, chunk) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        for (k, plane) in chunk.chunks_exact_mut(8).enumerate() {
            for (l, p) in plane.iter_mut().enumerate() {
                *p = xc[4 * l + k] * 2f32.powi(-(((4 * l * bits) % 8 + bits * k) as i32));
            }
        }
    }
}

/// Bytes one pass over `w` reads: packed integers, scales and biases.
pub(super) fn weight_bytes(w: &QuantizedView) -> usize {
    let scale_bytes = match w.scales {
        FloatSlice::F32(_) => 4,
        FloatSlice::F16(_) | FloatSlice::BF16(_) => 2,
    };
    4 * w.packed.len() + scale_bytes * (w.scales.len() + w.biases.len())
}

/// Weight rows per pool task: enough to amortise waking a worker, few enough to balance.
const GEMV_TASK_ROWS: usize = 64;

/// The GEMV: activation rows laid out for the kernels, then [`GEMV_ROWS`] weight rows at a time
/// against every activation row while those weight rows are in cache; blocks of
/// [`GEMV_TASK_ROWS`] weight rows go to the pool.
fn gemv_rows(isa: Isa, w: &QuantizedView, x: &[f32], m: usize, y: &mut [f32]) {
    let (rows, cols, g, bits) = (w.rows, w.cols, w.group_size, w.bits as usize);
    let groups = cols / g;
    let planes = matches!(bits, 2 | 4 | 8);
    let xp_len = if planes {
        (cols * bits / 32).div_ceil(8) * 8 * (32 / bits)
    } else {
        cols
    };
    with_scratch(m * (xp_len + groups), |s| {
        let (xp, sums) = s.split_at_mut(m * xp_len);
        for i in 0..m {
            let xi = &x[i * cols..(i + 1) * cols];
            let out = &mut xp[i * xp_len..(i + 1) * xp_len];
            if planes {
                permute_planes(xi, bits, out);
            } else {
                permute_spread(xi, bits, out);
            }
            group_sums(xi, g, &mut sums[i * groups..(i + 1) * groups]);
        }
        let (xp, sums) = (&*xp, &*sums);
        let y = SharedMut::new(y);
        pool::parallel_for_bytes(rows.div_ceil(GEMV_TASK_ROWS), weight_bytes(w), &|t| {
            let r0 = t * GEMV_TASK_ROWS;
            let r1 = (r0 + GEMV_TASK_ROWS).min(rows);
            gemv_task(isa, w, xp, xp_len, sums, m, r0..r1, y);
        });
    })
}

/// Weight rows `range` of the GEMV against every laid-out activation row.
#[allow(clippy::too_many_arguments)]
fn gemv_task(
    isa: Isa,
    w: &QuantizedView,
    xp: &[f32],
    xp_len: usize,
    sums: &[f32],
    m: usize,
    range: std::ops::Range<usize>,
    y: SharedMut<f32>,
) {
    let (rows, cols, g, bits) = (w.rows, w.cols, w.group_size, w.bits as usize);
    let groups = cols / g;
    let row_words = cols * bits / 32;
    // The task's scale and bias rows as f32 in one conversion each, followed by 8 zeros because
    // the planes kernel reads 8 scales at a time.
    let n = range.len();
    with_task_scratch(2 * (n * groups + 8), |s| {
        let (sc, bi) = s.split_at_mut(n * groups + 8);
        to_f32(isa, w.scales, range.start * groups, &mut sc[..n * groups]);
        to_f32(isa, w.biases, range.start * groups, &mut bi[..n * groups]);
        sc[n * groups..].fill(0.0);
        let stride = groups;
        for r0 in range.clone().step_by(GEMV_ROWS) {
            let rr = GEMV_ROWS.min(range.end - r0);
            let local = (r0 - range.start) * stride;
            let block = GemvRows {
                rows: rr,
                packed: &w.packed[r0 * row_words..],
                row_words,
                group_size: g,
                scales: &sc[local..],
                stride,
            };
            for i in 0..m {
                let xp = &xp[i * xp_len..(i + 1) * xp_len];
                let part = match bits {
                    2 => block.planes::<2>(isa, xp),
                    4 => block.planes::<4>(isa, xp),
                    8 => block.planes::<8>(isa, xp),
                    3 => block.spread::<3>(isa, xp),
                    5 => block.spread::<5>(isa, xp),
                    6 => block.spread::<6>(isa, xp),
                    b => unreachable!("{b}-bit weights passed construction"),
                };
                let sums = &sums[i * groups..(i + 1) * groups];
                // SAFETY: tasks own disjoint row ranges of each output row.
                let out = unsafe { y.range(i * rows + r0, rr) };
                for (j, (o, p)) in out.iter_mut().zip(part).enumerate() {
                    let bias =
                        super::dense::dot_with(isa, &bi[local + j * stride..][..groups], sums);
                    *o = p + bias;
                }
            }
        }
    })
}

/// `dst[i] = src[start + i]` as f32.
fn to_f32(isa: Isa, src: FloatSlice, start: usize, dst: &mut [f32]) {
    match isa {
        Isa::Portable => src.to_f32(start, dst),
        // SAFETY: the callers checked the processor.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
            super::avx2::convert_slice(src, start, dst)
        },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
    }
}

/// Up to [`GEMV_ROWS`] consecutive weight rows, as the GEMV kernels take them.
struct GemvRows<'a> {
    rows: usize,
    /// From the first row to the end of the matrix.
    packed: &'a [u32],
    row_words: usize,
    group_size: usize,
    /// The rows' scales as f32, `stride` apart, with 8 readable values past the last row.
    scales: &'a [f32],
    stride: usize,
}

/// Calls `$kernel::<$bits, R>($args)` for the runtime row count `$rows`, padding to [`GEMV_ROWS`].
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($rows:expr, $kernel:ident::<$bits:ident>($($arg:expr),*)) => {{
        fn widen<const R: usize>(v: [f32; R]) -> [f32; GEMV_ROWS] {
            std::array::from_fn(|i| v.get(i).copied().unwrap_or(0.0))
        }
        match $rows {
            4 => $kernel::<$bits, 4>($($arg),*),
            3 => widen($kernel::<$bits, 3>($($arg),*)),
            2 => widen($kernel::<$bits, 2>($($arg),*)),
            1 => widen($kernel::<$bits, 1>($($arg),*)),
            _ => unreachable!(),
        }
    }};
}

impl GemvRows<'_> {
    /// `Σ_groups s · Σ q·x` of each row against `xp` laid out by [`permute_planes`].
    fn planes<const B: usize>(&self, isa: Isa, xp: &[f32]) -> [f32; GEMV_ROWS] {
        // Words per group: a power of two from 2 to 32.
        let wpg = self.group_size * B / 32;
        match isa {
            Isa::Portable => std::array::from_fn(|j| {
                if j < self.rows {
                    self.row_planes::<B>(j, wpg, xp)
                } else {
                    0.0
                }
            }),
            // SAFETY: the callers checked the processor.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
                use super::avx2::qrows_pow2;
                let (p, rw, s, st) = (self.packed, self.row_words, self.scales, self.stride);
                by_rows!(self.rows, qrows_pow2::<B>(p, rw, wpg, s, st, xp))
            },
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
        }
    }

    /// `Σ_groups s · Σ q·x` of each row against `xp` laid out by [`permute_spread`].
    fn spread<const B: usize>(&self, isa: Isa, xp: &[f32]) -> [f32; GEMV_ROWS] {
        match isa {
            Isa::Portable => std::array::from_fn(|j| {
                if j < self.rows {
                    self.row_spread::<B>(j, xp)
                } else {
                    0.0
                }
            }),
            // SAFETY: the callers checked the processor.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe {
                use super::avx2::qrows_spread;
                let bytes: &[u8] = bytemuck::cast_slice(self.packed);
                let (rb, g, s, st) = (
                    self.row_words * 4,
                    self.group_size,
                    self.scales,
                    self.stride,
                );
                by_rows!(self.rows, qrows_spread::<B>(bytes, rb, g, s, st, xp))
            },
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 | Isa::Amx => unreachable!(),
        }
    }

    /// The portable twin of `avx2::qrows_pow2` for row `j`, in eight-lane arrays.
    fn row_planes<const B: usize>(&self, j: usize, wpg: usize, xp: &[f32]) -> f32 {
        let e = 32 / B;
        let wpg_log2 = wpg.trailing_zeros();
        let words = &self.packed[j * self.row_words..(j + 1) * self.row_words];
        let scales = &self.scales[j * self.stride..];
        let mut total = [0.0f32; 8];
        for (c, xc) in xp.chunks_exact(8 * e).enumerate() {
            let mut lanes = [0u32; 8];
            let have = (words.len() - c * 8).min(8);
            lanes[..have].copy_from_slice(&words[c * 8..c * 8 + have]);
            let mut acc = [0.0f32; 8];
            for (k, xk) in xc.chunks_exact(8).enumerate() {
                let xk: &[f32; 8] = xk.try_into().unwrap();
                for l in 0..8 {
                    let q = if k + 1 < e {
                        lanes[l] & (((1 << B) - 1) << (B * k))
                    } else {
                        lanes[l] >> (32 - B)
                    };
                    acc[l] += q as i32 as f32 * xk[l];
                }
            }
            if wpg >= 8 {
                let s = scales[(c * 8) >> wpg_log2];
                for l in 0..8 {
                    total[l] += acc[l] * s;
                }
            } else {
                // Lanes past the row's end read the next row's scales or the zero padding, and
                // meet zero integers.
                for l in 0..8 {
                    total[l] += acc[l] * scales[(c * 8 + l) >> wpg_log2];
                }
            }
        }
        total.iter().sum()
    }

    /// The portable twin of `avx2::qrows_spread` for row `j`, in eight-lane arrays.
    fn row_spread<const B: usize>(&self, j: usize, xp: &[f32]) -> f32 {
        let words = &self.packed[j * self.row_words..(j + 1) * self.row_words];
        let scales = &self.scales[j * self.stride..];
        let masks: [[u32; 8]; 4] = std::array::from_fn(|k| {
            std::array::from_fn(|l| ((1u32 << B) - 1) << ((4 * l * B) % 8 + B * k))
        });
        let mut total = [0.0f32; 8];
        for (c, xc) in xp.chunks_exact(32).enumerate() {
            // Lane l: the four bytes from byte 4lB/8 of the chunk, read from the words.
            let lanes: [u32; 8] = std::array::from_fn(|l| {
                let byte = c * 4 * B + 4 * l * B / 8;
                let lo = words[byte / 4] as u64;
                let hi = words.get(byte / 4 + 1).map_or(0, |&v| v as u64);
                ((lo | hi << 32) >> (8 * (byte % 4))) as u32
            });
            let mut acc = [0.0f32; 8];
            for (mask, xk) in masks.iter().zip(xc.chunks_exact(8)) {
                let xk: &[f32; 8] = xk.try_into().unwrap();
                for l in 0..8 {
                    acc[l] += (lanes[l] & mask[l]) as i32 as f32 * xk[l];
                }
            }
            let s = scales[c * 32 / self.group_size];
            for l in 0..8 {
                total[l] += acc[l] * s;
            }
        }
        total.iter().sum()
    }
}
