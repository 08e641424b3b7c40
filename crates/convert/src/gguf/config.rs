//! The Hugging Face `config.json` and `generation_config.json` of a GGUF's model, from its
//! `{arch}.*` hyper-parameters, for the architectures oxlm converts: `llama`, `qwen2`, `qwen3` and
//! `gemma3` (text only).
//!
//! A GGUF leaves out what llama.cpp hard-codes per architecture (Gemma 3's sliding-window
//! pattern and local RoPE base, its query scale); those come from llama.cpp's loader
//! (`llama-model.cpp`), so that the config describes the model llama.cpp runs from the same file.

use serde_json::{json, Map, Value};

use super::{GgmlType, GgufError, GgufFile, MetadataValue};

/// The architectures [`hf_config`] knows, as `general.architecture` names them.
pub const SUPPORTED_ARCHITECTURES: [&str; 4] = ["llama", "qwen2", "qwen3", "gemma3"];

/// llama.cpp's token type of a control token (`LLAMA_TOKEN_TYPE_CONTROL`).
pub(crate) const CONTROL: i64 = 3;

/// The special ids a config names: `tokenizer.ggml.{name}_token_id` and its config key.
const SPECIAL_IDS: [(&str, &str); 3] = [
    ("bos", "bos_token_id"),
    ("eos", "eos_token_id"),
    ("padding", "pad_token_id"),
];

/// Tokens llama.cpp ends generation on, besides `eos` / `eot` / `eom`, when the vocabulary has
/// them (`llama_vocab::impl::load`, the `special_eog_ids` by name).
const END_OF_GENERATION: [&str; 20] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
];

/// Typed reads of metadata: absent is `None`, present with the wrong type an error naming the key.
impl GgufFile {
    pub(crate) fn uint(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key)
            .map(|v| match v {
                MetadataValue::Bool(_) => None,
                v => v.as_i64().and_then(|n| u64::try_from(n).ok()),
            })
            .map(|n| n.ok_or_else(|| self.metadata_error(key, "not an unsigned integer")))
            .transpose()
    }

    pub(crate) fn required_uint(&self, key: &str) -> Result<u64, GgufError> {
        self.uint(key)?
            .ok_or_else(|| self.metadata_error(key, "missing"))
    }

    /// A number. An `f32` is given as the shortest decimal that reads back as that `f32`
    /// (`1e-5`, not `9.999999747378752e-6`), as the checkpoint's config.json had it.
    pub(crate) fn float(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key)
            .map(|v| match *v {
                MetadataValue::F32(x) => x.to_string().parse().ok(),
                MetadataValue::Bool(_) => None,
                ref v => v.as_f64(),
            })
            .map(|x| x.ok_or_else(|| self.metadata_error(key, "not a number")))
            .transpose()
    }

    pub(crate) fn string(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.metadata_error(key, "not a string"))
            })
            .transpose()
    }

    pub(crate) fn bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key)
            .map(|v| match *v {
                MetadataValue::Bool(b) => Ok(b),
                _ => Err(self.metadata_error(key, "not a boolean")),
            })
            .transpose()
    }

    pub(crate) fn string_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .and_then(|items| items.iter().map(MetadataValue::as_str).collect())
                    .ok_or_else(|| self.metadata_error(key, "not an array of strings"))
            })
            .transpose()
    }

    pub(crate) fn int_array(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .and_then(|items| items.iter().map(MetadataValue::as_i64).collect())
                    .ok_or_else(|| self.metadata_error(key, "not an array of integers"))
            })
            .transpose()
    }

    /// `tokenizer.ggml.{name}_token_id`, checked to be one of the `vocab` tokens.
    pub(crate) fn token_id(&self, name: &str, vocab: usize) -> Result<Option<u32>, GgufError> {
        let key = format!("tokenizer.ggml.{name}_token_id");
        match self.uint(&key)? {
            Some(id) if id < vocab as u64 => Ok(Some(id as u32)),
            Some(id) => Err(self.metadata_error(
                &key,
                format!("{id} is past the vocabulary's {vocab} tokens"),
            )),
            None => Ok(None),
        }
    }
}

/// The attention's shape, which the architectures' own keys build on.
struct Attention {
    hidden: usize,
    layers: usize,
    heads: usize,
    head_dim: usize,
    /// How many of a head's features RoPE turns.
    rotary: usize,
}

