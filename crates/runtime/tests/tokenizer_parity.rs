//! Tokenizer ids against transformers 5.24 / mlx-lm 0.32.2: the fixtures' goldens, and tokenizer classes that
//! transformers rebuilds (expected values from transformers run on the same directories).

mod tokenizer_fixtures;

use oxlm_runtime::tokenizer::{token_ids_from_json, HfTokenizerClass, Tokenizer};
use serde_json::{json, Value};
use tokenizer_fixtures::*;

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn fixture_encodings_match_mlx_lm() {
    let tok = Tokenizer::from_dir(tiny_tokenizer_dir()).unwrap();
    let rows = read_json(&tiny_tokenizer_dir().join("encodings.json"));
    for row in rows.as_array().unwrap() {
        let text = row["text"].as_str().unwrap();
        let want = ids(&row["ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(
            tok.encode(text, false).unwrap(),
            want,
            "{text:?} without special tokens"
        );
        let decoded = tok.decode(&want, false).unwrap();
        assert_eq!(
            tok.encode(&decoded, true).unwrap(),
            want,
            "{text:?} round trip"
        );
    }
}

#[test]
fn tiny_models_match_their_goldens() {
    let mut checked = 0;
    for entry in std::fs::read_dir(fixtures().join("tiny")).unwrap() {
        let dir = entry.unwrap().path();
        let golden_path = dir.join("golden.json");
        if !golden_path.exists() {
            continue;
        }
        let golden = read_json(&golden_path);
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(
            tok.hf_class().name(),
            golden["hf_tokenizer_class"],
            "{name}"
        );

        let config = read_json(&dir.join("config.json"));
        let model_eos = token_ids_from_json(config.get("eos_token_id")).unwrap_or_default();
        assert_eq!(
            tok.eos_token_ids(&model_eos),
            ids(&golden["eos_token_ids"]),
            "{name}"
        );

        let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let prompt_ids: Vec<u32> = tensors
            .tensor("prompt_ids")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect();
        let prompt_text = golden["prompt_text"].as_str().unwrap();
        assert_eq!(
            tok.encode(prompt_text, false).unwrap(),
            prompt_ids,
            "{name}"
        );
        assert_eq!(
            tok.decode(&ids(&golden["greedy_ids"]), false).unwrap(),
            golden["greedy_text"],
            "{name}"
        );
        checked += 1;
    }
    assert!(checked > 0, "no tiny model goldens");
}

#[test]
fn special_tokens_and_prompt_encoding() {
    let tok = Tokenizer::from_dir(tiny_tokenizer_dir()).unwrap();
    assert_eq!(tok.bos_token(), None);
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_id(), Some(2));
    assert_eq!(tok.eos_token_ids(&[0, 2]), [0, 2]);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.id_to_token(1).as_deref(), Some("<|im_start|>"));
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.think_markers(), None);
    assert_eq!(tok.decode(&[1, 67, 2], true).unwrap(), "a");

    // stream_generate adds special tokens unless the prompt starts with the BOS token.
    let dir = model_dir(
        "tok_spm_prompt",
        &spm_tokenizer_json(),
        &spm_tokenizer_config(),
        Some("llama"),
    );
    let tok = Tokenizer::from_dir(dir).unwrap();
    assert_eq!(tok.encode_prompt("hello world").unwrap(), [1, 278, 283]);
    assert_eq!(tok.encode_prompt("<s> hello world").unwrap(), [1, 278, 283]);
}

/// (text, ids with special tokens, ids without, decode, decode skipping special tokens)
type Case = (
    &'static str,
    &'static [u32],
    &'static [u32],
    &'static str,
    &'static str,
);

fn check(
    name: &str,
    tokenizer: &Value,
    config: &Value,
    model_type: Option<&str>,
    class: HfTokenizerClass,
    cases: &[Case],
) {
    let tok = Tokenizer::from_dir(model_dir(name, tokenizer, config, model_type)).unwrap();
    assert_eq!(tok.hf_class(), class, "{name}");
    for &(text, with, without, decoded, decoded_skip) in cases {
        assert_eq!(tok.encode(text, true).unwrap(), with, "{name}: {text:?}");
        assert_eq!(
            tok.encode(text, false).unwrap(),
            without,
            "{name}: {text:?}"
        );
        assert_eq!(
            tok.decode(with, false).unwrap(),
            decoded,
            "{name}: {text:?}"
        );
        assert_eq!(
            tok.decode(with, true).unwrap(),
            decoded_skip,
            "{name}: {text:?}"
        );
    }
}

