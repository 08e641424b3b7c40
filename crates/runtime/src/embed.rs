//! Sentence embeddings, as sentence-transformers computes them from an embedding checkpoint's
//! own files (Qwen3-Embedding's layout): the last hidden state after the final norm
//! ([`Logits::HiddenLast`], [`Logits::HiddenAll`]), pooled as `1_Pooling/config.json` says (the
//! last token's, or the mean), scaled to unit length where `modules.json` lists a `Normalize`
//! module, and prefixed with the instruction a prompt name picks from
//! `config_sentence_transformers.json`.
//!
//! Inputs go through the model together: sorted by length, as many as a prefill chunk's worth
//! of tokens in one pass ([`LanguageModel::hidden_runs`]), each in a cache of its own and padded
//! at its end to the longest of them. A causal model's tokens see only those before them, so
//! the padding changes no row that is pooled: each result is what the input gives alone, but
//! for the rounding of products taken over more rows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oxlm_engine::KvPrecision;
use oxlm_models::checkpoint::read_json;
use oxlm_models::{ForwardError, LanguageModel, LoadError, Logits, ModelInfo};
use serde_json::Value;

use crate::generate::DEFAULT_PREFILL_STEP;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why inputs could not be embedded, or a checkpoint cannot embed.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error(
        "it has no sentence-transformers modules.json, and config.json's `architectures` names \
         no bare `*Model` (a model without a language-model head)"
    )]
    NotAnEmbeddingModel,
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error("no input: at least one text or list of token ids is needed")]
    NoInput,
    #[error("input {index} is empty")]
    EmptyInput { index: usize },
    #[error("input {index} has {tokens} tokens, more than the model's context of {limit}")]
    TooLong {
        index: usize,
        tokens: usize,
        limit: usize,
    },
    #[error("input {index}: token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { index: usize, id: u32, vocab: usize },
    #[error("dimensions must be from 1 to {max} (the model's embedding size), not {asked}")]
    Dimensions { asked: usize, max: usize },
    #[error("the model has no prompt named `{name}` (it has: {})", .known.join(", "))]
    UnknownPrompt { name: String, known: Vec<String> },
}

/// How the hidden states of an input's tokens become one vector (sentence-transformers' modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's: in a causal model, the one token that has seen them all.
    LastToken,
    /// The mean of every token's, the prompt's included.
    Mean,
}

/// What to embed.
#[derive(Debug, Clone, PartialEq)]
pub enum EmbedInput {
    /// Tokenized with the prompt before it and the tokenizer's special tokens.
    Text(String),
    /// Token ids, taken as they are.
    Tokens(Vec<u32>),
}

/// How a checkpoint embeds: read once from its files, then applied to any inputs.
#[derive(Debug, Clone)]
pub struct Embedder {
    pub pooling: Pooling,
    /// Whether vectors are scaled to unit length (a `Normalize` module).
    pub normalize: bool,
    /// Instructions put before a text, by name.
    prompts: BTreeMap<String, String>,
    /// The prompt of texts that name none.
    default_prompt: Option<String>,
}

const TRANSFORMER: &str = "sentence_transformers.models.Transformer";
const POOLING: &str = "sentence_transformers.models.Pooling";
const NORMALIZE: &str = "sentence_transformers.models.Normalize";

