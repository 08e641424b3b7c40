//! Qwen3.5's recurrent cache on the tiny fixtures (made by scripts/oracle/make_tiny_qwen3_5.py):
//! a prefill and the same tokens one at a time reach the same state, chunking does not matter,
//! the cache refuses to go back and snapshots (clones) are the way to resume from a prefix.

mod recurrent_fixtures;

use std::path::Path;

use oxlm_engine::KvPrecision;
use oxlm_models::cache::{Cache, LayerCache};
use oxlm_models::{load, ForwardError, LanguageModel, LoadError, Logits, TruncateError};
use recurrent_fixtures::{max_abs_diff, sequence, tiny, TOLERANCE};
use serde_json::Value;

const MODELS: [&str; 3] = [
    "qwen3_5-4bit-g64",
    "qwen3_5-8bit-g32",
    "qwen3_5_moe-4bit-g64",
];

/// Largest difference between two caches of the same model, layer by layer.
fn cache_diff(a: &Cache, b: &Cache) -> f32 {
    assert_eq!(a.offset, b.offset);
    assert_eq!(a.layers.len(), b.layers.len());
    let mut worst = 0.0f32;
    for (x, y) in a.layers.iter().zip(&b.layers) {
        let d = match (x, y) {
            (LayerCache::Recurrent(x), LayerCache::Recurrent(y)) => {
                max_abs_diff(x.conv.data(), y.conv.data())
                    .max(max_abs_diff(x.state.data(), y.state.data()))
            }
            (LayerCache::Kv(x), LayerCache::Kv(y)) => {
                let (x, y) = (x.view(), y.view());
                assert_eq!((x.end, x.kv_heads), (y.end, y.kv_heads));
                let d = x.keys.len() / (x.kv_heads * x.capacity);
                let filled = |v: &[f32], cap: usize| -> Vec<f32> {
                    (0..x.kv_heads)
                        .flat_map(|h| v[h * cap * d..][..x.end * d].to_vec())
                        .collect()
                };
                let host = |b: &oxlm_engine::KvRing| b.to_vec().unwrap();
                let (xk, yk) = (host(x.keys), host(y.keys));
                let (xv, yv) = (host(x.values), host(y.values));
                max_abs_diff(&filled(&xk, x.capacity), &filled(&yk, y.capacity)).max(max_abs_diff(
                    &filled(&xv, x.capacity),
                    &filled(&yv, y.capacity),
                ))
            }
            _ => panic!("layer kinds differ"),
        };
        worst = worst.max(d);
    }
    worst
}

fn recurrent_layers(cache: &Cache) -> usize {
    cache
        .layers
        .iter()
        .filter(|l| matches!(l, LayerCache::Recurrent(_)))
        .count()
}

#[test]
fn prefill_and_single_token_steps_reach_the_same_state_and_logits() {
    for name in MODELS {
        let model = load(&tiny(name)).unwrap();
        let tokens = sequence(name);
        let vocab = model.info().vocab_size;

        let mut prefilled = model.new_cache_in(KvPrecision::F32).unwrap();
        let all = model.forward(&tokens, &mut prefilled, Logits::All).unwrap();
        assert!(recurrent_layers(&prefilled) >= 2, "{name}");

        let mut stepped = model.new_cache_in(KvPrecision::F32).unwrap();
        let mut worst = 0.0f32;
        for (t, &token) in tokens.iter().enumerate() {
            let logits = model.forward(&[token], &mut stepped, Logits::Last).unwrap();
            worst = worst.max(max_abs_diff(
                logits.data(),
                &all.data()[t * vocab..(t + 1) * vocab],
            ));
        }
        assert!(worst < TOLERANCE, "{name}: logits differ by {worst}");
        let state = cache_diff(&prefilled, &stepped);
        assert!(state < TOLERANCE, "{name}: states differ by {state}");
        assert_eq!(stepped.offset, tokens.len());
    }
}

#[test]
fn prefill_in_chunks_equals_one_prefill() {
    let name = "qwen3_5-4bit-g64";
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    let mut whole = model.new_cache_in(KvPrecision::F32).unwrap();
    let expected = model.forward(&tokens, &mut whole, Logits::Last).unwrap();
    // chunks shorter and longer than the convolution's kernel of 4
    let mut chunked = model.new_cache_in(KvPrecision::F32).unwrap();
    let mut logits = None;
    for chunk in tokens.chunks(3).take(2).chain(tokens[6..].chunks(17)) {
        logits = Some(model.forward(chunk, &mut chunked, Logits::Last).unwrap());
    }
    let d = max_abs_diff(logits.unwrap().data(), expected.data());
    assert!(d < TOLERANCE, "logits differ by {d}");
    assert!(cache_diff(&whole, &chunked) < TOLERANCE);
}

