//! Gemma specifics beyond tiny_parity.rs: prompts fed in chunks that wrap the sliding-window
//! ring, caches that do not belong to the model, and configs mlx-lm could not run.

use std::path::{Path, PathBuf};

use oxlm_engine::KvPrecision;
use oxlm_models::{load, ForwardError, LoadError, Logits};
use serde_json::{json, Value};

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

/// `prompt_ids` and `prompt_logits` of a tiny model's golden.
fn prompt_golden(dir: &Path) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |name: &str| -> Vec<[u8; 4]> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| b.try_into().unwrap())
            .collect()
    };
    let ids = words("prompt_ids")
        .into_iter()
        .map(|b| i32::from_le_bytes(b) as u32)
        .collect();
    let logits = words("prompt_logits")
        .into_iter()
        .map(f32::from_le_bytes)
        .collect();
    (ids, logits)
}

/// A prompt fed `chunk` tokens at a time gives mlx-lm's logits at every position: chunks
/// shorter and longer than the window of 8 make the ring widen, wrap and narrow.
#[test]
fn chunked_prefill_matches_the_oracle() {
    for name in ["gemma3-4bit-g64", "gemma4-4bit-g32", "gemma4-moe-4bit-g64"] {
        let dir = tiny(name);
        let (ids, want) = prompt_golden(&dir);
        let model = load(&dir).unwrap();
        let vocab = model.info().vocab_size;
        for chunk in [1, 3, 7, 8, 13] {
            let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
            let mut got = Vec::new();
            for part in ids.chunks(chunk) {
                let logits = model.forward(part, &mut cache, Logits::All).unwrap();
                got.extend_from_slice(logits.data());
            }
            assert_eq!(got.len(), ids.len() * vocab);
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(d < 2e-3, "{name}, chunks of {chunk}: logits differ by {d}");
        }
    }
}

#[test]
fn a_cache_of_another_model_is_refused() {
    let gemma3 = load(&tiny("gemma3-4bit-g64")).unwrap();
    let gemma4 = load(&tiny("gemma4-4bit-g32")).unwrap();
    let llama = load(&tiny("llama-8bit-g32")).unwrap();
    for (model, other) in [(&gemma3, &gemma4), (&gemma4, &gemma3), (&gemma3, &llama)] {
        let mut cache = other.new_cache_in(KvPrecision::F32).unwrap();
        let err = model.forward(&[1, 2, 3], &mut cache, Logits::Last);
        assert_eq!(err.unwrap_err(), ForwardError::CacheMismatch);
    }
}

/// A writable copy of a tiny model directory with its config edited.
fn edited(name: &str, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(tiny(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    let path = tmp.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(path, config.to_string()).unwrap();
    tmp
}

fn config_error(name: &str, edit: impl FnOnce(&mut Value)) -> String {
    match load(edited(name, edit).path()) {
        Err(LoadError::Config(msg)) => msg,
        Err(other) => panic!("{name}: expected a config error, got {other}"),
        Ok(_) => panic!("{name}: loaded but should not have"),
    }
}

#[test]
fn configs_that_cannot_run_are_refused() {
    let msg = config_error("gemma3-4bit-g64", |c| {
        c["sliding_window_pattern"] = json!(0)
    });
    assert!(msg.contains("sliding_window_pattern"), "{msg}");
    let msg = config_error("gemma4-4bit-g32", |c| c["num_kv_shared_layers"] = json!(6));
    assert!(msg.contains("KV-shared layer 0"), "{msg}");
    let msg = config_error("gemma4-4bit-g32", |c| {
        c["layer_types"][0] = json!("chunked_attention")
    });
    assert!(msg.contains("chunked_attention"), "{msg}");
    let msg = config_error("gemma4-4bit-g32", |c| c["layer_types"] = json!([]));
    assert!(msg.contains("layer_types"), "{msg}");
    let msg = config_error("gemma4-moe-4bit-g64", |c| c["top_k_experts"] = json!(9));
    assert!(msg.contains("9 experts per token of 8"), "{msg}");
    let msg = config_error("gemma4-vlm-8bit-g64", |c| {
        c["text_config"]["rope_parameters"]["full_attention"]["partial_rotary_factor"] = json!(2.0)
    });
    assert!(msg.contains("rotated features"), "{msg}");
}

/// A config whose weights disagree with it is refused by name, not run.
#[test]
fn weights_that_disagree_are_refused() {
    // Without KV sharing, layers 4 and 5 would need k/v projections the checkpoint lacks.
    let dir = edited("gemma4-4bit-g32", |c| c["num_kv_shared_layers"] = json!(0));
    let err = load(dir.path()).err().expect("loaded");
    assert!(
        matches!(
            err,
            LoadError::TensorShape { .. } | LoadError::MissingTensor(_)
        ),
        "{err}"
    );
}

/// Going back is fine while the ring still holds the window before the cut (after a long
/// prefill it holds every position); once decoding has narrowed it, going back further is refused.
#[test]
fn truncation_within_the_ring() {
    let dir = tiny("gemma3-4bit-g64");
    let (ids, want) = prompt_golden(&dir);
    let model = load(&dir).unwrap();
    let vocab = model.info().vocab_size;
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    model.forward(&ids, &mut cache, Logits::Last).unwrap();
    cache.truncate(20).unwrap();
    let logits = model.forward(&ids[20..], &mut cache, Logits::All).unwrap();
    let d = logits
        .data()
        .iter()
        .zip(&want[20 * vocab..])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(d < 2e-3, "resumed logits differ by {d}");

    // A ring of 8 holds the 7 positions before the last one, but not 8.
    model.forward(&[1], &mut cache, Logits::Last).unwrap();
    let before = cache.offset;
    assert!(cache.truncate(before - 2).is_err());
    assert_eq!(cache.offset, before);
    cache.truncate(before - 1).unwrap();
}
