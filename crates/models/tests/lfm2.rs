//! LFM2 and LFM2-MoE on their tiny fixtures (made by scripts/oracle/make_tiny_models.py): the
//! short convolutions' cache reaches the same state by a prefill, by chunks and token by token,
//! cannot go back (snapshots resume instead), refuses caches of another shape; Hugging Face's
//! layouts and mlx-lm's `lfm2-vl` wrapper load the same models; configs that would not build are
//! refused with a reason.

mod recurrent_fixtures;

use std::path::Path;

use oxlm_engine::{Device, KvPrecision};
use oxlm_models::cache::{Cache, LayerCache, RecurrentCache};
use oxlm_models::{load, ForwardError, LanguageModel, LoadError, Logits, TruncateError};
use recurrent_fixtures::{max_abs_diff, sequence, tiny, TOLERANCE};
use serde_json::{json, Map, Value};

const MODELS: [&str; 3] = ["lfm2-4bit-g64", "lfm2-8bit-g32", "lfm2_moe-4bit-g64"];

/// Largest difference between the convolutions' states of two caches of one model.
fn conv_state_diff(a: &Cache, b: &Cache) -> f32 {
    assert_eq!(a.offset, b.offset);
    let mut worst = 0.0f32;
    for (x, y) in a.layers.iter().zip(&b.layers) {
        if let (LayerCache::Recurrent(x), LayerCache::Recurrent(y)) = (x, y) {
            worst = worst.max(max_abs_diff(x.conv.data(), y.conv.data()));
        }
    }
    worst
}

fn last_logits(model: &dyn LanguageModel, tokens: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    model
        .forward(tokens, &mut cache, Logits::Last)
        .unwrap()
        .into_data()
}

#[test]
fn prefill_and_single_token_steps_reach_the_same_state_and_logits() {
    for name in MODELS {
        let model = load(&tiny(name)).unwrap();
        let tokens = sequence(name);
        let vocab = model.info().vocab_size;

        let mut prefilled = model.new_cache_in(KvPrecision::F32).unwrap();
        let all = model.forward(&tokens, &mut prefilled, Logits::All).unwrap();
        let convs = prefilled.layers.iter();
        let convs = convs.filter(|l| matches!(l, LayerCache::Recurrent(_)));
        assert!(convs.count() >= 2, "{name}");

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
        let state = conv_state_diff(&prefilled, &stepped);
        assert!(state < TOLERANCE, "{name}: states differ by {state}");
        assert_eq!(stepped.offset, tokens.len());
    }
}

#[test]
fn prefill_in_chunks_equals_one_prefill() {
    let name = "lfm2-4bit-g64";
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    let mut whole = model.new_cache_in(KvPrecision::F32).unwrap();
    let expected = model.forward(&tokens, &mut whole, Logits::Last).unwrap();
    // chunks shorter and longer than the convolution's kernel of 3
    let mut chunked = model.new_cache_in(KvPrecision::F32).unwrap();
    let mut logits = None;
    for chunk in [&tokens[..1], &tokens[1..3]]
        .into_iter()
        .chain(tokens[3..].chunks(17))
    {
        logits = Some(model.forward(chunk, &mut chunked, Logits::Last).unwrap());
    }
    let d = max_abs_diff(logits.unwrap().data(), expected.data());
    assert!(d < TOLERANCE, "logits differ by {d}");
    assert!(conv_state_diff(&whole, &chunked) < TOLERANCE);
}

#[test]
fn the_cache_cannot_go_back_but_a_snapshot_can() {
    // Layer 0 attends, layer 1 is the first short convolution.
    let name = "lfm2-8bit-g32";
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    let (prefix, rest) = tokens.split_at(20);

    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    model.forward(prefix, &mut cache, Logits::Last).unwrap();
    let snapshot = cache.clone();
    model.forward(&rest[..5], &mut cache, Logits::Last).unwrap();

    let before = cache.clone();
    let err = cache.truncate(20).unwrap_err();
    assert_eq!(
        err,
        TruncateError {
            layer: 1,
            offset: 25,
            len: 20
        }
    );
    assert_eq!(conv_state_diff(&cache, &before), 0.0);
    assert_eq!(cache.offset, 25);

    // The snapshot resumes the prefix with another continuation, as a fresh run would.
    let mut resumed = snapshot.clone();
    let got = model
        .forward(&rest[7..12], &mut resumed, Logits::Last)
        .unwrap();
    let mut input = prefix.to_vec();
    input.extend_from_slice(&rest[7..12]);
    let want = last_logits(model.as_ref(), &input);
    assert!(max_abs_diff(got.data(), &want) < TOLERANCE);
    assert_eq!(resumed.offset, 25);
}

