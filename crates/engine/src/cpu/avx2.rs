//! AVX2 + FMA + F16C kernels. Every function here is `unsafe` because it may only run once
//! [`super::Isa::Avx2`] was found available; pointer bounds are checked at each entry point.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::gemm::Kernel;
use crate::params::FloatSlice;

/// The float types weights, scales and biases come in.
pub(super) trait Elem: Copy {
    const KIND: Kind;
    fn to_f32(self) -> f32;
}

pub(super) enum Kind {
    F32,
    F16,
    BF16,
}

impl Elem for f32 {
    const KIND: Kind = Kind::F32;
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    const KIND: Kind = Kind::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Elem for bf16 {
    const KIND: Kind = Kind::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Asks for the cache line at `p` (any address: a prefetch never faults).
#[target_feature(enable = "sse")]
#[inline]
pub(super) unsafe fn prefetch<T>(p: *const T) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
}

/// Bytes ahead of the rows being read that attention asks the cache for: one core's stream of
/// keys or values otherwise waits on memory (at 4096 positions on a Sapphire Rapids core, about
/// half the core's bandwidth without, three quarters with).
const ATTENTION_PREFETCH_BYTES: usize = 2048;

/// Prefetches the cache lines of the `len` elements [`ATTENTION_PREFETCH_BYTES`] past `p`.
#[target_feature(enable = "sse")]
#[inline]
pub(super) unsafe fn prefetch_ahead<T>(p: *const T, len: usize) {
    let at = p.cast::<u8>().wrapping_add(ATTENTION_PREFETCH_BYTES);
    for line in (0..len * std::mem::size_of::<T>()).step_by(64) {
        prefetch(at.wrapping_add(line));
    }
}

/// Eight values from `p` as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn load8<T: Elem>(p: *const T) -> __m256 {
    match T::KIND {
        Kind::F32 => _mm256_loadu_ps(p.cast()),
        Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        // A bf16 is the top half of the f32 with the same value.
        Kind::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.cast()),
        ))),
    }
}

/// The sum of the eight lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// The lane sums of four vectors, in order.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hsum4(v: &[__m256; 4]) -> __m128 {
    let t = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
}

/// All-ones in lanes `0..n` (`n < 8`), zero above: a mask for a row's last partial vector.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn tail_mask(n: usize) -> __m256i {
    const ONES_THEN_ZEROS: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];
    _mm256_loadu_si256(ONES_THEN_ZEROS.as_ptr().add(8 - n).cast())
}

/// Eight little-endian bytes from `off`, zero-filled past the end of `bytes`.
#[inline(always)]
fn read_u64(bytes: &[u8], off: usize) -> u64 {
    match bytes.get(off..off + 8) {
        Some(b) => u64::from_le_bytes(b.try_into().unwrap()),
        None => {
            let rest = &bytes[off..];
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            u64::from_le_bytes(b)
        }
    }
}

/// `a · b` with four accumulators.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    assert!(b.len() >= n);
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            let o = i + 8 * j;
            *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i)),
            _mm256_loadu_ps(pb.add(i)),
            acc[0],
        );
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    for j in i..n {
        s += a[j] * b[j];
    }
    s
}

/// `dst[i] = src[i]` as f32 over the shorter of the two.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn convert<T: Elem>(src: &[T], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let full = n / 8 * 8;
    for c in (0..full).step_by(8) {
        _mm256_storeu_ps(dst.as_mut_ptr().add(c), load8(src.as_ptr().add(c)));
    }
    for c in full..n {
        dst[c] = src[c].to_f32();
    }
}

/// `dst[i] = src[start + i]` as f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn convert_slice(src: FloatSlice, start: usize, dst: &mut [f32]) {
    let end = start + dst.len();
    match src {
        FloatSlice::F32(v) => dst.copy_from_slice(&v[start..end]),
        FloatSlice::F16(v) => convert(&v[start..end], dst),
        FloatSlice::BF16(v) => convert(&v[start..end], dst),
    }
}

