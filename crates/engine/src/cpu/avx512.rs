//! AVX-512 kernels (with AVX2, FMA and F16C). Every function here is `unsafe` because it may only
//! run once [`super::Isa::Avx512`] was found available; pointer bounds are checked by the
//! callers, as for the AVX2 kernels.

use std::arch::x86_64::*;

use super::avx2::{hsum4, hsum8, prefetch_ahead, Elem, Kind};
use super::gemm::Kernel;

/// The eight-lane sum of the two halves of `v`.
#[target_feature(enable = "avx512f,avx512dq,avx2")]
#[inline]
unsafe fn fold(v: __m512) -> __m256 {
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v))
}

impl Kernel<'_> {
    /// The GEMM micro-kernel: `R × C` dot products of length `kc`, sixteen lanes wide (the AVX2
    /// kernel's shape, twice the width: twelve accumulators still cover the FMA latency).
    #[allow(clippy::needless_range_loop)] // `acc[i][j]` reads clearer than nested iterators
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(super) unsafe fn avx512<const R: usize, const C: usize>(self) {
        let (px, pw) = (self.x.as_ptr(), self.w.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let full = self.kc / 16 * 16;
        let mut c = 0;
        while c < full {
            let mut xv = [_mm512_setzero_ps(); R];
            for (i, v) in xv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(px.add(i * self.xs + c));
            }
            for j in 0..C {
                let wv = _mm512_loadu_ps(pw.add(j * self.ws + c));
                for i in 0..R {
                    acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
                }
            }
            c += 16;
        }
        if full < self.kc {
            let mask: __mmask16 = (1 << (self.kc - full)) - 1;
            for j in 0..C {
                let wv = _mm512_maskz_loadu_ps(mask, pw.add(j * self.ws + c));
                for i in 0..R {
                    let xv = _mm512_maskz_loadu_ps(mask, px.add(i * self.xs + c));
                    acc[i][j] = _mm512_fmadd_ps(xv, wv, acc[i][j]);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let y = self.y.add(i * self.ys);
            if let Ok(four) = <&[__m512; 4]>::try_from(&acc[..]) {
                let mut s = hsum4(&four.map(|v| fold(v)));
                if self.accumulate {
                    s = _mm_add_ps(s, _mm_loadu_ps(y));
                }
                _mm_storeu_ps(y, s);
            } else {
                for (j, &a) in acc.iter().enumerate() {
                    let s = _mm512_reduce_add_ps(a);
                    *y.add(j) = if self.accumulate { *y.add(j) + s } else { s };
                }
            }
        }
    }
}

/// Rows of `d` elements as the AVX-512 attention kernels read them, sixteen at a time as f32.
pub(super) trait Rows: Copy {
    /// Elements `col..col + 16` of row `row`.
    unsafe fn load16(self, row: usize, col: usize) -> __m512;
    /// Asks for rows `row..row + count` a prefetch distance ahead.
    unsafe fn prefetch(self, row: usize, count: usize);
}

/// Rows of f32, f16 or bf16 elements.
#[derive(Clone, Copy)]
pub(super) struct Plain<T> {
    pub ptr: *const T,
    pub d: usize,
}

impl<T: Elem> Rows for Plain<T> {
    #[inline(always)]
    unsafe fn load16(self, row: usize, col: usize) -> __m512 {
        load16(self.ptr.add(row * self.d + col))
    }
    #[inline(always)]
    unsafe fn prefetch(self, row: usize, count: usize) {
        prefetch_ahead(self.ptr.add(row * self.d), count * self.d);
    }
}

/// Rows of 8-bit codes in groups of 64 with a scale and a bias each (`d` a multiple of 64),
/// dequantized as they are loaded: the values a cache of them holds, read at about a quarter
/// of f32's bytes.
#[derive(Clone, Copy)]
pub(super) struct Codes {
    pub codes: *const u8,
    pub scales: *const f32,
    pub biases: *const f32,
    pub d: usize,
}

impl Rows for Codes {
    #[inline(always)]
    unsafe fn load16(self, row: usize, col: usize) -> __m512 {
        let at = row * self.d + col;
        let c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
            self.codes.add(at).cast(),
        )));
        let g = at / 64;
        _mm512_fmadd_ps(
            c,
            _mm512_set1_ps(*self.scales.add(g)),
            _mm512_set1_ps(*self.biases.add(g)),
        )
    }
    #[inline(always)]
    unsafe fn prefetch(self, row: usize, count: usize) {
        prefetch_ahead(self.codes.add(row * self.d), count * self.d);
        prefetch_ahead(self.scales.add(row * self.d / 64), count * self.d / 64);
        prefetch_ahead(self.biases.add(row * self.d / 64), count * self.d / 64);
    }
}