/// The model's Hugging Face `config.json`, as `transformers` would write it for this checkpoint.
pub fn hf_config(gguf: &GgufFile) -> Result<Value, GgufError> {
    let arch = gguf.architecture()?;
    if !SUPPORTED_ARCHITECTURES.contains(&arch) {
        return Err(gguf.metadata_error(
            "general.architecture",
            format!(
                "`{arch}` is not supported (supported: {})",
                SUPPORTED_ARCHITECTURES.join(", ")
            ),
        ));
    }
    let key = |name: &str| format!("{arch}.{name}");
    let uint = |name: &str| gguf.required_uint(&key(name)).map(|n| n as usize);
    // Mixtral's GGUFs say `llama`: their experts would be dropped without a word.
    if let Some(experts) = gguf.uint(&key("expert_count"))?.filter(|&n| n > 0) {
        return Err(gguf.metadata_error(
            &key("expert_count"),
            format!("{experts} experts: oxlm converts dense `{arch}` models only"),
        ));
    }
    let hidden = uint("embedding_length")?;
    let heads = uint("attention.head_count")?;
    if heads == 0 {
        return Err(gguf.metadata_error(&key("attention.head_count"), "is 0"));
    }
    let head_dim = match gguf.uint(&key("attention.key_length"))? {
        Some(n) => n as usize,
        None => hidden / heads,
    };
    // Hugging Face configs have one `head_dim` for queries, keys and values.
    if let Some(v) = gguf.uint(&key("attention.value_length"))? {
        if v as usize != head_dim {
            return Err(gguf.metadata_error(
                &key("attention.value_length"),
                format!("{v} differs from the key length {head_dim}, which oxlm cannot convert"),
            ));
        }
    }
    let attention = Attention {
        hidden,
        layers: uint("block_count")?,
        heads,
        head_dim,
        rotary: match gguf.uint(&key("rope.dimension_count"))? {
            Some(n) => n as usize,
            None => head_dim,
        },
    };
    let eps_key = key("attention.layer_norm_rms_epsilon");
    let eps = gguf
        .float(&eps_key)?
        .ok_or_else(|| gguf.metadata_error(&eps_key, "missing"))?;
    // llama.cpp's default base when a file leaves it out.
    let rope_theta = gguf.float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    let vocab = vocab_size(gguf, arch)?;
    let kv_heads = match gguf.uint(&key("attention.head_count_kv"))? {
        Some(n) => n as usize,
        None => heads,
    };

    let mut config = Map::new();
    let mut set = |k: &str, v: Value| config.insert(k.to_string(), v);
    set("hidden_size", hidden.into());
    set("num_hidden_layers", attention.layers.into());
    set("intermediate_size", uint("feed_forward_length")?.into());
    set("num_attention_heads", heads.into());
    set("num_key_value_heads", kv_heads.into());
    set("rms_norm_eps", eps.into());
    set("rope_theta", rope_theta.into());
    set("max_position_embeddings", uint("context_length")?.into());
    set("vocab_size", vocab.into());
    set(
        "tie_word_embeddings",
        gguf.tensor("output.weight").is_none().into(),
    );
    set("torch_dtype", torch_dtype(gguf).into());
    for (name, hf_key) in SPECIAL_IDS {
        if let Some(id) = gguf.token_id(name, vocab)? {
            set(hf_key, id.into());
        }
    }
    let rope_scaling = rope_scaling(gguf, arch, attention.rotary, rope_theta)?;
    config.extend(match arch {
        "gemma3" => gemma3(gguf, &attention, rope_scaling)?,
        _ => llama_family(gguf, arch, &attention, rope_scaling),
    });
    Ok(Value::Object(config))
}

