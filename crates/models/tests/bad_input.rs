//! Broken checkpoints are refused with an error that says what is wrong, never a panic.

use std::path::{Path, PathBuf};

use oxlm_models::{load, LoadError};
use serde_json::Value;

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

/// A writable copy of a tiny model directory.
fn copy_of(name: &str) -> tempfile::TempDir {
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

fn load_err(dir: &Path) -> LoadError {
    match load(dir) {
        Ok(_) => panic!("{} loaded but should not have", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn missing_directory_and_missing_weights() {
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(
        err.to_string()
            .contains("/nonexistent/model/config.json: no such file"),
        "{err}"
    );

    let dir = copy_of("llama-8bit-g32");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load_err(dir.path());
    assert!(
        matches!(err, LoadError::MissingFile(ref p) if p.ends_with("model.safetensors")),
        "{err}"
    );
}

#[test]
fn truncated_safetensors() {
    let dir = copy_of("llama-8bit-g32");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_err(dir.path());
    assert!(matches!(err, LoadError::Safetensors { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("model.safetensors: not a valid safetensors file"),
        "{err}"
    );

    std::fs::write(&path, &bytes[..5]).unwrap();
    assert!(matches!(
        load_err(dir.path()),
        LoadError::Safetensors { .. }
    ));
}

#[test]
fn header_that_lies_about_sizes() {
    let dir = copy_of("llama-8bit-g32");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    // Claim that the norm weight is twice as long as its byte range.
    let entry = header.get_mut("model.norm.weight").unwrap();
    entry["shape"] = serde_json::json!([128]);
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(header_len, b' ');
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + header_len..]);
    std::fs::write(&path, out).unwrap();
    let err = load_err(dir.path());
    assert!(matches!(err, LoadError::Safetensors { .. }), "{err}");
}

#[test]
fn config_that_does_not_match_the_weights() {
    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["hidden_size"] = 128.into());
    let err = load_err(dir.path());
    assert!(matches!(err, LoadError::TensorShape { .. }), "{err}");
    assert!(
        err.to_string().contains("model.embed_tokens.weight"),
        "{err}"
    );

    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["num_hidden_layers"] = 1.into());
    let err = load_err(dir.path());
    assert!(
        matches!(err, LoadError::UnusedTensors(ref names) if names.iter().all(|n| n.starts_with("model.layers.1."))),
        "{err}"
    );

    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["num_hidden_layers"] = 3.into());
    let err = load_err(dir.path());
    assert!(
        matches!(err, LoadError::MissingTensor(ref n) if n.starts_with("model.layers.2.")),
        "{err}"
    );

    // Bits in the config disagree with the packed weights.
    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["quantization"]["bits"] = 4.into());
    let err = load_err(dir.path());
    assert!(err.to_string().contains("4-bit, group size 32"), "{err}");
}

#[test]
fn unsupported_model_type_lists_the_supported_ones() {
    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["model_type"] = "mamba".into());
    let err = load_err(dir.path()).to_string();
    let supported = oxlm_models::supported_model_types().join(", ");
    assert_eq!(
        err,
        format!("unsupported model_type `mamba`; supported: {supported}")
    );
    assert!(supported.starts_with("llama, mistral, qwen2, qwen3, qwen3_moe, "));
    assert!(supported.contains("qwen3_5, qwen3_5_text, qwen3_5_moe"));
}

#[test]
fn an_unknown_layer_type_is_named() {
    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| {
        c["layer_types"] = serde_json::json!(["full_attention", "chunked_attention"])
    });
    let err = load_err(dir.path()).to_string();
    assert_eq!(
        err,
        "config.json: layer type `chunked_attention` (supported: full_attention, sliding_attention)"
    );
}

/// RoPE settings keyed by layer type that differ between the types: this architecture rotates
/// every layer alike, so it refuses them rather than run one kind wrong.
#[test]
fn a_rope_of_their_own_for_sliding_layers_is_refused() {
    let dir = copy_of("minicpm5-4bit-g64");
    edit_config(dir.path(), |c| {
        let local = serde_json::json!({"rope_type": "default", "rope_theta": 10000.0});
        c["rope_parameters"]["sliding_attention"] = local;
    });
    let err = load_err(dir.path()).to_string();
    assert_eq!(
        err,
        "config.json: `rope_parameters` gives sliding_attention layers a RoPE of their own, which \
         this architecture does not have"
    );
}

