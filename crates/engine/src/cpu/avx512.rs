//! AVX-512 kernels (with AVX2, FMA and F16C). Every function here is `unsafe` because it may only
//! run once [`super::Isa::Avx512`] was found available; pointer bounds are checked by the
//! callers, as for the AVX2 kernels.

use std::arch::x86_64::*;

use super::avx2::{hsum8, prefetch_ahead, Elem, Kind};

/// The eight-lane sum of the two halves of `v`.
#[target_feature(enable = "avx512f,avx512dq,avx2")]
#[inline]
unsafe fn fold(v: __m512) -> __m256 {
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v))
}

/// The mask of the first `n` of sixteen lanes (`n` ≤ 16).
#[inline]
fn first_lanes(n: usize) -> __mmask16 {
    debug_assert!(n <= 16);
    ((1u32 << n) - 1) as __mmask16
}

/// Rows `0..nc` of `rows` (`kc` floats each) column-major into `panel`: column `c` of the
/// `NR` rows at `panel[c · NR..]`, rows past `nc` zero. Sixteen rows × sixteen columns at a
/// time, transposed in registers (a gather per column is several times slower).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn column_major(rows: &[f32], nc: usize, kc: usize, panel: &mut [f32]) {
    use super::gemm::wide::NR;
    assert!(nc <= NR && rows.len() >= nc * kc && panel.len() >= NR * kc);
    for r0 in (0..NR).step_by(16) {
        for c0 in (0..kc).step_by(16) {
            let width = (kc - c0).min(16);
            let mask = first_lanes(width);
            let block: [__m512; 16] = std::array::from_fn(|r| {
                if r0 + r < nc {
                    _mm512_maskz_loadu_ps(mask, rows.as_ptr().add((r0 + r) * kc + c0))
                } else {
                    _mm512_setzero_ps()
                }
            });
            for (c, column) in transpose16(block).iter().take(width).enumerate() {
                _mm512_storeu_ps(panel.as_mut_ptr().add((c0 + c) * NR + r0), *column);
            }
        }
    }
}

/// The 16 × 16 transpose of `r` (rows in, columns out).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // Within each 128-bit lane l: t[2i] pairs rows 2i, 2i + 1 at columns 4l, 4l + 1, and
    // t[2i + 1] at columns 4l + 2, 4l + 3.
    let t: [__m512; 16] = std::array::from_fn(|j| {
        let (a, b) = (r[j & !1], r[j | 1]);
        if j % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4j + q], lane l: column 4l + q of rows 4j..4j + 4.
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (j, q) = (i / 4, i % 4);
        let (a, b) = (t[4 * j + q / 2], t[4 * j + 2 + q / 2]);
        if q % 2 == 0 {
            _mm512_shuffle_ps::<0x44>(a, b)
        } else {
            _mm512_shuffle_ps::<0xEE>(a, b)
        }
    });
    // Column 4l + q: lane l of u[q], u[4 + q], u[8 + q], u[12 + q].
    let mut out = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let low = _mm512_shuffle_f32x4::<0x44>(u[q], u[4 + q]);
        let high = _mm512_shuffle_f32x4::<0xEE>(u[q], u[4 + q]);
        let low2 = _mm512_shuffle_f32x4::<0x44>(u[8 + q], u[12 + q]);
        let high2 = _mm512_shuffle_f32x4::<0xEE>(u[8 + q], u[12 + q]);
        out[q] = _mm512_shuffle_f32x4::<0x88>(low, low2);
        out[4 + q] = _mm512_shuffle_f32x4::<0xDD>(low, low2);
        out[8 + q] = _mm512_shuffle_f32x4::<0x88>(high, high2);
        out[12 + q] = _mm512_shuffle_f32x4::<0xDD>(high, high2);
    }
    out
}

