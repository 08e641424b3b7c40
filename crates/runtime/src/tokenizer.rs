//! Tokenizer loading, encoding and decoding with the semantics of Python mlx-lm 0.32.2, which loads tokenizers
//! through transformers 5.24 `AutoTokenizer.from_pretrained` (mlx_lm/tokenizer_utils.py `load`).
//!
//! transformers 5.x does not always use `tokenizer.json` as it is: a tokenizer class with its own `__init__`
//! (`LlamaTokenizer`, `GemmaTokenizer`, `Qwen2Tokenizer`, `GPT2Tokenizer`, ...) rebuilds the pipeline from the
//! file's vocab and merges with the class's own normalizer, pre-tokenizer and decoder, keeping only the file's
//! post-processor (transformers/tokenization_utils_tokenizers.py `convert_to_native_format`). Which class is used
//! depends on `tokenizer_config.json`'s `tokenizer_class` and `config.json`'s `model_type`
//! (transformers/models/auto/tokenization_auto.py `AutoTokenizer.from_pretrained`). [`Tokenizer::from_dir`]
//! resolves the class the same way and rewrites `tokenizer.json` accordingly for the four classes above; any other
//! class is loaded from `tokenizer.json` as it is (exact for `TokenizersBackend`/`PreTrainedTokenizerFast`).
//!
//! Prompt encoding in mlx-lm (mlx_lm/generate.py):
//! - `mlx_lm generate` (`main`) encodes with `add_special_tokens = not use_chat_template`: a chat-templated prompt
//!   is encoded without special tokens (the template writes its own BOS), a raw prompt with them;
//! - `stream_generate` given a string encodes with `add_special_tokens = bos_token is None or not
//!   prompt.startswith(bos_token)` ([`Tokenizer::encode_prompt`]);
//! - the server tokenizes the chat template with `add_special_tokens=False` (transformers `apply_chat_template`).
//!
//! `encode(text, true)` applies `tokenizer.json`'s post-processor (e.g. Llama 3 prepends `<|begin_of_text|>`),
//! exactly as transformers' `encode` does.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde_json::{json, Map, Value};
use tokenizers::AddedToken;

use crate::detokenizer::{SharedTokenMap, TokenMap};

/// Errors from loading or running a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed JSON in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("tokenizer backend: {0}")]
    Backend(#[source] tokenizers::Error),
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// Reads and parses a JSON file, naming the file in any error.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.to_owned(),
        source,
    })
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Reads a JSON file that may be absent.
pub(crate) fn read_json_opt(path: &Path) -> Result<Option<Value>> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// The transformers tokenizer class whose pipeline is reproduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfTokenizerClass {
    /// `tokenizer.json` as it is (`TokenizersBackend`, also any class this crate does not emulate).
    TokenizersBackend,
    Llama,
    Gemma,
    Qwen2,
    /// Qwen2's pipeline with a pre-tokenizer regex that keeps combining marks with letters.
    Qwen3_5,
    Gpt2,
}

