//! config.json and generation_config.json from a GGUF's hyper-parameters: the three real GGUFs
//! against the configs of the models scripts/models/fetch_models.sh built from them
//! (scripts/models/gguf_to_hf.py), and synthetic files for the cases those do not have.

mod common;

use common::{cached, real_gguf, write_gguf, Meta};
use oxlm_convert::gguf::config::{generation_config, hf_config};
use oxlm_convert::gguf::GgufFile;
use serde_json::{json, Value};

fn read_json(relative: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(cached(relative)).unwrap()).unwrap()
}

/// Ids as a list, whether the config gives one or several.
fn ids(v: &Value) -> Vec<u64> {
    match v {
        Value::Array(list) => list.iter().map(|i| i.as_u64().unwrap()).collect(),
        v => v.as_u64().into_iter().collect(),
    }
}

/// The same model: every key of the built model's config.json but its quantization, with the
/// same value, and no other key. The one exception is `eos_token_id`: the file names one token,
/// and gguf_to_hf.py was told Qwen2.5's two (`--eos-ids`), so the file's must be among them.
fn same_model(gguf_name: &str, model_dir: &str) {
    let gguf = real_gguf(gguf_name);
    let ours = hf_config(&gguf).unwrap();
    let mut reference = read_json(&format!("models/{model_dir}/config.json"));
    let reference = reference.as_object_mut().unwrap();
    reference.remove("quantization");
    reference.remove("quantization_config");
    let eos = ids(&reference.remove("eos_token_id").unwrap());
    let mut ours = ours.as_object().unwrap().clone();
    let our_eos = ids(&ours.remove("eos_token_id").unwrap());
    assert!(
        our_eos.len() == 1 && eos.contains(&our_eos[0]),
        "{gguf_name}: eos {our_eos:?}, the model's {eos:?}"
    );
    let keys = |m: &serde_json::Map<String, Value>| {
        m.keys().cloned().collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(keys(&ours), keys(reference), "{gguf_name}");
    for (key, want) in reference.iter() {
        let got = &ours[key];
        let same = match (got.as_f64(), want.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => got == want,
        };
        assert!(same, "{gguf_name}: {key} is {got}, the model's {want}");
    }

    // generation_config.json: the model's special ids, and every eos it stops at among ours.
    let reference = read_json(&format!("models/{model_dir}/generation_config.json"));
    let ours = generation_config(&gguf).unwrap();
    for key in ["bos_token_id", "pad_token_id"] {
        assert_eq!(ours[key], reference[key], "{gguf_name} {key}");
    }
    let our_eos = ids(&ours["eos_token_id"]);
    for id in ids(&reference["eos_token_id"]) {
        assert!(
            our_eos.contains(&id),
            "{gguf_name}: eos {our_eos:?} lacks {id}"
        );
    }
}

#[test]
fn smollm2_is_the_built_model() {
    same_model(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-instruct-4bit",
    );
}

#[test]
fn qwen25_is_the_built_model() {
    same_model(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-0.5b-instruct-4bit",
    );
}

#[test]
fn gemma3_is_the_built_model() {
    same_model("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-4bit");
}

/// llama.cpp's end-of-generation tokens: the eos, then the control tokens it stops at by name.
#[test]
fn generation_stops_where_llama_cpp_stops() {
    for (name, eos) in [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", json!([2, 0])),
        (
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            json!([151645, 151643]),
        ),
        ("gemma-3-270m-q4_k_m.gguf", json!([1, 106])),
    ] {
        let config = generation_config(&real_gguf(name)).unwrap();
        assert_eq!(config["eos_token_id"], eos, "{name}");
    }
}

/// A llama whose hyper-parameters are those of SmolLM2-135M, plus `extra`.
fn llama_gguf<'a>(extra: &[(&'a str, Meta<'a>)], tensors: &[(&str, &[usize], &[f32])]) -> GgufFile {
    let mut meta = vec![
        ("general.architecture", Meta::Str("llama")),
        ("llama.block_count", Meta::U32(30)),
        ("llama.context_length", Meta::U32(8192)),
        ("llama.embedding_length", Meta::U32(576)),
        ("llama.feed_forward_length", Meta::U32(1536)),
        ("llama.attention.head_count", Meta::U32(9)),
        ("llama.attention.head_count_kv", Meta::U32(3)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("llama.vocab_size", Meta::U32(49152)),
    ];
    meta.extend_from_slice(extra);
    write_gguf(&meta, tensors)
}

fn llama<'a>(extra: &[(&'a str, Meta<'a>)], tensors: &[(&str, &[usize], &[f32])]) -> Value {
    hf_config(&llama_gguf(extra, tensors)).unwrap()
}

