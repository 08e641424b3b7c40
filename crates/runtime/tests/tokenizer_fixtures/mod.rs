//! Tokenizer directories shared by the tokenizer and detokenizer tests. The expected values in those tests
//! come from transformers 5.24 / mlx-lm 0.32.2 run on exactly these directories.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The tiny byte-level BPE tokenizer (512 tokens).
pub fn tiny_tokenizer_dir() -> PathBuf {
    fixtures().join("tiny/tokenizer")
}

pub fn tiny_tokenizer_json() -> Value {
    read_json(&tiny_tokenizer_dir().join("tokenizer.json"))
}

pub fn tiny_tokenizer_config() -> Value {
    read_json(&tiny_tokenizer_dir().join("tokenizer_config.json"))
}

pub fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A tiny SentencePiece-style tokenizer.json as Llama 2 / Mistral ship them: BPE with byte fallback, the
/// legacy `Prepend("▁")` + `Replace(" ", "▁")` normalizer, a BOS post-processor, and the SPM decoder.
/// Ids: 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3..=258 `<0x00>`..`<0xFF>`, 259 `▁`, 260.. single letters, then merges
/// (278 `▁hello`, 283 `▁world`, 284 `▁▁`).
pub fn spm_tokenizer_json() -> Value {
    let mut vocab: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    vocab.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
    vocab.extend("\u{2581}abcdehilnorstw".chars().map(String::from));
    let merges = [
        ("\u{2581}", "h"),
        ("e", "l"),
        ("el", "l"),
        ("ell", "o"),
        ("\u{2581}h", "ello"),
        ("\u{2581}", "w"),
        ("o", "r"),
        ("or", "l"),
        ("orl", "d"),
        ("\u{2581}w", "orld"),
        ("\u{2581}", "\u{2581}"),
    ];
    vocab.extend(merges.iter().map(|(a, b)| format!("{a}{b}")));
    let added: Vec<Value> = ["<unk>", "<s>", "</s>"]
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let vocab: serde_json::Map<String, Value> = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, json!(i)))
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
    })
}

/// tokenizer_config.json of a Llama-2-style checkpoint.
pub fn spm_tokenizer_config() -> Value {
    json!({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "legacy": true})
}

/// Writes a model directory (tokenizer.json, tokenizer_config.json and, with a model type, config.json) under
/// the test binary's scratch directory.
pub fn model_dir(
    name: &str,
    tokenizer: &Value,
    config: &Value,
    model_type: Option<&str>,
) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let model_config = dir.join("config.json");
    match model_type {
        Some(t) => std::fs::write(&model_config, json!({"model_type": t}).to_string()).unwrap(),
        None if model_config.exists() => std::fs::remove_file(&model_config).unwrap(),
        None => {}
    }
    dir
}
