use std::path::PathBuf;

use oxlm_engine::EngineError;
use thiserror::Error;

/// Why a checkpoint could not be loaded. Every message names the file or tensor at fault.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: malformed JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{0}: no such file (is this an MLX model directory?)")]
    MissingFile(PathBuf),
    #[error("{path}: not a valid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("weight `{0}` is missing from the checkpoint")]
    MissingTensor(String),
    #[error(
        "weight `{name}` has shape {found:?} and dtype {dtype}, but the config implies {expected}"
    )]
    TensorShape {
        name: String,
        found: Vec<usize>,
        dtype: String,
        expected: String,
    },
    #[error("the checkpoint has {} weights the config does not use (config and weights disagree), e.g. {}", .0.len(), .0.iter().take(5).cloned().collect::<Vec<_>>().join(", "))]
    UnusedTensors(Vec<String>),
    #[error("unsupported model_type `{found}`; supported: {}", .supported.join(", "))]
    UnsupportedModelType {
        found: String,
        supported: Vec<&'static str>,
    },
    #[error("unsupported quantization: {0}")]
    UnsupportedQuantization(String),
    #[error("config.json: {0}")]
    Config(String),
    /// A file beside the weights that says something the model cannot take.
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("weight `{name}`: {source}")]
    Engine { name: String, source: EngineError },
}

/// Why a forward pass was refused.
#[derive(Debug, Error, PartialEq)]
pub enum ForwardError {
    #[error("the sequence would reach {needed} tokens, past the model's context of {limit}")]
    ContextOverflow { needed: usize, limit: usize },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("empty input: at least one token is needed")]
    EmptyInput,
    #[error("the cache was not made by this model's `new_cache`")]
    CacheMismatch,
    #[error("a batch of {tokens} tokens for {caches} caches: one token per sequence is needed")]
    BatchMismatch { tokens: usize, caches: usize },
    #[error("{tokens} tokens do not split into runs of equal length for {caches} caches")]
    UnevenRuns { tokens: usize, caches: usize },
    /// A kernel or device failure (out of GPU memory, for one).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Why a [`Cache`](crate::Cache) could not be cut back to an earlier position.
#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "cannot go back from {offset} to {len} tokens: layer {layer} is recurrent or a sliding window \
     and keeps no per-token history that far back (keep a clone of the cache taken at the prefix \
     instead)"
)]
pub struct TruncateError {
    pub layer: usize,
    pub offset: usize,
    pub len: usize,
}
