//! Prompt caches on disk, in mlx-lm's format: the state of a model after a prompt, which
//! `oxlm cache-prompt` (`mlx_lm.cache_prompt`) writes and `oxlm generate --prompt-cache-file`
//! (`mlx_lm generate`) continues from. Files are interchangeable with mlx-lm's for the same
//! model.
//!
//! The file is a safetensors file (`save_prompt_cache`): its arrays are the leaves of
//! `[c.state for c in cache]` flattened as `mlx.utils.tree_flatten` names them (`"3.0"`: layer 3's
//! keys), and its metadata is the flattened `[metadata, cache_classes, scalars]`: `"0.model"`,
//! `"0.tokenizer_config"`; `"1.3"`: layer 3's class; `"2.0"`: `""`, then `"2.k.0"` and `"2.k.1"`
//! naming the k-th array that stands for a number (`"scalar"`, a 0-d array) or for `None`
//! (`"none"`, an empty array). What each class's state holds is
//! [`oxlm_models::cache_state`]'s.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use oxlm_engine::DType;
use oxlm_models::cache_state::{CacheStateError, LayerState, StateArray, StateItem};
use oxlm_models::checkpoint::engine_dtype;
use oxlm_models::save::{write_safetensors_with_metadata, SaveError, TensorBytes};
use oxlm_models::Cache;
use serde_json::{Map, Value};
use thiserror::Error;

use crate::chat_template::{write_json_string, ChatTemplate, ChatTemplateError};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// The metadata key naming the model the cache was made with (as `cache_prompt` was given it).
pub const MODEL_KEY: &str = "model";
/// The metadata key holding the tokenizer's options, as JSON.
pub const TOKENIZER_CONFIG_KEY: &str = "tokenizer_config";

#[derive(Debug, Error)]
pub enum PromptCacheFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not an mlx-lm prompt cache: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    State {
        path: PathBuf,
        source: CacheStateError,
    },
    #[error(transparent)]
    Save(#[from] SaveError),
}

/// Writes `cache` (the state after a prompt) to `path` as mlx-lm's `save_prompt_cache` does,
/// with `metadata` (`model`, `tokenizer_config`) beside it. Written under a temporary name and
/// renamed into place, so that an interrupted run leaves any earlier file whole.
pub fn save(
    path: &Path,
    cache: &Cache,
    metadata: &BTreeMap<String, String>,
) -> Result<(), PromptCacheFileError> {
    let layers = cache
        .mlx_state()
        .map_err(|source| PromptCacheFileError::State {
            path: path.to_path_buf(),
            source,
        })?;
    let mut tensors = BTreeMap::new();
    let mut meta: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (format!("0.{k}"), v.clone()))
        .collect();
    // mlx-lm's list of scalars starts with a placeholder, so that it is never empty (an empty
    // list would vanish from the flattened tree).
    meta.insert("2.0".into(), String::new());
    let mut scalars = 0;
    for (i, layer) in layers.iter().enumerate() {
        meta.insert(format!("1.{i}"), layer.class.clone());
        for (item_path, item) in &layer.items {
            let name = format!("{i}.{item_path}");
            let (bytes, kind) = match item {
                StateItem::Array(a) => (
                    TensorBytes {
                        dtype: a.dtype,
                        shape: a.shape.clone(),
                        data: Cow::Borrowed(&a.data),
                    },
                    None,
                ),
                // `mx.array(n)` of a Python int: a 0-d int32.
                StateItem::Int(n) => (scalar_bytes(*n), Some("scalar")),
                // `mx.array([])`: an empty float32 array.
                StateItem::None => (
                    TensorBytes {
                        dtype: DType::F32,
                        shape: vec![0],
                        data: Cow::Borrowed(&[]),
                    },
                    Some("none"),
                ),
            };
            if let Some(kind) = kind {
                scalars += 1;
                meta.insert(format!("2.{scalars}.0"), name.clone());
                meta.insert(format!("2.{scalars}.1"), kind.into());
            }
            tensors.insert(name, bytes);
        }
    }
    write_safetensors_with_metadata(path, &tensors, meta)?;
    Ok(())
}