impl HfTokenizerClass {
    /// The Python class name, as `type(tokenizer).__name__` prints it.
    pub fn name(self) -> &'static str {
        match self {
            Self::TokenizersBackend => "TokenizersBackend",
            Self::Llama => "LlamaTokenizer",
            Self::Gemma => "GemmaTokenizer",
            Self::Qwen2 => "Qwen2Tokenizer",
            Self::Qwen3_5 => "Qwen3_5Tokenizer",
            Self::Gpt2 => "GPT2Tokenizer",
        }
    }

    fn from_name(name: &str) -> Self {
        match name.strip_suffix("Fast").unwrap_or(name) {
            "LlamaTokenizer" => Self::Llama,
            "GemmaTokenizer" => Self::Gemma,
            "Qwen2Tokenizer" => Self::Qwen2,
            "Qwen3_5Tokenizer" => Self::Qwen3_5,
            "GPT2Tokenizer" => Self::Gpt2,
            _ => Self::TokenizersBackend,
        }
    }

    /// Special-token defaults of the class's `__init__`, used for keys absent from tokenizer_config.json.
    fn default_special_tokens(self) -> &'static [(&'static str, Option<&'static str>)] {
        match self {
            Self::TokenizersBackend => &[],
            Self::Llama => &[
                ("unk_token", Some("<unk>")),
                ("bos_token", Some("<s>")),
                ("eos_token", Some("</s>")),
            ],
            Self::Gemma => &[
                ("unk_token", Some("<unk>")),
                ("bos_token", Some("<bos>")),
                ("eos_token", Some("<eos>")),
                ("pad_token", Some("<pad>")),
                ("mask_token", Some("<mask>")),
            ],
            Self::Qwen2 | Self::Qwen3_5 => &[
                ("unk_token", Some("<|endoftext|>")),
                ("bos_token", None),
                ("eos_token", Some("<|endoftext|>")),
                ("pad_token", Some("<|endoftext|>")),
            ],
            Self::Gpt2 => &[
                ("unk_token", Some("<|endoftext|>")),
                ("bos_token", Some("<|endoftext|>")),
                ("eos_token", Some("<|endoftext|>")),
                ("pad_token", None),
            ],
        }
    }
}

// transformers 5.24 TOKENIZER_MAPPING_NAMES, restricted to the model types whose registered class matters here.
#[rustfmt::skip]
const REGISTERED_TOKENIZERS_BACKEND: &[&str] = &[
    "EvollaModel", "arctic", "aria", "beam", "bigbird_pegasus", "camembertv2-base", "canary",
    "chatlm", "cohere_asr", "ernie4_5", "ernie4_5_moe", "flex_olmo", "fuyu", "glm", "glm4",
    "glm4_moe", "glm4_moe_lite", "glm4v", "glm4v_moe", "glm_image", "glmasr", "got_ocr2",
    "gpt_bigcode", "gradium_phonon_tts", "granite", "granitemoe", "granitemoehybrid",
    "granitemoeshared", "h2ovl_chat", "hyperclovax", "hyperclovax_vlm", "internlm2", "internlm3",
    "iquestcoder", "jamba", "kimi_k25", "kimi_linear", "kosmos-2", "llava", "llava_next",
    "mimo_v2_flash", "minicpm3", "minicpm_ocr", "minicpmv", "minicpmv4_6", "minicpmv4_7",
    "minimax_m2", "ministral", "ministral3", "mistral", "mistral3", "mistral_large4", "mixtral",
    "modernbert", "modernbert-decoder", "molmo", "molmo2", "nemo_speechlm", "nemotron", "nvfp4",
    "nystromformer", "olmo2", "olmo3", "olmo_hybrid", "omniasr", "opencua", "openvla",
    "paddleocr_vl", "pegasus_x", "persimmon", "phi3", "phi3_v", "phimoe", "pix2struct", "pixtral",
    "pocket_tts", "smolvlm", "stablelm", "step3_vl", "umt5", "vipllava", "voxtral",
    "voxtral_realtime", "xlm-roberta-xl",
];
const REGISTERED_LLAMA: &[&str] = &["idefics", "idefics2"];
#[rustfmt::skip]
const REGISTERED_GEMMA: &[&str] = &[
    "diffusion_gemma", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text",
    "recurrent_gemma", "shieldgemma2", "t5gemma", "zaya",
];
#[rustfmt::skip]
const REGISTERED_QWEN2: &[&str] = &[
    "audioflamingo3", "colqwen2", "cosmos3_omni", "dots3_note", "fun_asr_nano", "hunyuan_vl",
    "internvl", "lighton_ocr", "moss_transcribe_diarize", "ovis2", "qianfan_ocr", "qwen2",
    "qwen2_5_omni", "qwen2_5_vl", "qwen2_audio", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_asr",
    "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_vl", "qwen3_vl_moe", "vibevoice",
];
#[rustfmt::skip]
const REGISTERED_GPT2: &[&str] = &[
    "blip-2", "codegen", "dbrx", "emu3", "gpt2", "gpt_neo", "gptj", "hyperclovax_vision_v2",
    "instructblip", "instructblipvideo", "jais2", "opt", "phi", "starcoder2",
];
#[rustfmt::skip]
const REGISTERED_QWEN3_5: &[&str] = &[
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen4_exp",
];
// Registered to classes this crate does not emulate, but named in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.
const REGISTERED_OTHER: &[&str] = &["siglip2"];
// transformers 5.24 MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: the registered class wins over the Hub's.
#[rustfmt::skip]
const INCORRECT_HUB_CLASS: &[&str] = &[
    "arctic", "camembertv2-base", "chatlm", "cohere_asr", "ernie4_5", "ernie4_5_moe", "fuyu",
    "h2ovl_chat", "hyperclovax", "hyperclovax_vision_v2", "hyperclovax_vlm", "internlm2",
    "internlm3", "iquestcoder", "jamba", "llava", "llava_next", "minicpm3", "minicpmv",
    "minimax_m2", "modernbert", "modernbert-decoder", "molmo", "molmo2", "nemotron", "nvfp4",
    "opencua", "openvla", "paddleocr_vl", "phi3", "phi3_v", "phimoe", "qwen2", "qwen3_5",
    "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "siglip2", "smolvlm", "step3_vl", "vipllava",
];

