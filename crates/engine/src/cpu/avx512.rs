//! AVX-512 kernels (with AVX2, FMA and F16C). Every function here is `unsafe` because it may only
//! run once [`super::Isa::Avx512`] was found available; pointer bounds are checked by the
//! callers, as for the AVX2 kernels.

use std::arch::x86_64::*;

use super::avx2::hsum4;
use super::gemm::Kernel;

/// The eight-lane sum of the two halves of `v`.
#[target_feature(enable = "avx512f,avx2")]
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
