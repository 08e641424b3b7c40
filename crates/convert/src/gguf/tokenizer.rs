//! The Hugging Face `tokenizer.json` and `tokenizer_config.json` of a GGUF's vocabulary, rebuilt
//! from its `tokenizer.ggml.*` metadata as transformers 5.24 rebuilds them when it loads a GGUF
//! (`integrations/gguf/gguf_tokenizer_mapping.py`), and where the two differ, as llama.cpp
//! tokenizes (its pre-tokenizer regexes in `llama-vocab.cpp`).
//!
//! Two kinds of vocabulary:
//! - `gpt2`: byte-level BPE with the file's merges, split first by the regex `tokenizer.ggml.pre`
//!   names;
//! - `llama` (SentencePiece) of the Gemma models: BPE over `▁`-for-space text with byte fallback,
//!   whose merges the file does not keep: they are rebuilt from the order of the tokens.
//!
//! Control tokens become special added tokens and user-defined ones (`<tool_call>`, Gemma's runs
//! of newlines) plain added tokens, so that both are matched whole in the text.

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Map, Value};

use super::config::CONTROL;
use super::{GgufError, GgufFile};

/// llama.cpp's token type of an added token that is not special (`LLAMA_TOKEN_TYPE_USER_DEFINED`).
const USER_DEFINED: i64 = 4;

/// The architectures whose SentencePiece vocabulary converts: transformers rebuilds only Gemma's
/// (as `GemmaTokenizer`) from the bare vocabulary a GGUF keeps.
const SENTENCEPIECE_ARCHITECTURES: [&str; 3] = ["gemma", "gemma2", "gemma3"];

/// The `tokenizer.ggml.pre` values of byte-level vocabularies that convert.
const BYTE_LEVEL_PRE: &str = "smollm, qwen2, llama-bpe (llama3, llama-v3), gpt-2";

/// Qwen2's split: single digits, letters with one leading non-letter, newlines kept with the
/// punctuation before them.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split: Qwen2's with numbers in groups of up to three digits.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The two files a Hugging Face model directory keeps its tokenizer in.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    /// `tokenizer.json`, as the `tokenizers` library reads it.
    pub tokenizer_json: Value,
    /// `tokenizer_config.json`: the transformers class, special tokens, chat template.
    pub tokenizer_config: Value,
}

/// What one kind of vocabulary makes of the file.
struct Pipeline {
    /// The BPE model's tokens, spelled as the model matches them, to their ids.
    vocab: HashMap<String, u32>,
    merges: Vec<(String, String)>,
    /// The BPE model's settings other than its vocabulary and merges.
    bpe: Value,
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// The transformers tokenizer class whose own pipeline is this one: transformers and oxlm
    /// rebuild the pipeline of a registered class from the vocabulary and merges.
    class: &'static str,
    /// Whether to prepend BOS where the file does not say (transformers' and llama.cpp's default
    /// for the kind of vocabulary).
    add_bos_default: bool,
}

/// The tokenizer files of the GGUF's vocabulary.
pub fn tokenizer_files(gguf: &GgufFile) -> Result<TokenizerFiles, GgufError> {
    let tokens = gguf
        .string_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| gguf.metadata_error("tokenizer.ggml.tokens", "missing"))?;
    let types = match gguf.int_array("tokenizer.ggml.token_type")? {
        Some(types) if types.len() != tokens.len() => {
            return Err(gguf.metadata_error(
                "tokenizer.ggml.token_type",
                format!("{} types for {} tokens", types.len(), tokens.len()),
            ))
        }
        types => types.unwrap_or_default(),
    };
    let model = gguf
        .string("tokenizer.ggml.model")?
        .ok_or_else(|| gguf.metadata_error("tokenizer.ggml.model", "missing"))?;
    let pipeline = match model {
        "gpt2" => byte_level(gguf, &tokens)?,
        "llama" => sentencepiece(gguf, &tokens)?,
        other => {
            return Err(gguf.metadata_error(
                "tokenizer.ggml.model",
                format!(
                    "`{other}` is not supported (supported: gpt2, byte-level BPE; llama, \
                     SentencePiece, for {})",
                    SENTENCEPIECE_ARCHITECTURES.join(", ")
                ),
            ))
        }
    };

    let id = |name: &str| gguf.token_id(name, tokens.len());
    let (bos, eos) = (id("bos")?, id("eos")?);
    let special = [
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", id("unknown")?),
        ("pad_token", id("padding")?),
    ];
    let added = added_tokens(&tokens, &types, &pipeline, &special);
    // llama.cpp refuses a file that asks for a BOS or EOS it does not name.
    let flag = |name: &str, default: bool, token: Option<u32>| -> Result<bool, GgufError> {
        let on = gguf
            .bool(&format!("tokenizer.ggml.add_{name}_token"))?
            .unwrap_or(default);
        match (on, token) {
            (true, None) => Err(gguf.metadata_error(
                &format!("tokenizer.ggml.{name}_token_id"),
                format!("missing, but add_{name}_token is on"),
            )),
            (on, _) => Ok(on),
        }
    };
    let add_bos = flag("bos", pipeline.add_bos_default, bos)?;
    let add_eos = flag("eos", false, eos)?;
    let named = |id: Option<u32>| id.map(|id| (tokens[id as usize], id));
    let post_processor = template_processing(
        named(bos).filter(|_| add_bos),
        named(eos).filter(|_| add_eos),
    );

    let names = special.map(|(key, id)| (key, named(id).map(|(token, _)| token)));
    Ok(TokenizerFiles {
        tokenizer_config: tokenizer_config(
            gguf,
            pipeline.class,
            [add_bos, add_eos],
            &names,
            &added,
        )?,
        tokenizer_json: tokenizer_json(pipeline, &added, post_processor),
    })
}