/// A model type's registered tokenizer class: `Ok(class)` for classes handled here, `Err(())` for others.
fn registered_class(model_type: &str) -> Option<Result<HfTokenizerClass, ()>> {
    let tables = [
        (
            REGISTERED_TOKENIZERS_BACKEND,
            HfTokenizerClass::TokenizersBackend,
        ),
        (REGISTERED_LLAMA, HfTokenizerClass::Llama),
        (REGISTERED_GEMMA, HfTokenizerClass::Gemma),
        (REGISTERED_QWEN2, HfTokenizerClass::Qwen2),
        (REGISTERED_QWEN3_5, HfTokenizerClass::Qwen3_5),
        (REGISTERED_GPT2, HfTokenizerClass::Gpt2),
    ];
    if let Some((_, class)) = tables.iter().find(|(names, _)| names.contains(&model_type)) {
        return Some(Ok(*class));
    }
    REGISTERED_OTHER.contains(&model_type).then_some(Err(()))
}

/// The class `AutoTokenizer.from_pretrained` picks (tokenization_auto.py), for a local directory without
/// remote code.
fn resolve_class(
    hub_class: Option<&str>,
    model_type: Option<&str>,
    json_has_byte_level: bool,
) -> HfTokenizerClass {
    let strip = |s: &'_ str| s.strip_suffix("Fast").unwrap_or(s).to_owned();
    let incorrect = model_type.is_some_and(|t| INCORRECT_HUB_CLASS.contains(&t));
    let registered = model_type
        .filter(|t| !t.is_empty())
        .and_then(registered_class);
    let Some(hub) = hub_class else {
        return match registered {
            Some(Ok(class)) => class,
            _ => HfTokenizerClass::TokenizersBackend,
        };
    };
    // A Hub `LlamaTokenizer` over a byte-level tokenizer.json loads as TokenizersBackend.
    if strip(hub) == "LlamaTokenizer" && !incorrect && json_has_byte_level {
        return HfTokenizerClass::TokenizersBackend;
    }
    match registered {
        Some(Ok(reg)) if reg.name() != strip(hub) => {
            if reg == HfTokenizerClass::TokenizersBackend {
                HfTokenizerClass::TokenizersBackend
            } else if incorrect {
                reg
            } else {
                HfTokenizerClass::from_name(hub)
            }
        }
        // Registered to a class not emulated here, and that class wins.
        Some(Err(())) if incorrect => HfTokenizerClass::TokenizersBackend,
        _ => HfTokenizerClass::from_name(hub),
    }
}

/// Which of mlx-lm's streaming detokenizers applies (tokenizer_utils.py `load`, from tokenizer.json's decoder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DetokenizerKind {
    /// `SPMStreamingDetokenizer`; `trim_space` drops the leading space of the output.
    Spm { trim_space: bool },
    /// `BPEStreamingDetokenizer` (byte-level decoder).
    Bpe,
    /// `NaiveStreamingDetokenizer` (re-decodes the current line).
    Naive,
}

