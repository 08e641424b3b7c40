//! Random operands shared by the kernel tests.

#![allow(dead_code)] // each test binary uses its own part

use half::{bf16, f16};
use oxlm_engine::quant::QuantMode;
use oxlm_engine::{Bytes, DType, QuantizedMatrix};
use rand::rngs::StdRng;
use rand::Rng;

pub fn floats_as(dtype: DType, v: &[f32]) -> Bytes {
    match dtype {
        DType::F32 => Bytes::from_values(v),
        DType::F16 => Bytes::from_values(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()),
        DType::BF16 => {
            Bytes::from_values(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())
        }
        other => panic!("{other} is not a float type"),
    }
}

/// Random packed words (every bit pattern), scales of either sign and biases.
pub fn random_quantized(
    rng: &mut StdRng,
    rows: usize,
    cols: usize,
    bits: u32,
    g: usize,
    dtype: DType,
) -> QuantizedMatrix {
    let words: Vec<u32> = (0..rows * cols * bits as usize / 32)
        .map(|_| rng.random())
        .collect();
    let groups = rows * cols / g;
    let scales: Vec<f32> = (0..groups)
        .map(|_| rng.random_range(0.001f32..0.02) * if rng.random() { 1.0 } else { -1.0 })
        .collect();
    let biases: Vec<f32> = (0..groups)
        .map(|_| rng.random_range(-0.1f32..0.1))
        .collect();
    QuantizedMatrix::new(
        rows,
        cols,
        bits,
        g,
        Bytes::from_values(&words),
        dtype,
        floats_as(dtype, &scales),
        floats_as(dtype, &biases),
    )
    .unwrap()
}

/// A random matrix in the float mode `mode`: every code but E4M3's NaN (0x7F, 0xFF), and
/// scales of a moderate range (E8M0 2^-8..2^0; E4M3 2^-8..2^-1, subnormal ones included).
pub fn random_float_quantized(
    rng: &mut StdRng,
    rows: usize,
    cols: usize,
    mode: QuantMode,
) -> QuantizedMatrix {
    let (bits, g) = mode.float_format().expect("a float mode");
    let bytes: Vec<u8> = (0..rows * cols * bits as usize / 8)
        .map(|_| {
            let b: u8 = rng.random();
            if bits == 8 && b & 0x7F == 0x7F {
                b ^ 1
            } else {
                b
            }
        })
        .collect();
    let scales: Vec<u8> = (0..rows * cols / g)
        .map(|_| match mode {
            QuantMode::Nvfp4 => rng.random_range(0x04..0x38),
            _ => rng.random_range(119..=127),
        })
        .collect();
    QuantizedMatrix::new_float(
        mode,
        rows,
        cols,
        bits,
        g,
        Bytes::copy_from(&bytes),
        Bytes::copy_from(&scales),
    )
    .unwrap()
}

pub fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}
