//! Integer GEMV kernels for 4- and 8-bit MLX weights against int8 activations
//! (`super::qint`). One source, two instruction sets: AVX2 (`vpmaddubsw` then `vpmaddwd`) and
//! AVX-VNNI (`vpdpbusd`, one instruction for the same four-product sums).

use std::arch::x86_64::*;

use super::avx2::{hsum, load8, Elem};
use super::qint::{IntRows, CHUNK_BYTES};

/// `Σ q·x` over four neighbouring bytes, per i32 lane, without VNNI. `q` is unsigned (at most
/// 15 here, so the pair sums of `vpmaddubsw` cannot saturate).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_u4_avx2(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)),
    )
}

#[target_feature(enable = "avx2,avxvnni")]
#[inline]
unsafe fn dot_u4_vnni(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, q, x)
}

/// `Σ (q - 128)·x` for full bytes `q`: `vpmaddubsw` pairs of `255·127` would saturate, so the
/// sign moves onto x and `|q - 128| ≤ 128` is the unsigned side. The caller adds `128·Σx` back.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_u8_avx2(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    let centred = _mm256_xor_si256(q, _mm256_set1_epi8(-128));
    let prod = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(x, centred));
    _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16(1)))
}

#[target_feature(enable = "avx2,avxvnni")]
#[inline]
unsafe fn dot_u8_vnni(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, q, x)
}

/// One kernel body per instruction set. Groups are walked in order; each takes one or more
/// whole 32-byte chunks, except at 4 bits with groups of 32, where one chunk holds two groups
/// (i32 lanes 0-3 and 4-7).
macro_rules! int_rows {
    ($name:ident, $features:literal, $dot4:ident, $dot8:ident) => {
        /// `y[r - r0] = Σ_g (s·dx·Σq·xq + b·Σx + s·dx·corr)` for rows `r0..r1`.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<T: Elem, const BITS: usize>(
            w: &IntRows<T>,
            r0: usize,
            r1: usize,
            y: &mut [f32],
        ) {
            let g = w.group_size;
            let groups = w.cols / g;
            let row_bytes = w.cols * BITS / 8;
            let per_chunk = CHUNK_BYTES * 8 / BITS;
            assert!(
                w.packed.len() >= r1 * row_bytes
                    && w.scales.len() >= r1 * groups
                    && w.biases.len() >= r1 * groups
                    && w.xq.len() >= w.cols
                    && w.dx.len() >= groups
                    && w.sums.len() >= groups
                    && w.corr.len() >= groups
                    && y.len() >= r1 - r0
                    && w.cols.is_multiple_of(per_chunk)
            );
            let mask = _mm256_set1_epi8(0x0f);
            let (px, pdx, psum, pcorr) = (
                w.xq.as_ptr(),
                w.dx.as_ptr(),
                w.sums.as_ptr(),
                w.corr.as_ptr(),
            );
            // `Σq·xq` of the chunk at packed byte `off`, elements from `e`, per i32 lane.
            let chunk = |pw: *const u8, off: usize, e: usize| -> __m256i {
                let q = _mm256_loadu_si256(pw.add(off).cast());
                let x = px.add(e);
                if BITS == 4 {
                    // Low nibbles are the even elements, high nibbles the odd ones; xq is laid
                    // out to match.
                    let lo = _mm256_and_si256(q, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
                    let p = $dot4(_mm256_setzero_si256(), lo, _mm256_loadu_si256(x.cast()));
                    $dot4(p, hi, _mm256_loadu_si256(x.add(32).cast()))
                } else {
                    $dot8(_mm256_setzero_si256(), q, _mm256_loadu_si256(x.cast()))
                }
            };
            for r in r0..r1 {
                let pw = w.packed.as_ptr().add(r * row_bytes);
                let (ps, pb) = (
                    w.scales.as_ptr().add(r * groups),
                    w.biases.as_ptr().add(r * groups),
                );
                // Two accumulators so that consecutive groups do not wait on one FMA chain.
                let mut acc = [_mm256_setzero_ps(); 2];
                let mut rest = _mm256_setzero_ps();
                let mut rest_tail = 0.0f32;
                // Per block of eight groups, `s·dx` and the bias terms in vectors first.
                let mut sd = [0.0f32; 8];
                for gb in (0..groups).step_by(8) {
                    let n = (groups - gb).min(8);
                    if n == 8 {
                        let d = _mm256_mul_ps(load8(ps.add(gb)), _mm256_loadu_ps(pdx.add(gb)));
                        _mm256_storeu_ps(sd.as_mut_ptr(), d);
                        rest =
                            _mm256_fmadd_ps(load8(pb.add(gb)), _mm256_loadu_ps(psum.add(gb)), rest);
                        rest = _mm256_fmadd_ps(d, _mm256_loadu_ps(pcorr.add(gb)), rest);
                    } else {
                        for (j, v) in sd.iter_mut().enumerate().take(n) {
                            let gi = gb + j;
                            *v = (*ps.add(gi)).to_f32() * *pdx.add(gi);
                            rest_tail +=
                                (*pb.add(gi)).to_f32() * *psum.add(gi) + *v * *pcorr.add(gi);
                        }
                    }
                    if g < per_chunk {
                        for j in (0..n).step_by(2) {
                            let c = (gb + j) / 2;
                            let p = chunk(pw, c * CHUNK_BYTES, c * per_chunk);
                            let scale = _mm256_setr_m128(
                                _mm_broadcast_ss(&sd[j]),
                                _mm_broadcast_ss(&sd[j + 1]),
                            );
                            let a = &mut acc[j / 2 % 2];
                            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, *a);
                        }
                    } else {
                        let chunks = g / per_chunk;
                        for (j, d) in sd.iter().enumerate().take(n) {
                            let c0 = (gb + j) * chunks;
                            let mut p = chunk(pw, c0 * CHUNK_BYTES, c0 * per_chunk);
                            for c in c0 + 1..c0 + chunks {
                                p = _mm256_add_epi32(p, chunk(pw, c * CHUNK_BYTES, c * per_chunk));
                            }
                            let a = &mut acc[j % 2];
                            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(d), *a);
                        }
                    }
                }
                let acc = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), rest);
                y[r - r0] = hsum(acc) + rest_tail;
            }
        }
    };
}

int_rows!(rows_avx2, "avx2,fma,f16c", dot_u4_avx2, dot_u8_avx2);
int_rows!(rows_vnni, "avx2,fma,f16c,avxvnni", dot_u4_vnni, dot_u8_vnni);
