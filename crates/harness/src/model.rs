//! What the harness needs to know of the model it serves, from its config.json.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};

pub struct ModelInfo {
    /// End-of-sequence token ids.
    pub eos_ids: Vec<u64>,
    pub vocab_size: u64,
    /// The longest context (`max_position_embeddings`).
    pub max_context: u64,
    /// Whether the server embeds with it: a sentence-transformers export (`modules.json`), or
    /// a bare `*Model` with no language-model head, as the server decides.
    pub embeds: bool,
}

impl ModelInfo {
    pub fn read(dir: &Path) -> Result<ModelInfo> {
        let path = dir.join("config.json");
        let config: Value = serde_json::from_slice(&std::fs::read(&path)?)
            .with_context(|| path.display().to_string())?;
        // Multimodal configs keep the language model's numbers in `text_config`.
        let text = config.get("text_config").unwrap_or(&config);
        let eos_ids = match &text["eos_token_id"] {
            Value::Array(ids) => ids.iter().filter_map(Value::as_u64).collect(),
            id => id.as_u64().into_iter().collect(),
        };
        Ok(ModelInfo {
            eos_ids,
            vocab_size: text["vocab_size"]
                .as_u64()
                .context("config.json: vocab_size")?,
            max_context: text["max_position_embeddings"].as_u64().unwrap_or(32_768),
            embeds: dir.join("modules.json").exists()
                || config["architectures"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|name| name.as_str().is_some_and(|name| name.ends_with("Model"))),
        })
    }

    /// A `logit_bias` that adds `bias` to every end-of-sequence token: +100 ends a generation
    /// at once, -100 keeps it going to `max_tokens`.
    pub fn eos_bias(&self, bias: i32) -> Value {
        let entries: Map<String, Value> = self
            .eos_ids
            .iter()
            .map(|id| (id.to_string(), json!(bias)))
            .collect();
        Value::Object(entries)
    }
}