fn detokenizer_kind(decoder: Option<&Value>) -> DetokenizerKind {
    let spm = |strip: bool| {
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if strip {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        json!({"type": "Sequence", "decoders": decoders})
    };
    match decoder {
        Some(d) if *d == spm(true) => DetokenizerKind::Spm { trim_space: true },
        Some(d) if *d == spm(false) => DetokenizerKind::Spm { trim_space: false },
        Some(d) if d.get("type").and_then(Value::as_str) == Some("ByteLevel") => {
            DetokenizerKind::Bpe
        }
        _ => DetokenizerKind::Naive,
    }
}

const STANDARD_SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A special token as written in tokenizer_config.json: a string or an AddedToken object.
fn token_entry(value: &Value) -> Option<AddedToken> {
    match value {
        Value::String(s) => Some(AddedToken::from(s.clone(), true)),
        Value::Object(o) => {
            let content = o.get("content")?.as_str()?;
            let flag =
                |k: &str, default: bool| o.get(k).and_then(Value::as_bool).unwrap_or(default);
            let special = flag("special", true);
            Some(
                AddedToken::from(content, special)
                    .single_word(flag("single_word", false))
                    .lstrip(flag("lstrip", false))
                    .rstrip(flag("rstrip", false))
                    .normalized(flag("normalized", !special)),
            )
        }
        _ => None,
    }
}

fn set_named(named: &mut Vec<(String, AddedToken)>, key: &str, token: AddedToken) {
    match named.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = token,
        None => named.push((key.to_owned(), token)),
    }
}

/// The named special tokens transformers exposes as `special_tokens_map` (and passes to chat templates):
/// bos/eos/unk/sep/pad/cls/mask plus model-specific `*_token` entries (e.g. Gemma 3's `image_token`).
#[derive(Clone, Debug, Default)]
pub struct SpecialTokens {
    named: Vec<(String, AddedToken)>,
    extra: Vec<AddedToken>,
}

impl SpecialTokens {
    /// Builds the map the way `PreTrainedTokenizerBase.__init__` does from the tokenizer_config.json entries,
    /// with `defaults` standing for the tokenizer class's `__init__` defaults.
    fn from_config(config: &Map<String, Value>, defaults: &[(&str, Option<&str>)]) -> Self {
        let mut named: Vec<(String, AddedToken)> = Vec::new();
        for key in STANDARD_SPECIAL_TOKENS {
            let value = match config.get(key) {
                Some(v) => token_entry(v),
                None => defaults
                    .iter()
                    .find(|(k, _)| *k == key)
                    .and_then(|(_, v)| v.map(|s| AddedToken::from(s, true))),
            };
            if let Some(token) = value {
                set_named(&mut named, key, token);
            }
        }
        // Other `*_token` keys with a token value are model-specific special tokens.
        for (key, value) in config {
            let is_token = value.is_string()
                || value.get("__type").and_then(Value::as_str) == Some("AddedToken");
            if key.ends_with("_token")
                && !STANDARD_SPECIAL_TOKENS.contains(&key.as_str())
                && is_token
            {
                if let Some(token) = token_entry(value) {
                    set_named(&mut named, key, token);
                }
            }
        }
        let mut extra = Vec::new();
        let extra_value = config
            .get("extra_special_tokens")
            .or_else(|| config.get("additional_special_tokens"));
        match extra_value {
            Some(Value::Object(map)) => {
                for (key, value) in map {
                    if let Some(token) = token_entry(value) {
                        set_named(&mut named, key, token);
                    }
                }
            }
            Some(Value::Array(list)) => extra.extend(list.iter().filter_map(token_entry)),
            _ => {}
        }
        Self { named, extra }
    }

    /// The token string of a named special token (`"bos_token"`, `"eos_token"`, `"image_token"`, ...).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.named
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, t)| t.content.as_str())
    }

    /// All named special tokens, as `(name, token)`, in transformers' order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.named
            .iter()
            .map(|(k, t)| (k.as_str(), t.content.as_str()))
    }
}