/// The GEMM micro-kernel: `y[i · ys + j] (+)= Σ_c x[c · MR + i] · w[c · NR + j]` for `i < mr`,
/// `j < nc`, with `MR × NR` accumulators (activations column-major by `MR`, the panel by `NR`).
///
/// # Safety
/// AVX-512; `y` spans `(mr - 1) · ys + nc` writable floats that no one else writes.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)] // `acc[i][h]` reads clearer
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn gemm_kernel(
    x: &[f32],
    w: &[f32],
    kc: usize,
    y: *mut f32,
    ys: usize,
    mr: usize,
    nc: usize,
    accumulate: bool,
) {
    use super::gemm::wide::{MR, NR};
    const H: usize = NR / 16;
    assert!(x.len() >= MR * kc && w.len() >= NR * kc && mr <= MR && nc <= NR);
    let (px, pw) = (x.as_ptr(), w.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); H]; MR];
    for c in 0..kc {
        let wv: [__m512; H] = std::array::from_fn(|h| _mm512_loadu_ps(pw.add(c * NR + 16 * h)));
        for i in 0..MR {
            let xv = _mm512_set1_ps(*px.add(c * MR + i));
            for h in 0..H {
                acc[i][h] = _mm512_fmadd_ps(xv, wv[h], acc[i][h]);
            }
        }
    }
    for i in 0..mr {
        let row = y.add(i * ys);
        for h in 0..H {
            let mask = first_lanes(nc.saturating_sub(16 * h).min(16));
            let mut v = acc[i][h];
            if accumulate {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, row.add(16 * h)));
            }
            _mm512_mask_storeu_ps(row.add(16 * h), mask, v);
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

/// Rows of 8-bit codes in groups of `group` (32, 64 or 128) with a scale and a bias each (`d`
/// a multiple of the group), dequantized as they are loaded: the values a cache of them holds,
/// read at about a quarter of f32's bytes.
#[derive(Clone, Copy)]
pub(super) struct Codes {
    pub codes: *const u8,
    pub scales: *const f32,
    pub biases: *const f32,
    pub d: usize,
    pub group: usize,
}

impl Codes {
    /// Sixteen codes (as i32 lanes) at element `at`, and the lanes' scale and bias.
    #[inline(always)]
    unsafe fn dequantize(self, codes: __m512i, at: usize) -> __m512 {
        let g = at / self.group;
        _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(codes),
            _mm512_set1_ps(*self.scales.add(g)),
            _mm512_set1_ps(*self.biases.add(g)),
        )
    }
}

impl Rows for Codes {
    #[inline(always)]
    unsafe fn load16(self, row: usize, col: usize) -> __m512 {
        let at = row * self.d + col;
        let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(self.codes.add(at).cast()));
        self.dequantize(codes, at)
    }
    #[inline(always)]
    unsafe fn prefetch(self, row: usize, count: usize) {
        let groups = self.d / self.group;
        prefetch_ahead(self.codes.add(row * self.d), count * self.d);
        prefetch_ahead(self.scales.add(row * groups), count * groups);
        prefetch_ahead(self.biases.add(row * groups), count * groups);
    }
}

/// [`Codes`] of 4 bits, two to a byte (the even element in the low half): an eighth of f32's
/// bytes.
#[derive(Clone, Copy)]
pub(super) struct Nibbles(pub Codes);