#[test]
fn the_cache_cannot_go_back_but_a_snapshot_can() {
    let name = "qwen3_5-8bit-g32";
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    let (prefix, rest) = tokens.split_at(20);

    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    model.forward(prefix, &mut cache, Logits::Last).unwrap();
    let snapshot = cache.clone();
    model.forward(&rest[..5], &mut cache, Logits::Last).unwrap();

    // Going back is refused and changes nothing; staying put or "forward" is fine.
    let before = cache.clone();
    let err = cache.truncate(20).unwrap_err();
    assert_eq!(
        err,
        TruncateError {
            layer: 0,
            offset: 25,
            len: 20
        }
    );
    assert!(err.to_string().contains("clone"), "{err}");
    assert_eq!(cache_diff(&cache, &before), 0.0);
    assert!(cache.truncate(25).is_ok() && cache.truncate(100).is_ok());
    assert_eq!(cache.offset, 25);

    // The snapshot resumes the prefix with another continuation, as a fresh run would.
    let mut resumed = snapshot.clone();
    let got = model
        .forward(&rest[7..12], &mut resumed, Logits::Last)
        .unwrap();
    let mut fresh = model.new_cache_in(KvPrecision::F32).unwrap();
    let mut input = prefix.to_vec();
    input.extend_from_slice(&rest[7..12]);
    let want = model.forward(&input, &mut fresh, Logits::Last).unwrap();
    assert!(max_abs_diff(got.data(), want.data()) < TOLERANCE);
    assert_eq!(resumed.offset, 25);
}

#[test]
fn a_cache_of_another_shape_is_refused_untouched() {
    let model = load(&tiny("qwen3_5-4bit-g64")).unwrap();
    let mut empty = Cache::new(Vec::new());
    assert_eq!(
        model
            .forward(&[1, 2], &mut empty, Logits::Last)
            .unwrap_err(),
        ForwardError::CacheMismatch
    );
    let other = load(&tiny("qwen3_5-8bit-g32")).unwrap();
    let mut foreign = other.new_cache_in(KvPrecision::F32).unwrap();
    assert_eq!(
        model
            .forward(&[1, 2], &mut foreign, Logits::Last)
            .unwrap_err(),
        ForwardError::CacheMismatch
    );
    assert_eq!(foreign.offset, 0);
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
    std::fs::write(path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    tmp
}

fn load_err(dir: &Path) -> LoadError {
    match load(dir) {
        Ok(_) => panic!("{} loaded but should not have", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn text_only_model_type_reads_the_same_checkpoint() {
    let name = "qwen3_5-8bit-g32";
    let dir = edited(name, |c| c["model_type"] = "qwen3_5_text".into());
    let text: Box<dyn LanguageModel> = load(dir.path()).unwrap();
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    let a = text
        .forward(
            &tokens,
            &mut text.new_cache_in(KvPrecision::F32).unwrap(),
            Logits::Last,
        )
        .unwrap();
    let b = model
        .forward(
            &tokens,
            &mut model.new_cache_in(KvPrecision::F32).unwrap(),
            Logits::Last,
        )
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(text.info().model_type, "qwen3_5_text");
}

#[test]
fn bad_configs_are_refused_with_a_reason() {
    let name = "qwen3_5-4bit-g64";
    // (what, config edit, a phrase the error must contain)
    type Case = (&'static str, fn(&mut Value), &'static str);
    let cases: [Case; 5] = [
        (
            "layer_types",
            |c| c["text_config"]["layer_types"][0] = "full_attention".into(),
            "layer_types",
        ),
        (
            "interval 0",
            |c| c["text_config"]["full_attention_interval"] = 0.into(),
            "full_attention_interval",
        ),
        (
            "value heads",
            |c| c["text_config"]["linear_num_value_heads"] = 3.into(),
            "linear value heads",
        ),
        (
            "odd rotary",
            |c| c["text_config"]["rope_parameters"]["partial_rotary_factor"] = 0.1.into(),
            "rotated features",
        ),
        (
            "interval 2",
            |c| {
                c["text_config"]["full_attention_interval"] = 2.into();
                c["text_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("layer_types");
            },
            "self_attn",
        ),
    ];
    for (what, edit, expected) in cases {
        let dir = edited(name, edit);
        let err = load_err(dir.path()).to_string();
        assert!(err.contains(expected), "{what}: {err}");
    }
}
