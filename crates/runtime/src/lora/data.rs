//! mlx-lm's LoRA data sets: `train.jsonl`, `valid.jsonl` and `test.jsonl` in a directory, one JSON
//! object a line, tokenized as `mlx_lm.tuner.datasets` does. The first line decides the format:
//! - completions, `{"prompt": …, "completion": …}`: the pair as a user and an assistant message;
//! - chat, `{"messages": [...], "tools": [...]?}`: the conversation through the chat template;
//! - text, `{"text": …}`: the encoded text, ending with the eos token.
//!
//! With `mask_prompt`, an item's offset is the length of everything before its last message, and
//! only the tokens after it count towards the loss.
//!
//! Preference training reads another format, mlx-lm-lora's: `{"prompt": …, "chosen": …,
//! "rejected": …, "system": …?}`, each answer a string (an assistant message) or a list of
//! messages, each rendered after the prompt through the chat template.

use std::path::{Path, PathBuf};

use oxlm_models::lora_grad::Example;
use serde_json::{json, Map, Value};
use thiserror::Error;

use crate::chat_template::{ChatTemplate, ChatTemplateError};
use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {reason}")]
    Item {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error(
        "{0}: unsupported data format: each line needs `messages`, `prompt` and `completion`, or `text` \
         (see mlx-lm's LORA.md)"
    )]
    Format(PathBuf),
    #[error("{0}: prompt masking is not supported for text data")]
    MaskedText(PathBuf),
    #[error("{0}: chat data needs a chat template, and the tokenizer has none")]
    NoChatTemplate(PathBuf),
    #[error("{0}: text data needs an eos token, and the tokenizer has none")]
    NoEos(PathBuf),
    #[error("`{0}` is missing or not of the expected type")]
    Field(String),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
}

/// One tokenized item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub tokens: Vec<u32>,
    /// Tokens before this position do not count towards the loss.
    pub offset: usize,
    /// The number of keys of the item's JSON object: what mlx-lm's `CacheDataset.itemlen` gives,
    /// and so what it sorts items by before batching.
    pub keys: usize,
}

/// The items of one file: mlx-lm's, or preference items.
#[derive(Debug, Clone)]
pub struct Dataset<T = Item> {
    pub items: Vec<T>,
}

impl<T> Default for Dataset<T> {
    fn default() -> Self {
        Dataset { items: Vec::new() }
    }
}

impl<T> Dataset<T> {
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// The three splits; a missing file is an empty split.
pub struct Splits<D = Dataset> {
    pub train: D,
    pub valid: D,
    pub test: D,
}

/// One tokenized preference item: the prompt with its chosen answer, and with its rejected one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceItem {
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
    /// The prompt's tokens (through the generation prompt), which both answers start with and
    /// which do not count towards the loss.
    pub prompt_len: usize,
}

impl PreferenceItem {
    /// The scored part of the chosen and of the rejected sequence, each cut at
    /// `max_seq_length`: as mlx-lm-lora scores them, the answer's tokens after the prompt up to
    /// its end (and no padding after it). `None` when either has nothing left to score.
    pub fn examples(&self, max_seq_length: usize) -> Option<[Example; 2]> {
        let answer = |tokens: &[u32]| {
            let cut = &tokens[..tokens.len().min(max_seq_length)];
            Example::from_padded(cut, self.prompt_len, cut.len())
        };
        Some([answer(&self.chosen)?, answer(&self.rejected)?])
    }
}

/// The preference items of one file.
pub type PreferenceSet = Dataset<PreferenceItem>;

/// Turns JSON objects into tokens.
pub struct Encoder<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a ChatTemplate>,
    pub mask_prompt: bool,
}