impl Rows for Nibbles {
    #[inline(always)]
    unsafe fn load16(self, row: usize, col: usize) -> __m512 {
        let at = row * self.0.d + col;
        let packed = _mm_loadl_epi64(self.0.codes.add(at / 2).cast());
        let low = _mm_set1_epi8(15);
        let even = _mm_and_si128(packed, low);
        let odd = _mm_and_si128(_mm_srli_epi16::<4>(packed), low);
        let codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd));
        self.0.dequantize(codes, at)
    }
    #[inline(always)]
    unsafe fn prefetch(self, row: usize, count: usize) {
        let (d, groups) = (self.0.d, self.0.d / self.0.group);
        prefetch_ahead(self.0.codes.add(row * d / 2), count * d / 2);
        prefetch_ahead(self.0.scales.add(row * groups), count * groups);
        prefetch_ahead(self.0.biases.add(row * groups), count * groups);
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
    by_heads!(
        heads,
        scores_for::<R>(queries, keys, n, d, scale, scores, stride)
    )
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
    by_heads!(heads, values_for::<R>(p, stride, values, n, d, out))
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

/// A chunk of up to four query heads rounded for the integer 8-bit kernels: per head `d` int16
/// codes (`q ≈ code · scale` in each group of 64 features), and per head and group (`[head,
/// group]`) the scale and the exact sum of the group's queries, which the keys' biases multiply.
#[derive(Clone, Copy)]
pub(super) struct QueryCodes {
    pub codes: *const i16,
    pub scales: *const f32,
    pub sums: *const f32,
}

/// `p[rows[r] · stride]` for the four rows.
#[inline(always)]
unsafe fn gather4(p: *const f32, stride: usize, rows: [usize; 4]) -> __m128 {
    _mm_setr_ps(
        *p.add(rows[0] * stride),
        *p.add(rows[1] * stride),
        *p.add(rows[2] * stride),
        *p.add(rows[3] * stride),
    )
}

/// The sums of the lanes of each of sixteen vectors `a[h][r]`, in one vector at lane `4h + r`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce16(a: &[[__m512i; 4]; 4]) -> __m512i {
    // Lanes of x and y summed in pairs: per 128 bits [x, y, x, y].
    let pair = |x, y| _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
    // Per 128 bits, rows 0..4 of one head: four partial sums of each.
    let heads = a.map(|r| {
        let (t, u) = (pair(r[0], r[1]), pair(r[2], r[3]));
        _mm512_add_epi32(_mm512_unpacklo_epi64(t, u), _mm512_unpackhi_epi64(t, u))
    });
    // Neighbouring 128-bit quarters added: x's two halves, then y's.
    let halves = |x, y| {
        _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(x, y),
            _mm512_shuffle_i32x4::<0xDD>(x, y),
        )
    };
    halves(halves(heads[0], heads[1]), halves(heads[2], heads[3]))
}

/// [`group_scores`] on 8-bit codes with integer products: in each group of 64 features, a key's
/// codes are widened to int16 once and multiplied with every head's int16 query codes by
/// `vpdpwssd`, four keys at a time; the sixteen sums of a step are reduced together into one
/// vector (lane `4h + r`: head h, key j + r), then given the key's and the query's scales and the
/// bias term `bias · Σq`.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI; `d` a multiple of 64; `queries` holds `heads` heads, `keys` `n`
/// rows and `scores` `(heads - 1) · stride + n` elements, `heads` in `1..=4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn q8_group_scores(
    queries: QueryCodes,
    heads: usize,
    keys: IntCodes,
    n: usize,
    d: usize,
    scale: f32,
    scores: *mut f32,
    stride: usize,
) {
    by_heads!(
        heads,
        q8_scores_for(queries, keys, n, d, scale, scores, stride)
    )
}

/// Rows of codes in groups of 64 as the integer kernels read them: 8-bit codes, or 4-bit ones
/// (`nibbles`) widened to bytes in registers.
#[derive(Clone, Copy)]
pub(super) struct IntCodes {
    pub codes: Codes,
    pub nibbles: bool,
}

impl IntCodes {
    /// Group `g` of row `row` (rows of `d`) as int16: features 0..32 and 32..64.
    #[inline(always)]
    unsafe fn group(self, row: usize, d: usize, g: usize) -> (__m512i, __m512i) {
        if !self.nibbles {
            let c = self.codes.codes.add(row * d + g * 64);
            let lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256(c.cast()));
            let hi = _mm512_cvtepu8_epi16(_mm256_loadu_si256(c.add(32).cast()));
            return (lo, hi);
        }
        // Byte j holds features 2j (low half) and 2j + 1: widened to 32 bits and shifted up
        // twelve, its high half lands at bit 16, and masking keeps each int16's low four bits.
        let c = self.codes.codes.add((row * d + g * 64) / 2);
        let half = |at: *const u8| {
            let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(at.cast()));
            _mm512_and_si512(
                _mm512_or_si512(x, _mm512_slli_epi32::<12>(x)),
                _mm512_set1_epi32(0x000f_000f),
            )
        };
        (half(c), half(c.add(16)))
    }

    #[inline(always)]
    unsafe fn prefetch(self, row: usize, count: usize) {
        if self.nibbles {
            Nibbles(self.codes).prefetch(row, count)
        } else {
            self.codes.prefetch(row, count)
        }
    }
}