fn scalar_bytes(n: i64) -> TensorBytes<'static> {
    let (dtype, data) = match i32::try_from(n) {
        Ok(n) => (DType::I32, n.to_le_bytes().to_vec()),
        Err(_) => (DType::I64, n.to_le_bytes().to_vec()),
    };
    TensorBytes {
        dtype,
        shape: Vec::new(),
        data: Cow::Owned(data),
    }
}

/// A prompt cache file read whole, its metadata parsed; [`layers`](Self::layers) reads the
/// arrays where they lie.
pub struct PromptCacheFile {
    path: PathBuf,
    bytes: Vec<u8>,
    /// `model`, `tokenizer_config` and whatever else the writer put there.
    pub metadata: BTreeMap<String, String>,
    /// Each layer's mlx-lm class.
    pub classes: Vec<String>,
    /// Array names that stand for a number (`"scalar"`) or for `None` (`"none"`).
    scalars: HashMap<String, String>,
}

impl PromptCacheFile {
    /// Reads and checks `path`: its metadata, and every array's place in the state.
    pub fn load(path: &Path) -> Result<Self, PromptCacheFileError> {
        let bytes = std::fs::read(path).map_err(|source| PromptCacheFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let format = |reason: String| PromptCacheFileError::Format {
            path: path.to_path_buf(),
            reason,
        };
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| format(format!("not a safetensors file ({e})")))?;
        let mut metadata = BTreeMap::new();
        let mut classes = BTreeMap::new();
        let mut scalar_entries: BTreeMap<usize, (Option<String>, Option<String>)> = BTreeMap::new();
        for (key, value) in header.metadata().iter().flatten() {
            let index = |text: &str| {
                text.parse::<usize>()
                    .map_err(|_| format(format!("metadata key `{key}`")))
            };
            match key.split_once('.') {
                Some(("0", name)) => _ = metadata.insert(name.to_string(), value.clone()),
                Some(("1", i)) => _ = classes.insert(index(i)?, value.clone()),
                Some(("2", "0")) => {}
                Some(("2", rest)) => {
                    let (k, field) = rest
                        .split_once('.')
                        .ok_or_else(|| format(format!("metadata key `{key}`")))?;
                    let entry = scalar_entries.entry(index(k)?).or_default();
                    match field {
                        "0" => entry.0 = Some(value.clone()),
                        "1" => entry.1 = Some(value.clone()),
                        _ => return Err(format(format!("metadata key `{key}`"))),
                    }
                }
                // MLX's own weight files say `{"format": "mlx"}`: nothing of a prompt cache.
                None if key == "format" => {}
                _ => return Err(format(format!("metadata key `{key}`"))),
            }
        }
        if classes.is_empty() {
            return Err(format("no cache classes in its metadata".into()));
        }
        if classes.keys().enumerate().any(|(i, &k)| i != k) {
            return Err(format("its cache classes are not numbered 0, 1, …".into()));
        }
        let mut scalars = HashMap::new();
        for (k, entry) in scalar_entries {
            match entry {
                (Some(name), Some(kind)) => _ = scalars.insert(name, kind),
                _ => return Err(format(format!("scalar entry {k} is incomplete"))),
            }
        }
        let file = PromptCacheFile {
            path: path.to_path_buf(),
            bytes,
            metadata,
            classes: classes.into_values().collect(),
            scalars,
        };
        file.layers()?;
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model the cache was made with, as `cache_prompt` was given it.
    pub fn model(&self) -> Option<&str> {
        self.metadata.get(MODEL_KEY).map(String::as_str)
    }

    /// The tokenizer's options the cache was made with (`{}` where the file has none).
    pub fn tokenizer_config(&self) -> Result<Map<String, Value>, PromptCacheFileError> {
        match self.metadata.get(TOKENIZER_CONFIG_KEY) {
            None => Ok(Map::new()),
            Some(text) => serde_json::from_str(text).map_err(|e| PromptCacheFileError::Format {
                path: self.path.clone(),
                reason: format!("its tokenizer_config is not a JSON object ({e})"),
            }),
        }
    }

    /// Each layer's class and state, the arrays borrowed from the file.
    pub fn layers(&self) -> Result<Vec<LayerState<'_>>, PromptCacheFileError> {
        let format = |reason: String| PromptCacheFileError::Format {
            path: self.path.clone(),
            reason,
        };
        let tensors = safetensors::SafeTensors::deserialize(&self.bytes)
            .map_err(|e| format(format!("not a safetensors file ({e})")))?;
        let mut layers: Vec<LayerState> = self
            .classes
            .iter()
            .map(|class| LayerState {
                class: class.clone(),
                items: Vec::new(),
            })
            .collect();
        for (name, view) in tensors.tensors() {
            let layer = name
                .split_once('.')
                .and_then(|(i, path)| Some((i.parse::<usize>().ok()?, path)))
                .filter(|(i, _)| *i < layers.len());
            let Some((i, path)) = layer else {
                return Err(format(format!("array `{name}` belongs to no layer")));
            };
            let dtype = engine_dtype(view.dtype())
                .ok_or_else(|| format(format!("array `{name}` of type {:?}", view.dtype())))?;
            let item = match self.scalars.get(&name).map(String::as_str) {
                Some("scalar") => StateItem::Int(
                    scalar(dtype, view.shape(), view.data())
                        .ok_or_else(|| format(format!("`{name}` is not an integer")))?,
                ),
                Some("none") => StateItem::None,
                Some(kind) => {
                    return Err(format(format!(
                        "`{name}` stands for a {kind}, which no cache here holds"
                    )))
                }
                None => StateItem::Array(StateArray {
                    dtype,
                    shape: view.shape().to_vec(),
                    data: Cow::Borrowed(view.data()),
                }),
            };
            layers[i].items.push((path.to_string(), item));
        }
        for layer in &mut layers {
            // As mlx-lm flattens them: by each component of the path, as numbers.
            layer.items.sort_by_key(|(path, _)| {
                path.split('.')
                    .map(|c| c.parse::<usize>().unwrap_or(usize::MAX))
                    .collect::<Vec<_>>()
            });
        }
        Ok(layers)
    }

