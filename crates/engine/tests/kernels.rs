//! The CPU kernels against the plain definitions: every bit width, group size and scale dtype,
//! both methods (GEMV, GEMM) and every instruction set the processor runs, on shapes chosen to
//! hit every remainder (rows not a multiple of the row blocks, columns past one panel, rows of
//! packed words that are not a multiple of eight).
//!
//! Tolerance: |y - ref| <= 1e-5 · Σ|w·x| per output, with `ref` in f64 on the f32 weights that
//! `QuantizedView::dequantize` gives; the kernels differ from it only in summation order and, on
//! the GEMV path, in applying scale and bias once per group (`s·Σq·x + b·Σx`).

mod common;

use common::{floats_as, random_quantized as random_matrix, random_vec};
use oxlm_engine::cpu::{dense, elementwise, matmul, pool, qint, Isa};
use oxlm_engine::params::DenseView;
use oxlm_engine::quant::{QuantizedView, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES};
use oxlm_engine::{Bytes, DType, FloatMatrix, QuantizedMatrix};
use rand::rngs::StdRng;
use rand::SeedableRng;

const TOLERANCE: f64 = 1e-5;
const MS: [usize; 4] = [1, 3, 17, 64];
const SCALE_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

type Method = fn(Isa, &QuantizedView, &[f32], usize, &mut [f32]);
const METHODS: [(&str, Method); 2] = [("gemv", matmul::gemv), ("gemm", matmul::gemm)];

/// `x · Wᵀ` in f64 on the given f32 weights, with `Σ|w·x|` per output.
fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; m * rows];
    let mut mag = vec![0.0; m * rows];
    for i in 0..m {
        for r in 0..rows {
            for c in 0..cols {
                let p = w[r * cols + c] as f64 * x[i * cols + c] as f64;
                y[i * rows + r] += p;
                mag[i * rows + r] += p.abs();
            }
        }
    }
    (y, mag)
}

fn compare(got: &[f32], want: &(Vec<f64>, Vec<f64>)) -> Result<(), String> {
    compare_within(got, want, &vec![0.0; got.len()])
}

/// As [`compare`], allowing `extra[i]` more error on output `i`.
fn compare_within(
    got: &[f32],
    (want, mag): &(Vec<f64>, Vec<f64>),
    extra: &[f64],
) -> Result<(), String> {
    for (i, (((&g, &w), &m), &e)) in got.iter().zip(want).zip(mag).zip(extra).enumerate() {
        let err = (g as f64 - w).abs();
        let bound = TOLERANCE * m + e + 1e-30;
        if err.is_nan() || err > bound {
            return Err(format!(
                "output {i}: got {g}, want {w} (error {err:e}, bound {bound:e}, Σ|w·x| {m:e})"
            ));
        }
    }
    Ok(())
}

/// What rounding activations to integers of at most `max` per group of `g` may add to each
/// output: `Σ|w|·dx/2`, `dx = max|x| / max` over the element's group.
fn rounding_bound(w: &[f32], rows: usize, cols: usize, x: &[f32], g: usize, max: f64) -> Vec<f64> {
    let m = x.len() / cols;
    let mut out = Vec::with_capacity(m * rows);
    for xi in x.chunks_exact(cols) {
        let dx: Vec<f64> = xi
            .chunks(g)
            .map(|c| c.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64)) / max)
            .collect();
        for wr in w.chunks_exact(cols) {
            out.push(
                wr.iter()
                    .enumerate()
                    .map(|(c, &v)| (v as f64).abs() * dx[c / g] / 2.0)
                    .sum(),
            );
        }
    }
    out
}

#[test]
fn the_x86_kernels_are_tested_when_the_processor_has_them() {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        assert!(Isa::available().contains(&Isa::Avx2));
        let avx512 = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vl");
        assert_eq!(Isa::best() >= Isa::Avx512, avx512);
    }
    assert!(Isa::available().contains(&Isa::Portable));
}