/// `x · w_r` for `R` float rows `ws` apart, each `x.len()` long: the dense GEMV.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dense_rows<T: Elem, const R: usize>(
    w: &[T],
    ws: usize,
    x: &[f32],
) -> [f32; R] {
    let k = x.len();
    assert!(w.len() >= (R - 1) * ws + k);
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    // Two accumulators per row so that R = 1 still keeps two FMA chains in flight.
    let mut a0 = [_mm256_setzero_ps(); R];
    let mut a1 = [_mm256_setzero_ps(); R];
    let mut c = 0;
    while c + 16 <= k {
        let (x0, x1) = (_mm256_loadu_ps(px.add(c)), _mm256_loadu_ps(px.add(c + 8)));
        for r in 0..R {
            let row = pw.add(r * ws + c);
            a0[r] = _mm256_fmadd_ps(load8(row), x0, a0[r]);
            a1[r] = _mm256_fmadd_ps(load8(row.add(8)), x1, a1[r]);
        }
        c += 16;
    }
    if c + 8 <= k {
        let x0 = _mm256_loadu_ps(px.add(c));
        for (r, a) in a0.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(load8(pw.add(r * ws + c)), x0, *a);
        }
        c += 8;
    }
    let mut out = [0.0f32; R];
    for (r, o) in out.iter_mut().enumerate() {
        *o = hsum(_mm256_add_ps(a0[r], a1[r]));
        for j in c..k {
            *o += w[r * ws + j].to_f32() * x[j];
        }
    }
    out
}

impl Kernel<'_> {
    /// The GEMM micro-kernel: `R × C` dot products of length `kc`, eight lanes wide.
    #[allow(clippy::needless_range_loop)] // `acc[i][j]` reads clearer than nested iterators
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2<const R: usize, const C: usize>(self) {
        let (px, pw) = (self.x.as_ptr(), self.w.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let full = self.kc / 8 * 8;
        let mut c = 0;
        while c < full {
            let mut xv = [_mm256_setzero_ps(); R];
            for (i, v) in xv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(px.add(i * self.xs + c));
            }
            for j in 0..C {
                let wv = _mm256_loadu_ps(pw.add(j * self.ws + c));
                for i in 0..R {
                    acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
                }
            }
            c += 8;
        }
        if full < self.kc {
            let mask = tail_mask(self.kc - full);
            for j in 0..C {
                let wv = _mm256_maskload_ps(pw.add(j * self.ws + c), mask);
                for i in 0..R {
                    let xv = _mm256_maskload_ps(px.add(i * self.xs + c), mask);
                    acc[i][j] = _mm256_fmadd_ps(xv, wv, acc[i][j]);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let y = self.y.add(i * self.ys);
            if let Ok(four) = <&[__m256; 4]>::try_from(&acc[..]) {
                let mut s = hsum4(four);
                if self.accumulate {
                    s = _mm_add_ps(s, _mm_loadu_ps(y));
                }
                _mm_storeu_ps(y, s);
            } else {
                for (j, &a) in acc.iter().enumerate() {
                    let s = hsum(a);
                    *y.add(j) = if self.accumulate { *y.add(j) + s } else { s };
                }
            }
        }
    }
}

/// The eight 4-bit integers of one packed word, in order, as i32 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn unpack_word4(word: u32) -> __m256i {
    let v = _mm256_srlv_epi32(
        _mm256_set1_epi32(word as i32),
        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
    );
    _mm256_and_si256(v, _mm256_set1_epi32(0xf))
}

/// The eight `B`-bit integers of the 8-element block at byte `off` of an MLX-packed row (eight
/// elements always start on a byte), in order, as i32 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn unpack8<const B: u32>(bytes: &[u8], off: usize) -> __m256i {
    // Elements 0-3 lie in the low 4B bits and 4-7 in the next 4B (B <= 8): put each half in its
    // own 32-bit word, spread the words over four lanes each, then shift each lane's element down.
    let v = read_u64(bytes, off);
    let halves = (v & 0xffff_ffff) | ((v >> (4 * B)) << 32);
    let v = _mm256_permutevar8x32_epi32(
        _mm256_castsi128_si256(_mm_cvtsi64_si128(halves as i64)),
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
    );
    let b = B as i32;
    let v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, b, 2 * b, 3 * b, 0, b, 2 * b, 3 * b));
    _mm256_and_si256(v, _mm256_set1_epi32((1 << B) - 1))
}