    /// Puts the file's state into `cache`, a fresh cache of the model it is for (see
    /// [`Cache::restore_mlx_state`]).
    pub fn restore(&self, cache: &mut Cache) -> Result<(), PromptCacheFileError> {
        cache
            .restore_mlx_state(&self.layers()?)
            .map_err(|source| PromptCacheFileError::State {
                path: self.path.clone(),
                source,
            })
    }
}

/// The integer a one-element array holds (`array.item()`): any integer or bool type, or a float
/// that is a whole number.
fn scalar(dtype: DType, shape: &[usize], data: &[u8]) -> Option<i64> {
    if shape.iter().product::<usize>() != 1 {
        return None;
    }
    let bytes = |n: usize| data.get(..n);
    Some(match dtype {
        DType::I32 => i32::from_le_bytes(bytes(4)?.try_into().ok()?) as i64,
        DType::I64 => i64::from_le_bytes(bytes(8)?.try_into().ok()?),
        DType::U32 => u32::from_le_bytes(bytes(4)?.try_into().ok()?) as i64,
        DType::U64 => i64::try_from(u64::from_le_bytes(bytes(8)?.try_into().ok()?)).ok()?,
        DType::I16 => i16::from_le_bytes(bytes(2)?.try_into().ok()?) as i64,
        DType::U16 => u16::from_le_bytes(bytes(2)?.try_into().ok()?) as i64,
        DType::I8 => bytes(1)?[0] as i8 as i64,
        DType::U8 | DType::Bool => bytes(1)?[0] as i64,
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => {
            let array = StateArray {
                dtype,
                shape: shape.to_vec(),
                data: Cow::Borrowed(data),
            };
            let v = match dtype {
                DType::F64 => f64::from_le_bytes(bytes(8)?.try_into().ok()?),
                _ => *array.to_f32()?.first()? as f64,
            };
            (v.fract() == 0.0 && v.abs() < 9e15).then_some(v as i64)?
        }
    })
}