#[test]
fn quantized_matmul_matches_the_dequantized_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    for &g in &SUPPORTED_GROUP_SIZES {
        // 5 groups leave half a chunk of eight words at 2 and 4 bits; 1152 columns span three
        // GEMM panels, the last one partial; 7, 37 and 133 rows leave remainders of every block
        // (133: of the pool's tasks too).
        for (rows, cols) in [(7, 5 * g), (37, 1152), (133, 2 * g)] {
            for &bits in &SUPPORTED_BITS {
                for dtype in SCALE_DTYPES {
                    let w = random_matrix(&mut rng, rows, cols, bits, g, dtype);
                    let v = w.view();
                    let deq = v.dequantize();
                    for m in MS {
                        let x = random_vec(&mut rng, m * cols);
                        let want = reference(&deq, rows, cols, &x, m);
                        for isa in Isa::available() {
                            for (name, method) in METHODS {
                                let mut y = vec![f32::NAN; m * rows];
                                method(isa, &v, &x, m, &mut y);
                                let case = format!("{bits}-bit g{g} {dtype} [{rows}x{cols}] m={m}");
                                compare(&y, &want)
                                    .unwrap_or_else(|e| panic!("{case} {isa:?} {name}: {e}"));
                            }
                        }
                        // The default path may round activations to int16 pairs.
                        let mut y = vec![f32::NAN; m * rows];
                        w.matmul(&x, m, &mut y);
                        let extra = rounding_bound(&deq, rows, cols, &x, g, 32767.0 * 65536.0);
                        compare_within(&y, &want, &extra).unwrap();
                    }
                }
            }
        }
    }
}

#[test]
fn fast_dequantization_is_bit_exact() {
    let mut rng = StdRng::seed_from_u64(2);
    for &g in &SUPPORTED_GROUP_SIZES {
        for &bits in &SUPPORTED_BITS {
            for dtype in SCALE_DTYPES {
                let (rows, cols) = (5, 3 * g);
                let w = random_matrix(&mut rng, rows, cols, bits, g, dtype);
                let v = w.view();
                let deq = v.dequantize();
                for isa in Isa::available() {
                    let mut row = vec![f32::NAN; cols];
                    for r in 0..rows {
                        matmul::dequantize_row(isa, &v, r, &mut row);
                        let want = &deq[r * cols..(r + 1) * cols];
                        let same = row
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{bits}-bit g{g} {dtype} {isa:?} row {r}");
                    }
                }
            }
        }
    }
}

/// The comparison is sharp enough to see one wrong scale, bias or packed integer.
#[test]
fn a_corrupted_matrix_fails_the_comparison() {
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, cols, bits, g) = (9, 256, 4, 64);
    let w = random_matrix(&mut rng, rows, cols, bits, g, DType::F32);
    let v = w.view();
    let groups = rows * cols / g;
    let x = random_vec(&mut rng, 3 * cols);
    let want = reference(&v.dequantize(), rows, cols, &x, 3);

    let scales: Vec<f32> = (0..groups).map(|i| v.scales.get(i)).collect();
    let biases: Vec<f32> = (0..groups).map(|i| v.biases.get(i)).collect();
    let mut bad_scales = scales.clone();
    bad_scales[13] *= 1.001;
    let mut bad_biases = biases.clone();
    bad_biases[30] += 1e-4;
    let mut bad_words = v.packed.to_vec();
    bad_words[77] ^= 1 << 9;
    let corrupted = [
        (v.packed.to_vec(), bad_scales, biases.clone()),
        (v.packed.to_vec(), scales.clone(), bad_biases),
        (bad_words, scales, biases),
    ];
    for (words, scales, biases) in corrupted {
        let bad = QuantizedMatrix::new(
            rows,
            cols,
            bits,
            g,
            Bytes::from_values(&words),
            DType::F32,
            Bytes::from_values(&scales),
            Bytes::from_values(&biases),
        )
        .unwrap();
        for isa in Isa::available() {
            for (name, method) in METHODS {
                let mut y = vec![0.0; 3 * rows];
                method(isa, &bad.view(), &x, 3, &mut y);
                assert!(
                    compare(&y, &want).is_err(),
                    "{isa:?} {name} missed the corruption"
                );
            }
        }
    }
}