/// Dequantizes columns `k0..k0 + out.len()` of row `row` (whole groups) exactly as
/// `QuantizedView::dequantize_row` does: `scale * q`, then `+ bias`, each rounded.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize<const B: u32>(
    w: &crate::params::QuantizedView,
    row: usize,
    k0: usize,
    out: &mut [f32],
) {
    let bytes: &[u8] = bytemuck::cast_slice(w.packed);
    for_each_group(w, row, k0, out, |scale, bias, e0, group| {
        let g = group.len();
        let (s, b) = (_mm256_set1_ps(scale), _mm256_set1_ps(bias));
        let dq = |q: __m256i, dst: &mut [f32]| {
            let v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), s), b);
            _mm256_storeu_ps(dst.as_mut_ptr(), v);
        };
        match B {
            // One word is eight elements.
            4 => {
                let words = &w.packed[e0 / 8..(e0 + g) / 8];
                for (&word, dst) in words.iter().zip(group.chunks_exact_mut(8)) {
                    dq(unpack_word4(word), dst);
                }
            }
            // Two words are eight elements.
            8 => {
                let words = &w.packed[e0 / 4..(e0 + g) / 4];
                for (pair, dst) in words.chunks_exact(2).zip(group.chunks_exact_mut(8)) {
                    dq(
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(pair.as_ptr().cast())),
                        dst,
                    );
                }
            }
            _ => {
                for (i, dst) in group.chunks_exact_mut(8).enumerate() {
                    dq(unpack8::<B>(bytes, (e0 / 8 + i) * B as usize), dst);
                }
            }
        }
    });
}

/// Calls `each(scale, bias, first element, out's slice)` for every group of columns
/// `k0..k0 + out.len()` (whole groups) of row `row`: the dequantizers' walk. Scales and biases
/// are converted a batch of groups at a time, with the vector conversions.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn for_each_group(
    w: &crate::params::QuantizedView,
    row: usize,
    k0: usize,
    out: &mut [f32],
    mut each: impl FnMut(f32, f32, usize, &mut [f32]),
) {
    const BATCH: usize = 16;
    let g = w.group_size;
    assert!(k0.is_multiple_of(g) && out.len().is_multiple_of(g) && k0 + out.len() <= w.cols);
    let first = row * w.cols + k0;
    for (bi, batch) in out.chunks_mut(BATCH * g).enumerate() {
        let groups = batch.len() / g;
        let mut sb = [0.0f32; 2 * BATCH];
        let g0 = first / g + bi * BATCH;
        convert_slice(w.scales, g0, &mut sb[..groups]);
        convert_slice(w.biases, g0, &mut sb[BATCH..BATCH + groups]);
        for (gi, group) in batch.chunks_exact_mut(g).enumerate() {
            each(sb[gi], sb[BATCH + gi], first + (bi * BATCH + gi) * g, group);
        }
    }
}

