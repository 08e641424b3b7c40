//! The LoRA fixtures (tests/fixtures/lora, from scripts/oracle/make_lora_fixture.py) that the
//! adapter and fuse tests share, and how they are compared with mlx-lm's goldens.

#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use oxlm_engine::{cuda, Device, KvPrecision};
use oxlm_models::{LanguageModel, Logits};

/// As the tiny-model parity tests: both sides compute in f32.
pub const LOGIT_TOLERANCE: f32 = 2e-3;

/// `(adapter fixture, base model)`: every architecture, the multimodal wrappers, the mixtures
/// of experts and the float quantization modes.
pub const CASES: [(&str, &str); 15] = [
    ("llama-4bit-g64-r4", "llama-4bit-g64"),
    ("qwen2-4bit-g64-keys", "qwen2-4bit-g64"),
    ("gemma3-4bit-g64-r4", "gemma3-4bit-g64"),
    ("qwen3_5-4bit-g64-r4", "qwen3_5-4bit-g64"),
    ("gemma4-4bit-g32-r4", "gemma4-4bit-g32"),
    ("gemma3-vlm-8bit-g32-r4", "gemma3-vlm-8bit-g32"),
    ("gemma4-vlm-8bit-g64-r4", "gemma4-vlm-8bit-g64"),
    ("qwen3_5_moe-4bit-g64-r4", "qwen3_5_moe-4bit-g64"),
    ("gemma4-moe-4bit-g64-r4", "gemma4-moe-4bit-g64"),
    ("lfm2-8bit-g32-r4", "lfm2-8bit-g32"),
    ("lfm2_moe-4bit-g64-r4", "lfm2_moe-4bit-g64"),
    ("llama-mxfp4-g32-r4", "llama-mxfp4-g32"),
    ("phi3-4bit-g32-r4", "phi3-4bit-g32"),
    ("glm4-4bit-g32-r4", "glm4-4bit-g32"),
    ("gemma3n-4bit-g32-r4", "gemma3n-4bit-g32"),
];

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Array `name` of the adapter fixture's golden.safetensors, as f32.
pub fn golden(adapter: &str, name: &str) -> Vec<f32> {
    let path = fixtures()
        .join("lora")
        .join(adapter)
        .join("golden.safetensors");
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The prompt the goldens were computed on (int32 ids, stored bit for bit).
pub fn prompt(adapter: &str) -> Vec<u32> {
    golden(adapter, "prompt_ids")
        .into_iter()
        .map(|v| v.to_bits())
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every position's logits of one forward pass over `tokens`, with an f32 cache.
pub fn all_logits(model: &dyn LanguageModel, tokens: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    model
        .forward(tokens, &mut cache, Logits::All)
        .unwrap()
        .into_host()
        .unwrap()
        .into_data()
}

/// The devices adapters are checked on: the CPU, then the GPU (if any) in exact math, which
/// holds the same tolerance; with the GPU, this test's turn on it (a GPU handle has one stream
/// for every thread).
pub fn devices() -> (Vec<Device>, Option<MutexGuard<'static, ()>>) {
    static TURN: Mutex<()> = Mutex::new(());
    if !cuda::libraries_present() {
        eprintln!("GPU runs skipped: no CUDA driver on this machine");
        return (vec![Device::Cpu], None);
    }
    let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Device::Cuda(gpu) = Device::open("cuda").expect("opening GPU 0") else {
        unreachable!()
    };
    let exact = Device::Cuda(gpu.with_exact_math(true));
    (vec![Device::Cpu, exact], Some(turn))
}