/// How a file's items are encoded, with what that needs.
enum Format<'a> {
    Completions(&'a ChatTemplate),
    Chat(&'a ChatTemplate),
    /// The eos token id every text ends with.
    Text(u32),
}

impl Encoder<'_> {
    /// Renders `messages` with the chat template and encodes the text (no special tokens added:
    /// the template writes them), as `TokenizerWrapper.apply_chat_template` does.
    fn chat(
        &self,
        template: &ChatTemplate,
        messages: &[Value],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, DataError> {
        let mut extra = Map::new();
        extra.insert(
            "enable_thinking".into(),
            json!(self.tokenizer.think_markers().is_some()),
        );
        let messages = Value::Array(messages.to_vec());
        let text = template.render(&messages, tools, add_generation_prompt, &extra)?;
        Ok(self.tokenizer.encode(&text, false)?)
    }

    /// `(tokens, offset)` of one item (the datasets' `process`).
    fn item(
        &self,
        format: &Format,
        obj: &Map<String, Value>,
    ) -> Result<(Vec<u32>, usize), DataError> {
        let field = |key: &str| {
            obj.get(key)
                .and_then(Value::as_str)
                .ok_or_else(|| DataError::Field(key.to_string()))
        };
        let tools = obj.get("tools").filter(|t| !t.is_null());
        let (messages, prompt_end) = match format {
            Format::Text(eos) => {
                let mut tokens = self.tokenizer.encode(field("text")?, true)?;
                if tokens.last() != Some(eos) {
                    tokens.push(*eos);
                }
                return Ok((tokens, 0));
            }
            Format::Completions(_) => {
                let messages = vec![
                    json!({"role": "user", "content": field("prompt")?}),
                    json!({"role": "assistant", "content": field("completion")?}),
                ];
                (messages, true)
            }
            Format::Chat(_) => {
                let messages = obj
                    .get("messages")
                    .and_then(Value::as_array)
                    .ok_or_else(|| DataError::Field("messages".into()))?
                    .clone();
                // The prompt ends with a generation prompt when an assistant message follows it.
                let last = messages.last().and_then(|m| m.get("role"));
                let before_assistant = last.and_then(Value::as_str) == Some("assistant");
                (messages, before_assistant)
            }
        };
        let (Format::Completions(template) | Format::Chat(template)) = format else {
            unreachable!("text returned above")
        };
        let tokens = self.chat(template, &messages, tools, false)?;
        if !self.mask_prompt || messages.is_empty() {
            return Ok((tokens, 0));
        }
        let prompt = self.chat(template, &messages[..messages.len() - 1], tools, prompt_end)?;
        Ok((tokens, prompt.len()))
    }

    /// Reads and tokenizes one `.jsonl` file; a missing file is an empty set.
    pub fn load_file(&self, path: &Path) -> Result<Dataset, DataError> {
        let objects = read_objects(path)?;
        let Some((_, first)) = objects.first() else {
            return Ok(Dataset::default());
        };
        let template = || {
            self.template
                .ok_or_else(|| DataError::NoChatTemplate(path.to_path_buf()))
        };
        let format = if first.contains_key("prompt") && first.contains_key("completion") {
            Format::Completions(template()?)
        } else if first.contains_key("messages") {
            Format::Chat(template()?)
        } else if first.contains_key("text") {
            if self.mask_prompt {
                return Err(DataError::MaskedText(path.to_path_buf()));
            }
            let eos = self.tokenizer.eos_token_id();
            Format::Text(eos.ok_or_else(|| DataError::NoEos(path.to_path_buf()))?)
        } else {
            return Err(DataError::Format(path.to_path_buf()));
        };
        let items = each_object(path, &objects, |obj| {
            let (tokens, offset) = self.item(&format, obj)?;
            Ok(Item {
                tokens,
                offset,
                keys: obj.len(),
            })
        })?;
        Ok(Dataset { items })
    }

    /// One preference item, as mlx-lm-lora's `DPODataset` and `ORPODataset` make it.
    fn preference_item(
        &self,
        template: &ChatTemplate,
        obj: &Map<String, Value>,
    ) -> Result<PreferenceItem, DataError> {
        let mut prompt = Vec::new();
        if let Some(system) = obj.get("system").filter(|s| !s.is_null()) {
            let system = system
                .as_str()
                .ok_or_else(|| DataError::Field("system".into()))?;
            prompt.push(json!({"role": "system", "content": system}));
        }
        let user = (obj.get("prompt").and_then(Value::as_str))
            .ok_or_else(|| DataError::Field("prompt".into()))?;
        prompt.push(json!({"role": "user", "content": user}));
        let answer = |key: &str| -> Result<Vec<u32>, DataError> {
            let mut messages = prompt.clone();
            match obj.get(key) {
                Some(Value::String(content)) => {
                    messages.push(json!({"role": "assistant", "content": content}));
                }
                Some(Value::Array(turns)) if !turns.is_empty() => messages.extend(turns.clone()),
                _ => return Err(DataError::Field(key.into())),
            }
            self.chat(template, &messages, None, false)
        };
        Ok(PreferenceItem {
            chosen: answer("chosen")?,
            rejected: answer("rejected")?,
            prompt_len: self.chat(template, &prompt, None, true)?.len(),
        })
    }

    /// Reads and tokenizes one `.jsonl` file of preference rows; a missing file is an empty set.
    pub fn load_preference_file(&self, path: &Path) -> Result<PreferenceSet, DataError> {
        let objects = read_objects(path)?;
        if objects.is_empty() {
            return Ok(PreferenceSet::default());
        }
        let template =
            (self.template).ok_or_else(|| DataError::NoChatTemplate(path.to_path_buf()))?;
        let items = each_object(path, &objects, |obj| self.preference_item(template, obj))?;
        Ok(PreferenceSet { items })
    }

    /// `train.jsonl`, `valid.jsonl` and `test.jsonl` of `dir`.
    pub fn load_dir(&self, dir: &Path) -> Result<Splits, DataError> {
        load_splits(dir, |path| self.load_file(path))
    }

    /// `train.jsonl`, `valid.jsonl` and `test.jsonl` of `dir`, of preference rows.
    pub fn load_preference_dir(&self, dir: &Path) -> Result<Splits<PreferenceSet>, DataError> {
        load_splits(dir, |path| self.load_preference_file(path))
    }
}

fn load_splits<D>(
    dir: &Path,
    load: impl Fn(&Path) -> Result<D, DataError>,
) -> Result<Splits<D>, DataError> {
    Ok(Splits {
        train: load(&dir.join("train.jsonl"))?,
        valid: load(&dir.join("valid.jsonl"))?,
        test: load(&dir.join("test.jsonl"))?,
    })
}

/// JSON objects, each with the number of the line it was read from.
type NumberedObjects = Vec<(usize, Map<String, Value>)>;

/// The JSON objects of a `.jsonl` file, blank lines skipped; a missing file has none.
fn read_objects(path: &Path) -> Result<NumberedObjects, DataError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DataError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let mut objects = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |reason: String| DataError::Item {
            path: path.to_path_buf(),
            line: i + 1,
            reason,
        };
        match serde_json::from_str(line).map_err(|e| bad(e.to_string()))? {
            Value::Object(obj) => objects.push((i + 1, obj)),
            _ => return Err(bad("not a JSON object".into())),
        }
    }
    Ok(objects)
}

/// `make` of each object, an error naming the object's line.
fn each_object<T>(
    path: &Path,
    objects: &NumberedObjects,
    make: impl Fn(&Map<String, Value>) -> Result<T, DataError>,
) -> Result<Vec<T>, DataError> {
    (objects.iter())
        .map(|(line, obj)| {
            make(obj).map_err(|e| DataError::Item {
                path: path.to_path_buf(),
                line: *line,
                reason: e.to_string(),
            })
        })
        .collect()
}