fn tokenizer_json(
    pipeline: Pipeline,
    added: &BTreeMap<u32, Added>,
    post_processor: Value,
) -> Value {
    // In id order (where serde_json keeps the order, as in the oxlm binary), as the tokenizers
    // library writes a vocabulary.
    let mut vocab: Vec<(String, u32)> = pipeline.vocab.into_iter().collect();
    vocab.sort_by_key(|&(_, id)| id);
    let mut model = pipeline.bpe;
    model["vocab"] = Value::Object(
        vocab
            .into_iter()
            .map(|(token, id)| (token, id.into()))
            .collect(),
    );
    model["merges"] = pipeline
        .merges
        .into_iter()
        .map(|(left, right)| json!([left, right]))
        .collect();
    let added: Vec<Value> = added
        .iter()
        .map(|(&id, token)| {
            let mut entry = added_token_json(token);
            entry["id"] = id.into();
            entry
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": pipeline.normalizer,
        "pre_tokenizer": pipeline.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": pipeline.decoder,
        "model": model,
    })
}

/// `tokenizer_config.json`: what transformers (and oxlm's runtime, which loads as it does) reads
/// besides tokenizer.json. `[add_bos, add_eos]`; `special`: each special token's key and text.
fn tokenizer_config(
    gguf: &GgufFile,
    class: &str,
    [add_bos, add_eos]: [bool; 2],
    special: &[(&str, Option<&str>)],
    added: &BTreeMap<u32, Added>,
) -> Result<Value, GgufError> {
    let mut config = Map::new();
    config.insert("tokenizer_class".into(), class.into());
    config.insert("add_bos_token".into(), add_bos.into());
    config.insert("add_eos_token".into(), add_eos.into());
    // A token the file does not name is null, not absent: absent, the class's default applies
    // (Qwen2Tokenizer's unk_token is `<|endoftext|>`).
    for &(key, token) in special {
        config.insert(key.into(), token.into());
    }
    config.insert("clean_up_tokenization_spaces".into(), false.into());
    let arch = gguf.architecture()?;
    if let Some(context) = gguf.uint(&format!("{arch}.context_length"))? {
        config.insert("model_max_length".into(), context.into());
    }
    let decoder: Map<String, Value> = added
        .iter()
        .map(|(id, token)| (id.to_string(), added_token_json(token)))
        .collect();
    config.insert("added_tokens_decoder".into(), decoder.into());
    if let Some(template) = gguf.string("tokenizer.chat_template")? {
        config.insert("chat_template".into(), template.into());
    }
    Ok(Value::Object(config))
}

/// An added token: its text and whether it is special.
struct Added {
    content: String,
    special: bool,
}

/// One `added_tokens` entry (without its id, which `tokenizer.json` has and
/// `added_tokens_decoder` keys by): matched as written, never normalized.
fn added_token_json(token: &Added) -> Value {
    json!({
        "content": token.content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": token.special,
    })
}

/// The added tokens by id, as transformers adds them (`add_gguf_special_tokens`, then the named
/// special tokens its `TokenizersBackend.__init__` adds): control tokens as special ones, then
/// user-defined tokens the vocabulary has as plain ones, then any named special token not yet
/// added; each only if the vocabulary has it as written. A byte-level vocabulary holds only
/// tokens spelled in its byte alphabet, so a control token spelled otherwise is one llama.cpp
/// mislabelled, and is left out, as transformers leaves it out.
fn added_tokens(
    tokens: &[&str],
    types: &[i64],
    pipeline: &Pipeline,
    special: &[(&str, Option<u32>)],
) -> BTreeMap<u32, Added> {
    let mut added = BTreeMap::new();
    let mut add = |token: &str, special: bool| {
        if let Some(&id) = pipeline.vocab.get(token) {
            added.entry(id).or_insert_with(|| Added {
                content: token.to_string(),
                special,
            });
        }
    };
    let typed = |kind: i64| {
        tokens
            .iter()
            .zip(types)
            .filter(move |&(_, &t)| t == kind)
            .map(|(token, _)| *token)
    };
    for token in typed(CONTROL) {
        add(token, true);
    }
    for token in typed(USER_DEFINED) {
        add(token, false);
    }
    for id in special.iter().filter_map(|&(_, id)| id) {
        add(tokens[id as usize], true);
    }
    added
}