/// Each value comes back as the nearest representable one after clamping to the group's range,
/// which MLX's rounding of the scale (so that the bias edge is exact) may leave short of the far
/// end.
#[test]
fn quantize_rounds_to_the_nearest_representable_value() {
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols) = (3, 256);
    let values = random_vec(&mut rng, rows * cols);
    for &bits in &SUPPORTED_BITS {
        let levels = ((1u32 << bits) - 1) as f32;
        for &g in &SUPPORTED_GROUP_SIZES {
            let (words, scales, biases) =
                oxlm_engine::quant::quantize(&values, rows, cols, bits, g);
            let w = QuantizedMatrix::new(
                rows,
                cols,
                bits,
                g,
                Bytes::from_values(&words),
                DType::F32,
                Bytes::from_values(&scales),
                Bytes::from_values(&biases),
            )
            .unwrap();
            for (i, (a, b)) in w.view().dequantize().iter().zip(&values).enumerate() {
                let (s, bias) = (scales[i / g], biases[i / g]);
                let far = bias + levels * s;
                let b = b.clamp(bias.min(far), bias.max(far));
                assert!(
                    (a - b).abs() <= s.abs() * 0.5001,
                    "{bits}-bit g{g} element {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn dense_matmul_matches_the_reference() {
    let mut rng = StdRng::seed_from_u64(5);
    type Dense = fn(Isa, &DenseView, &[f32], usize, &mut [f32]);
    let methods: [(&str, Dense); 2] = [("gemv", dense::gemv), ("gemm", dense::gemm)];
    // 45 and 1100 columns leave partial vectors; 1100 spans three GEMM panels.
    for (rows, cols) in [(7, 45), (37, 1100), (5, 8)] {
        for dtype in SCALE_DTYPES {
            let values = random_vec(&mut rng, rows * cols);
            let w = FloatMatrix::new(rows, cols, dtype, floats_as(dtype, &values)).unwrap();
            let exact = w.to_f32_vec();
            for m in MS {
                let x = random_vec(&mut rng, m * cols);
                let want = reference(&exact, rows, cols, &x, m);
                for isa in Isa::available() {
                    for (name, method) in methods {
                        let mut y = vec![f32::NAN; m * rows];
                        method(isa, &w.view(), &x, m, &mut y);
                        compare(&y, &want).unwrap_or_else(|e| {
                            panic!("{dtype} [{rows}x{cols}] m={m} {isa:?} {name}: {e}")
                        });
                    }
                }
                let mut y = vec![f32::NAN; m * rows];
                w.matmul(&x, m, &mut y);
                compare(&y, &want).unwrap();
            }
        }
    }
}

#[test]
fn dot_matches_the_reference_at_every_length() {
    let mut rng = StdRng::seed_from_u64(6);
    for n in (0..80).chain([1000, 4099]) {
        let a = random_vec(&mut rng, n);
        let b = random_vec(&mut rng, n + 3);
        let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let mag: f64 = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| (x as f64 * y as f64).abs())
            .sum();
        for isa in Isa::available() {
            let got = dense::dot_with(isa, &a, &b) as f64;
            assert!(
                (got - want).abs() <= TOLERANCE * mag + 1e-30,
                "{isa:?} n={n}: {got} vs {want}"
            );
        }
    }
}

/// Attention's softmax against f64 at every length past the vectors' tails, with the largest
/// score at each position (a max that passed it over would overflow `exp`), with and without a
/// sink.
#[test]
fn softmax_matches_the_reference_with_its_largest_anywhere() {
    use oxlm_engine::cpu::attention;
    let mut rng = StdRng::seed_from_u64(12);
    for n in (1..70).chain([1000, 4099]) {
        let base: Vec<f32> = random_vec(&mut rng, n).iter().map(|v| 20.0 * v).collect();
        let tops: Vec<usize> = if n < 70 {
            (0..n).collect()
        } else {
            vec![0, n / 2, n - 1]
        };
        for top in tops {
            let mut x = base.clone();
            x[top] = 200.0;
            for sink in [None, Some(199.0f32)] {
                let max = sink.map_or(200.0, |s| s.max(200.0)) as f64;
                let e: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
                let total = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s as f64 - max).exp());
                for isa in Isa::available() {
                    let mut got = x.clone();
                    attention::softmax(isa, &mut got, sink);
                    for (i, (&g, &w)) in got.iter().zip(&e).enumerate() {
                        let w = w / total;
                        assert!(
                            (g as f64 - w).abs() <= 1e-6,
                            "{isa:?} n={n} top={top} sink={sink:?} [{i}]: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}

/// A softmax's weights and their sum against f64 `exp`: each within the rounding of its f32
/// argument (an ulp of `scale · x − shift` moves `exp` by that much relatively) and a few ulp of
/// its own, filtered (−∞) entries exactly 0, at every length past the vectors' tails.
#[test]
fn exponentials_match_the_reference_at_every_length() {
    let mut rng = StdRng::seed_from_u64(11);
    for n in (0..40).chain([1000, 4099]) {
        let mut x: Vec<f32> = random_vec(&mut rng, n).iter().map(|v| 20.0 * v).collect();
        for i in (0..n).step_by(7) {
            x[i] = f32::NEG_INFINITY;
        }
        let (scale, shift) = (1.3f32, 4.0f32);
        let args: Vec<f64> = x
            .iter()
            .map(|&v| v as f64 * scale as f64 - shift as f64)
            .collect();
        let want: Vec<f64> = args.iter().map(|a| a.exp()).collect();
        let bound: Vec<f64> = args
            .iter()
            .zip(&want)
            .map(|(a, &w)| {
                if w > 0.0 {
                    w * 2e-7 * (a.abs() + 2.0)
                } else {
                    0.0
                }
            })
            .collect();
        for isa in Isa::available() {
            let mut got = vec![f32::NAN; n];
            let sum = elementwise::exp_into_with(isa, &x, scale, shift, &mut got);
            for (i, &g) in got.iter().enumerate() {
                let (w, b) = (want[i], bound[i]);
                assert!((g as f64 - w).abs() <= b, "{isa:?} n={n} [{i}]: {g} vs {w}");
            }
            let (total, b): (f64, f64) = (want.iter().sum(), bound.iter().sum());
            assert!((sum - total).abs() <= b, "{isa:?} n={n}: {sum} vs {total}");
            let unwritten = elementwise::exp_into_with(isa, &x, scale, shift, &mut []);
            assert_eq!(unwritten, sum, "{isa:?} n={n}");
            // A NaN anywhere makes its term and the sum NaN, as libm's exp does.
            if n > 1 {
                let mut with_nan = x.clone();
                with_nan[n - 2] = f32::NAN;
                let sum = elementwise::exp_into_with(isa, &with_nan, scale, shift, &mut got);
                assert!(sum.is_nan() && got[n - 2].is_nan(), "{isa:?} n={n}: {sum}");
            }
        }
    }
}

/// The integer-activation GEMVs against the f64 reference. Rounding x to `dx·xq` moves each
/// product by at most `|w|·dx/2`, so the bound is `Σ|w|·dx/2` plus the f32 tolerance.
#[test]
fn integer_gemv_is_within_the_activation_rounding_bound() {
    let mut rng = StdRng::seed_from_u64(2);
    for &kernel in qint::IntKernel::available() {
        let a = kernel.activations;
        let max = (a.max() / a.resolution()) as f64;
        for &g in &SUPPORTED_GROUP_SIZES {
            for bits in [4, 8] {
                for dtype in SCALE_DTYPES {
                    // Rows of 5 groups of 128 are whole vectors for every kernel: 20 groups of
                    // 32 leave a partial block of 8 groups, 5 of 128 one group per block.
                    let (rows, cols) = (37, 640);
                    let w = random_matrix(&mut rng, rows, cols, bits, g, dtype);
                    let v = w.view();
                    assert!(kernel.supports(&v));
                    let deq = v.dequantize();
                    // Up to the most rows the integer GEMV takes (batched decoding).
                    for m in [1, 3, matmul::INT_GEMV_MAX_M] {
                        let x = random_vec(&mut rng, m * cols);
                        let want = reference(&deq, rows, cols, &x, m);
                        let extra = rounding_bound(&deq, rows, cols, &x, g, max);
                        let mut y = vec![f32::NAN; m * rows];
                        qint::gemv(kernel, &v, &x, m, &mut y);
                        compare_within(&y, &want, &extra).unwrap_or_else(|e| {
                            panic!("{kernel:?} {bits}-bit g{g} {dtype} m={m}: {e}")
                        });
                    }
                }
            }
        }
    }
}

/// Int16 pairs and int8 triples are as exact as f32 activations, and far more than one int16:
/// the largest error relative to `Σ|w·x|` of each method on the same products.
#[test]
fn pairs_and_triples_are_as_exact_as_f32() {
    let mut rng = StdRng::seed_from_u64(8);
    let (rows, cols) = (64, 1024);
    for (bits, g) in [(4, 64), (8, 32), (4, 128)] {
        let w = random_matrix(&mut rng, rows, cols, bits, g, DType::BF16);
        let v = w.view();
        let x = random_vec(&mut rng, cols);
        let (want, mag) = reference(&v.dequantize(), rows, cols, &x, 1);
        let worst = |y: &[f32]| {
            y.iter()
                .zip(&want)
                .zip(&mag)
                .map(|((&g, &w), &m)| (g as f64 - w).abs() / m)
                .fold(0.0, f64::max)
        };
        let mut y = vec![f32::NAN; rows];
        matmul::gemv(Isa::best(), &v, &x, 1, &mut y);
        let float = worst(&y);
        for &kernel in qint::IntKernel::available() {
            if kernel.activations == qint::Activations::I8 {
                continue;
            }
            qint::gemv(kernel, &v, &x, 1, &mut y);
            let err = worst(&y);
            println!("{bits}-bit g{g} {kernel:?}: {err:.2e} (f32 {float:.2e})");
            match kernel.activations {
                qint::Activations::I16Pair | qint::Activations::I8Triple => {
                    assert!(err <= 2.0 * float, "{kernel:?}")
                }
                _ => assert!(err > 30.0 * float, "{kernel:?}"),
            }
        }
    }
}

/// Each integer kernel takes only rows of whole vectors, and the default path falls back to a
/// narrower kernel (or to f32) for the rest: 576 columns (SmolLM2's width) are 4.5 vectors of
/// 512 bits at 4 bits.
#[test]
fn integer_kernels_are_chosen_by_what_they_take() {
    let mut rng = StdRng::seed_from_u64(7);
    let w = random_matrix(&mut rng, 8, 576, 4, 64, DType::BF16);
    let v = w.view();
    for &kernel in qint::IntKernel::available() {
        let wide = kernel.isa == qint::IntIsa::Avx512Vnni;
        assert_eq!(kernel.supports(&v), !wide, "{kernel:?}");
    }
    for a in qint::Activations::ALL {
        if let Some(kernel) = qint::IntKernel::best(a, &v) {
            assert!(kernel.supports(&v) && kernel.activations == a);
        }
    }
    let odd = random_matrix(&mut rng, 8, 96, 4, 32, DType::BF16);
    assert!(qint::IntKernel::available()
        .iter()
        .all(|k| !k.supports(&odd.view())));
}

/// Splitting the output rows over threads changes no output bit, for either method or format.
#[test]
fn matmul_outputs_do_not_depend_on_the_thread_count() {
    let mut rng = StdRng::seed_from_u64(3);
    let w = random_matrix(&mut rng, 300, 512, 4, 64, DType::BF16);
    let values = random_vec(&mut rng, 300 * 512);
    let dense = FloatMatrix::from_f32(300, 512, &values).unwrap();
    for m in [1, 40] {
        let x = random_vec(&mut rng, m * 512);
        let run = |threads| {
            pool::set_threads(threads);
            let mut yq = vec![0.0; m * 300];
            let mut yd = vec![0.0; m * 300];
            w.matmul(&x, m, &mut yq);
            dense.matmul(&x, m, &mut yd);
            (yq, yd)
        };
        let one = run(1);
        assert_eq!(one, run(3), "m={m}");
    }
    pool::set_threads(pool::default_threads());
}

/// Several matrices in one GEMV job give what each gives alone, bit for bit (the activations are
/// quantized once either way), at any thread count.
#[test]
fn grouped_gemv_equals_one_gemv_per_matrix() {
    let mut rng = StdRng::seed_from_u64(11);
    for (bits, g) in [(4, 64), (8, 32), (4, 128)] {
        let ws: Vec<QuantizedMatrix> = [256, 64, 200]
            .iter()
            .map(|&rows| random_matrix(&mut rng, rows, 512, bits, g, DType::BF16))
            .collect();
        let views: Vec<QuantizedView> = ws.iter().map(|w| w.view()).collect();
        let refs: Vec<&QuantizedView> = views.iter().collect();
        for m in [1, 3] {
            let x = random_vec(&mut rng, m * 512);
            let alone: Vec<Vec<f32>> = views
                .iter()
                .map(|w| {
                    let mut y = vec![0.0; m * w.rows];
                    matmul::matmul(w, &x, m, &mut y);
                    y
                })
                .collect();
            for threads in [1, 3] {
                pool::set_threads(threads);
                let mut ys: Vec<Vec<f32>> = views.iter().map(|w| vec![0.0; m * w.rows]).collect();
                let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
                matmul::matmul_group(&refs, &x, m, &mut outs);
                assert_eq!(ys, alone, "{bits}-bit g{g} m={m} threads={threads}");
            }
        }
    }
    pool::set_threads(pool::default_threads());
}

/// Grouped attention of one position against the f64 softmax-weighted sum of the values the
/// cache holds, on every instruction set and over f32, f16, 8-bit and 4-bit rows (groups of 32,
/// 64 and 128): key counts around
/// the kernels' blocks of 8 and 64, head sizes with and without a partial vector (AVX-512 takes
/// whole 64s, AVX2 whole 8s), groups that four-head chunks do not divide, and the rows split in
/// two runs as a wrapped ring's are.
#[test]
fn group_attention_matches_the_reference() {
    use half::f16;
    use oxlm_engine::cpu::attention::{self, GroupAttention, KvElem, KvRows};
    use oxlm_engine::{KvQuant, QuantRing};

    /// The rows as they are read: `(keys, values)` stored whole and stored as a ring that
    /// wrapped (the last third first), with the runs that read each in order; each output
    /// within `tolerance` of the f64 attention over the values the rows hold.
    fn compare<R: KvRows>(
        stored: [(R, R, [std::ops::Range<usize>; 2]); 2],
        held: (&[f32], &[f32]),
        queries: &[f32],
        d: usize,
        (format, tolerance): (&str, f64),
    ) {
        let (kr, vr) = held;
        let (group, len) = (queries.len() / d, kr.len() / d);
        let scale = 1.0 / (d as f32).sqrt();
        let mut want = vec![0.0f64; group * d];
        for (g, q) in queries.chunks_exact(d).enumerate() {
            let s: Vec<f64> = kr
                .chunks_exact(d)
                .map(|k| {
                    q.iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                })
                .map(|v| v * scale as f64)
                .collect();
            let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for (p, v) in e.iter().zip(vr.chunks_exact(d)) {
                for (o, &x) in want[g * d..(g + 1) * d].iter_mut().zip(v) {
                    *o += p / total * x as f64;
                }
            }
        }
        for (keys, values, runs) in stored {
            let job = GroupAttention {
                queries,
                keys,
                values,
                head_dim: d,
                runs: runs.clone(),
                scale,
                softcap: None,
                sinks: None,
                visible: None,
            };
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; group * d];
                job.run(isa, &mut out);
                for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (g as f64 - w).abs() <= tolerance,
                        "{isa:?} {format} d={d} group={group} len={len} runs {runs:?} output {i}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// Rows `cut..` then `..cut` of `x` (rows of `d`).
    fn wrap<T: Clone>(x: &[T], cut: usize, d: usize) -> Vec<T> {
        [&x[cut * d..], &x[..cut * d]].concat()
    }

    fn check<T: KvElem>(keys: &[f32], values: &[f32], queries: &[f32], d: usize) {
        let len = keys.len() / d;
        let stored = |x: &[f32]| -> Vec<T> { x.iter().map(|&v| T::from_f32(v)).collect() };
        let held = |x: &[T]| -> Vec<f32> {
            let mut out = vec![0.0; x.len()];
            T::floats(x).to_f32(0, &mut out);
            out
        };
        let (ks, vs) = (stored(keys), stored(values));
        let cut = len - len / 3;
        let (kw, vw) = (wrap(&ks, cut, d), wrap(&vs, cut, d));
        compare(
            [
                (&ks[..], &vs[..], [0..len, 0..0]),
                (&kw[..], &vw[..], [len - cut..len, 0..len - cut]),
            ],
            (&held(&ks), &held(&vs)),
            queries,
            d,
            (std::any::type_name::<T>(), 1e-5),
        );
    }

    /// Codes of `quant`: scores and values of the values the codes stand for.
    fn check_codes(quant: KvQuant, keys: &[f32], values: &[f32], queries: &[f32], d: usize) {
        let quantize = |x: &[f32]| QuantRing::quantized(x, quant).unwrap();
        let rows = QuantRing::rows;
        let held = |r: &QuantRing| {
            let mut out = vec![0.0; r.rows().elements()];
            attention::dequantize(Isa::Portable, r.rows(), &mut out);
            out
        };
        let len = keys.len() / d;
        let cut = len - len / 3;
        let (kq, vq) = (quantize(keys), quantize(values));
        let (kw, vw) = (
            quantize(&wrap(keys, cut, d)),
            quantize(&wrap(values, cut, d)),
        );
        let (kh, vh) = (held(&kq), held(&vq));
        // One step of a code: what quantizing moved each value by, at most (values in -1..1).
        let step = |x: &[f32], h: &[f32]| {
            x.iter()
                .zip(h)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        };
        let levels = quant.levels();
        assert!(step(keys, &kh) <= 2.0 / levels && step(values, &vh) <= 2.0 / levels);
        compare(
            [
                (rows(&kq), rows(&vq), [0..len, 0..0]),
                (rows(&kw), rows(&vw), [len - cut..len, 0..len - cut]),
            ],
            (&kh, &vh),
            queries,
            d,
            // The integer kernels on 8-bit codes round queries and softmax weights to int16
            // against the largest of each group: within about 3e-5 of the largest weight times
            // a code (up to 255 steps), a fortieth of what 8-bit codes themselves move a value.
            // Other codes are dequantized for the f32 kernels.
            (&format!("{quant:?}"), 1e-4),
        );
    }

    let mut rng = StdRng::seed_from_u64(9);
    for (d, group) in [
        (64, 4),
        (64, 3),
        (36, 2),
        (128, 1),
        (80, 3),
        (256, 5),
        (16, 4),
    ] {
        for len in [1, 7, 8, 63, 65, 200, 1000] {
            let queries = random_vec(&mut rng, group * d);
            let keys = random_vec(&mut rng, len * d);
            let values = random_vec(&mut rng, len * d);
            check::<f32>(&keys, &values, &queries, d);
            check::<f16>(&keys, &values, &queries, d);
            let quants = [(8, 64), (4, 64), (4, 32), (8, 32), (4, 128)];
            for quant in quants.map(|(bits, group)| KvQuant::new(bits, group).unwrap()) {
                if d % quant.group == 0 {
                    check_codes(quant, &keys, &values, &queries, d);
                }
            }
        }
    }
}

/// A prompt's tokens attended together (their queries stacked over one read of the cache, each
/// masked to its own positions) give exactly what each token attended alone gives: over f32,
/// f16, 8-bit and 4-bit rows, causally and through a sliding window over a ring that wrapped
/// (whose tokens start their positions one apart), with groups the stacks do not divide, a
/// soft cap and sinks.
#[test]
fn a_prompt_attends_as_its_tokens_one_by_one() {
    use half::f16;
    use oxlm_engine::cpu::attention::{self, KvElem, KvRows, KvView, Options};
    use oxlm_engine::{KvQuant, QuantRing};

    struct Case {
        heads: usize,
        kv_heads: usize,
        d: usize,
        capacity: usize,
        end: usize,
        window: Option<usize>,
        first: usize,
    }

    fn check<R: KvRows>(keys: R, values: R, case: &Case, q: &[f32], sinks: &[f32], what: &str) {
        let &Case {
            heads,
            kv_heads,
            d,
            capacity,
            end,
            window,
            first,
        } = case;
        let view = KvView {
            keys,
            values,
            kv_heads,
            capacity,
            start: end.saturating_sub(capacity),
            end,
            window,
        };
        let positions: Vec<usize> = (first..end).collect();
        for options in [
            Options::scaled(0.125),
            Options::scaled(0.125).with_softcap(2.0).with_sinks(sinks),
        ] {
            let row = heads * d;
            let mut together = vec![f32::NAN; positions.len() * row];
            attention::attention(q, heads, d, &positions, &view, options, &mut together);
            for (t, &pos) in positions.iter().enumerate() {
                let mut alone = vec![f32::NAN; row];
                let qt = &q[t * row..(t + 1) * row];
                attention::attention(qt, heads, d, &[pos], &view, options, &mut alone);
                let got = &together[t * row..(t + 1) * row];
                assert!(
                    got.iter()
                        .zip(&alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: {heads}/{kv_heads} heads of {d}, ring {capacity}, end {end}, \
                     window {window:?}, position {pos}, sinks {}",
                    options.sinks.is_some()
                );
            }
        }
    }

    fn as_elems<T: KvElem>(x: &[f32]) -> Vec<T> {
        x.iter().map(|&v| T::from_f32(v)).collect()
    }

    let mut rng = StdRng::seed_from_u64(21);
    let cases = [
        Case {
            heads: 8,
            kv_heads: 2,
            d: 64,
            capacity: 256,
            end: 200,
            window: None,
            first: 0,
        },
        Case {
            heads: 14,
            kv_heads: 2,
            d: 128,
            capacity: 512,
            end: 300,
            window: None,
            first: 100,
        },
        Case {
            heads: 4,
            kv_heads: 4,
            d: 64,
            capacity: 96,
            end: 250,
            window: Some(80),
            first: 200,
        },
    ];
    for case in &cases {
        let n = case.kv_heads * case.capacity * case.d;
        let (k, v) = (random_vec(&mut rng, n), random_vec(&mut rng, n));
        let q = random_vec(&mut rng, (case.end - case.first) * case.heads * case.d);
        let sinks = random_vec(&mut rng, case.heads);
        check(&k[..], &v[..], case, &q, &sinks, "f32");
        let (kh, vh) = (as_elems::<f16>(&k), as_elems::<f16>(&v));
        check(&kh[..], &vh[..], case, &q, &sinks, "f16");
        for quant in [KvQuant::Q8, KvQuant::new(4, 32).unwrap()] {
            let codes = |x: &[f32]| QuantRing::quantized(x, quant).expect("whole groups");
            let (kq, vq) = (codes(&k), codes(&v));
            check(
                kq.rows(),
                vq.rows(),
                case,
                &q,
                &sinks,
                &format!("{quant:?}"),
            );
        }
    }
}
