//! The quantization formats and kernels against MLX itself:
//! `tests/fixtures/quant_oracle.safetensors` holds `mx.quantize`, `mx.dequantize` and
//! `mx.quantized_matmul` outputs (mlx 0.32.4, CPU) for bits 2, 3, 4, 5, 6, 8, group sizes 32, 64,
//! 128 and f32, f16, bf16 weights in the affine mode, and
//! `tests/fixtures/quant_modes_oracle.safetensors` the same for the float modes (mxfp4, nvfp4,
//! mxfp8); they are made by `scripts/oracle/make_quant_fixture.py` and
//! `make_quant_modes_fixture.py`, whose docstrings describe every tensor.

use half::{bf16, f16};
use oxlm_engine::cpu::{fp, matmul, transposed, Isa};
use oxlm_engine::quant::{
    quantize, quantize_float, QuantMode, QuantizedParts, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES,
};
use oxlm_engine::{Bytes, DType, EngineError, QuantizedMatrix};
use safetensors::{Dtype, SafeTensors};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/quant_oracle.safetensors"
);
const MODES_FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/quant_modes_oracle.safetensors"
);
const FLOAT_MODES: [QuantMode; 3] = [QuantMode::Mxfp4, QuantMode::Nvfp4, QuantMode::Mxfp8];
const DTYPES: [(&str, DType); 3] = [
    ("f32", DType::F32),
    ("f16", DType::F16),
    ("bf16", DType::BF16),
];
/// As in the kernel tests: |y - y_mlx| <= 1e-5 · Σ|w·x|; MLX sums in another order.
const TOLERANCE: f64 = 1e-5;

struct Fixture(Vec<u8>);

impl Fixture {
    fn load() -> Fixture {
        Fixture(std::fs::read(FIXTURE).expect("the oracle fixture"))
    }

    fn load_modes() -> Fixture {
        Fixture(std::fs::read(MODES_FIXTURE).expect("the float modes' oracle fixture"))
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.0).unwrap()
    }
}

/// A tensor's shape and bytes, checking its dtype.
fn raw(st: &SafeTensors, name: &str, dtype: Dtype) -> (Vec<usize>, Bytes) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), dtype, "{name}");
    (t.shape().to_vec(), Bytes::copy_from(t.data()))
}

fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let (shape, bytes) = raw(st, name, Dtype::F32);
    (shape, bytes.view::<f32>().to_vec())
}

fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        other => panic!("{other}"),
    }
}

/// `v` rounded to `dtype` the way MLX stores scales (round to nearest even), as raw bytes.
fn rounded_bytes(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(v).to_vec(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
        other => panic!("{other}"),
    }
}

/// The source weights of one dtype, exactly as f32.
fn source_weights(st: &SafeTensors, tag: &str, dtype: DType) -> (usize, usize, Vec<f32>) {
    let (shape, bytes) = raw(st, &format!("w.{tag}"), st_dtype(dtype));
    let values = match dtype {
        DType::F32 => bytes.view::<f32>().to_vec(),
        DType::F16 => bytes.view::<f16>().iter().map(|v| v.to_f32()).collect(),
        DType::BF16 => bytes.view::<bf16>().iter().map(|v| v.to_f32()).collect(),
        other => panic!("{other}"),
    };
    (shape[0], shape[1], values)
}

fn quantized(st: &SafeTensors, prefix: &str, dtype: DType, bits: u32, g: usize) -> QuantizedMatrix {
    let (wshape, words) = raw(st, &format!("{prefix}weight"), Dtype::U32);
    let (_, scales) = raw(st, &format!("{prefix}scales"), st_dtype(dtype));
    let (_, biases) = raw(st, &format!("{prefix}biases"), st_dtype(dtype));
    let cols = wshape[1] * 32 / bits as usize;
    QuantizedMatrix::new(wshape[0], cols, bits, g, words, dtype, scales, biases).unwrap()
}

fn every_case() -> impl Iterator<Item = (&'static str, DType, u32, usize)> {
    DTYPES.into_iter().flat_map(|(tag, dtype)| {
        SUPPORTED_BITS.into_iter().flat_map(move |bits| {
            SUPPORTED_GROUP_SIZES
                .into_iter()
                .map(move |g| (tag, dtype, bits, g))
        })
    })
}