#[test]
fn llama_tokenizer_is_rebuilt_like_transformers() {
    // transformers 5.24 LlamaTokenizer: Metaspace pre-tokenizer instead of the file's legacy normalizer.
    let (json, config) = (spm_tokenizer_json(), spm_tokenizer_config());
    check(
        "tok_llama_legacy",
        &json,
        &config,
        Some("llama"),
        HfTokenizerClass::Llama,
        &[
            (
                " hello  world ",
                &[1, 278, 259, 283, 259],
                &[278, 259, 283, 259],
                "<s> hello  world ",
                "hello  world ",
            ),
            (
                "<s> hello</s>world",
                &[1, 1, 278, 2, 283],
                &[1, 278, 2, 283],
                "<s><s> hello</s> world",
                "hello world",
            ),
            ("  ", &[1, 284], &[284], "<s>  ", " "),
            (
                "héllo wörld 😀",
                &[
                    1, 274, 198, 172, 267, 267, 269, 279, 198, 185, 270, 267, 263, 259, 243, 162,
                    155, 131,
                ],
                &[
                    274, 198, 172, 267, 267, 269, 279, 198, 185, 270, 267, 263, 259, 243, 162, 155,
                    131,
                ],
                "<s> héllo wörld 😀",
                "héllo wörld 😀",
            ),
        ],
    );
    let mut config = spm_tokenizer_config();
    config["legacy"] = json!(false);
    check(
        "tok_llama_nolegacy",
        &json,
        &config,
        Some("llama"),
        HfTokenizerClass::Llama,
        &[(
            "<s> hello</s>world",
            &[1, 1, 278, 2, 273, 282],
            &[1, 278, 2, 273, 282],
            "<s><s> hello</s>world",
            "helloworld",
        )],
    );
    // model_type mistral registers TokenizersBackend: tokenizer.json as it is.
    check(
        "tok_llama_as_mistral",
        &json,
        &spm_tokenizer_config(),
        Some("mistral"),
        HfTokenizerClass::TokenizersBackend,
        &[
            (
                " hello  world ",
                &[1, 259, 278, 259, 283, 259],
                &[259, 278, 259, 283, 259],
                "<s>  hello  world ",
                " hello  world ",
            ),
            (
                "<s> hello</s>world",
                &[1, 1, 259, 278, 2, 283],
                &[1, 259, 278, 2, 283],
                "<s><s>  hello</s> world",
                " hello world",
            ),
            ("  ", &[1, 284, 259], &[284, 259], "<s>   ", "  "),
        ],
    );
}

#[test]
fn gpt2_tokenizer_drops_the_file_normalizer() {
    let mut json = tiny_tokenizer_json();
    json["normalizer"] = json!({"type": "Lowercase"});
    let mut config = tiny_tokenizer_config();
    check(
        "tok_raw_lower",
        &json,
        &config,
        Some("llama"),
        HfTokenizerClass::TokenizersBackend,
        &[(
            "Hello World",
            &[74, 71, 382, 81, 275, 263, 78, 70],
            &[74, 71, 382, 81, 275, 263, 78, 70],
            "hello world",
            "hello world",
        )],
    );
    config["tokenizer_class"] = json!("GPT2Tokenizer");
    check(
        "tok_gpt2_lower",
        &json,
        &config,
        Some("llama"),
        HfTokenizerClass::Gpt2,
        &[(
            "Hello World",
            &[42, 71, 382, 81, 507, 263, 78, 70],
            &[42, 71, 382, 81, 507, 263, 78, 70],
            "Hello World",
            "Hello World",
        )],
    );
}

#[test]
fn missing_and_malformed_files_name_the_path() {
    let missing = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tok_no_such_dir");
    let err = Tokenizer::from_dir(&missing).unwrap_err().to_string();
    assert!(
        err.contains("tok_no_such_dir") && err.contains("tokenizer.json"),
        "{err}"
    );

    let dir = model_dir("tok_bad_config", &tiny_tokenizer_json(), &json!({}), None);
    std::fs::write(dir.join("tokenizer_config.json"), "{not json").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains("malformed JSON") && err.contains("tokenizer_config.json"),
        "{err}"
    );
}
