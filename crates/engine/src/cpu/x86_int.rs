//! Integer GEMV kernels for 4- and 8-bit MLX weights against int8 or int16 activations
//! (`super::qint`). One body, instantiated per vector width and multiply instruction:
//! - int8: `vpmaddubsw` then `vpmaddwd` (AVX2), `vpdpbusd` (AVX-VNNI, AVX512-VNNI);
//! - int16: `vpmaddwd` (AVX2), `vpdpwssd` (AVX-VNNI, AVX512-VNNI).

use std::arch::x86_64::*;

use super::avx2::{hsum, load8, prefetch, Elem};
use super::qint::{IntRows, Quantized, PAIR_REFINEMENT, TRIPLE_REFINEMENT};

/// The vector operations of the kernel body on 256 bits.
mod v256 {
    use std::arch::x86_64::*;

    pub type I = __m256i;
    pub type F = __m256;
    pub const BITS: usize = 256;

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn load(p: *const u8) -> I {
        _mm256_loadu_si256(p.cast())
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn zero() -> I {
        _mm256_setzero_si256()
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn fzero() -> F {
        _mm256_setzero_ps()
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn and(a: I, b: I) -> I {
        _mm256_and_si256(a, b)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn srli16<const S: i32>(a: I) -> I {
        _mm256_srli_epi16::<S>(a)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn splat8(v: i8) -> I {
        _mm256_set1_epi8(v)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn splat16(v: i16) -> I {
        _mm256_set1_epi16(v)
    }

    /// Lane `i` of the result is lane `idx[i]` of `d`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn pick(d: __m256, idx: I) -> F {
        _mm256_permutevar8x32_ps(d, idx)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn offset(idx: I, k: i32) -> I {
        _mm256_add_epi32(idx, _mm256_set1_epi32(k))
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn index(v: &[i32; 16]) -> I {
        _mm256_loadu_si256(v.as_ptr().cast())
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub unsafe fn fmadd_int(acc: F, p: I, s: F) -> F {
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub unsafe fn sum(a: F) -> f32 {
        super::hsum(a)
    }

    /// `a + s·b`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub unsafe fn add_scaled(a: F, b: F, s: f32) -> F {
        _mm256_fmadd_ps(b, _mm256_set1_ps(s), a)
    }
}

/// The vector operations of the kernel body on 512 bits.
mod v512 {
    use std::arch::x86_64::*;

    pub type I = __m512i;
    pub type F = __m512;
    pub const BITS: usize = 512;

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn load(p: *const u8) -> I {
        _mm512_loadu_si512(p.cast())
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn zero() -> I {
        _mm512_setzero_si512()
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn fzero() -> F {
        _mm512_setzero_ps()
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn and(a: I, b: I) -> I {
        _mm512_and_si512(a, b)
    }

    #[target_feature(enable = "avx512bw")]
    #[inline]
    pub unsafe fn srli16<const S: u32>(a: I) -> I {
        _mm512_srli_epi16::<S>(a)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn splat8(v: i8) -> I {
        _mm512_set1_epi8(v)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn splat16(v: i16) -> I {
        _mm512_set1_epi16(v)
    }

    /// Lane `i` of the result is lane `idx[i]` (below 8) of `d`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn pick(d: __m256, idx: I) -> F {
        _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(d))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn offset(idx: I, k: i32) -> I {
        _mm512_add_epi32(idx, _mm512_set1_epi32(k))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn index(v: &[i32; 16]) -> I {
        _mm512_loadu_si512(v.as_ptr().cast())
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn fmadd_int(acc: F, p: I, s: F) -> F {
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn sum(a: F) -> f32 {
        _mm512_reduce_add_ps(a)
    }

    /// `a + s·b`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn add_scaled(a: F, b: F, s: f32) -> F {
        _mm512_fmadd_ps(b, _mm512_set1_ps(s), a)
    }
}

/// Quantizes `x` (a multiple of 8 long) to integers of at most `max` (127 or 32767) into
/// `pieces[0]`, rounding to nearest even; each further piece (the low integers of int16 pairs,
/// the second and third of int8 triples) takes what the ones before left, in units of
/// `refinement` times the last one's.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_group<X: bytemuck::Pod>(
    x: &[f32],
    max: f32,
    refinement: f32,
    pieces: &mut [&mut [X]],
) -> Quantized {
    let n = x.len();
    let wide = size_of::<X>() == 2;
    assert!(n.is_multiple_of(8) && !pieces.is_empty() && pieces.iter().all(|p| p.len() >= n));
    assert!(size_of::<X>() == if wide { 2 } else { 1 });
    let px = x.as_ptr();
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let (mut amax, mut sum) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in (0..n).step_by(8) {
        let v = _mm256_loadu_ps(px.add(c));
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, abs_mask));
        sum = _mm256_add_ps(sum, v);
    }
    let m = _mm_max_ps(
        _mm256_castps256_ps128(amax),
        _mm256_extractf128_ps::<1>(amax),
    );
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let scale = amax / max;
    let inv = if amax > 0.0 { max / amax } else { 0.0 };
    // Eight i32 lanes as i16 or i8 (saturating) at `p`.
    let store = |p: *mut u8, q: __m256i| {
        let q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        if wide {
            _mm_storeu_si128(p.cast(), q16);
        } else {
            _mm_storel_epi64(p.cast(), _mm_packs_epi16(q16, q16));
        }
    };
    let mut isum = _mm256_setzero_ps();
    for c in (0..n).step_by(8) {
        let mut rest = _mm256_loadu_ps(px.add(c));
        let (mut unit, mut unit_inv, mut weight) = (scale, inv, 1.0f32);
        for piece in pieces.iter_mut() {
            // The default rounding mode is to nearest even.
            let q = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(unit_inv)));
            store(piece.as_mut_ptr().cast::<u8>().add(c * size_of::<X>()), q);
            let qf = _mm256_cvtepi32_ps(q);
            isum = _mm256_fmadd_ps(qf, _mm256_set1_ps(weight), isum);
            rest = _mm256_fnmadd_ps(qf, _mm256_set1_ps(unit), rest);
            unit *= refinement;
            unit_inv /= refinement;
            weight *= refinement;
        }
    }
    Quantized {
        scale,
        sum: hsum(sum),
        int_sum: hsum(isum),
    }
}

/// `acc + Σ q·x` over four neighbouring bytes per i32 lane, without VNNI. `q` is unsigned (at
/// most 15 here, so the pair sums of `vpmaddubsw` cannot saturate).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_u4_avx2(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)),
    )
}

/// `acc + Σ (q - 128)·x` for full bytes `q`: `vpmaddubsw` pairs of `255·127` would saturate, so
/// the sign moves onto x and `|q - 128| ≤ 128` is the unsigned side. The caller adds `128·Σx`
/// back.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_u8_centred_avx2(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    let centred = _mm256_xor_si256(q, _mm256_set1_epi8(-128));
    let prod = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(x, centred));
    _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16(1)))
}

#[target_feature(enable = "avx2,avxvnni")]
#[inline]
unsafe fn dot_u8_vnni(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, q, x)
}

#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn dot_u8_avx512(acc: __m512i, q: __m512i, x: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(acc, q, x)
}

/// `acc + Σ q·x` over two neighbouring int16 lanes per i32 lane.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_i16_avx2(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(q, x))
}