impl Embedder {
    /// How the checkpoint in `dir` embeds: from its sentence-transformers files where it has
    /// them; else, where config.json names a bare `*Model` (an export without a head, as
    /// Qwen3-Embedding's `Qwen3Model`), Qwen3-Embedding's last-token pooling and normalization;
    /// else [`EmbedError::NotAnEmbeddingModel`].
    pub fn from_dir(dir: &Path) -> Result<Self, EmbedError> {
        let (pooling, normalize) = match read_optional(&dir.join("modules.json"))? {
            Some(modules) => modules_pipeline(dir, &modules)?,
            None if names_bare_model(&read_json(&dir.join("config.json"))?) => {
                (Pooling::LastToken, true)
            }
            None => return Err(EmbedError::NotAnEmbeddingModel),
        };
        let path = dir.join("config_sentence_transformers.json");
        let settings = read_optional(&path)?.unwrap_or(Value::Null);
        let prompts = match settings.get("prompts") {
            None | Some(Value::Null) => BTreeMap::new(),
            Some(prompts) => serde_json::from_value(prompts.clone()).map_err(|e| {
                config_error(&path, format!("`prompts` is not a map of strings: {e}"))
            })?,
        };
        let default_prompt = match settings.get("default_prompt_name") {
            None | Some(Value::Null) => None,
            Some(Value::String(name)) if prompts.contains_key(name) => Some(name.clone()),
            Some(other) => {
                return Err(config_error(
                    &path,
                    format!("`default_prompt_name` {other} names none of its `prompts`"),
                ))
            }
        };
        Ok(Embedder {
            pooling,
            normalize,
            prompts,
            default_prompt,
        })
    }

    /// The names of the prompts a text may be embedded with.
    pub fn prompt_names(&self) -> impl Iterator<Item = &str> {
        self.prompts.keys().map(String::as_str)
    }

    /// The token ids of each input: a text after the prompt named (else the default one), with
    /// the tokenizer's special tokens (Qwen3-Embedding's tokenizer appends `<|endoftext|>`, the
    /// token whose state last-token pooling takes); token ids as they are.
    pub fn tokenize(
        &self,
        tokenizer: &Tokenizer,
        inputs: &[EmbedInput],
        prompt_name: Option<&str>,
    ) -> Result<Vec<Vec<u32>>, EmbedError> {
        let prompt = match prompt_name.or(self.default_prompt.as_deref()) {
            None => "",
            Some(name) => self
                .prompts
                .get(name)
                .ok_or_else(|| EmbedError::UnknownPrompt {
                    name: name.to_owned(),
                    known: self.prompts.keys().cloned().collect(),
                })?,
        };
        inputs
            .iter()
            .enumerate()
            .map(|(index, input)| match input {
                EmbedInput::Text(text) if text.is_empty() => Err(EmbedError::EmptyInput { index }),
                EmbedInput::Text(text) => Ok(tokenizer.encode(&format!("{prompt}{text}"), true)?),
                EmbedInput::Tokens(ids) => Ok(ids.clone()),
            })
            .collect()
    }