/// Reads tokenizer_config.json's entries the way transformers merges them, including the legacy
/// special_tokens_map.json that transformers reads only when the config has no `added_tokens_decoder`.
pub(crate) fn load_tokenizer_config(dir: &Path) -> Result<Map<String, Value>> {
    let path = dir.join("tokenizer_config.json");
    let mut config = match read_json_opt(&path)? {
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(TokenizerError::Invalid {
                path,
                message: "expected a JSON object".into(),
            })
        }
        None => Map::new(),
    };
    if !config.contains_key("added_tokens_decoder") {
        let legacy_path = dir.join("special_tokens_map.json");
        if let Some(Value::Object(legacy)) = read_json_opt(&legacy_path)? {
            for (key, value) in legacy {
                config.insert(key, value);
            }
        }
    }
    Ok(config)
}

/// Special tokens for chat templates, as transformers computes them for the tokenizer in `dir`.
pub(crate) fn special_tokens_for_dir(dir: &Path) -> Result<SpecialTokens> {
    let config = load_tokenizer_config(dir)?;
    let class = class_for_dir(dir, &config)?;
    Ok(SpecialTokens::from_config(
        &config,
        class.default_special_tokens(),
    ))
}

fn class_for_dir(dir: &Path, config: &Map<String, Value>) -> Result<HfTokenizerClass> {
    let model_config = read_json_opt(&dir.join("config.json"))?;
    let hub_class = config
        .get("tokenizer_class")
        .or_else(|| model_config.as_ref()?.get("tokenizer_class"))
        .and_then(Value::as_str);
    let model_type = model_config
        .as_ref()
        .and_then(|c| c.get("model_type"))
        .and_then(Value::as_str);
    let json_path = dir.join("tokenizer.json");
    // transformers checks the raw text for `"ByteLevel"` (TokenizersBackend._tokenizer_json_has_byte_level).
    let byte_level = hub_class.is_some_and(|c| c.starts_with("LlamaTokenizer"))
        && json_path.exists()
        && read_text(&json_path)?.contains("\"ByteLevel\"");
    Ok(resolve_class(hub_class, model_type, byte_level))
}

/// Rewrites tokenizer.json's pipeline as the class's `__init__` rebuilds it (its vocab and merges, the class's
/// normalizer, pre-tokenizer and decoder, the file's post-processor).
fn rebuild_pipeline(
    json: &mut Value,
    class: HfTokenizerClass,
    config: &Map<String, Value>,
    special: &SpecialTokens,
) {
    let Some(model) = json
        .get("model")
        .filter(|m| m.get("type").and_then(Value::as_str) == Some("BPE"))
    else {
        // The classes build a BPE model; other files are left as they are.
        return;
    };
    let bpe = |unk: Value, prefix: Value, fuse_unk: bool, byte_fallback: bool| {
        json!({
            "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": prefix,
            "end_of_word_suffix": prefix, "fuse_unk": fuse_unk, "byte_fallback": byte_fallback,
            "ignore_merges": false, "vocab": model["vocab"], "merges": model["merges"],
        })
    };
    let flag = |key: &str| config.get(key).and_then(Value::as_bool);
    let spm_decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    let byte_level_decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let (model, normalizer, pre_tokenizer, decoder) = match class {
        HfTokenizerClass::TokenizersBackend => return,
        HfTokenizerClass::Llama => {
            let add_prefix_space = flag("add_prefix_space").unwrap_or(true);
            // transformers `_get_prepend_scheme`
            let scheme = match (add_prefix_space, flag("legacy").unwrap_or(false)) {
                (false, _) => "never",
                (true, true) => "always",
                (true, false) => "first",
            };
            let mut decoders = spm_decoders;
            if add_prefix_space {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            (
                bpe(Value::Null, Value::Null, true, true),
                Value::Null,
                json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": scheme, "split": false}),
                json!({"type": "Sequence", "decoders": decoders}),
            )
        }
        HfTokenizerClass::Gemma => (
            bpe(
                json!(special.get("unk_token").unwrap_or("<unk>")),
                Value::Null,
                true,
                true,
            ),
            json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
            json!({"type": "Sequence", "decoders": spm_decoders}),
        ),
        HfTokenizerClass::Qwen2 | HfTokenizerClass::Qwen3_5 => (
            bpe(Value::Null, json!(""), false, false),
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": if class == HfTokenizerClass::Qwen2 {
                    QWEN2_PRETOKENIZE_REGEX
                } else {
                    QWEN3_5_PRETOKENIZE_REGEX
                }}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": flag("add_prefix_space").unwrap_or(false),
                 "trim_offsets": true, "use_regex": false},
            ]}),
            byte_level_decoder,
        ),
        HfTokenizerClass::Gpt2 => (
            bpe(Value::Null, json!(""), false, false),
            Value::Null,
            json!({"type": "ByteLevel", "add_prefix_space": flag("add_prefix_space").unwrap_or(false),
                   "trim_offsets": true, "use_regex": true}),
            byte_level_decoder,
        ),
    };
    json["model"] = model;
    json["normalizer"] = normalizer;
    json["pre_tokenizer"] = pre_tokenizer;
    json["decoder"] = decoder;
}