/// `Σ_groups s · Σ q·x` for `R` consecutive rows of a `B`-bit matrix, `B` in {2, 4, 8}, against
/// one activation row laid out by `matmul::permute_planes`. The bias term is the caller's.
///
/// Eight packed words are loaded as one vector; "plane" `k` of it is bits `B*k..B*(k+1)` of every
/// word, isolated with one AND as `q << B*k`, which converts to f32 exactly and meets
/// `x · 2^(-B*k)` (pre-scaled, so the product is exact too). The top plane is shifted down
/// instead, as `q << 32-B` would not fit a signed lane.
///
/// `packed` starts at the first row (rows are `row_words` apart); `scales` holds each row's
/// scales as f32, rows `scale_stride` apart, and at least 8 values past the last row's last group
/// (read 8 at a time; values past a row's groups only meet zero lanes, so must be finite).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn qrows_pow2<const B: usize, const R: usize>(
    packed: &[u32],
    row_words: usize,
    words_per_group: usize,
    scales: &[f32],
    scale_stride: usize,
    xp: &[f32],
) -> [f32; R] {
    let planes = 32 / B;
    let chunks = row_words.div_ceil(8);
    let groups = row_words / words_per_group;
    assert!(
        packed.len() >= R * row_words
            && scales.len() >= (R - 1) * scale_stride + groups + 8
            && scale_stride >= groups
            && xp.len() >= chunks * 8 * planes
    );
    assert!(words_per_group.is_power_of_two());
    let wpg_log2 = words_per_group.trailing_zeros();
    // Lane l of a chunk belongs to group `first + l / words_per_group`.
    let mut lanes = [0i32; 8];
    for (l, v) in lanes.iter_mut().enumerate() {
        *v = (l / words_per_group) as i32;
    }
    let lane_group = _mm256_loadu_si256(lanes.as_ptr().cast());
    let mut masks = [_mm256_setzero_si256(); 15];
    for (k, m) in masks.iter_mut().enumerate().take(planes - 1) {
        *m = _mm256_set1_epi32(((1 << B) - 1) << (B * k));
    }
    let top = _mm256_set1_epi32(32 - B as i32);
    let (pw, ps) = (packed.as_ptr(), scales.as_ptr());
    let mut total = [_mm256_setzero_ps(); R];
    let mut words = [_mm256_setzero_si256(); R];
    let tail = row_words % 8;
    for c in 0..chunks {
        if c * 8 + 8 <= row_words {
            for (r, v) in words.iter_mut().enumerate() {
                *v = _mm256_loadu_si256(pw.add(r * row_words + c * 8).cast());
            }
        } else {
            let mask = tail_mask(tail);
            for (r, v) in words.iter_mut().enumerate() {
                *v = _mm256_maskload_epi32(pw.add(r * row_words + c * 8).cast(), mask);
            }
        }
        let x = xp.as_ptr().add(c * 8 * planes);
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, mask) in masks.iter().enumerate().take(planes - 1) {
            let xk = _mm256_loadu_ps(x.add(8 * k));
            for r in 0..R {
                let q = _mm256_cvtepi32_ps(_mm256_and_si256(words[r], *mask));
                acc[r] = _mm256_fmadd_ps(q, xk, acc[r]);
            }
        }
        let xk = _mm256_loadu_ps(x.add(8 * (planes - 1)));
        let first = (c * 8) >> wpg_log2;
        for r in 0..R {
            let q = _mm256_cvtepi32_ps(_mm256_srlv_epi32(words[r], top));
            acc[r] = _mm256_fmadd_ps(q, xk, acc[r]);
            let s = _mm256_loadu_ps(ps.add(r * scale_stride + first));
            total[r] = _mm256_fmadd_ps(acc[r], _mm256_permutevar8x32_ps(s, lane_group), total[r]);
        }
    }
    let mut out = [0.0f32; R];
    for r in 0..R {
        out[r] = hsum(total[r]);
    }
    out
}

/// 32 elements of a 3-, 5- or 6-bit row (`4B` bytes from `off`), spread so that dword lane `l`
/// holds the four bytes from byte `4lB/8`, which contain elements `4l..4l + 4`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn spread32<const B: usize>(bytes: &[u8], off: usize, control: __m256i) -> __m256i {
    // Elements 0-15 lie in bytes 0..2B and 16-31 in 2B..4B: one 16-byte load per 128-bit half,
    // then one in-lane shuffle with the same control for both halves.
    let half = 2 * B;
    let v = if off + half + 16 <= bytes.len() {
        let p = bytes.as_ptr().add(off);
        _mm256_loadu2_m128i(p.add(half).cast(), p.cast())
    } else {
        let mut buf = [0u8; 32];
        let n = 4 * B;
        buf[..n].copy_from_slice(&bytes[off..off + n]);
        _mm256_loadu2_m128i(buf.as_ptr().add(half).cast(), buf.as_ptr().cast())
    };
    _mm256_shuffle_epi8(v, control)
}