/// Sixteen elements from `p`, as f32.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
unsafe fn load16<T: Elem>(p: *const T) -> __m512 {
    match T::KIND {
        Kind::F32 => _mm512_loadu_ps(p.cast()),
        Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        // A bf16 is the top half of the f32 with the same value.
        Kind::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p.cast()),
        ))),
    }
}

/// [`super::avx2::group_scores`] sixteen lanes wide, over the `n` rows of `keys`: half the
/// FMAs and loads a key; each sum is folded to eight lanes, then reduced as [`hsum8`] reduces.
///
/// # Safety
/// AVX-512F and DQ, AVX2, FMA and F16C; `d` a multiple of 16 (callers give it whole 64s); `queries`
/// holds `heads · d`, `keys` `n` rows and `scores` `(heads - 1) · stride + n` elements,
/// `heads` in `1..=4`.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn group_scores<R: Rows>(
    queries: *const f32,
    heads: usize,
    keys: R,
    n: usize,
    d: usize,
    scale: f32,
    scores: *mut f32,
    stride: usize,
) {
    match heads {
        1 => scores_for::<R, 1>(queries, keys, n, d, scale, scores, stride),
        2 => scores_for::<R, 2>(queries, keys, n, d, scale, scores, stride),
        3 => scores_for::<R, 3>(queries, keys, n, d, scale, scores, stride),
        _ => scores_for::<R, 4>(queries, keys, n, d, scale, scores, stride),
    }
}

#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn scores_for<R: Rows, const H: usize>(
    queries: *const f32,
    keys: R,
    n: usize,
    d: usize,
    scale: f32,
    scores: *mut f32,
    stride: usize,
) {
    let s = _mm256_set1_ps(scale);
    for j in (0..n).step_by(2) {
        let pair = j + 1 < n;
        let j1 = if pair { j + 1 } else { j };
        keys.prefetch(j, 2);
        // acc[2h] sums head h against key j, acc[2h + 1] against key j + 1.
        let mut acc = [_mm512_setzero_ps(); 8];
        for c in (0..d).step_by(16) {
            let (a, b) = (keys.load16(j, c), keys.load16(j1, c));
            for h in 0..H {
                let q = _mm512_loadu_ps(queries.add(h * d + c));
                acc[2 * h] = _mm512_fmadd_ps(q, a, acc[2 * h]);
                acc[2 * h + 1] = _mm512_fmadd_ps(q, b, acc[2 * h + 1]);
            }
        }
        let mut sums = [0.0f32; 8];
        _mm256_storeu_ps(
            sums.as_mut_ptr(),
            _mm256_mul_ps(hsum8(&acc.map(|v| fold(v))), s),
        );
        for h in 0..H {
            *scores.add(h * stride + j) = sums[2 * h];
            if pair {
                *scores.add(h * stride + j + 1) = sums[2 * h + 1];
            }
        }
    }
}

/// [`super::avx2::group_values`] sixteen lanes wide over the `n` rows of `values`, 64 columns
/// at a time (all of a head of 64): each value row is loaded once for every head of the chunk.
///
/// # Safety
/// AVX-512F and DQ, AVX2, FMA and F16C; `d` a multiple of 64; `p` holds `(heads - 1) · stride +
/// n`, `values` `n` rows and `out` `heads · d` elements, `heads` in `1..=4`.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn group_values<R: Rows>(
    p: *const f32,
    stride: usize,
    heads: usize,
    values: R,
    n: usize,
    d: usize,
    out: *mut f32,
) {
    match heads {
        1 => values_for::<R, 1>(p, stride, values, n, d, out),
        2 => values_for::<R, 2>(p, stride, values, n, d, out),
        3 => values_for::<R, 3>(p, stride, values, n, d, out),
        _ => values_for::<R, 4>(p, stride, values, n, d, out),
    }
}

#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn values_for<R: Rows, const H: usize>(
    p: *const f32,
    stride: usize,
    values: R,
    n: usize,
    d: usize,
    out: *mut f32,
) {
    for c in (0..d).step_by(64) {
        let mut acc = [[_mm512_setzero_ps(); 4]; H];
        for (h, a) in acc.iter_mut().enumerate() {
            for (i, v) in a.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(out.add(h * d + c + 16 * i));
            }
        }
        for j in 0..n {
            if c == 0 {
                values.prefetch(j, 1);
            }
            let v = [
                values.load16(j, c),
                values.load16(j, c + 16),
                values.load16(j, c + 32),
                values.load16(j, c + 48),
            ];
            for (h, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.add(h * stride + j));
                for (a, &v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(w, v, *a);
                }
            }
        }
        for (h, a) in acc.iter().enumerate() {
            for (i, &v) in a.iter().enumerate() {
                _mm512_storeu_ps(out.add(h * d + c + 16 * i), v);
            }
        }
    }
}