/// transformers' `TemplateProcessing` for `add_bos_token` / `add_eos_token`: BOS before and EOS
/// after each sequence (`update_post_processor`).
fn template_processing(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Value {
    let sequence = |type_id: u32| {
        let mut pieces = Vec::new();
        if let Some((token, _)) = bos {
            pieces.push(json!({"SpecialToken": {"id": token, "type_id": type_id}}));
        }
        let name = if type_id == 0 { "A" } else { "B" };
        pieces.push(json!({"Sequence": {"id": name, "type_id": type_id}}));
        if let Some((token, _)) = eos {
            pieces.push(json!({"SpecialToken": {"id": token, "type_id": type_id}}));
        }
        pieces
    };
    let special_tokens: Map<String, Value> = bos
        .into_iter()
        .chain(eos)
        .map(|(token, id)| {
            let entry = json!({"id": token, "ids": [id], "tokens": [token]});
            (token.to_string(), entry)
        })
        .collect();
    let pair = [sequence(0), sequence(1)].concat();
    json!({
        "type": "TemplateProcessing",
        "single": sequence(0),
        "pair": pair,
        "special_tokens": special_tokens,
    })
}

/// GPT-2's byte alphabet (`bytes_to_unicode`): each byte as a printable character, the printable
/// ASCII and Latin-1 ones as themselves, the others from U+0100 on.
fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    std::array::from_fn(|b| {
        let b = b as u8;
        if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
            next += 1;
            c
        }
    })
}

/// A byte-level BPE vocabulary (`gpt2`), its merges from the file.
fn byte_level(gguf: &GgufFile, tokens: &[&str]) -> Result<Pipeline, GgufError> {
    let pre = gguf.string("tokenizer.ggml.pre")?.ok_or_else(|| {
        gguf.metadata_error(
            "tokenizer.ggml.pre",
            format!(
                "missing: a gpt2 vocabulary needs its pre-tokenizer ({BYTE_LEVEL_PRE}), and \
                 llama.cpp's fallback for a file without one tokenizes poorly"
            ),
        )
    })?;
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    let (normalizer, pre_tokenizer, class) = match pre {
        // Every digit apart, then GPT-2's regex: llama.cpp's `\p{N}` split first, SmolLM2's own
        // tokenizer.json. (transformers has no split for `smollm` and falls back to GPT-2's,
        // which keeps a space with a non-ASCII numeral: ` ½`.)
        "smollm" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            "TokenizersBackend",
        ),
        // Qwen2Tokenizer's pipeline, NFC included: transformers and oxlm load a model_type qwen2
        // directory as Qwen2Tokenizer, which normalizes with NFC whatever tokenizer.json says.
        "qwen2" => (json!({"type": "NFC"}), split(QWEN2_SPLIT), "Qwen2Tokenizer"),
        "llama-bpe" | "llama3" | "llama-v3" => {
            (Value::Null, split(LLAMA3_SPLIT), "TokenizersBackend")
        }
        "gpt-2" => (Value::Null, byte_level(true), "TokenizersBackend"),
        other => {
            return Err(gguf.metadata_error(
                "tokenizer.ggml.pre",
                format!(
                "`{other}` is not supported for a gpt2 vocabulary (supported: {BYTE_LEVEL_PRE})"
            ),
            ))
        }
    };

    // A token spelled outside the byte alphabet (a special token with a space, say) is looked up
    // as its UTF-8 bytes spelled in it.
    let alphabet = byte_alphabet();
    let spelled = |token: &str| -> String {
        if token.chars().all(|c| alphabet.contains(&c)) {
            token.to_string()
        } else {
            token.bytes().map(|b| alphabet[b as usize]).collect()
        }
    };
    let vocab = vocabulary(tokens.iter().map(|t| spelled(t)));

    let key = "tokenizer.ggml.merges";
    let listed = gguf.string_array(key)?.ok_or_else(|| {
        gguf.metadata_error(
            key,
            "missing: a gpt2 (byte-level BPE) vocabulary needs its merges",
        )
    })?;
    let mut merges = Vec::with_capacity(listed.len());
    for (i, merge) in listed.iter().enumerate() {
        let pair = merge.split_once(' ').filter(|(left, right)| {
            [*left, *right, &format!("{left}{right}")]
                .iter()
                .all(|t| vocab.contains_key(*t))
        });
        let Some((left, right)) = pair else {
            return Err(gguf.metadata_error(
                key,
                format!(
                    "merge {i} `{merge}` is not two tokens of the vocabulary whose join is one"
                ),
            ));
        };
        merges.push((left.to_string(), right.to_string()));
    }
    Ok(Pipeline {
        vocab,
        merges,
        bpe: json!({
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
        }),
        normalizer,
        pre_tokenizer,
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        class,
        add_bos_default: false,
    })
}