#[target_feature(enable = "avx2,avxvnni")]
#[inline]
unsafe fn dot_i16_vnni(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    _mm256_dpwssd_avx_epi32(acc, q, x)
}

#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn dot_i16_avx512(acc: __m512i, q: __m512i, x: __m512i) -> __m512i {
    _mm512_dpwssd_epi32(acc, q, x)
}

/// How far ahead of the packed weights being read the kernels prefetch. They read one row at a
/// time, a single stream from memory interleaved with much arithmetic, which leaves the hardware
/// prefetchers behind (2 KiB ahead nearly doubles one thread's bandwidth through a large 4-bit
/// matrix). The f32 kernels read four rows at once and gain nothing from it.
const PREFETCH_BYTES: usize = 2048;

/// How far ahead of the scales and biases being read the kernels prefetch, in groups: as far as
/// [`PREFETCH_BYTES`] of 4-bit weights in groups of 64.
const PREFETCH_GROUPS: usize = 64;

/// One kernel body per vector width (`$v`), activation width (`$a` bits) and multiply (`$dot4`
/// for 4-bit weights, `$dot8` for 8-bit; `$centred` if `$dot8` leaves out `128·Σxq`). A chunk is one vector of packed weights; groups are
/// walked in order, each taking one or more whole chunks, or several groups sharing a chunk in
/// equal runs of i32 lanes (which `pick` gives their scales). With `PIECES` integers an element
/// (int16 pairs, int8 triples), each chunk's planes meet each piece's integers in turn, summed in
/// accumulators of their own.
macro_rules! int_rows {
    ($name:ident, $features:literal, $v:ident, $a:literal, $dot4:ident, $dot8:ident, $centred:literal) => {
        /// `y[r - r0] = Σ_g (s·dx·Σq·xq + b·Σx + s·dx·corr)` for rows `r0..r1`.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<T: Elem, const B: usize, const G: usize, const PIECES: usize>(
            w: &IntRows<T>,
            r0: usize,
            r1: usize,
            y: &mut [f32],
        ) {
            use $v as v;
            // A constant group size makes every loop below a constant trip count.
            assert_eq!(w.group_size, G);
            let groups = w.cols / G;
            let row_bytes = w.cols * B / 8;
            let chunk_bytes = v::BITS / 8;
            let per_chunk = v::BITS / B;
            let planes = $a / B;
            // Bytes of activations per chunk.
            let x_stride = PIECES * planes * chunk_bytes;
            assert!(
                w.packed.len() >= r1 * row_bytes
                    && w.scales.len() >= r1 * groups
                    && w.biases.len() >= r1 * groups
                    && w.xq.len() >= w.cols / per_chunk * x_stride
                    && w.dx.len() >= groups
                    && w.sums.len() >= groups
                    && w.corr.len() >= groups
                    && y.len() >= r1 - r0
                    && (w.cols * B).is_multiple_of(v::BITS)
                    && matches!((PIECES, $a), (1, _) | (2, 16) | (3, 8))
            );
            // The integer of a lane's lowest B bits.
            let mask = match ($a, B) {
                (8, _) => v::splat8(0x0f),
                (_, 4) => v::splat16(0x000f),
                _ => v::splat16(0x00ff),
            };
            let (px, pdx, psum, pcorr) = (
                w.xq.as_ptr(),
                w.dx.as_ptr(),
                w.sums.as_ptr(),
                w.corr.as_ptr(),
            );
            // The planes of chunk `c` of the row at `pw`.
            let unpack = |pw: *const u8, c: usize| -> [v::I; 4] {
                prefetch(pw.wrapping_add(c * chunk_bytes + PREFETCH_BYTES));
                let q = v::load(pw.add(c * chunk_bytes));
                match ($a, B) {
                    (8, 8) => [q; 4],
                    (8, _) => [v::and(q, mask), v::and(v::srli16::<4>(q), mask), q, q],
                    (_, 8) => [v::and(q, mask), v::srli16::<8>(q), q, q],
                    _ => [
                        v::and(q, mask),
                        v::and(v::srli16::<4>(q), mask),
                        v::and(v::srli16::<8>(q), mask),
                        v::srli16::<12>(q),
                    ],
                }
            };
            // `acc + Σq·xq` per i32 lane of one chunk's planes against activations at `x`, laid
            // out plane after plane, one vector each, as `qint::IntKernel::layout` says.
            let dot = |acc: v::I, p: &[v::I; 4], x: *const u8| -> v::I {
                let xk = |k: usize| v::load(x.add(k * chunk_bytes));
                match (planes, B) {
                    (1, _) => $dot8(acc, p[0], xk(0)),
                    (2, 4) => $dot4($dot4(acc, p[0], xk(0)), p[1], xk(1)),
                    (2, _) => $dot8($dot8(acc, p[0], xk(0)), p[1], xk(1)),
                    _ => {
                        let a = $dot4($dot4(acc, p[0], xk(0)), p[1], xk(1));
                        $dot4($dot4(a, p[2], xk(2)), p[3], xk(3))
                    }
                }
            };
            // Groups per chunk when several share one, and which group each i32 lane is in;
            // chunks per group otherwise.
            let shared = (per_chunk / G).max(1);
            let chunks = (G / per_chunk).max(1);
            let lane_group = v::index(&std::array::from_fn(|i| {
                (i * shared / (v::BITS / 32)) as i32
            }));
            for r in r0..r1 {
                let pw = w.packed.as_ptr().add(r * row_bytes);
                let (ps, pb) = (
                    w.scales.as_ptr().add(r * groups),
                    w.biases.as_ptr().add(r * groups),
                );
                // An accumulator a piece; one piece alternates two, so that consecutive units do
                // not wait on one FMA chain.
                let mut acc = [v::fzero(); 3];
                let mut rest = _mm256_setzero_ps();
                for gb in (0..groups).step_by(8) {
                    // Per block of eight groups: `s·dx` in `d`, and the bias and correction terms
                    // (the last, partial block through zero-padded copies).
                    let n = (groups - gb).min(8);
                    prefetch(ps.wrapping_add(gb + PREFETCH_GROUPS));
                    prefetch(pb.wrapping_add(gb + PREFETCH_GROUPS));
                    let d = if n == 8 {
                        let d = _mm256_mul_ps(load8(ps.add(gb)), _mm256_loadu_ps(pdx.add(gb)));
                        rest =
                            _mm256_fmadd_ps(load8(pb.add(gb)), _mm256_loadu_ps(psum.add(gb)), rest);
                        if $centred && B == 8 {
                            rest = _mm256_fmadd_ps(d, _mm256_loadu_ps(pcorr.add(gb)), rest);
                        }
                        d
                    } else {
                        let mut t = [[0.0f32; 8]; 4];
                        for j in 0..n {
                            let gi = gb + j;
                            t[0][j] = (*ps.add(gi)).to_f32() * *pdx.add(gi);
                            t[1][j] = (*pb.add(gi)).to_f32();
                            t[2][j] = *psum.add(gi);
                            t[3][j] = *pcorr.add(gi);
                        }
                        let [d, b, sum, corr] = t.map(|v| _mm256_loadu_ps(v.as_ptr()));
                        rest = _mm256_fmadd_ps(b, sum, rest);
                        rest = _mm256_fmadd_ps(d, corr, rest);
                        d
                    };
                    // A unit is one chunk of `shared` groups or one group of `chunks` chunks;
                    // returns its sums, one a piece, and its scales.
                    let unit = |u: usize| {
                        let c0 = (gb / shared + u) * chunks;
                        let mut sums = [v::zero(); PIECES];
                        for c in c0..c0 + chunks {
                            let p = unpack(pw, c);
                            let x = px.add(c * x_stride);
                            for (k, sum) in sums.iter_mut().enumerate() {
                                *sum = dot(*sum, &p, x.add(k * planes * chunk_bytes));
                            }
                        }
                        let scale = v::pick(d, v::offset(lane_group, (u * shared) as i32));
                        (sums, scale)
                    };
                    let units = n / shared;
                    if PIECES > 1 {
                        for u in 0..units {
                            let (sums, s) = unit(u);
                            for (a, sum) in acc.iter_mut().zip(sums) {
                                *a = v::fmadd_int(*a, sum, s);
                            }
                        }
                    } else {
                        for u in (0..units - units % 2).step_by(2) {
                            let (p, s) = unit(u);
                            acc[0] = v::fmadd_int(acc[0], p[0], s);
                            let (p, s) = unit(u + 1);
                            acc[1] = v::fmadd_int(acc[1], p[0], s);
                        }
                        if units % 2 == 1 {
                            let (p, s) = unit(units - 1);
                            acc[0] = v::fmadd_int(acc[0], p[0], s);
                        }
                    }
                }
                // Pieces weighted by the refinement to the power of their place (Horner); one
                // piece's two accumulators summed.
                let total = if PIECES == 1 {
                    v::add_scaled(acc[0], acc[1], 1.0)
                } else {
                    let refinement = if $a == 16 {
                        PAIR_REFINEMENT
                    } else {
                        TRIPLE_REFINEMENT
                    };
                    acc[..PIECES]
                        .iter()
                        .rev()
                        .copied()
                        .reduce(|later, a| v::add_scaled(a, later, refinement))
                        .unwrap()
                };
                y[r - r0] = v::sum(total) + hsum(rest);
            }
        }
    };
}

int_rows!(
    avx2_i8,
    "avx2,fma,f16c",
    v256,
    8,
    dot_u4_avx2,
    dot_u8_centred_avx2,
    true
);
int_rows!(
    vnni_i8,
    "avx2,fma,f16c,avxvnni",
    v256,
    8,
    dot_u8_vnni,
    dot_u8_vnni,
    false
);
int_rows!(
    avx512_i8,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vnni",
    v512,
    8,
    dot_u8_avx512,
    dot_u8_avx512,
    false
);
int_rows!(
    avx2_i16,
    "avx2,fma,f16c",
    v256,
    16,
    dot_i16_avx2,
    dot_i16_avx2,
    false
);
int_rows!(
    vnni_i16,
    "avx2,fma,f16c,avxvnni",
    v256,
    16,
    dot_i16_vnni,
    dot_i16_vnni,
    false
);
int_rows!(
    avx512_i16,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vnni",
    v512,
    16,
    dot_i16_avx512,
    dot_i16_avx512,
    false
);
