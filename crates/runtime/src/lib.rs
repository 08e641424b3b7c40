//! The runtime: tokenizers and chat templates, sampling, and the generation loop over a model.

pub mod adapter_store;
pub mod batcher;
pub mod chat_template;
pub mod constraint;
pub mod detokenizer;
pub mod embed;
pub mod generate;
pub mod generation_config;
pub mod hub;
pub mod loaded;
pub mod lora;
pub mod memory;
pub mod prompt_cache;
pub mod prompt_cache_file;
pub mod reasoning_budget;
pub mod sampler;
pub mod stop;
pub mod tokenizer;

pub use generate::{
    generate, generate_stream, Event, FinishReason, GenerateOptions, Generation, StreamOptions,
};
pub use loaded::LoadedModel;

use thiserror::Error;

/// Everything that can go wrong between a model directory and generated text.
#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Load(#[from] oxlm_models::LoadError),
    #[error(transparent)]
    Forward(#[from] oxlm_models::ForwardError),
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] chat_template::ChatTemplateError),
    #[error(transparent)]
    Sampler(#[from] sampler::SamplerError),
    #[error(transparent)]
    Constraint(#[from] constraint::ConstraintError),
}