    /// Refuses what [`embed`](Self::embed) cannot take, before any of it runs.
    pub fn check(
        &self,
        info: &ModelInfo,
        inputs: &[Vec<u32>],
        dimensions: Option<usize>,
    ) -> Result<(), EmbedError> {
        if inputs.is_empty() {
            return Err(EmbedError::NoInput);
        }
        for (index, ids) in inputs.iter().enumerate() {
            if ids.is_empty() {
                return Err(EmbedError::EmptyInput { index });
            }
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= info.vocab_size) {
                return Err(EmbedError::TokenOutOfRange {
                    index,
                    id,
                    vocab: info.vocab_size,
                });
            }
            if let Err(ForwardError::ContextOverflow { limit, .. }) =
                info.check_context(0, ids.len())
            {
                return Err(EmbedError::TooLong {
                    index,
                    tokens: ids.len(),
                    limit,
                });
            }
        }
        match dimensions {
            Some(asked) if asked == 0 || asked > info.hidden_size => Err(EmbedError::Dimensions {
                asked,
                max: info.hidden_size,
            }),
            _ => Ok(()),
        }
    }

    /// One vector per input (see [`check`](Self::check)), pooled, cut to its first `dimensions`
    /// values when asked (a Matryoshka embedding) and then normalized where the model is.
    pub fn embed(
        &self,
        model: &dyn LanguageModel,
        inputs: &[Vec<u32>],
        dimensions: Option<usize>,
    ) -> Result<Vec<Vec<f32>>, EmbedError> {
        self.check(model.info(), inputs, dimensions)?;
        let mut vectors = vec![Vec::new(); inputs.len()];
        for group in passes(inputs) {
            let pooled = match group[..] {
                [one] => vec![self.pool(model, &inputs[one])?],
                _ => self.pool_together(model, inputs, &group)?,
            };
            for (i, mut vector) in group.into_iter().zip(pooled) {
                if let Some(dimensions) = dimensions {
                    vector.truncate(dimensions);
                }
                if self.normalize {
                    normalize(&mut vector);
                }
                vectors[i] = vector;
            }
        }
        Ok(vectors)
    }

    /// The pooled hidden state of `ids`, which go through the model a prefill step at a time.
    fn pool(&self, model: &dyn LanguageModel, ids: &[u32]) -> Result<Vec<f32>, EmbedError> {
        // f32 keys and values, as the layers computed them: the cache lasts one input.
        let mut cache = model.new_cache_in(KvPrecision::F32)?;
        let hidden = model.info().hidden_size;
        let rows = match self.pooling {
            Pooling::LastToken => Logits::HiddenLast,
            Pooling::Mean => Logits::HiddenAll,
        };
        let mut sum = vec![0f64; hidden];
        let mut states = Vec::new();
        for chunk in ids.chunks(DEFAULT_PREFILL_STEP) {
            let output = model.forward(chunk, &mut cache, rows)?;
            states = output.into_vec().map_err(ForwardError::from)?;
            if self.pooling == Pooling::Mean {
                add_rows(&mut sum, &states);
            }
        }
        Ok(match self.pooling {
            // The last chunk's last row.
            Pooling::LastToken => states,
            Pooling::Mean => mean(&sum, ids.len()),
        })
    }

    /// The pooled hidden states of the inputs `group` picks, in one pass: each padded at its
    /// end (with its last token) to the longest one's length.
    fn pool_together(
        &self,
        model: &dyn LanguageModel,
        inputs: &[Vec<u32>],
        group: &[usize],
    ) -> Result<Vec<Vec<f32>>, EmbedError> {
        let length = group.iter().map(|&i| inputs[i].len()).max().unwrap_or(0);
        let mut tokens = Vec::with_capacity(length * group.len());
        for &i in group {
            let ids = &inputs[i];
            tokens.extend(ids);
            tokens.extend(std::iter::repeat_n(ids[ids.len() - 1], length - ids.len()));
        }
        let mut caches = group
            .iter()
            .map(|_| model.new_cache_in(KvPrecision::F32))
            .collect::<Result<Vec<_>, _>>()?;
        let mut refs: Vec<_> = caches.iter_mut().collect();
        let states = model.hidden_runs(&tokens, &mut refs)?;
        let states = states.into_vec().map_err(ForwardError::from)?;
        let hidden = model.info().hidden_size;
        let runs = states.chunks_exact(length * hidden);
        Ok(group
            .iter()
            .zip(runs)
            .map(|(&i, run)| {
                let rows = &run[..inputs[i].len() * hidden];
                match self.pooling {
                    Pooling::LastToken => rows[rows.len() - hidden..].to_vec(),
                    Pooling::Mean => {
                        let mut sum = vec![0f64; hidden];
                        add_rows(&mut sum, rows);
                        mean(&sum, inputs[i].len())
                    }
                }
            })
            .collect())
    }
}

/// The inputs of each pass, by index: sorted by length (so that little is padding), as many
/// as fit [`DEFAULT_PREFILL_STEP`] tokens once padded to the longest, so that a pass's transient
/// memory is a prefill chunk's; an input longer than that goes alone, a chunk at a time.
fn passes(inputs: &[Vec<u32>]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..inputs.len()).collect();
    order.sort_by_key(|&i| inputs[i].len());
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for i in order {
        match groups.last_mut() {
            // Sorted: this input is the group's longest.
            Some(group) if (group.len() + 1) * inputs[i].len() <= DEFAULT_PREFILL_STEP => {
                group.push(i)
            }
            _ => groups.push(vec![i]),
        }
    }
    groups
}

