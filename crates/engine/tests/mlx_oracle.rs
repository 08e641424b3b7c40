//! The quantization format and kernels against MLX itself:
//! `tests/fixtures/quant_oracle.safetensors` holds `mx.quantize`, `mx.dequantize` and
//! `mx.quantized_matmul` outputs (mlx 0.32.4, CPU) for bits 2, 3, 4, 5, 6, 8, group sizes 32, 64,
//! 128 and f32, f16, bf16 weights; it is made by `scripts/oracle/make_quant_fixture.py`, whose
//! docstring describes every tensor.

use half::{bf16, f16};
use oxlm_engine::cpu::{matmul, Isa};
use oxlm_engine::quant::{quantize, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES};
use oxlm_engine::{Bytes, DType, QuantizedMatrix};
use safetensors::{Dtype, SafeTensors};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/quant_oracle.safetensors"
);
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