/// `Σ_groups s · Σ q·x` for `R` consecutive rows of a `B`-bit matrix, `B` in {3, 5, 6}, against
/// one activation row laid out by `matmul::permute_spread`. The bias term is the caller's.
///
/// After [`spread32`], element `4l + k` sits in lane `l` at bit `o_l + B*k`, `o_l = 4lB mod 8`;
/// one AND per plane `k` isolates it as `q << (o_l + B*k)` (below 2^28, so exact in f32), which
/// meets x pre-scaled by `2^-(o_l + B*k)`. A chunk of 32 elements lies in one group.
///
/// `bytes` starts at the first row's packed bytes (rows `row_bytes` apart; bytes past the rows
/// may be read but are ignored); `scales` holds each row's scales as f32, `scale_stride` apart.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn qrows_spread<const B: usize, const R: usize>(
    bytes: &[u8],
    row_bytes: usize,
    group_size: usize,
    scales: &[f32],
    scale_stride: usize,
    xp: &[f32],
) -> [f32; R] {
    let chunks = row_bytes / (4 * B);
    assert!(
        bytes.len() >= R * row_bytes
            && scales.len() >= (R - 1) * scale_stride + chunks * 32 / group_size
            && xp.len() >= chunks * 32
    );
    let mut control = [0i8; 16];
    for (i, c) in control.iter_mut().enumerate() {
        *c = (4 * (i / 4) * B / 8 + i % 4) as i8;
    }
    let control = _mm256_broadcastsi128_si256(_mm_loadu_si128(control.as_ptr().cast()));
    let mut masks = [_mm256_setzero_si256(); 4];
    for (k, m) in masks.iter_mut().enumerate() {
        let mut lanes = [0i32; 8];
        for (l, v) in lanes.iter_mut().enumerate() {
            *v = ((1 << B) - 1) << ((4 * l * B) % 8 + B * k);
        }
        *m = _mm256_loadu_si256(lanes.as_ptr().cast());
    }
    let mut total = [_mm256_setzero_ps(); R];
    let mut words = [_mm256_setzero_si256(); R];
    for c in 0..chunks {
        for (r, v) in words.iter_mut().enumerate() {
            *v = spread32::<B>(bytes, r * row_bytes + c * 4 * B, control);
        }
        let x = xp.as_ptr().add(c * 32);
        let mut acc = [_mm256_setzero_ps(); R];
        for (k, mask) in masks.iter().enumerate() {
            let xk = _mm256_loadu_ps(x.add(8 * k));
            for r in 0..R {
                let q = _mm256_cvtepi32_ps(_mm256_and_si256(words[r], *mask));
                acc[r] = _mm256_fmadd_ps(q, xk, acc[r]);
            }
        }
        let group = c * 32 / group_size;
        for r in 0..R {
            let s = _mm256_set1_ps(scales[r * scale_stride + group]);
            total[r] = _mm256_fmadd_ps(acc[r], s, total[r]);
        }
    }
    let mut out = [0.0f32; R];
    for r in 0..R {
        out[r] = hsum(total[r]);
    }
    out
}

/// The lane sums of eight vectors, in order, by one transposing reduction.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn hsum8(v: &[__m256; 8]) -> __m256 {
    let t: [__m256; 4] = std::array::from_fn(|i| _mm256_hadd_ps(v[2 * i], v[2 * i + 1]));
    let (u0, u1) = (_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(u0, u1),
        _mm256_permute2f128_ps::<0x31>(u0, u1),
    )
}