#[test]
fn dequantize_matches_mlx_bit_for_bit() {
    let fixture = Fixture::load();
    let st = fixture.tensors();
    for (tag, dtype, bits, g) in every_case() {
        let prefix = format!("{tag}.b{bits}.g{g}.");
        let w = quantized(&st, &prefix, dtype, bits, g);
        let (_, want) = f32s(&st, &format!("{prefix}dequant"));
        let got = w.view().dequantize();
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{prefix}dequant[{i}]: {a} vs mlx {b}"
            );
        }
        for isa in Isa::available() {
            let mut row = vec![0.0; w.cols];
            for r in 0..w.rows {
                matmul::dequantize_row(isa, &w.view(), r, &mut row);
                assert_eq!(
                    row,
                    want[r * w.cols..(r + 1) * w.cols],
                    "{prefix} {isa:?} row {r}"
                );
            }
        }
    }
}

#[test]
fn quantize_matches_mlx_bit_for_bit() {
    let fixture = Fixture::load();
    let st = fixture.tensors();
    for (tag, dtype, bits, g) in every_case() {
        let prefix = format!("{tag}.b{bits}.g{g}.");
        let (rows, cols, values) = source_weights(&st, tag, dtype);
        let (words, scales, biases) = quantize(&values, rows, cols, bits, g);
        let (_, want_words) = raw(&st, &format!("{prefix}weight"), Dtype::U32);
        assert_eq!(words, want_words.view::<u32>(), "{prefix}weight");
        let (_, want_scales) = raw(&st, &format!("{prefix}scales"), st_dtype(dtype));
        assert_eq!(
            rounded_bytes(dtype, &scales),
            want_scales.as_slice(),
            "{prefix}scales"
        );
        let (_, want_biases) = raw(&st, &format!("{prefix}biases"), st_dtype(dtype));
        assert_eq!(
            rounded_bytes(dtype, &biases),
            want_biases.as_slice(),
            "{prefix}biases"
        );
    }
}

#[test]
fn matmul_matches_mlx_quantized_matmul() {
    let fixture = Fixture::load();
    let st = fixture.tensors();
    let (xshape, x) = f32s(&st, "x");
    let (m, cols) = (xshape[0], xshape[1]);
    type Method = fn(Isa, &oxlm_engine::quant::QuantizedView, &[f32], usize, &mut [f32]);
    let methods: [(&str, Method); 2] = [("gemv", matmul::gemv), ("gemm", matmul::gemm)];
    for (tag, dtype, bits, g) in every_case() {
        let prefix = format!("{tag}.b{bits}.g{g}.");
        let w = quantized(&st, &prefix, dtype, bits, g);
        assert_eq!(w.cols, cols);
        let (_, want) = f32s(&st, &format!("{prefix}y"));
        let deq = w.view().dequantize();
        let rows = w.rows;
        for isa in Isa::available() {
            for (name, method) in methods {
                let mut y = vec![f32::NAN; m * rows];
                method(isa, &w.view(), &x, m, &mut y);
                for i in 0..m {
                    for r in 0..rows {
                        let mag: f64 = (0..cols)
                            .map(|c| (deq[r * cols + c] as f64 * x[i * cols + c] as f64).abs())
                            .sum();
                        let (got, want) = (y[i * rows + r], want[i * rows + r]);
                        assert!(
                            ((got - want) as f64).abs() <= TOLERANCE * mag,
                            "{prefix} {isa:?} {name} y[{i}, {r}]: {got} vs mlx {want}, Σ|w·x| {mag}"
                        );
                    }
                }
            }
        }
    }
}

fn float_quantized(st: &SafeTensors, prefix: &str, mode: QuantMode) -> QuantizedMatrix {
    let (bits, g) = mode.float_format().unwrap();
    let (wshape, words) = raw(st, &format!("{prefix}weight"), Dtype::U32);
    let (_, scales) = raw(st, &format!("{prefix}scales"), Dtype::U8);
    let cols = wshape[1] * 32 / bits as usize;
    QuantizedMatrix::new_float(mode, wshape[0], cols, bits, g, words, scales).unwrap()
}