/// Quarter `h` of `v`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn quarter(v: __m512, h: usize) -> __m128 {
    match h {
        0 => _mm512_extractf32x4_ps::<0>(v),
        1 => _mm512_extractf32x4_ps::<1>(v),
        2 => _mm512_extractf32x4_ps::<2>(v),
        _ => _mm512_extractf32x4_ps::<3>(v),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn q8_scores_for<const H: usize>(
    queries: QueryCodes,
    keys: IntCodes,
    n: usize,
    d: usize,
    scale: f32,
    scores: *mut f32,
    stride: usize,
) {
    let groups = d / 64;
    for g in 0..groups {
        // The heads' codes (zero past H), and at lane 4h + r their scale and sum, with `scale`.
        let mut q = [[_mm512_setzero_si512(); 2]; 4];
        let (mut qs, mut qsum) = ([0.0f32; 16], [0.0f32; 16]);
        for h in 0..H {
            let c = queries.codes.add(h * d + g * 64);
            q[h] = [
                _mm512_loadu_si512(c.cast()),
                _mm512_loadu_si512(c.add(32).cast()),
            ];
            qs[4 * h..4 * h + 4].fill(*queries.scales.add(h * groups + g) * scale);
            qsum[4 * h..4 * h + 4].fill(*queries.sums.add(h * groups + g) * scale);
        }
        let (qs, qsum) = (_mm512_loadu_ps(qs.as_ptr()), _mm512_loadu_ps(qsum.as_ptr()));
        for j in (0..n).step_by(4) {
            let rows = [j, j + 1, j + 2, j + 3].map(|r| r.min(n - 1));
            if g == 0 {
                keys.prefetch(j, 4);
            }
            let mut acc = [[_mm512_setzero_si512(); 4]; 4];
            for (r, &row) in rows.iter().enumerate() {
                let (lo, hi) = keys.group(row, d, g);
                for h in 0..H {
                    let s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, q[h][0]);
                    acc[h][r] = _mm512_dpwssd_epi32(s, hi, q[h][1]);
                }
            }
            let sums = _mm512_cvtepi32_ps(reduce16(&acc));
            let ks = _mm512_broadcast_f32x4(gather4(keys.codes.scales.add(g), groups, rows));
            let kb = _mm512_broadcast_f32x4(gather4(keys.codes.biases.add(g), groups, rows));
            let v = _mm512_fmadd_ps(sums, _mm512_mul_ps(ks, qs), _mm512_mul_ps(kb, qsum));
            let mask: __mmask8 = (1 << (n - j).min(4)) - 1;
            for h in 0..H {
                let out = scores.add(h * stride + j);
                let mut s = quarter(v, h);
                if g > 0 {
                    s = _mm_add_ps(s, _mm_maskz_loadu_ps(mask, out));
                }
                _mm_mask_storeu_ps(out, mask, s);
            }
        }
    }
}

/// Rows of a block that the integer values kernel takes at once: its int16 weights stay on the
/// stack, and 32 pairs of rows keep its int32 sums within range (`2 · 32 · 255 · 32767 < 2^31`).
pub(super) const Q8_VALUE_ROWS: usize = 64;

/// [`group_values`] on 8-bit codes with integer products, for up to [`Q8_VALUE_ROWS`] rows: per
/// group of 64 features, each head's weights `p · scale` are rounded to int16 against their
/// largest, two rows' codes are interleaved as int16 pairs, and `vpdpwssd` adds both rows'
/// products into each feature's sum; the biases' term `Σ p · bias` is added once at the end.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI; `d` a multiple of 64; `n <= Q8_VALUE_ROWS`; `p` holds `(heads - 1)
/// · stride + n`, `values` `n` rows and `out` `heads · d` elements, `heads` in `1..=4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn q8_group_values(
    p: *const f32,
    stride: usize,
    heads: usize,
    values: IntCodes,
    n: usize,
    d: usize,
    out: *mut f32,
) {
    by_heads!(heads, q8_values_for(p, stride, values, n, d, out))
}