/// Attention scores of `n` keys for a chunk of up to four query heads that share them:
/// `scores[h · stride + j] = scale · q_h · k_j` for the rows `k_j` of `keys` (`d` apart, `d` a
/// multiple of 8) and the queries `q_h = queries[h · d..]`. Keys go two at a time, each vector
/// loaded (and widened) once for every head; each sum is reduced as [`hsum8`] reduces.
///
/// # Safety
/// AVX2, FMA and F16C; `queries` holds `heads · d`, `keys` `n · d` and `scores` `(heads - 1) ·
/// stride + n` elements, `heads` in `1..=4`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn group_scores<T: Elem>(
    queries: *const f32,
    heads: usize,
    keys: *const T,
    n: usize,
    d: usize,
    scale: f32,
    scores: *mut f32,
    stride: usize,
) {
    by_heads!(
        heads,
        scores_for::<T>(queries, keys, n, d, scale, scores, stride)
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scores_for<T: Elem, const H: usize>(
    queries: *const f32,
    keys: *const T,
    n: usize,
    d: usize,
    scale: f32,
    scores: *mut f32,
    stride: usize,
) {
    let s = _mm256_set1_ps(scale);
    for j in (0..n).step_by(2) {
        let pair = j + 1 < n;
        let k0 = keys.add(j * d);
        let k1 = if pair { k0.add(d) } else { k0 };
        prefetch_ahead(k0, 2 * d);
        // acc[2h] sums head h against key j, acc[2h + 1] against key j + 1.
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..d).step_by(8) {
            let (a, b) = (load8(k0.add(c)), load8(k1.add(c)));
            for h in 0..H {
                let q = _mm256_loadu_ps(queries.add(h * d + c));
                acc[2 * h] = _mm256_fmadd_ps(q, a, acc[2 * h]);
                acc[2 * h + 1] = _mm256_fmadd_ps(q, b, acc[2 * h + 1]);
            }
        }
        let mut sums = [0.0f32; 8];
        _mm256_storeu_ps(sums.as_mut_ptr(), _mm256_mul_ps(hsum8(&acc), s));
        for h in 0..H {
            *scores.add(h * stride + j) = sums[2 * h];
            if pair {
                *scores.add(h * stride + j + 1) = sums[2 * h + 1];
            }
        }
    }
}

/// Softmax-weighted values for a chunk of up to four query heads: `out[h · d..] += Σ_j p[h ·
/// stride + j] · v_j` for the `n` rows `v_j` of `values` (`d` apart, a multiple of 8). Sixteen
/// columns at a time for every head in registers, so that each value vector is loaded (and
/// widened) once per chunk of heads; each column sums its keys in order.
///
/// # Safety
/// AVX2, FMA and F16C; `p` holds `(heads - 1) · stride + n`, `values` `n · d` and `out` `heads ·
/// d` elements, `heads` in `1..=4`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn group_values<T: Elem>(
    p: *const f32,
    stride: usize,
    heads: usize,
    values: *const T,
    n: usize,
    d: usize,
    out: *mut f32,
) {
    by_heads!(heads, values_for::<T>(p, stride, values, n, d, out))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values_for<T: Elem, const H: usize>(
    p: *const f32,
    stride: usize,
    values: *const T,
    n: usize,
    d: usize,
    out: *mut f32,
) {
    for c in (0..d).step_by(16) {
        let pair = c + 8 < d;
        let mut acc = [[_mm256_setzero_ps(); 2]; H];
        for (h, a) in acc.iter_mut().enumerate() {
            a[0] = _mm256_loadu_ps(out.add(h * d + c));
            if pair {
                a[1] = _mm256_loadu_ps(out.add(h * d + c + 8));
            }
        }
        for j in 0..n {
            let row = values.add(j * d + c);
            if c == 0 {
                prefetch_ahead(row, d);
            }
            let a = load8(row);
            let b = if pair { load8(row.add(8)) } else { a };
            for (h, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_broadcast_ss(&*p.add(h * stride + j));
                acc[0] = _mm256_fmadd_ps(w, a, acc[0]);
                acc[1] = _mm256_fmadd_ps(w, b, acc[1]);
            }
        }
        for (h, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(h * d + c), a[0]);
            if pair {
                _mm256_storeu_ps(out.add(h * d + c + 8), a[1]);
            }
        }
    }
}

/// `out[i] = codes[i] · scale + bias` for `n` codes (a multiple of 8).
///
/// # Safety
/// AVX2 and FMA; `codes` and `out` hold `n` elements.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dequantize_u8(
    codes: *const u8,
    n: usize,
    scale: f32,
    bias: f32,
    out: *mut f32,
) {
    let (s, b) = (_mm256_set1_ps(scale), _mm256_set1_ps(bias));
    for i in (0..n).step_by(8) {
        let c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(codes.add(i).cast())));
        _mm256_storeu_ps(out.add(i), _mm256_fmadd_ps(c, s, b));
    }
}

/// `exp(v)` of eight lanes as Cephes' `expf` computes it (range reduction by ln 2 in two parts,
/// a degree-5 polynomial), within 2 ulp of libm for the arguments softmax gives it (≤ 0).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(
        _mm256_min_ps(x, _mm256_set1_ps(88.37626)),
        _mm256_set1_ps(-87.33654),
    );
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        _mm256_mul_ps(p, x),
        x,
        _mm256_add_ps(x, _mm256_set1_ps(1.0)),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(fx),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

/// `exp(scale · x[i] − shift)` of eight lanes, 0 where `x[i]` is −∞ (a token a sampler
/// filtered out never weighs anything; `exp8` alone would give its clamp's 1e-38) and NaN
/// where it is NaN, as libm's (the clamp would make it finite, and a row of logits with a NaN
/// a distribution).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp8_scaled(x: __m256, scale: __m256, shift: __m256) -> __m256 {
    let dropped = _mm256_cmp_ps::<_CMP_EQ_OQ>(x, _mm256_set1_ps(f32::NEG_INFINITY));
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    let e = _mm256_andnot_ps(dropped, exp8(_mm256_fmsub_ps(x, scale, shift)));
    _mm256_or_ps(e, nan)
}