/// Gemma 3's own keys. A GGUF keeps only its sliding window: llama.cpp hard-codes every 6th
/// layer global, sliding layers on RoPE base 10000, and queries scaled by 1/√(hidden / heads)
/// in the 27B model (62 layers), by 1/√head_dim in the others; it has no soft-capping.
fn gemma3(
    gguf: &GgufFile,
    attention: &Attention,
    rope_scaling: Option<Value>,
) -> Result<Map<String, Value>, GgufError> {
    let &Attention {
        hidden,
        layers,
        heads,
        head_dim,
        rotary,
    } = attention;
    if rotary != head_dim {
        return Err(gguf.metadata_error(
            "gemma3.rope.dimension_count",
            format!("{rotary} of {head_dim} features: Gemma 3 turns them all"),
        ));
    }
    let window = gguf.required_uint("gemma3.attention.sliding_window")?;
    let pattern = 6;
    let query_scale = if layers == 62 {
        hidden / heads
    } else {
        head_dim
    };
    let layer_types: Vec<&str> = (1..=layers)
        .map(|i| match i % pattern {
            0 => "full_attention",
            _ => "sliding_attention",
        })
        .collect();
    let keys = [
        ("architectures", json!(["Gemma3ForCausalLM"])),
        ("model_type", json!("gemma3_text")),
        ("head_dim", json!(head_dim)),
        ("query_pre_attn_scalar", json!(query_scale)),
        ("hidden_activation", json!("gelu_pytorch_tanh")),
        ("sliding_window", json!(window)),
        ("sliding_window_pattern", json!(pattern)),
        ("layer_types", json!(layer_types)),
        ("rope_local_base_freq", json!(10_000.0)),
        ("rope_scaling", json!(rope_scaling)),
        ("final_logit_softcapping", Value::Null),
        ("attn_logit_softcapping", Value::Null),
        ("attention_bias", json!(false)),
    ];
    Ok(keys.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// The keys of the llama-like architectures: Llama (biases as its tensors say), Qwen2 (q/k/v
/// biases, heads as wide as the model over the heads) and Qwen3 (q/k norms, its own head width).
fn llama_family(
    gguf: &GgufFile,
    arch: &str,
    attention: &Attention,
    rope_scaling: Option<Value>,
) -> Map<String, Value> {
    let (class, model_type) = match arch {
        "llama" => ("LlamaForCausalLM", "llama"),
        "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
        _ => ("Qwen3ForCausalLM", "qwen3"),
    };
    let mut keys = Map::new();
    let mut set = |k: &str, v: Value| keys.insert(k.to_string(), v);
    set("architectures", json!([class]));
    set("model_type", model_type.into());
    set("hidden_act", "silu".into());
    // Qwen2's config has no head_dim: its heads are as wide as the model over the heads.
    let head_dim = attention.head_dim;
    if arch != "qwen2" || head_dim != attention.hidden / attention.heads {
        set("head_dim", head_dim.into());
    }
    if attention.rotary != head_dim {
        let fraction = attention.rotary as f64 / head_dim as f64;
        set("partial_rotary_factor", fraction.into());
    }
    if let Some(scaling) = rope_scaling {
        set("rope_scaling", scaling);
    }
    match arch {
        "llama" => {
            let bias = |name: &str| gguf.tensor(name).is_some();
            set("attention_bias", bias("blk.0.attn_q.bias").into());
            set("mlp_bias", bias("blk.0.ffn_up.bias").into());
        }
        "qwen2" => {
            set("use_sliding_window", false.into());
        }
        _ => {
            set("attention_bias", false.into());
            set("use_sliding_window", false.into());
        }
    }
    keys
}

/// `generation_config.json`: the special ids, with as `eos_token_id` every token llama.cpp stops
/// generating at (`<|im_end|>` and `<|endoftext|>` for Qwen2.5, `<eos>` and `<end_of_turn>` for
/// Gemma 3), as the checkpoints' own generation configs list them.
pub fn generation_config(gguf: &GgufFile) -> Result<Value, GgufError> {
    let tokens = gguf
        .string_array("tokenizer.ggml.tokens")?
        .unwrap_or_default();
    let types = gguf
        .int_array("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    let vocab = if tokens.is_empty() {
        usize::MAX
    } else {
        tokens.len()
    };
    let mut config = Map::new();
    for (name, hf_key) in [SPECIAL_IDS[0], SPECIAL_IDS[2]] {
        if let Some(id) = gguf.token_id(name, vocab)? {
            config.insert(hf_key.into(), id.into());
        }
    }
    let mut eos = Vec::new();
    for name in ["eos", "eot", "eom"] {
        eos.extend(gguf.token_id(name, vocab)?);
    }
    let named = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (token, &kind))| kind == CONTROL && END_OF_GENERATION.contains(token))
        .map(|(id, _)| id as u32);
    for id in named {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    match eos.as_slice() {
        [] => {}
        [one] => {
            config.insert("eos_token_id".into(), (*one).into());
        }
        all => {
            config.insert("eos_token_id".into(), json!(all));
        }
    }
    Ok(Value::Object(config))
}

/// The vocabulary's size: its token list, else `{arch}.vocab_size`, else the embedding's rows.
fn vocab_size(gguf: &GgufFile, arch: &str) -> Result<usize, GgufError> {
    if let Some(tokens) = gguf.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
        return Ok(tokens.len());
    }
    if let Some(n) = gguf.uint(&format!("{arch}.vocab_size"))? {
        return Ok(n as usize);
    }
    match gguf.tensor("token_embd.weight") {
        Some(t) if t.shape.len() == 2 => Ok(t.shape[0]),
        _ => Err(gguf.metadata_error(
            "tokenizer.ggml.tokens",
            format!("missing, and so are `{arch}.vocab_size` and a 2-D `token_embd.weight`"),
        )),
    }
}