/// The float-mode matrices of the fixture: `(prefix, mode, dtype)`, the weights of each source
/// dtype and then every code of each mode (`dtype` `None`).
fn float_cases() -> impl Iterator<Item = (String, QuantMode, Option<DType>)> {
    FLOAT_MODES.into_iter().flat_map(|mode| {
        DTYPES
            .into_iter()
            .map(move |(tag, dtype)| (format!("{mode}.{tag}."), mode, Some(dtype)))
            .chain([(format!("{mode}.codes."), mode, None)])
    })
}

fn assert_same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}[{i}]: {a} vs mlx {b}");
    }
}

#[test]
fn float_modes_dequantize_match_mlx_bit_for_bit() {
    let fixture = Fixture::load_modes();
    let st = fixture.tensors();
    for (prefix, mode, _) in float_cases() {
        let w = float_quantized(&st, &prefix, mode);
        let (_, want) = f32s(&st, &format!("{prefix}dequant"));
        let QuantizedParts::Float(v) = w.parts() else {
            panic!("{prefix}: not a float mode")
        };
        assert_same_bits(&format!("{prefix}dequant"), &v.dequantize(), &want);
        let mut row = vec![0.0; w.cols];
        for isa in Isa::available() {
            for r in 0..w.rows {
                fp::dequantize_row(isa, &v, r, &mut row);
                let what = format!("{prefix} {isa:?} row {r}");
                assert_same_bits(&what, &row, &want[r * w.cols..(r + 1) * w.cols]);
            }
        }
        // The embedding lookup's path.
        w.dequantize_row(w.rows - 1, &mut row);
        assert_same_bits(&prefix, &row, &want[(w.rows - 1) * w.cols..]);
    }
}

#[test]
fn float_modes_quantize_match_mlx_bit_for_bit() {
    let fixture = Fixture::load_modes();
    let st = fixture.tensors();
    for (prefix, mode, dtype) in float_cases() {
        let Some(dtype) = dtype else { continue };
        let tag = prefix.split('.').nth(1).unwrap();
        let (rows, cols, values) = source_weights(&st, tag, dtype);
        let (words, scales) = quantize_float(mode, &values, rows, cols, dtype);
        let (_, want_words) = raw(&st, &format!("{prefix}weight"), Dtype::U32);
        assert_eq!(words, want_words.view::<u32>(), "{prefix}weight");
        let (_, want_scales) = raw(&st, &format!("{prefix}scales"), Dtype::U8);
        assert_eq!(scales, want_scales.as_slice(), "{prefix}scales");
    }
}

/// `|y - y_mlx| <= TOLERANCE · Σ|w·x|` for every output of `y[m, rows]`.
fn assert_close_to_mlx(what: &str, y: &[f32], want: &[f32], deq: &[f32], x: &[f32], cols: usize) {
    let rows = deq.len() / cols;
    for (i, (yi, wi)) in y.chunks(rows).zip(want.chunks(rows)).enumerate() {
        for (r, (&got, &want)) in yi.iter().zip(wi).enumerate() {
            let mag: f64 = (0..cols)
                .map(|c| (deq[r * cols + c] as f64 * x[i * cols + c] as f64).abs())
                .sum();
            assert!(
                ((got - want) as f64).abs() <= TOLERANCE * mag,
                "{what} y[{i}, {r}]: {got} vs mlx {want}, Σ|w·x| {mag}"
            );
        }
    }
}