/// Adds each `hidden`-wide row of `rows` to `sum`.
fn add_rows(sum: &mut [f64], rows: &[f32]) {
    for row in rows.chunks_exact(sum.len()) {
        sum.iter_mut()
            .zip(row)
            .for_each(|(s, &x)| *s += f64::from(x));
    }
}

fn mean(sum: &[f64], count: usize) -> Vec<f32> {
    sum.iter().map(|s| (s / count as f64) as f32).collect()
}

/// Scales `vector` to unit length (a zero vector stays zero, as torch's `normalize` leaves it).
fn normalize(vector: &mut [f32]) {
    let norm = vector
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        vector
            .iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
}

/// The JSON file at `path`, or `None` where there is none.
fn read_optional(path: &Path) -> Result<Option<Value>, EmbedError> {
    match read_json(path) {
        Ok(value) => Ok(Some(value)),
        Err(LoadError::MissingFile(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn config_error(path: &Path, reason: impl Into<String>) -> EmbedError {
    EmbedError::Config {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Whether config.json's `architectures` names a model without a head (`Qwen3Model`, not
/// `Qwen3ForCausalLM`).
fn names_bare_model(config: &Value) -> bool {
    let names = config.get("architectures").and_then(Value::as_array);
    names
        .into_iter()
        .flatten()
        .any(|name| name.as_str().is_some_and(|name| name.ends_with("Model")))
}

/// The pooling and normalization of modules.json's pipeline: the model, its pooling, and
/// optionally a normalization; other modules (dense projections) are refused.
fn modules_pipeline(dir: &Path, modules: &Value) -> Result<(Pooling, bool), EmbedError> {
    let path = dir.join("modules.json");
    let modules = modules
        .as_array()
        .ok_or_else(|| config_error(&path, "not a list of modules"))?;
    let mut pooling = None;
    let mut normalize = false;
    for module in modules {
        let kind = module.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            TRANSFORMER => {}
            POOLING => {
                let subdir = module.get("path").and_then(Value::as_str).unwrap_or("");
                pooling = Some(pooling_mode(&dir.join(subdir).join("config.json"))?);
            }
            NORMALIZE => normalize = true,
            other => {
                return Err(config_error(
                    &path,
                    format!(
                        "module `{other}` is not supported (only {TRANSFORMER}, {POOLING} and \
                         {NORMALIZE})"
                    ),
                ))
            }
        }
    }
    let pooling = pooling.ok_or_else(|| config_error(&path, format!("no {POOLING} module")))?;
    Ok((pooling, normalize))
}

/// The one pooling mode a sentence-transformers pooling config turns on.
fn pooling_mode(path: &Path) -> Result<Pooling, EmbedError> {
    let config = read_json(path)?;
    let modes: Vec<&str> = (config.as_object().into_iter().flatten())
        .filter(|(key, on)| key.starts_with("pooling_mode_") && on.as_bool() == Some(true))
        .map(|(key, _)| key.as_str())
        .collect();
    let whole_input = config.get("include_prompt").and_then(Value::as_bool) != Some(false);
    match modes.as_slice() {
        ["pooling_mode_lasttoken"] => Ok(Pooling::LastToken),
        ["pooling_mode_mean_tokens"] if whole_input => Ok(Pooling::Mean),
        ["pooling_mode_mean_tokens"] => Err(config_error(
            path,
            "mean pooling without the prompt's tokens (`include_prompt: false`) is not supported",
        )),
        [] => Err(config_error(path, "no pooling_mode_* is on")),
        modes => Err(config_error(
            path,
            format!(
                "pooling by {} is not supported (pooling_mode_lasttoken or \
                 pooling_mode_mean_tokens alone is)",
                modes.join(" and ")
            ),
        )),
    }
}