/// Hybrids' block kinds: unknown ones are named, a mixture block needs its settings, and a
/// Mamba-2 mixer whose heads its groups do not divide is refused before its weights are read.
#[test]
fn hybrid_block_kinds_and_shapes_are_checked() {
    let dir = copy_of("nemotron_h-4bit-g32");
    let cases = [
        (
            "hybrid_override_pattern",
            serde_json::json!("M-E*-M"),
            "config.json: `n_routed_experts` is missing",
        ),
        (
            "hybrid_override_pattern",
            serde_json::json!("M-M?-M"),
            "config.json: block `?` in `hybrid_override_pattern` (supported: M, *, -, E)",
        ),
        (
            "n_groups",
            serde_json::json!(3),
            "config.json: 8 Mamba heads cannot be grouped in 3 groups",
        ),
        (
            "time_step_limit",
            serde_json::json!([5.5, 2.0]),
            "config.json: `time_step_limit` [5.5, 2] is no range: its low bound must not exceed \
             its high",
        ),
    ];
    for (key, value, want) in cases {
        let original = std::fs::read(dir.path().join("config.json")).unwrap();
        edit_config(dir.path(), |c| c[key] = value);
        assert_eq!(load_err(dir.path()).to_string(), want);
        std::fs::write(dir.path().join("config.json"), original).unwrap();
    }
    let dir = copy_of("granitemoehybrid-4bit-g32");
    // What the fuzzer found: the clip's bounds swapped panicked in the first forward pass.
    edit_config(dir.path(), |c| {
        c["time_step_limit"] = serde_json::json!([5.5, 2.0])
    });
    assert_eq!(
        load_err(dir.path()).to_string(),
        "config.json: `time_step_limit` [5.5, 2] is no range: its low bound must not exceed its \
         high"
    );
    edit_config(dir.path(), |c| {
        c["time_step_limit"] = serde_json::json!([0.001, 100.0]);
        c["layer_types"] = serde_json::json!(["mamba", "attention", "mamba", "conv"])
    });
    assert_eq!(
        load_err(dir.path()).to_string(),
        "config.json: layer type `conv` (supported: mamba, attention)"
    );
}

#[test]
fn unsupported_quantization_mode_lists_the_supported_ones() {
    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["quantization"]["mode"] = "int8".into());
    let err = load_err(dir.path());
    assert!(
        matches!(err, LoadError::UnsupportedQuantization(_)),
        "{err}"
    );
    let err = err.to_string();
    assert!(
        err.contains("mode \"int8\"") && err.contains("supported: affine, mxfp4, nvfp4, mxfp8"),
        "{err}"
    );
}

#[test]
fn a_quantization_mode_the_arrays_do_not_have() {
    // mxfp8's bits and group size, but affine arrays: float scales, and biases left over.
    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["quantization"]["mode"] = "mxfp8".into());
    let err = load_err(dir.path());
    assert!(matches!(err, LoadError::TensorShape { .. }), "{err}");
    assert!(err.to_string().contains(".scales"), "{err}");
    // A float mode's bits and group size are its own.
    let dir = copy_of("llama-8bit-g32");
    edit_config(dir.path(), |c| c["quantization"]["mode"] = "mxfp4".into());
    let err = load_err(dir.path());
    assert!(
        matches!(err, LoadError::UnsupportedQuantization(_)),
        "{err}"
    );
    assert!(err.to_string().contains("mxfp4 takes 4 bits"), "{err}");
}

#[test]
fn malformed_config_json() {
    let dir = copy_of("llama-8bit-g32");
    std::fs::write(
        dir.path().join("config.json"),
        "{\"model_type\": \"llama\",",
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(matches!(err, LoadError::Json { .. }), "{err}");
    assert!(
        err.to_string().contains("config.json: malformed JSON"),
        "{err}"
    );
}

/// Sets the text model's `key`: in `text_config` where the config nests one.
fn set_text(config: &mut Value, key: &str, value: Value) {
    match config.get("text_config") {
        Some(_) => config["text_config"][key] = value,
        None => config[key] = value,
    }
}

/// Configs that used to abort, hang or load into garbage: an impossible layer count or head
/// size, a `config.json` that is a FIFO, and a non-positive norm epsilon or RoPE base. Each is an error
/// naming the cause, for every architecture that reads the key.
#[test]
fn impossible_configs_are_refused() {
    for model in ["llama-8bit-g32", "gemma4-4bit-g32", "qwen3_5-4bit-g64"] {
        let dir = copy_of(model);
        edit_config(dir.path(), |c| {
            set_text(c, "num_hidden_layers", (1u64 << 40).into())
        });
        let err = load_err(dir.path());
        assert!(
            err.to_string()
                .contains("`num_hidden_layers` is 1099511627776"),
            "{model}: {err}"
        );
    }
    for (model, key) in [
        ("llama-8bit-g32", "head_dim"),
        ("gemma4-4bit-g32", "global_head_dim"),
        ("qwen3_5-4bit-g64", "head_dim"),
    ] {
        let dir = copy_of(model);
        edit_config(dir.path(), |c| set_text(c, key, (1u64 << 30).into()));
        let err = load_err(dir.path());
        assert!(
            err.to_string().contains(&format!(
                "`{key}` is 1073741824, but no weight has a dimension that large"
            )),
            "{model}: {err}"
        );
    }
    for (model, key, value) in [
        ("llama-8bit-g32", "rms_norm_eps", 0.0),
        ("llama-8bit-g32", "rms_norm_eps", -1e-6),
        ("llama-8bit-g32", "rope_theta", -10000.0),
        ("gemma3-4bit-g64", "rope_theta", 0.0),
        ("qwen3_5-4bit-g64", "rms_norm_eps", 0.0),
    ] {
        let dir = copy_of(model);
        edit_config(dir.path(), |c| set_text(c, key, value.into()));
        let err = load_err(dir.path());
        assert!(
            err.to_string()
                .contains(&format!("`{key}` must be a positive number")),
            "{model} {key}={value}: {err}"
        );
    }
    let dir = copy_of("llama-8bit-g32");
    let config = dir.path().join("config.json");
    std::fs::remove_file(&config).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&config)
        .status()
        .unwrap();
    assert!(made.success());
    let err = load_err(dir.path());
    assert!(err.to_string().contains("not a regular file"), "{err}");
}