/// bfloat16 for a file that keeps tensors in bf16; float16 otherwise: GGUF's block
/// quantizations store their scales in f16, so their weights fit f16's range.
fn torch_dtype(gguf: &GgufFile) -> &'static str {
    match gguf.tensors.iter().any(|t| t.ggml_type == GgmlType::BF16) {
        true => "bfloat16",
        false => "float16",
    }
}

/// `rope_scaling` from `{arch}.rope.scaling.*` (linear, YaRN), the older `rope.scale_linear`, or
/// for Llama 3.1 and later the per-frequency factors llama.cpp stores as `rope_freqs.weight`.
fn rope_scaling(
    gguf: &GgufFile,
    arch: &str,
    rotary: usize,
    theta: f64,
) -> Result<Option<Value>, GgufError> {
    let key = |name: &str| format!("{arch}.rope.{name}");
    let factor = || {
        gguf.float(&key("scaling.factor"))?
            .ok_or_else(|| gguf.metadata_error(&key("scaling.factor"), "missing"))
    };
    let kind = gguf.string(&key("scaling.type"))?;
    let scaling = match kind {
        Some("linear") => json!({"rope_type": "linear", "factor": factor()?}),
        Some("yarn") => {
            let mut yarn = json!({"rope_type": "yarn", "factor": factor()?});
            if let Some(n) = gguf.uint(&key("scaling.original_context_length"))? {
                yarn["original_max_position_embeddings"] = n.into();
            }
            for (gguf_name, hf_name) in [
                ("scaling.yarn_beta_fast", "beta_fast"),
                ("scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(v) = gguf.float(&key(gguf_name))? {
                    yarn[hf_name] = v.into();
                }
            }
            yarn
        }
        None | Some("none") => match gguf.float(&key("scale_linear"))? {
            Some(f) if f != 1.0 => json!({"rope_type": "linear", "factor": f}),
            _ => return llama3_scaling(gguf, rotary, theta),
        },
        Some(other) => {
            return Err(gguf.metadata_error(
                &key("scaling.type"),
                format!("`{other}` is not supported (supported: none, linear, yarn)"),
            ))
        }
    };
    Ok(Some(scaling))
}

/// Llama 3.1's scaling, which a GGUF keeps only as its result: one factor per rotary frequency
/// in `rope_freqs.weight`. Meta's releases all use low/high frequency factors 1 and 4 over an
/// original context of 8192; the scaling factor is the largest of the factors. The factors are
/// recomputed from those and must match the file's, or the file is refused.
fn llama3_scaling(gguf: &GgufFile, rotary: usize, theta: f64) -> Result<Option<Value>, GgufError> {
    let Some(tensor) = gguf.tensor("rope_freqs.weight") else {
        return Ok(None);
    };
    let refuse = |reason: String| gguf.metadata_error("rope_freqs.weight", reason);
    if tensor.ggml_type != GgmlType::F32 || tensor.elements() != rotary / 2 {
        return Err(refuse(format!(
            "{} {:?}, not the {} F32 factors of the rotary frequencies",
            tensor.ggml_type.name(),
            tensor.shape,
            rotary / 2
        )));
    }
    let stored: Vec<f64> = gguf
        .tensor_data(tensor)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
        .collect();
    let factor = stored.iter().copied().fold(1.0, f64::max);
    let (low, high, old_context) = (1.0, 4.0, 8192.0);
    let expected = (0..rotary / 2).map(|i| {
        let wavelen = 2.0 * std::f64::consts::PI * theta.powf(2.0 * i as f64 / rotary as f64);
        if wavelen < old_context / high {
            1.0
        } else if wavelen > old_context / low {
            factor
        } else {
            let smooth = (old_context / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor + smooth)
        }
    });
    if let Some((i, (want, got))) = expected
        .zip(&stored)
        .enumerate()
        .find(|(_, (want, got))| (want - **got).abs() > 1e-4 * want.abs())
    {
        return Err(refuse(format!(
            "factor {i} is {got}, not the {want} of Llama 3 scaling by {factor} \
             (low/high frequency factors 1 and 4, original context 8192)"
        )));
    }
    Ok(Some(json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_context as u64,
    })))
}