/// Gemma's SentencePiece vocabulary as `GemmaTokenizer`: spaces written `▁`, BPE with byte
/// fallback (the `<0x..>` tokens) and merges rebuilt from the vocabulary.
fn sentencepiece(gguf: &GgufFile, tokens: &[&str]) -> Result<Pipeline, GgufError> {
    let arch = gguf.architecture()?;
    if !SENTENCEPIECE_ARCHITECTURES.contains(&arch) {
        return Err(gguf.metadata_error(
            "tokenizer.ggml.model",
            format!(
                "`llama` (SentencePiece) converts for {} only, not for `{arch}`",
                SENTENCEPIECE_ARCHITECTURES.join(", ")
            ),
        ));
    }
    // GemmaTokenizer never prepends a space; llama.cpp would, so such a file cannot convert.
    if gguf.bool("tokenizer.ggml.add_space_prefix")? == Some(true) {
        return Err(gguf.metadata_error(
            "tokenizer.ggml.add_space_prefix",
            "true, which Gemma's tokenizer does not do",
        ));
    }
    // Gemma's GGUFs write the tokens of two or more spaces with real spaces, which the text,
    // its spaces turned into `▁`, never matches: respell them.
    let respelled = |token: &str| -> String {
        if token.contains(' ') && token.chars().all(char::is_whitespace) {
            token.replace(' ', "\u{2581}")
        } else {
            token.to_string()
        }
    };
    let spelled: Vec<String> = tokens.iter().map(|t| respelled(t)).collect();
    let vocab = vocabulary(spelled.iter().cloned());
    let merges = merges_from_order(&spelled, &vocab);
    let unk = match gguf.token_id("unknown", tokens.len())? {
        Some(id) => tokens[id as usize],
        None => "<unk>",
    };
    Ok(Pipeline {
        vocab,
        merges,
        bpe: json!({
            "type": "BPE",
            "dropout": null,
            "unk_token": unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
        }),
        normalizer: json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
        pre_tokenizer: json!({
            "type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false,
        }),
        decoder: json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]}),
        class: "GemmaTokenizer",
        add_bos_default: true,
    })
}

/// Token → id, a token listed twice keeping its last id (as a Python dict built from the list).
fn vocabulary(tokens: impl Iterator<Item = String>) -> HashMap<String, u32> {
    let mut vocab = HashMap::new();
    for (id, token) in tokens.enumerate() {
        vocab.insert(token, id as u32);
    }
    vocab
}

/// The merges a SentencePiece vocabulary implies, as transformers' `generate_merges` derives
/// them for Gemma: every cut of a token into two tokens of the vocabulary, ranked by the merged
/// token's place in the file (earlier first: Gemma's scores do not follow its merge order, the
/// order of its tokens does), then longer left part first.
fn merges_from_order(tokens: &[String], vocab: &HashMap<String, u32>) -> Vec<(String, String)> {
    let mut merges = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        // A token listed twice ranks at the place the vocabulary keeps, its last.
        if vocab.get(token) != Some(&(id as u32)) {
            continue;
        }
        for (cut, _) in token.char_indices().rev() {
            let (left, right) = token.split_at(cut);
            if cut > 0 && vocab.contains_key(left) && vocab.contains_key(right) {
                merges.push((left.to_string(), right.to_string()));
            }
        }
    }
    merges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let alphabet = byte_alphabet();
        assert_eq!(
            (alphabet[b' ' as usize], alphabet[b'\n' as usize]),
            ('Ġ', 'Ċ')
        );
        assert_eq!((alphabet[b'a' as usize], alphabet[0xAD]), ('a', 'Ń'));
        let mut sorted = alphabet.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    #[test]
    fn merges_rank_by_token_order_then_longer_left_part() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "abc", "bc", "x", "x"]
            .map(String::from)
            .to_vec();
        let vocab = vocabulary(tokens.iter().cloned());
        assert_eq!(vocab["x"], 7);
        let merges = merges_from_order(&tokens, &vocab);
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|(l, r)| (l.as_str(), r.as_str()))
            .collect();
        assert_eq!(pairs, [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]);
    }
}