/// `Σ exp(scale · x[i] − shift)` in f64 (the exponentials in f32), writing each term to
/// `out[i]` where `out` is as long as `x` (and nowhere where it is empty).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_scaled_sum(x: &[f32], scale: f32, shift: f32, out: &mut [f32]) -> f64 {
    let write = out.len() == x.len();
    let (scale, shift) = (_mm256_set1_ps(scale), _mm256_set1_ps(shift));
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    let whole = x.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        let e = exp8_scaled(_mm256_loadu_ps(x.as_ptr().add(i)), scale, shift);
        if write {
            _mm256_storeu_ps(out.as_mut_ptr().add(i), e);
        }
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
    }
    let mut lanes = [0.0f64; 4];
    _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(lo, hi));
    let mut sum: f64 = lanes.iter().sum();
    if whole < x.len() {
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..x.len() - whole].copy_from_slice(&x[whole..]);
        let e = exp8_scaled(_mm256_loadu_ps(buf.as_ptr()), scale, shift);
        _mm256_storeu_ps(buf.as_mut_ptr(), e);
        for (i, &v) in buf[..x.len() - whole].iter().enumerate() {
            if write {
                out[whole + i] = v;
            }
            sum += f64::from(v);
        }
    }
    sum
}

/// The largest of `x` (NaNs passed over, as `f32::max` does; `-inf` if empty).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn max(x: &[f32]) -> f32 {
    // Four chains, so that each max waits on one of its own four steps back.
    let mut acc = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for (i, a) in acc.iter_mut().enumerate() {
            // `max_ps` returns its second operand where either is NaN.
            *a = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr().add(8 * i)), *a);
        }
    }
    let v = _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3]));
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
    let rest = chunks.remainder().iter();
    lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// `x[i] *= s`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scale(x: &mut [f32], s: f32) {
    let sv = _mm256_set1_ps(s);
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        _mm256_storeu_ps(
            c.as_mut_ptr(),
            _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), sv),
        );
    }
    for v in chunks.into_remainder() {
        *v *= s;
    }
}

/// `x[i] = exp(x[i] - max)`, returning the sum.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        acc = _mm256_add_ps(acc, e);
    }
    let rest = chunks.into_remainder();
    let mut sum = hsum(acc);
    if !rest.is_empty() {
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..rest.len()].copy_from_slice(rest);
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), m));
        _mm256_storeu_ps(buf.as_mut_ptr(), e);
        for (r, &b) in rest.iter_mut().zip(&buf) {
            *r = b;
            sum += b;
        }
    }
    sum
}

// ---- MLX float-quantized weights (mxfp4, nvfp4, mxfp8) ------------------------------------------

/// The values of a word's eight E2M1 codes (code `j` in bits `4j..4j+4`), as
/// `params::E2M1` has them: the three magnitude bits index a permute of the eight magnitudes,
/// and bit 3 becomes the sign.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn e2m1x8(word: u32) -> __m256 {
    let codes = _mm256_srlv_epi32(
        _mm256_set1_epi32(word as i32),
        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
    );
    // The permute reads each lane's low three bits only.
    let magnitudes = _mm256_permutevar8x32_ps(
        _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
        codes,
    );
    let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(codes, _mm256_set1_epi32(8)));
    _mm256_xor_ps(magnitudes, _mm256_castsi256_ps(sign))
}

/// The values of eight E4M3 codes (byte `j` of `bytes`), as `params::E4M3` has them: the
/// exponent and mantissa go under f32's with the exponent rebased, the subnormals (exponent 0)
/// are `m · 2^-9`, and 0x7F is NaN.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn e4m3x8(bytes: u64) -> __m256 {
    let codes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64));
    let mag = _mm256_and_si256(codes, _mm256_set1_epi32(0x7F));
    let normal = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_slli_epi32::<20>(mag),
        _mm256_set1_epi32(120 << 23),
    ));
    let subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0 / 512.0));
    let is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    let v = _mm256_blendv_ps(normal, subnormal, is_subnormal);
    let is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    let v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::NAN), is_nan);
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)));
    _mm256_xor_ps(v, _mm256_castsi256_ps(sign))
}