/// Sixteen of `p[(j + i) · stride]` (zero past `mask`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows16(p: *const f32, stride: usize, j: usize, mask: __mmask16) -> __m512 {
    if stride == 1 {
        return _mm512_maskz_loadu_ps(mask, p.add(j));
    }
    let at = _mm512_mullo_epi32(
        _mm512_add_epi32(
            _mm512_set1_epi32(j as i32),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        ),
        _mm512_set1_epi32(stride as i32),
    );
    _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, at, p)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
unsafe fn q8_values_for<const H: usize>(
    p: *const f32,
    stride: usize,
    values: IntCodes,
    n: usize,
    d: usize,
    out: *mut f32,
) {
    let groups = d / 64;
    for g in 0..groups {
        // Per head: the weights as int16 (zero from row n on, so a last odd row pairs with
        // nothing), the unit they count in, and the biases' term.
        let mut w = [[0i16; Q8_VALUE_ROWS]; H];
        let (mut unit, mut bias) = ([0.0f32; H], [0.0f32; H]);
        for h in 0..H {
            let mut weighted = [_mm512_setzero_ps(); Q8_VALUE_ROWS / 16];
            let (mut top, mut bsum) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for (i, j) in (0..n).step_by(16).enumerate() {
                let mask = first_lanes((n - j).min(16));
                let pj = _mm512_maskz_loadu_ps(mask, p.add(h * stride + j));
                let s = rows16(values.codes.scales.add(g), groups, j, mask);
                let b = rows16(values.codes.biases.add(g), groups, j, mask);
                weighted[i] = _mm512_mul_ps(pj, s);
                top = _mm512_max_ps(top, _mm512_abs_ps(weighted[i]));
                bsum = _mm512_fmadd_ps(pj, b, bsum);
            }
            let top = _mm512_reduce_max_ps(top);
            (unit[h], bias[h]) = (top / 32767.0, _mm512_reduce_add_ps(bsum));
            let inv = _mm512_set1_ps(if top > 0.0 { 32767.0 / top } else { 0.0 });
            for (i, v) in weighted.iter().enumerate().take(n.div_ceil(16)) {
                let codes = _mm512_cvtps_epi32(_mm512_mul_ps(*v, inv));
                _mm256_storeu_si256(
                    w[h][16 * i..].as_mut_ptr().cast(),
                    _mm512_cvtepi32_epi16(codes),
                );
            }
        }
        // acc[h][i]: per 128 bits, features 8k + 4(i % 2) .. of the half i / 2 of the group.
        let mut acc = [[_mm512_setzero_si512(); 4]; H];
        for j in (0..n).step_by(2) {
            if g == 0 {
                values.prefetch(j, 2);
            }
            let (a_lo, a_hi) = values.group(j, d, g);
            let (b_lo, b_hi) = values.group((j + 1).min(n - 1), d, g);
            let pairs = [
                _mm512_unpacklo_epi16(a_lo, b_lo),
                _mm512_unpackhi_epi16(a_lo, b_lo),
                _mm512_unpacklo_epi16(a_hi, b_hi),
                _mm512_unpackhi_epi16(a_hi, b_hi),
            ];
            for (h, acc) in acc.iter_mut().enumerate() {
                let wj = _mm512_set1_epi32(w[h].as_ptr().add(j).cast::<i32>().read_unaligned());
                for (a, &x) in acc.iter_mut().zip(&pairs) {
                    *a = _mm512_dpwssd_epi32(*a, x, wj);
                }
            }
        }
        // Features in order: quarters of the low and high fours interleaved.
        let first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        let second =
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (h, acc) in acc.iter().enumerate() {
            let (u, b) = (_mm512_set1_ps(unit[h]), _mm512_set1_ps(bias[h]));
            let o = out.add(h * d + g * 64);
            let sums = [
                _mm512_permutex2var_epi32(acc[0], first, acc[1]),
                _mm512_permutex2var_epi32(acc[0], second, acc[1]),
                _mm512_permutex2var_epi32(acc[2], first, acc[3]),
                _mm512_permutex2var_epi32(acc[2], second, acc[3]),
            ];
            for (i, &s) in sums.iter().enumerate() {
                let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), u, b);
                _mm512_storeu_ps(
                    o.add(16 * i),
                    _mm512_add_ps(v, _mm512_loadu_ps(o.add(16 * i))),
                );
            }
        }
    }
}