#[test]
fn a_cache_of_another_shape_is_refused_untouched() {
    let model = load(&tiny("lfm2-4bit-g64")).unwrap();
    let other = load(&tiny("lfm2-8bit-g32")).unwrap();
    let mut foreign = other.new_cache_in(KvPrecision::F32).unwrap();
    assert_eq!(
        model
            .forward(&[1, 2], &mut foreign, Logits::Last)
            .unwrap_err(),
        ForwardError::CacheMismatch
    );
    // A convolution state of a wider kernel in one layer; the attention layer before it is
    // left as it was too.
    let mut cache = model.new_cache_in(KvPrecision::F32).unwrap();
    cache.layers[3] =
        LayerCache::Recurrent(RecurrentCache::conv_only(64, 4, &Device::Cpu).unwrap());
    assert_eq!(
        model
            .forward(&[1, 2], &mut cache, Logits::Last)
            .unwrap_err(),
        ForwardError::CacheMismatch
    );
    assert_eq!(cache.offset, 0);
    assert!(matches!(&cache.layers[2], LayerCache::Kv(kv) if kv.is_empty()));
}

/// A writable copy of a tiny model directory.
fn copy(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(tiny(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

/// Rewrites the header of `dir`'s model.safetensors (names, shapes) with `edit`, which may also
/// append bytes to the data for arrays it adds.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Map<String, Value>, &mut Vec<u8>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    edit(&mut header, &mut data);
    let mut text = serde_json::to_vec(&header).unwrap();
    // The data stays 8-byte aligned, as safetensors writers keep it.
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

/// Hugging Face stores the convolution weights `[hidden, 1, kernel]`, which mlx-lm's
/// `sanitize` transposes: the same values, in the same order.
#[test]
fn the_hugging_face_conv_layout_loads_the_same_model() {
    let name = "lfm2-8bit-g32";
    let dir = copy(name);
    let mut rewritten = 0;
    edit_weights(dir.path(), |header, _| {
        for (key, info) in header.iter_mut() {
            if key.ends_with("conv.conv.weight") {
                assert_eq!(info["shape"], json!([64, 3, 1]));
                info["shape"] = json!([64, 1, 3]);
                rewritten += 1;
            }
        }
    });
    assert_eq!(rewritten, 2);
    let hf = load(dir.path()).unwrap();
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    assert_eq!(
        last_logits(hf.as_ref(), &tokens),
        last_logits(model.as_ref(), &tokens)
    );

    // Any other shape is named in the error.
    edit_weights(dir.path(), |header, _| {
        header["model.layers.1.conv.conv.weight"]["shape"] = json!([64, 3]);
    });
    let err = load(dir.path()).err().expect("a 2-D convolution weight");
    assert!(
        err.to_string().contains("model.layers.1.conv.conv.weight"),
        "{err}"
    );
}

/// Hugging Face's LFM2-MoE names the feed-forwards' weights `w1`, `w3` and `w2` and keeps one
/// module per expert, which mlx-lm's `sanitize` renames and stacks. (Its `.scales` keep the
/// stacked names here: a Hugging Face checkpoint is not quantized, and mlx-lm renames only the
/// `.weight`s.)
#[test]
fn the_hugging_face_moe_layout_loads_the_same_model() {
    let name = "lfm2_moe-4bit-g64";
    let dir = copy(name);
    let experts = 4;
    edit_weights(dir.path(), |header, _| {
        let names: Vec<String> = header.keys().cloned().collect();
        for name in names {
            let Some(rest) = name.split_once(".switch_mlp.") else {
                continue;
            };
            let info = header.remove(&name).unwrap();
            let shape: Vec<u64> = serde_json::from_value(info["shape"].clone()).unwrap();
            let offsets: Vec<u64> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
            let size = (offsets[1] - offsets[0]) / experts;
            for e in 0..experts {
                let start = offsets[0] + e * size;
                let mut each = info.clone();
                each["shape"] = json!(shape[1..]);
                each["data_offsets"] = json!([start, start + size]);
                header.insert(format!("{}.experts.{e}.{}", rest.0, rest.1), each);
            }
        }
        let names: Vec<String> = header.keys().cloned().collect();
        for name in names {
            let renamed = [("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")]
                .iter()
                .find_map(|(new, old)| {
                    let stem = name.strip_suffix(&format!(".{new}.weight"))?;
                    Some(format!("{stem}.{old}.weight"))
                });
            if let Some(renamed) = renamed {
                let info = header.remove(&name).unwrap();
                header.insert(renamed, info);
            }
        }
        assert!(header.contains_key("model.layers.0.feed_forward.w1.weight"));
        assert!(header.contains_key("model.layers.3.feed_forward.experts.3.w2.weight"));
    });
    let hf = load(dir.path()).unwrap();
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    assert_eq!(
        last_logits(hf.as_ref(), &tokens),
        last_logits(model.as_ref(), &tokens)
    );
}

/// mlx-lm's `lfm2-vl`: the text model under `language_model.`, its settings in `text_config`,
/// beside a vision tower and a projector that are dropped.
#[test]
fn the_lfm2_vl_wrapper_reads_its_text_model() {
    let name = "lfm2-4bit-g64";
    let dir = copy(name);
    edit_weights(dir.path(), |header, data| {
        let names: Vec<String> = header
            .keys()
            .filter(|k| *k != "__metadata__")
            .cloned()
            .collect();
        for name in names {
            let info = header.remove(&name).unwrap();
            header.insert(format!("language_model.{name}"), info);
        }
        for extra in [
            "vision_tower.patch_embedding.weight",
            "multi_modal_projector.linear_1.weight",
        ] {
            let start = data.len();
            data.extend([0u8; 8]);
            let offsets = json!([start, start + 8]);
            let info = json!({"dtype": "F32", "shape": [2], "data_offsets": offsets});
            header.insert(extra.into(), info);
        }
    });
    edit_config(dir.path(), |c| {
        let Value::Object(text) = c.clone() else {
            unreachable!()
        };
        let quantization = c["quantization"].clone();
        *c = json!({
            "model_type": "lfm2-vl",
            "text_config": Value::Object(text),
            "vision_config": {"model_type": "siglip2_vision_model"},
            "quantization": quantization,
        });
    });
    let vl = load(dir.path()).unwrap();
    let model = load(&tiny(name)).unwrap();
    let tokens = sequence(name);
    assert_eq!(
        last_logits(vl.as_ref(), &tokens),
        last_logits(model.as_ref(), &tokens)
    );
    assert_eq!(vl.info().model_type, "lfm2-vl");
    let blocks = vl.adaptable().unwrap().blocks_path();
    assert_eq!(blocks, "language_model.model.layers");
}

fn load_err(dir: &Path) -> LoadError {
    match load(dir) {
        Ok(_) => panic!("{} loaded but should not have", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn bad_configs_are_refused_with_a_reason() {
    // (what, fixture, config edit, a phrase the error must contain)
    type Case = (&'static str, &'static str, fn(&mut Value), &'static str);
    let cases: [Case; 14] = [
        (
            "block_dim",
            "lfm2-4bit-g64",
            |c| c["block_dim"] = 128.into(),
            "`block_dim` 128 differs from `hidden_size` 64",
        ),
        (
            "layer type",
            "lfm2-4bit-g64",
            |c| c["layer_types"][1] = "sliding_attention".into(),
            "layer type `sliding_attention` (supported: conv, full_attention)",
        ),
        (
            "layer_types length",
            "lfm2-4bit-g64",
            |c| c["layer_types"] = json!(["conv", "full_attention"]),
            "`layer_types` has 2 entries for 6 layers",
        ),
        (
            "disagreeing lists",
            "lfm2-4bit-g64",
            |c| c["full_attn_idxs"] = json!([2, 5]),
            "place the attention layers differently",
        ),
        (
            "index out of range",
            "lfm2-8bit-g32",
            |c| c["full_attn_idxs"] = json!([0, 4]),
            "`full_attn_idxs` names layer 4 of a model of 4 layers",
        ),
        (
            "no layer placement",
            "lfm2-8bit-g32",
            |c| _ = c.as_object_mut().unwrap().remove("full_attn_idxs"),
            "neither `full_attn_idxs` nor `layer_types`",
        ),
        (
            "no width",
            "lfm2-8bit-g32",
            |c| _ = c.as_object_mut().unwrap().remove("intermediate_size"),
            "either `block_ff_dim` or `intermediate_size`",
        ),
        (
            "kernel 0",
            "lfm2-8bit-g32",
            |c| c["conv_L_cache"] = 0.into(),
            "`conv_L_cache` must be positive",
        ),
        (
            "kv heads",
            "lfm2-4bit-g64",
            |c| c["num_key_value_heads"] = 3.into(),
            "4 attention heads cannot be grouped over 3 key/value heads",
        ),
        (
            "odd heads",
            "lfm2-4bit-g64",
            |c| {
                c["num_attention_heads"] = 64.into();
                c["num_key_value_heads"] = 64.into();
            },
            "RoPE needs an even number",
        ),
        (
            "missing key",
            "lfm2-4bit-g64",
            |c| _ = c.as_object_mut().unwrap().remove("conv_bias"),
            "conv_bias",
        ),
        (
            "missing LFM2 key",
            "lfm2-4bit-g64",
            |c| _ = c.as_object_mut().unwrap().remove("block_multiple_of"),
            "`block_multiple_of` is missing",
        ),
        (
            "missing LFM2-MoE key",
            "lfm2_moe-4bit-g64",
            |c| _ = c.as_object_mut().unwrap().remove("num_dense_layers"),
            "`num_dense_layers` is missing",
        ),
        (
            "experts per token",
            "lfm2_moe-4bit-g64",
            |c| c["num_experts_per_tok"] = 5.into(),
            "5 experts per token of 4",
        ),
    ];
    for (what, name, edit, expected) in cases {
        let dir = copy(name);
        edit_config(dir.path(), edit);
        let err = load_err(dir.path()).to_string();
        assert!(err.contains(expected), "{what}: {err}");
    }
}