// transformers/models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX
const QWEN2_PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

// transformers/models/qwen3_5/tokenization_qwen3_5.py PRETOKENIZE_REGEX
const QWEN3_5_PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer loaded from a model directory.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    class: HfTokenizerClass,
    special: SpecialTokens,
    detokenizer: DetokenizerKind,
    clean_up_spaces: bool,
    token_map: SharedTokenMap,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("class", &self.class)
            .field("special", &self.special)
            .field("detokenizer", &self.detokenizer)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (and, when present, `config.json` for `model_type`,
    /// `special_tokens_map.json` for old checkpoints) from a model directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = load_tokenizer_config(dir)?;
        let class = class_for_dir(dir, &config)?;
        let special = SpecialTokens::from_config(&config, class.default_special_tokens());

        let json_path = dir.join("tokenizer.json");
        let mut json = read_json(&json_path)?;
        let detokenizer = detokenizer_kind(json.get("decoder"));
        if !json.is_object() {
            return Err(TokenizerError::Invalid {
                path: json_path,
                message: "expected a JSON object".into(),
            });
        }
        rebuild_pipeline(&mut json, class, &config, &special);
        // transformers takes tokenizer.json's padding token as a default pad_token.
        let mut special = special;
        if special.get("pad_token").is_none() && !config.contains_key("pad_token") {
            if let Some(pad) = json.pointer("/padding/pad_token").and_then(Value::as_str) {
                special
                    .named
                    .push(("pad_token".into(), AddedToken::from(pad, true)));
            }
        }
        let mut inner: tokenizers::Tokenizer =
            serde_json::from_value(json).map_err(|source| TokenizerError::Json {
                path: json_path.clone(),
                source,
            })?;
        // transformers disables both for plain `encode` calls (set_truncation_and_padding).
        inner
            .with_truncation(None)
            .map_err(TokenizerError::Backend)?
            .with_padding(None);
        inner.set_encode_special_tokens(
            config
                .get("split_special_tokens")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        );
        add_config_tokens(&mut inner, &config, &special);

        let is_bpe = matches!(inner.get_model(), tokenizers::ModelWrapper::BPE(_));
        // transformers skips clean_up_tokenization for BPE models (TokenizersBackend._decode).
        let clean_up_spaces = !is_bpe
            && config
                .get("clean_up_tokenization_spaces")
                .and_then(Value::as_bool)
                .unwrap_or(false);
        Ok(Self {
            inner: Arc::new(inner),
            class,
            special,
            detokenizer,
            clean_up_spaces,
            token_map: SharedTokenMap::default(),
        })
    }

    /// The transformers class whose behaviour this tokenizer reproduces.
    pub fn hf_class(&self) -> HfTokenizerClass {
        self.class
    }

    /// The streaming detokenizer mlx-lm would pick for this tokenizer.
    pub fn detokenizer_kind(&self) -> DetokenizerKind {
        self.detokenizer
    }

    /// Named special tokens (the `special_tokens_map` chat templates see).
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// Encodes `text`; `add_special_tokens` applies tokenizer.json's post-processor (e.g. a BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(TokenizerError::Backend)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encodes a prompt string as mlx-lm's `stream_generate` does: special tokens are added unless the text
    /// already starts with the BOS token.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        let add = self.bos_token().is_none_or(|bos| !prompt.starts_with(bos));
        self.encode(prompt, add)
    }

    /// Decodes ids as transformers' `decode` does (including `clean_up_tokenization_spaces` for non-BPE models).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(TokenizerError::Backend)?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// The whole tokenizer (with the tokens its config adds) as tokenizer.json text.
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(TokenizerError::Backend)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (`convert_ids_to_tokens`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens (`len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.special.get("bos_token")
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.special.get("eos_token")
    }

    /// `convert_tokens_to_ids`: an unknown token maps to the unk token's id.
    fn special_id(&self, token: Option<&str>) -> Option<u32> {
        let token = token?;
        self.token_to_id(token)
            .or_else(|| self.token_to_id(self.special.get("unk_token")?))
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.special_id(self.bos_token())
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.special_id(self.eos_token())
    }

    /// The ids that end generation: the model's `eos_token_id` (config.json, overridden by
    /// generation_config.json — see [`token_ids_from_json`]) plus the tokenizer's eos token, as mlx-lm's
    /// `TokenizerWrapper` combines them. Sorted, without duplicates.
    pub fn eos_token_ids(&self, model_eos: &[u32]) -> Vec<u32> {
        let mut ids: Vec<u32> = model_eos
            .iter()
            .copied()
            .chain(self.eos_token_id())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The reasoning markers mlx-lm infers from the vocabulary (tokenizer_utils.py `_infer_thinking`), as
    /// `(start, end)`. When present, mlx-lm passes `enable_thinking=True` to the chat template unless the
    /// caller set it.
    pub fn think_markers(&self) -> Option<(&'static str, &'static str)> {
        let has = |t: &str| self.inner.token_to_id(t).is_some();
        const SINGLE: [(&str, &str); 3] = [
            ("<think>", "</think>"),
            ("<longcat_think>", "</longcat_think>"),
            ("<|think:start|>", "<|think:end|>"),
        ];
        if let Some(pair) = SINGLE.into_iter().find(|(s, e)| has(s) && has(e)) {
            return Some(pair);
        }
        if has("<|channel>") && has("<channel|>") {
            return Some(("<|channel>thought", "<channel|>"));
        }
        if ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
            .into_iter()
            .all(has)
        {
            return Some(("<|open|>think<|sep|>", "<|close|>think<|sep|>"));
        }
        None
    }

    pub(crate) fn token_map_cell(&self) -> &OnceLock<TokenMap> {
        &self.token_map
    }
}

/// Adds what transformers' `TokenizersBackend.__init__` adds on top of tokenizer.json: tokenizer_config.json's
/// `added_tokens_decoder` entries that differ from the file's, then named and extra special tokens that are not
/// added tokens yet.
fn add_config_tokens(
    inner: &mut tokenizers::Tokenizer,
    config: &Map<String, Value>,
    special: &SpecialTokens,
) {
    let existing = inner.get_added_tokens_decoder();
    let mut to_add: Vec<AddedToken> = Vec::new();
    if let Some(Value::Object(decoder)) = config.get("added_tokens_decoder") {
        let mut entries: Vec<(u64, AddedToken)> = decoder
            .iter()
            .filter_map(|(id, v)| Some((id.parse().ok()?, token_entry(v)?)))
            .collect();
        entries.sort_by_key(|(id, _)| *id);
        to_add.extend(
            entries
                .into_iter()
                .map(|(_, t)| t)
                .filter(|t| !existing.values().any(|e| e == t)),
        );
    }
    let mut known: HashSet<String> = existing.values().map(|t| t.content.clone()).collect();
    known.extend(to_add.iter().map(|t| t.content.clone()));
    let named: Vec<&str> = special.iter().map(|(_, t)| t).collect();
    for token in special.named.iter().map(|(_, t)| t).chain(&special.extra) {
        if known.insert(token.content.clone()) {
            let mut token = token.clone();
            token.special |= named.contains(&token.content.as_str());
            to_add.push(token);
        }
    }
    if !to_add.is_empty() {
        inner.add_tokens(&to_add);
    }
}

/// transformers `PreTrainedTokenizerBase.clean_up_tokenization`.
fn clean_up_tokenization(text: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
}

/// Token ids from a config value that is an int or a list of ints (config.json / generation_config.json
/// `eos_token_id`); `null` or absent gives none.
pub fn token_ids_from_json(value: Option<&Value>) -> Option<Vec<u32>> {
    let as_id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match value? {
        Value::Null => Some(Vec::new()),
        Value::Array(list) => list.iter().map(as_id).collect(),
        v => as_id(v).map(|id| vec![id]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_resolution_follows_auto_tokenizer() {
        use HfTokenizerClass::*;
        let fast = Some("PreTrainedTokenizerFast");
        assert_eq!(resolve_class(fast, Some("qwen2"), true), Qwen2);
        assert_eq!(resolve_class(fast, Some("qwen3"), true), TokenizersBackend);
        assert_eq!(resolve_class(fast, Some("llama"), true), TokenizersBackend);
        assert_eq!(
            resolve_class(Some("LlamaTokenizer"), Some("mistral"), false),
            TokenizersBackend
        );
        assert_eq!(
            resolve_class(Some("LlamaTokenizerFast"), Some("llama"), false),
            Llama
        );
        assert_eq!(
            resolve_class(Some("LlamaTokenizer"), Some("llama"), true),
            TokenizersBackend
        );
        assert_eq!(
            resolve_class(Some("GPT2Tokenizer"), Some("llama"), true),
            Gpt2
        );
        assert_eq!(
            resolve_class(Some("GemmaTokenizer"), Some("gemma3"), false),
            Gemma
        );
        assert_eq!(resolve_class(None, Some("gemma3_text"), false), Gemma);
        assert_eq!(
            resolve_class(Some("Qwen2Tokenizer"), Some("qwen3_5"), true),
            Qwen3_5
        );
        assert_eq!(resolve_class(Some("Qwen2TokenizerFast"), None, true), Qwen2);
    }

    #[test]
    fn special_tokens_from_config() {
        let config: Map<String, Value> = serde_json::from_str(
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": "</s>", "unk_token": null, "image_token": "<img>", "add_bos_token": true,
                "extra_special_tokens": {"boi_token": "<boi>"}}"#,
        )
        .unwrap();
        let special =
            SpecialTokens::from_config(&config, HfTokenizerClass::Llama.default_special_tokens());
        let got: Vec<_> = special.iter().collect();
        assert_eq!(
            got,
            [
                ("bos_token", "<s>"),
                ("eos_token", "</s>"),
                ("image_token", "<img>"),
                ("boi_token", "<boi>")
            ]
        );
        // Absent keys take the class defaults.
        let special = SpecialTokens::from_config(
            &Map::new(),
            HfTokenizerClass::Gemma.default_special_tokens(),
        );
        assert_eq!(special.get("mask_token"), Some("<mask>"));
        assert_eq!(special.get("eos_token"), Some("<eos>"));
    }

    #[test]
    fn token_ids_from_int_or_list() {
        assert_eq!(token_ids_from_json(Some(&json!(7))), Some(vec![7]));
        assert_eq!(token_ids_from_json(Some(&json!([1, 2]))), Some(vec![1, 2]));
        assert_eq!(token_ids_from_json(Some(&json!(null))), Some(vec![]));
        assert_eq!(token_ids_from_json(None), None);
        assert_eq!(token_ids_from_json(Some(&json!("x"))), None);
    }

    #[test]
    fn clean_up_matches_transformers() {
        assert_eq!(clean_up_tokenization("a , b . I 'm"), "a, b. I'm");
    }
}