#[test]
fn defaults_and_untied_heads() {
    let config = llama(&[], &[("output.weight", &[1, 8], &[0.0; 8])]);
    assert_eq!(config["tie_word_embeddings"], false);
    assert_eq!(config["vocab_size"], 49152);
    assert_eq!(config["rope_theta"], 10000.0);
    assert_eq!(config["head_dim"], 64);
    assert_eq!(config["rms_norm_eps"], 1e-5);
    assert!(config.get("rope_scaling").is_none());
}

#[test]
fn rope_scaling_keys_become_rope_scaling() {
    let config = llama(
        &[
            ("llama.rope.scaling.type", Meta::Str("yarn")),
            ("llama.rope.scaling.factor", Meta::F32(4.0)),
            (
                "llama.rope.scaling.original_context_length",
                Meta::U32(32768),
            ),
        ],
        &[],
    );
    assert_eq!(
        config["rope_scaling"],
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    );
    let config = llama(&[("llama.rope.dimension_count", Meta::U32(32))], &[]);
    assert_eq!(config["partial_rotary_factor"], 0.5);
}

/// Llama 3.2's 32× scaling over 64 features of base 500000, which the file keeps as factors.
#[test]
fn llama3_scaling_is_recovered_from_its_factors() {
    let (dims, theta, factor) = (64usize, 500_000f64, 32f64);
    let factors: Vec<f32> = (0..dims / 2)
        .map(|i| {
            let wavelen = 2.0 * std::f64::consts::PI * theta.powf(2.0 * i as f64 / dims as f64);
            let smooth = (8192.0 / wavelen - 1.0) / 3.0;
            match wavelen {
                w if w < 2048.0 => 1.0,
                w if w > 8192.0 => factor,
                _ => 1.0 / ((1.0 - smooth) / factor + smooth),
            }
        })
        .map(|f| f as f32)
        .collect();
    let meta = [
        ("llama.rope.freq_base", Meta::F32(theta as f32)),
        ("llama.attention.key_length", Meta::U32(dims as u32)),
    ];
    let config = llama(&meta, &[("rope_freqs.weight", &[dims / 2], &factors)]);
    assert_eq!(
        config["rope_scaling"],
        json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    );

    let mut other = factors.clone();
    other[dims / 4] *= 1.5;
    let gguf = llama_gguf(&meta, &[("rope_freqs.weight", &[dims / 2], &other)]);
    let err = hf_config(&gguf).err().unwrap().to_string();
    assert!(
        err.contains("metadata `rope_freqs.weight`: factor 16 is"),
        "{err}"
    );
}

#[test]
fn an_unknown_architecture_is_an_error_listing_the_known_ones() {
    let gguf = write_gguf(&[("general.architecture", Meta::Str("mamba"))], &[]);
    let err = hf_config(&gguf).err().unwrap().to_string();
    assert!(
        err.contains(
            "`general.architecture`: `mamba` is not supported (supported: llama, qwen2, qwen3, gemma3)"
        ),
        "{err}"
    );
}

#[test]
fn a_missing_hyper_parameter_is_an_error_naming_the_key() {
    let gguf = write_gguf(
        &[
            ("general.architecture", Meta::Str("qwen2")),
            ("qwen2.embedding_length", Meta::U32(896)),
        ],
        &[],
    );
    let err = hf_config(&gguf).err().unwrap().to_string();
    assert!(
        err.contains("`qwen2.attention.head_count`: missing"),
        "{err}"
    );
    let gguf = write_gguf(
        &[
            ("general.architecture", Meta::Str("qwen2")),
            ("qwen2.embedding_length", Meta::Str("896")),
        ],
        &[],
    );
    let err = hf_config(&gguf).err().unwrap().to_string();
    assert!(
        err.contains("`qwen2.embedding_length`: not an unsigned integer"),
        "{err}"
    );
}
