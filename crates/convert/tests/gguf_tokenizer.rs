//! The tokenizer.json built from a GGUF's vocabulary, loaded by the `tokenizers` library the
//! runtime uses, against transformers' own GGUF tokenizer (tests/fixtures/gguf/tokenizer_goldens.json,
//! from scripts/oracle/make_gguf_tokenizer_goldens.py) on the three real GGUFs; and the errors of
//! files it cannot convert.

mod common;

use std::path::Path;
use std::str::FromStr;

use common::{real_gguf, write_gguf, Meta};
use oxlm_convert::gguf::tokenizer::tokenizer_files;
use oxlm_convert::gguf::GgufFile;
use serde_json::Value;
use tokenizers::Tokenizer;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn load(gguf: &GgufFile) -> Tokenizer {
    let files = tokenizer_files(gguf).unwrap();
    Tokenizer::from_str(&files.tokenizer_json.to_string()).unwrap()
}

/// Every corpus string encodes (with and without special tokens) to transformers' ids, and
/// transformers' ids decode (with and without special tokens) to its text.
fn matches_transformers(name: &str) {
    let gguf = real_gguf(name);
    let goldens = &fixture("tokenizer_goldens.json")["models"][name];
    let size = std::fs::metadata(gguf.path()).unwrap().len();
    assert_eq!(
        goldens["bytes"].as_u64(),
        Some(size),
        "{name} is not the GGUF the goldens were made from"
    );
    let tokenizer = load(&gguf);
    let tokens = gguf.get("tokenizer.ggml.tokens").unwrap();
    assert_eq!(
        tokenizer.get_vocab_size(true),
        tokens.as_array().unwrap().len(),
        "{name}: added tokens must not grow the vocabulary"
    );
    let corpus = fixture("tokenizer_corpus.json");
    let corpus = corpus.as_array().unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    assert_eq!(corpus.len(), cases.len());
    let ids = |v: &Value| -> Vec<u32> {
        let list = v.as_array().unwrap();
        list.iter().map(|i| i.as_u64().unwrap() as u32).collect()
    };
    let mut differ = Vec::new();
    for (text, case) in corpus.iter().zip(cases) {
        let text = text.as_str().unwrap();
        let golden = ids(&case["ids"]);
        let got = [
            tokenizer.encode(text, true).unwrap().get_ids().to_vec(),
            tokenizer.encode(text, false).unwrap().get_ids().to_vec(),
        ];
        let decoded = [
            tokenizer.decode(&golden, false).unwrap(),
            tokenizer.decode(&golden, true).unwrap(),
        ];
        if got != [golden.clone(), ids(&case["ids_no_special"])] {
            differ.push(format!("{text:?}: {got:?}, transformers {golden:?}"));
        }
        for (decoded, key) in decoded.iter().zip(["decoded", "decoded_skip_special"]) {
            if case[key].as_str() != Some(decoded.as_str()) {
                differ.push(format!(
                    "{text:?} {key}: {decoded:?}, transformers {}",
                    case[key]
                ));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "{name}: {} of {} strings differ:\n{}",
        differ.len(),
        corpus.len(),
        differ.join("\n")
    );
}

#[test]
fn smollm2_tokenizes_as_transformers() {
    matches_transformers("SmolLM2-135M-Instruct.Q4_1.gguf");
}

#[test]
fn qwen25_tokenizes_as_transformers() {
    matches_transformers("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

#[test]
fn gemma3_tokenizes_as_transformers() {
    matches_transformers("gemma-3-270m-q4_k_m.gguf");
}

/// tokenizer_config.json names what transformers' GGUF tokenizer has: the class, the special
/// tokens, the added tokens and the file's chat template.
#[test]
fn the_tokenizer_configs_are_transformers() {
    for (name, class, [bos, eos, unk, pad], add_bos, added) in [
        (
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "TokenizersBackend",
            ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>"].map(Some),
            false,
            17,
        ),
        (
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "Qwen2Tokenizer",
            [
                Some("<|endoftext|>"),
                Some("<|im_end|>"),
                None,
                Some("<|endoftext|>"),
            ],
            false,
            22,
        ),
        (
            "gemma-3-270m-q4_k_m.gguf",
            "GemmaTokenizer",
            ["<bos>", "<eos>", "<unk>", "<pad>"].map(Some),
            true,
            6384,
        ),
    ] {
        let gguf = real_gguf(name);
        let config = tokenizer_files(&gguf).unwrap().tokenizer_config;
        assert_eq!(config["tokenizer_class"], class, "{name}");
        for (key, want) in ["bos_token", "eos_token", "unk_token", "pad_token"]
            .iter()
            .zip([bos, eos, unk, pad])
        {
            assert_eq!(config[key].as_str(), want, "{name} {key}");
        }
        assert_eq!(config["add_bos_token"], add_bos, "{name}");
        let decoder = config["added_tokens_decoder"].as_object().unwrap();
        assert_eq!(decoder.len(), added, "{name}");
        let template = gguf
            .get("tokenizer.chat_template")
            .map(|t| t.as_str().unwrap());
        assert_eq!(config["chat_template"].as_str(), template, "{name}");
    }
}

/// A byte-level vocabulary of five tokens: `h`, `i`, `hi`, `Ġ`, `<|end|>`.
fn tiny_gpt2<'a>(extra: &[(&'a str, Meta<'a>)], merges: Option<&'a [&'a str]>) -> GgufFile {
    let mut meta = vec![
        ("general.architecture", Meta::Str("llama")),
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
        ("tokenizer.ggml.pre", Meta::Str("gpt-2")),
        (
            "tokenizer.ggml.tokens",
            Meta::Strs(&["h", "i", "hi", "Ġ", "<|end|>"]),
        ),
        ("tokenizer.ggml.token_type", Meta::I32s(&[1, 1, 1, 1, 3])),
        ("tokenizer.ggml.eos_token_id", Meta::U32(4)),
    ];
    if let Some(merges) = merges {
        meta.push(("tokenizer.ggml.merges", Meta::Strs(merges)));
    }
    for &(key, value) in extra {
        match meta.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => meta.push((key, value)),
        }
    }
    write_gguf(&meta, &[])
}

fn error(gguf: &GgufFile) -> String {
    tokenizer_files(gguf).err().unwrap().to_string()
}

#[test]
fn a_tiny_byte_level_vocabulary_converts() {
    let gguf = tiny_gpt2(
        &[("tokenizer.ggml.add_eos_token", Meta::Bool(true))],
        Some(&["h i"]),
    );
    let tokenizer = load(&gguf);
    let encoding = tokenizer.encode("hi hi<|end|>", true).unwrap();
    assert_eq!(encoding.get_ids(), [2, 3, 2, 4, 4]);
    assert_eq!(
        tokenizer.decode(&[2, 3, 2, 4], false).unwrap(),
        "hi hi<|end|>"
    );
    assert_eq!(tokenizer.decode(&[2, 3, 2, 4], true).unwrap(), "hi hi");
}

#[test]
fn a_file_without_tokens_is_an_error_naming_the_key() {
    let gguf = write_gguf(
        &[
            ("general.architecture", Meta::Str("llama")),
            ("tokenizer.ggml.model", Meta::Str("gpt2")),
        ],
        &[],
    );
    let err = error(&gguf);
    assert!(
        err.contains("metadata `tokenizer.ggml.tokens`: missing"),
        "{err}"
    );
}

#[test]
fn an_unknown_tokenizer_model_is_an_error_listing_the_known_ones() {
    let err = error(&tiny_gpt2(
        &[("tokenizer.ggml.model", Meta::Str("bert"))],
        None,
    ));
    assert!(
        err.contains("`tokenizer.ggml.model`: `bert` is not supported (supported: gpt2"),
        "{err}"
    );
    // SentencePiece converts for Gemma only.
    let err = error(&tiny_gpt2(
        &[("tokenizer.ggml.model", Meta::Str("llama"))],
        None,
    ));
    assert!(
        err.contains("for gemma, gemma2, gemma3 only, not for `llama`"),
        "{err}"
    );
}

#[test]
fn a_byte_level_vocabulary_without_merges_is_an_error_naming_the_key() {
    let err = error(&tiny_gpt2(&[], None));
    assert!(
        err.contains(
            "`tokenizer.ggml.merges`: missing: a gpt2 (byte-level BPE) vocabulary needs its merges"
        ),
        "{err}"
    );
    let err = error(&tiny_gpt2(&[], Some(&["h i", "i h"])));
    assert!(err.contains("merge 1 `i h` is not two tokens"), "{err}");
}

#[test]
fn an_unknown_pre_tokenizer_is_an_error_listing_the_known_ones() {
    let err = error(&tiny_gpt2(
        &[("tokenizer.ggml.pre", Meta::Str("default"))],
        Some(&["h i"]),
    ));
    assert!(
        err.contains("`tokenizer.ggml.pre`: `default` is not supported for a gpt2 vocabulary (supported: smollm, qwen2"),
        "{err}"
    );
}

#[test]
fn inconsistent_special_tokens_are_errors_naming_the_key() {
    let err = error(&tiny_gpt2(
        &[("tokenizer.ggml.add_bos_token", Meta::Bool(true))],
        Some(&["h i"]),
    ));
    assert!(
        err.contains("`tokenizer.ggml.bos_token_id`: missing, but add_bos_token is on"),
        "{err}"
    );
    let err = error(&tiny_gpt2(
        &[("tokenizer.ggml.eos_token_id", Meta::U32(5))],
        Some(&["h i"]),
    ));
    assert!(
        err.contains("`tokenizer.ggml.eos_token_id`: 5 is past the vocabulary's 5 tokens"),
        "{err}"
    );
    let err = error(&tiny_gpt2(
        &[("tokenizer.ggml.token_type", Meta::I32s(&[1, 3]))],
        Some(&["h i"]),
    ));
    assert!(err.contains("2 types for 5 tokens"), "{err}");
}
