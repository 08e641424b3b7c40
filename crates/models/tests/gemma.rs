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
    let names = [
        "gemma3-4bit-g64",
        "gemma4-4bit-g32",
        "gemma4-moe-4bit-g64",
        "gemma3n-4bit-g32",
    ];
    for name in names {
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
            let d = max_abs_diff(&got, &want);
            assert!(d < 2e-3, "{name}, chunks of {chunk}: logits differ by {d}");
        }
    }
}

#[test]
fn a_cache_of_another_model_is_refused() {
    let gemma3 = load(&tiny("gemma3-4bit-g64")).unwrap();
    let gemma4 = load(&tiny("gemma4-4bit-g32")).unwrap();
    let llama = load(&tiny("llama-8bit-g32")).unwrap();
    let gemma3n = load(&tiny("gemma3n-4bit-g32")).unwrap();
    let pairs = [
        (&gemma3, &gemma4),
        (&gemma4, &gemma3),
        (&gemma3, &llama),
        (&gemma3n, &gemma4),
        (&gemma4, &gemma3n),
    ];
    for (model, other) in pairs {
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

/// Gemma 3n's `text_config` has no defaults in mlx-lm: a missing key is named, as are settings
/// that name more layers or streams than there are.
#[test]
fn gemma3n_configs_that_cannot_run_are_refused() {
    let name = "gemma3n-4bit-g32";
    let msg = config_error(name, |c| {
        c["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("laurel_rank");
    });
    assert!(msg.contains("laurel_rank"), "{msg}");
    let msg = config_error(name, |c| {
        c.as_object_mut().unwrap().remove("text_config");
    });
    assert!(msg.contains("text_config"), "{msg}");
    let msg = config_error(name, |c| c["text_config"]["altup_active_idx"] = json!(4));
    assert!(msg.contains("altup_active_idx"), "{msg}");
    let msg = config_error(name, |c| {
        c["text_config"]["activation_sparsity_pattern"] = json!([0.95])
    });
    assert!(
        msg.contains("`activation_sparsity_pattern` names 1 of 6"),
        "{msg}"
    );
    let msg = config_error(name, |c| {
        c["text_config"]["activation_sparsity_pattern"][0] = json!(1.0)
    });
    assert!(msg.contains("activation_sparsity_pattern"), "{msg}");
    let msg = config_error(name, |c| {
        c["text_config"]["intermediate_size"] = json!("wide")
    });
    assert!(msg.contains("intermediate_size"), "{msg}");
    let msg = config_error(name, |c| {
        c["text_config"]["num_kv_shared_layers"] = json!(6)
    });
    assert!(msg.contains("KV-shared layer 0"), "{msg}");
}

/// A `gemma3n` checkpoint as published carries its audio and vision towers beside the language
/// model: they are dropped, as mlx-lm's `sanitize` drops them, and the logits are the oracle's.
#[test]
fn gemma3n_towers_are_dropped() {
    let dir = edited("gemma3n-4bit-g32", |_| {});
    let towers = [
        "model.audio_tower.conformer.0.ffw_layer_start.ffw_layer_1.weight",
        "model.embed_audio.embedding_projection.weight",
        "model.embed_vision.embedding_projection.weight",
        "model.vision_tower.timm_model.conv_stem.conv.weight",
    ];
    let zeros = vec![0u8; 2 * 8 * 4];
    let views = towers.map(|name| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![8, 4], &zeros);
        (name, view.unwrap())
    });
    safetensors::serialize_to_file(views, None, &dir.path().join("towers.safetensors")).unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    let mut map: Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    for name in towers {
        map["weight_map"][name] = json!("towers.safetensors");
    }
    std::fs::write(&index, map.to_string()).unwrap();

    let (ids, want) = prompt_golden(dir.path());
    let model = load(dir.path()).unwrap();
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    let logits = model.forward(&ids, &mut cache, Logits::All).unwrap();
    let d = max_abs_diff(logits.data(), &want);
    assert!(d < 2e-3, "logits differ by {d}");
}

/// A cache's state as mlx-lm's `make_cache` lays it out for Gemma 3n (a cache for each layer
/// but the KV-shared ones, rings for the sliding-window layers), put into a fresh cache, goes on
/// as the cache it came from: the rest of the prompt gets the oracle's logits.
#[test]
fn gemma3n_cache_state_round_trips() {
    let dir = tiny("gemma3n-4bit-g32");
    let (ids, want) = prompt_golden(&dir);
    let model = load(&dir).unwrap();
    let vocab = model.info().vocab_size;
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    model.forward(&ids[..30], &mut cache, Logits::Last).unwrap();
    let states = cache.mlx_state().unwrap();
    let classes: Vec<&str> = states.iter().map(|s| s.class.as_str()).collect();
    assert_eq!(
        classes,
        [
            "RotatingKVCache",
            "RotatingKVCache",
            "KVCache",
            "RotatingKVCache"
        ]
    );
    let mut restored = model.new_cache_in(KvPrecision::F32).unwrap();
    restored.restore_mlx_state(&states).unwrap();
    let logits = model
        .forward(&ids[30..], &mut restored, Logits::All)
        .unwrap();
    let d = max_abs_diff(logits.data(), &want[30 * vocab..]);
    assert!(d < 2e-3, "logits after the restored state differ by {d}");
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
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
    // Gemma 3n's KV-shared layers read the rings of earlier layers.
    for name in ["gemma3-4bit-g64", "gemma3n-4bit-g32"] {
        truncation_within_the_ring_of(name);
    }
}

fn truncation_within_the_ring_of(name: &str) {
    let dir = tiny(name);
    let (ids, want) = prompt_golden(&dir);
    let model = load(&dir).unwrap();
    let vocab = model.info().vocab_size;
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    model.forward(&ids, &mut cache, Logits::Last).unwrap();
    cache.truncate(20).unwrap();
    let logits = model.forward(&ids[20..], &mut cache, Logits::All).unwrap();
    let d = max_abs_diff(logits.data(), &want[20 * vocab..]);
    assert!(d < 2e-3, "{name}: resumed logits differ by {d}");

    // A ring of 8 holds the 7 positions before the last one, but not 8.
    model.forward(&[1], &mut cache, Logits::Last).unwrap();
    let before = cache.offset;
    assert!(cache.truncate(before - 2).is_err());
    assert_eq!(cache.offset, before);
    cache.truncate(before - 1).unwrap();
}