/// Elements `8i..8i + 8` of a run of `B`-bit float codes (E2M1 for 4 bits, E4M3 for 8) that
/// starts at `words[0]`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn fp_values<const B: u32>(words: &[u32], i: usize) -> __m256 {
    if B == 4 {
        e2m1x8(words[i])
    } else {
        e4m3x8(u64::from(words[2 * i]) | u64::from(words[2 * i + 1]) << 32)
    }
}

/// How far ahead of the codes (and, in groups, of the scale codes) being read the float-mode
/// GEMV prefetches: it reads one row at a time, a single stream interleaved with the decoding,
/// which leaves the hardware prefetchers behind, as in the integer GEMVs (on a Sapphire Rapids
/// core 2 KiB ahead more than doubles its rate through a 4096×4096 matrix).
const FP_PREFETCH_BYTES: usize = 2048;
const FP_PREFETCH_GROUPS: usize = 128;

/// `out[i] = Σ_groups s · Σ v·x` of one row of `B`-bit float codes (`words`, its groups' scale
/// codes `scales` decoded by `table`, each group `8·V` codes) against activation rows
/// `i < out.len() ≤ 8` of `x`, `cols` apart: each group is decoded once into registers and
/// meets every row, and its sum is scaled as MLX scales it, once per group.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fp_row_dots<const B: u32, const V: usize>(
    words: &[u32],
    (scales, table): (&[u8], &[f32; 256]),
    x: &[f32],
    cols: usize,
    out: &mut [f32],
) {
    let (m, g) = (out.len(), 8 * V);
    assert!(
        m <= 8
            && scales.len() * g == cols
            && words.len() * 32 == cols * B as usize
            && x.len() >= m * cols
    );
    let group_words = g * B as usize / 32;
    let mut total = [_mm256_setzero_ps(); 8];
    for gi in 0..scales.len() {
        let run = &words[gi * group_words..(gi + 1) * group_words];
        // One prefetch a line of codes, and one a line of scale codes.
        if (gi * group_words * 4).is_multiple_of(64) {
            prefetch(run.as_ptr().cast::<u8>().wrapping_add(FP_PREFETCH_BYTES));
        }
        if gi.is_multiple_of(64) {
            prefetch(scales.as_ptr().wrapping_add(gi + FP_PREFETCH_GROUPS));
        }
        let mut w = [_mm256_setzero_ps(); V];
        for (v, wv) in w.iter_mut().enumerate() {
            *wv = fp_values::<B>(run, v);
        }
        let s = _mm256_set1_ps(table[usize::from(scales[gi])]);
        for (i, t) in total[..m].iter_mut().enumerate() {
            let xp = x.as_ptr().add(i * cols + gi * g);
            let mut dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
            for (v, wv) in w.iter().enumerate().skip(1) {
                dot = _mm256_fmadd_ps(*wv, _mm256_loadu_ps(xp.add(8 * v)), dot);
            }
            *t = _mm256_fmadd_ps(s, dot, *t);
        }
    }
    for (o, t) in out.iter_mut().zip(total) {
        *o = hsum(t);
    }
}

/// Dequantizes whole groups of a row of `B`-bit float codes (`words`, `8·V` codes a group) into
/// `out`, group `i` scaled by `table[scales[i]]`: `value · scale`, exactly as
/// `FpQuantizedView::dequantize_row`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn fp_dequantize<const B: u32, const V: usize>(
    words: &[u32],
    (scales, table): (&[u8], &[f32; 256]),
    out: &mut [f32],
) {
    let g = 8 * V;
    assert!(out.len() == scales.len() * g && words.len() * 32 == out.len() * B as usize);
    let group_words = g * B as usize / 32;
    for gi in 0..scales.len() {
        let run = &words[gi * group_words..(gi + 1) * group_words];
        let s = _mm256_set1_ps(table[usize::from(scales[gi])]);
        let dst = out.as_mut_ptr().add(gi * g);
        for v in 0..V {
            _mm256_storeu_ps(dst.add(8 * v), _mm256_mul_ps(fp_values::<B>(run, v), s));
        }
    }
}
