//! Models over the oxlm engine: reading MLX checkpoints, shared layers, caches, and one file
//! per architecture, as mlx-lm arranges them. Nothing here knows about HTTP or tokenizers.

pub mod cache;
pub mod cache_state;
pub mod checkpoint;
mod decoder_grad;
pub mod deepseek_v3;
mod error;
mod footprint;
pub mod fuse;
pub mod gemma3;
pub mod gemma3n;
pub mod gemma4;
pub mod granitemoehybrid;
pub mod kv_quantization;
pub mod layers;
pub mod lfm2;
pub mod llama;
pub mod lora;
pub mod lora_dropout;
pub mod lora_grad;
mod lora_rows;
mod mamba2;
pub mod nemotron_h;
mod pass;
pub mod qwen3_5;
mod recurrent_cache;
mod rotating_cache;
pub mod save;
mod switch;

use std::path::Path;

pub use cache::Cache;
pub use checkpoint::{Checkpoint, Config, Scope};
pub use error::{ForwardError, LoadError, TruncateError};
pub use kv_quantization::{KvQuantization, QuantizedLayers};
use oxlm_engine::{Device, KvPrecision, Tensor};

/// What callers need to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// `max_position_embeddings`, when the config states it.
    pub max_context: Option<usize>,
    /// Where the weights live and the forward pass runs.
    pub device: Device,
}

impl ModelInfo {
    /// Whether `tokens` more fit the context after `offset` ([`ForwardError::ContextOverflow`]
    /// where they do not).
    pub fn check_context(&self, offset: usize, tokens: usize) -> Result<(), ForwardError> {
        match self.max_context {
            Some(limit) if offset + tokens > limit => Err(ForwardError::ContextOverflow {
                needed: offset + tokens,
                limit,
            }),
            _ => Ok(()),
        }
    }
}

/// What a forward pass returns: which positions' logits, or the hidden states the head takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's: `[1, vocab]` (prefill and decoding).
    Last,
    /// Every position's: `[tokens, vocab]` (scoring, training).
    All,
    /// [`Last`](Logits::Last), left on the model's device: for a caller that reads only a
    /// little of it (a greedy pick, `oxlm_engine::ops::greedy_rows`), so that a GPU does not
    /// copy a vocabulary's row back every step.
    LastOnDevice,
    /// The last position's hidden state after the final norm, no head applied: `[1, hidden]`,
    /// on the host (what an embedding model's last-token pooling takes).
    HiddenLast,
    /// Every position's hidden state after the final norm: `[tokens, hidden]`, on the host
    /// (what mean pooling averages).
    HiddenAll,
}

/// A causal language model.
pub trait LanguageModel: Send + Sync {
    fn info(&self) -> &ModelInfo;

    /// Fresh per-layer state for one sequence, on the model's device, its attention layers'
    /// keys and values in the default precision ([`KvPrecision::default`]: f16).
    fn new_cache(&self) -> Result<Cache, ForwardError>;

    /// [`new_cache`](Self::new_cache) with keys and values kept in `precision` (f16 on a GPU
    /// asked for 8 bits).
    fn new_cache_in(&self, precision: KvPrecision) -> Result<Cache, ForwardError> {
        Ok(self.new_cache()?.with_kv_precision(precision)?)
    }

    /// Runs `tokens` at the positions following what `cache` holds and appends their state.
    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        logits: Logits,
    ) -> Result<Tensor, ForwardError>;

    /// One decoding step of several sequences: `tokens[i]` follows what `caches[i]` holds.
    /// Returns `[sequences, vocab]` logits, on the host or on the model's device (a batch's
    /// logits are megabytes; greedy picks need only `ops::greedy_rows` of them). The
    /// architectures run them as one batch, reading each weight once for all of them; this
    /// default, for a model that cannot, runs them one after another.
    fn forward_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor, ForwardError> {
        check_batch(tokens, caches)?;
        let mut rows = Vec::with_capacity(tokens.len() * self.info().vocab_size);
        for (&token, cache) in tokens.iter().zip(caches.iter_mut()) {
            rows.extend(self.forward(&[token], cache, Logits::Last)?.into_data());
        }
        Ok(Tensor::new(
            vec![tokens.len(), self.info().vocab_size],
            rows,
        ))
    }

    /// Several sequences' prompts in one pass: `tokens` holds `caches.len()` runs of equal
    /// length, run `i` following what `caches[i]` holds. Returns every row's hidden state after
    /// the final norm (each run's [`Logits::HiddenAll`], in order: `[tokens, hidden]`, on the
    /// host). The architectures read each weight once for all the runs where no layer is
    /// recurrent; this default, for a model that cannot, runs them one after another.
    fn hidden_runs(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> Result<Tensor, ForwardError> {
        pass::hidden_runs_one_by_one(self, tokens, caches)
    }

    /// The model as LoRA adapters attach to it; `None` when its architecture takes none yet.
    fn adaptable(&self) -> Option<&dyn lora::Adaptable> {
        None
    }
}

/// Rejects a batch that is not one token per cache.
pub(crate) fn check_batch(tokens: &[u32], caches: &[&mut Cache]) -> Result<(), ForwardError> {
    if tokens.len() == caches.len() {
        Ok(())
    } else {
        Err(ForwardError::BatchMismatch {
            tokens: tokens.len(),
            caches: caches.len(),
        })
    }
}

