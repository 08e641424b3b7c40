//! What the recurrent architectures' tests (Qwen3.5's, LFM2's) share: their tiny fixtures, the
//! token sequence of a fixture's golden run, and the tolerance between prefill and stepping.

use std::path::{Path, PathBuf};

/// Prefill and step-by-step runs differ only in summation order (GEMM against GEMV).
pub const TOLERANCE: f32 = 1e-3;

pub fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

/// The golden prompt followed by the greedy tokens: some 75 tokens of realistic input.
pub fn sequence(name: &str) -> Vec<u32> {
    let bytes = std::fs::read(tiny(name).join("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |n: &str| -> Vec<u32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    let mut ids = ints("prompt_ids");
    ids.extend(ints("greedy_ids"));
    ids
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