#[test]
fn float_modes_matmul_matches_mlx_quantized_matmul() {
    let fixture = Fixture::load_modes();
    let st = fixture.tensors();
    let (xshape, x) = f32s(&st, "x");
    let (m_all, cols) = (xshape[0], xshape[1]);
    for (prefix, mode, dtype) in float_cases() {
        if dtype.is_none() {
            continue;
        }
        let w = float_quantized(&st, &prefix, mode);
        let QuantizedParts::Float(v) = w.parts() else {
            panic!("{prefix}: not a float mode")
        };
        let deq = v.dequantize();
        let (_, want) = f32s(&st, &format!("{prefix}y"));
        let (_, want1) = f32s(&st, &format!("{prefix}y1"));
        let rows = w.rows;
        // The decode row as MLX computed it alone, then the GEMV for each count of rows it
        // takes and the GEMM for one and for all of them.
        let mut y = vec![f32::NAN; rows];
        w.matmul(&x, 1, &mut y);
        assert_close_to_mlx(&format!("{prefix} decode"), &y, &want1, &deq, &x, cols);
        for isa in Isa::available() {
            for m in 1..=8 {
                let mut y = vec![f32::NAN; m * rows];
                fp::gemv(isa, &v, &x, m, &mut y);
                let what = format!("{prefix} {isa:?} gemv m={m}");
                assert_close_to_mlx(&what, &y, &want[..m * rows], &deq, &x, cols);
            }
            for m in [1, m_all] {
                let mut y = vec![f32::NAN; m * rows];
                fp::gemm(isa, &v, &x, m, &mut y);
                let what = format!("{prefix} {isa:?} gemm m={m}");
                assert_close_to_mlx(&what, &y, &want[..m * rows], &deq, &x, cols);
            }
        }
        let mut y = vec![f32::NAN; m_all * rows];
        w.matmul(&x, m_all, &mut y);
        assert_close_to_mlx(&format!("{prefix} prefill"), &y, &want, &deq, &x, cols);
    }
}

#[test]
fn float_modes_backward_multiplies_by_the_dequantized_matrix() {
    let fixture = Fixture::load_modes();
    let st = fixture.tensors();
    let (_, x) = f32s(&st, "x");
    for (prefix, mode, dtype) in float_cases() {
        if dtype.is_none() {
            continue;
        }
        let w = float_quantized(&st, &prefix, mode);
        let QuantizedParts::Float(v) = w.parts() else {
            panic!("{prefix}: not a float mode")
        };
        let (rows, cols, deq) = (w.rows, w.cols, v.dequantize());
        // dy: the first rows of x, cut to W's output width.
        let m = 3;
        let dy: Vec<f32> = x
            .chunks(cols)
            .take(m)
            .flat_map(|r| &r[..rows])
            .copied()
            .collect();
        for isa in Isa::available() {
            let mut dx = vec![f32::NAN; m * cols];
            transposed::float_quantized(isa, &v, &dy, m, &mut dx);
            for i in 0..m {
                for c in 0..cols {
                    let terms =
                        (0..rows).map(|r| dy[i * rows + r] as f64 * deq[r * cols + c] as f64);
                    let (want, mag) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                    let got = dx[i * cols + c] as f64;
                    assert!(
                        (got - want).abs() <= TOLERANCE * mag,
                        "{prefix} {isa:?} dx[{i}, {c}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn float_modes_check_their_format_and_sizes() {
    let words = |n: usize| Bytes::from_values(&vec![0u32; n]);
    // A [2, 64] mxfp4 matrix: 8 words a row, one scale per 32.
    let ok = QuantizedMatrix::new_float(
        QuantMode::Mxfp4,
        2,
        64,
        4,
        32,
        words(16),
        Bytes::copy_from(&[127; 4]),
    );
    assert_eq!(ok.unwrap().mode, QuantMode::Mxfp4);
    let cases = [
        (QuantMode::Mxfp4, 4, 16, 16, 4),
        (QuantMode::Nvfp4, 4, 32, 16, 4),
        (QuantMode::Mxfp8, 4, 32, 16, 4),
        (QuantMode::Affine, 4, 32, 16, 4),
        (QuantMode::Mxfp4, 4, 32, 15, 4),
        (QuantMode::Mxfp4, 4, 32, 16, 3),
    ];
    for (mode, bits, g, n_words, n_scales) in cases {
        let err = QuantizedMatrix::new_float(
            mode,
            2,
            64,
            bits,
            g,
            words(n_words),
            Bytes::copy_from(&vec![127; n_scales]),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::UnsupportedQuantization(_) | EngineError::SizeMismatch { .. }
            ),
            "{mode} {bits} bits, group {g}: {err}"
        );
    }
}