/// The length of each run when `tokens` split into runs of equal length, one per cache.
pub(crate) fn run_length(tokens: &[u32], caches: &[&mut Cache]) -> Result<usize, ForwardError> {
    if tokens.is_empty() || caches.is_empty() || !tokens.len().is_multiple_of(caches.len()) {
        return Err(ForwardError::UnevenRuns {
            tokens: tokens.len(),
            caches: caches.len(),
        });
    }
    Ok(tokens.len() / caches.len())
}

/// Rejects input that a forward pass cannot take.
pub(crate) fn check_tokens(
    info: &ModelInfo,
    tokens: &[u32],
    offset: usize,
) -> Result<(), ForwardError> {
    if tokens.is_empty() {
        return Err(ForwardError::EmptyInput);
    }
    if let Some(&id) = tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
        return Err(ForwardError::TokenOutOfRange {
            id,
            vocab: info.vocab_size,
        });
    }
    info.check_context(offset, tokens.len())
}

type Constructor = fn(Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError>;

fn llama(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(llama::Llama::load(ckpt)?))
}

fn qwen3_5(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(qwen3_5::Qwen3_5::load(ckpt)?))
}

fn deepseek_v3(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(deepseek_v3::DeepseekV3::load(ckpt)?))
}

fn lfm2(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(lfm2::Lfm2::load(ckpt)?))
}

fn gemma3(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(gemma3::Gemma3::load(ckpt)?))
}

fn gemma3n(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(gemma3n::Gemma3n::load(ckpt)?))
}

fn gemma4(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(gemma4::Gemma4::load(ckpt)?))
}

fn granitemoehybrid(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(granitemoehybrid::GraniteMoeHybrid::load(ckpt)?))
}

fn nemotron_h(ckpt: Checkpoint) -> Result<Box<dyn LanguageModel>, LoadError> {
    Ok(Box::new(nemotron_h::NemotronH::load(ckpt)?))
}

/// `model_type` → constructor for the architectures outside the llama family; the first
/// column is what `--help` and errors list as supported, after the family's members.
const REGISTRY: &[(&str, Constructor)] = &[
    ("gemma3_text", gemma3),
    ("gemma3", gemma3),
    ("gemma3n", gemma3n),
    ("gemma4_text", gemma4),
    ("gemma4", gemma4),
    ("lfm2", lfm2),
    ("lfm2-vl", lfm2),
    ("lfm2_moe", lfm2),
    ("qwen3_5", qwen3_5),
    ("qwen3_5_text", qwen3_5),
    ("qwen3_5_moe", qwen3_5),
    ("qwen3_next", qwen3_5),
    ("granitemoehybrid", granitemoehybrid),
    ("nemotron_h", nemotron_h),
    ("deepseek_v3", deepseek_v3),
    ("kimi_k2", deepseek_v3),
    ("joyai_llm_flash", deepseek_v3),
];

/// The `model_type`s whose mlx-lm model builds no cache of its own, so that mlx-lm's
/// `make_prompt_cache(model, max_kv_size)` bounds each layer's (see
/// [`Cache::with_max_kv_size`]); for every other type mlx-lm leaves `--max-kv-size` unused.
const MAX_KV_SIZE_TYPES: &[&str] = &[
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "smollm3",
    "phi3",
    "olmo2",
    "granite",
    "granitemoe",
    "minicpm",
    "glm4",
    "glm4_moe",
    "ernie4_5",
    "ernie4_5_moe",
    "hunyuan_v1_dense",
    "seed_oss",
    "mistral3",
    "gemma2",
    "olmoe",
];

/// Whether `--max-kv-size` bounds the cache of a `model_type` model, as it does in mlx-lm.
pub fn takes_max_kv_size(model_type: &str) -> bool {
    MAX_KV_SIZE_TYPES.contains(&model_type)
}

/// The `model_type`s this build can load.
pub fn supported_model_types() -> Vec<&'static str> {
    let others = REGISTRY.iter().map(|(name, _)| *name);
    llama::member_types().chain(others).collect()
}

/// Opens the MLX model directory `dir` and builds its architecture on the CPU.
pub fn load(dir: &Path) -> Result<Box<dyn LanguageModel>, LoadError> {
    load_on(dir, &Device::Cpu)
}

/// Opens the MLX model directory `dir` and builds its architecture with its weights on
/// `device` (copied there once, in their packed form).
pub fn load_on(dir: &Path, device: &Device) -> Result<Box<dyn LanguageModel>, LoadError> {
    // The architecture is checked before any weight file is opened.
    let config = Config::from_value(checkpoint::read_json(&dir.join("config.json"))?)?;
    let model_type = config.model_type()?.to_string();
    let family = llama::is_member(&model_type).then_some(llama as Constructor);
    let constructor = REGISTRY
        .iter()
        .find(|(name, _)| *name == model_type)
        .map(|(_, c)| *c)
        .or(family)
        .ok_or_else(|| LoadError::UnsupportedModelType {
            found: model_type,
            supported: supported_model_types(),
        })?;
    let ckpt = Checkpoint::open_on(dir, device)?;
    ckpt.check_sizes()?;
    constructor(ckpt)
}