/// The sixteen `B`-bit integers (4 or 8) of elements `e..e + 16` of a packed matrix's `bytes`,
/// as i32 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn sixteen<const B: u32>(bytes: &[u8], e: usize) -> __m512i {
    if B == 4 {
        // Element 2j is byte j's low nibble and 2j + 1 its high one.
        let low = _mm_set1_epi8(0x0f);
        let x = _mm_loadl_epi64(bytes[e / 2..e / 2 + 8].as_ptr().cast());
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), low);
        _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, low), hi))
    } else {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes[e..e + 16].as_ptr().cast()))
    }
}

/// [`super::avx2::dequantize`] of a 4- or 8-bit matrix whose groups are whole runs of sixteen,
/// sixteen elements to a vector: the same `q · s + b` (a product, then a sum, as MLX rounds
/// them), in half the instructions. Prefill's panels and a large batch's spend much of their
/// time here.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn dequantize<const B: u32>(
    w: &crate::params::QuantizedView,
    row: usize,
    k0: usize,
    out: &mut [f32],
) {
    assert!((B == 4 || B == 8) && w.group_size.is_multiple_of(16));
    let bytes: &[u8] = bytemuck::cast_slice(w.packed);
    super::avx2::for_each_group(w, row, k0, out, |scale, bias, e0, group| {
        let (s, b) = (_mm512_set1_ps(scale), _mm512_set1_ps(bias));
        for (i, dst) in group.chunks_exact_mut(16).enumerate() {
            let e = e0 + 16 * i;
            let q = sixteen::<B>(bytes, e);
            let v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), b);
            _mm512_storeu_ps(dst.as_mut_ptr(), v);
        }
    });
}

/// Rows `n0..n0 + nc` of a 4- or 8-bit matrix, columns `k0..k0 + kc` (whole groups, of a
/// multiple of 16), dequantized as [`dequantize`] does straight into the panel that
/// [`column_major`] would make of them: sixteen rows by sixteen columns at a time, dequantized
/// in registers and transposed there, rather than written as a row-major tile and read again.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn dequantize_column_major<const B: u32>(
    w: &crate::params::QuantizedView,
    n0: usize,
    nc: usize,
    k0: usize,
    kc: usize,
    panel: &mut [f32],
) {
    use super::gemm::wide::NR;
    /// Groups of a panel's columns at the most (128 columns of groups of 16 or more).
    const GROUPS: usize = 8;
    let g = w.group_size;
    assert!(
        (B == 4 || B == 8)
            && g.is_multiple_of(16)
            && k0.is_multiple_of(g)
            && kc.is_multiple_of(g)
            && kc / g <= GROUPS
            && k0 + kc <= w.cols
            && nc <= NR
            && n0 + nc <= w.rows
            && panel.len() >= NR * kc
    );
    let bytes: &[u8] = bytemuck::cast_slice(w.packed);
    // Each row's scales and biases over the panel's columns.
    let mut scales = [[0.0f32; GROUPS]; NR];
    let mut biases = [[0.0f32; GROUPS]; NR];
    for r in 0..nc {
        let first = ((n0 + r) * w.cols + k0) / g;
        super::avx2::convert_slice(w.scales, first, &mut scales[r][..kc / g]);
        super::avx2::convert_slice(w.biases, first, &mut biases[r][..kc / g]);
    }
    for r0 in (0..NR).step_by(16) {
        for c0 in (0..kc).step_by(16) {
            let gi = c0 / g;
            let block: [__m512; 16] = std::array::from_fn(|r| {
                let row = r0 + r;
                if row >= nc {
                    return _mm512_setzero_ps();
                }
                let e = (n0 + row) * w.cols + k0 + c0;
                let q = sixteen::<B>(bytes, e);
                let (s, b) = (scales[row][gi], biases[row][gi]);
                _mm512_add_ps(
                    _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s)),
                    _mm512_set1_ps(b),
                )
            });
            for (c, column) in transpose16(block).iter().enumerate() {
                _mm512_storeu_ps(panel.as_mut_ptr().add((c0 + c) * NR + r0), *column);
            }
        }
    }
}