/// Why a prompt could not be prepared for caching or for continuing a cache.
#[derive(Debug, Error)]
pub enum CachedPromptError {
    #[error(transparent)]
    Template(#[from] ChatTemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("the chat template does not place the message's text in the prompt")]
    NoQuery,
}

/// The ids `mlx_lm.cache_prompt` runs through the model for `prompt`: with a chat template, a
/// user message rendered as one to be continued (no end of turn, so that a later prompt extends
/// the message); without one, the text with the tokenizer's special tokens.
pub fn cached_prompt_ids(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    prompt: &str,
) -> Result<Vec<u32>, CachedPromptError> {
    Ok(match template {
        Some(template) => {
            let messages = serde_json::json!([{"role": "user", "content": prompt}]);
            let text = template.render_continuing(&messages, None, &Map::new())?;
            tokenizer.encode(&text, false)?
        }
        None => tokenizer.encode(prompt, true)?,
    })
}

/// The text `mlx_lm generate --prompt-cache-file` runs after the cached prompt: `messages`
/// (whose last is the new user message) rendered, from where that message's content starts on.
/// The cached prompt holds what comes before it, so its text and this one's make one message.
/// mlx-lm finds the place by rendering `<query>` as the content, without `extra` (the template
/// variables): so does this.
pub fn prompt_after_cache(
    template: &ChatTemplate,
    messages: &[Value],
    extra: &Map<String, Value>,
) -> Result<String, CachedPromptError> {
    let text = template.render(&Value::Array(messages.to_vec()), None, true, extra)?;
    let mut probe = messages.to_vec();
    if let Some(Value::Object(last)) = probe.last_mut() {
        last.insert("content".into(), Value::String("<query>".into()));
    }
    let probe = template.render(&Value::Array(probe), None, true, &Map::new())?;
    let at = probe.find("<query>").ok_or(CachedPromptError::NoQuery)?;
    // Python slices by characters: the same count of them into the real rendering.
    let chars = probe[..at].chars().count();
    let start = text
        .char_indices()
        .nth(chars)
        .map_or(text.len(), |(i, _)| i);
    Ok(text[start..].to_string())
}

/// The `tokenizer_config` metadata `mlx_lm.cache_prompt` writes: its `--trust-remote-code`, and
/// its `--eos-token` where given, as Python's `json.dumps` writes them.
pub fn tokenizer_config_json(trust_remote_code: bool, eos_token: Option<&str>) -> String {
    let mut config = vec![("trust_remote_code", Value::Bool(trust_remote_code))];
    if let Some(eos) = eos_token {
        config.push(("eos_token", Value::String(eos.to_string())));
    }
    let fields: Vec<String> = config
        .iter()
        .map(|(k, v)| {
            format!(
                "{}: {}",
                python_json(&Value::String(k.to_string())),
                python_json(v)
            )
        })
        .collect();
    format!("{{{}}}", fields.join(", "))
}

/// `json.dumps(value)` as Python writes it: `", "` and `": "` between items, non-ASCII as
/// `\uXXXX` escapes, so that the metadata reads as mlx-lm's does.
pub fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_python_json(value, &mut out);
    out
}

fn write_python_json(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_json_string(s, true, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_json_string(k, true, out);
                out.push_str(": ");
                write_python_json(v, out);
            }
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_config_reads_as_mlx_lms() {
        assert_eq!(
            tokenizer_config_json(false, None),
            r#"{"trust_remote_code": false}"#
        );
        assert_eq!(
            tokenizer_config_json(true, Some("<|im_end|>")),
            r#"{"trust_remote_code": true, "eos_token": "<|im_end|>"}"#
        );
    }

    #[test]
    fn json_reads_as_pythons() {
        let value = serde_json::json!({"trust_remote_code": false, "eos_token": "<é\n\"😀>"});
        assert_eq!(
            python_json(&value),
            r#"{"trust_remote_code": false, "eos_token": "<\u00e9\n\"\ud83d\ude00>"}"#
        );
    }

    #[test]
    fn scalars_are_read_from_any_integer_type() {
        assert_eq!(scalar(DType::I32, &[], &27i32.to_le_bytes()), Some(27));
        assert_eq!(scalar(DType::I64, &[1], &(-3i64).to_le_bytes()), Some(-3));
        assert_eq!(scalar(DType::F32, &[], &8.0f32.to_le_bytes()), Some(8));
        assert_eq!(scalar(DType::F32, &[], &8.5f32.to_le_bytes()), None);
        assert_eq!(scalar(DType::I32, &[2], &[0; 8]), None);
    }
}
