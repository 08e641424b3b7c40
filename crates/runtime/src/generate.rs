//! The generation loop: prefill the prompt in chunks, then decode one token at a time, streaming
//! text as it becomes final, as `mlx_lm.generate`'s `stream_generate` does.

use std::collections::HashSet;
use std::time::Instant;

use oxlm_models::{Cache, ForwardError, LanguageModel, Logits};

use crate::sampler::{Sampler, SamplerConfig};
use crate::tokenizer::Tokenizer;
use crate::RuntimeError;

/// mlx-lm's `--prefill-step-size` default.
pub const DEFAULT_PREFILL_STEP: usize = 2048;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Prompt tokens per forward pass during prefill (bounds the attention scratch memory).
    pub prefill_step: usize,
}

/// Why generation ended, named as the OpenAI API and mlx-lm name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was produced.
    Stop,
    /// `max_tokens` were produced.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated ids, without the end-of-sequence token.
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens per second, first generated token included (as mlx-lm reports it).
    pub prompt_tps: f64,
    pub generation_tps: f64,
}

/// Runs `prompt` through `model` and generates up to `options.max_tokens` tokens, calling
/// `on_text` with each piece of finished text.
pub fn generate(
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    eos_ids: &HashSet<u32>,
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation, RuntimeError> {
    let start = Instant::now();
    let mut cache = model.new_cache();
    let mut sampler = Sampler::new(options.sampler.clone())?;
    let mut history: Vec<u32> = prompt.to_vec();
    let mut logits = prefill(model, prompt, &mut cache, options.prefill_step)?;
    let mut detokenizer = tokenizer.detokenizer()?;
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut finish_reason = FinishReason::Length;
    let mut prompt_tps = 0.0;
    let mut decode_start = start;
    while tokens.len() < options.max_tokens {
        let token = sampler.sample(&mut logits, &history);
        if tokens.is_empty() {
            decode_start = Instant::now();
            prompt_tps = prompt.len() as f64 / (decode_start - start).as_secs_f64();
        }
        if eos_ids.contains(&token) {
            finish_reason = FinishReason::Stop;
            break;
        }
        tokens.push(token);
        history.push(token);
        let piece = detokenizer.push(token)?;
        on_text(&piece);
        text.push_str(&piece);
        if tokens.len() == options.max_tokens {
            break;
        }
        logits = model
            .forward(&[token], &mut cache, Logits::Last)?
            .into_data();
    }
    let rest = detokenizer.finish()?;
    on_text(&rest);
    text.push_str(&rest);
    let elapsed = decode_start.elapsed().as_secs_f64();
    Ok(Generation {
        generation_tps: if elapsed > 0.0 {
            tokens.len() as f64 / elapsed
        } else {
            0.0
        },
        tokens,
        text,
        finish_reason,
        prompt_tokens: prompt.len(),
        prompt_tps,
    })
}

/// Feeds `prompt` through the model in chunks of `step` tokens; returns the last logits.
pub fn prefill(
    model: &dyn LanguageModel,
    prompt: &[u32],
    cache: &mut Cache,
    step: usize,
) -> Result<Vec<f32>, ForwardError> {
    if prompt.is_empty() {
        return Err(ForwardError::EmptyInput);
    }
    let mut logits = Vec::new();
    for chunk in prompt.chunks(step.max(1)) {
        logits = model.forward(chunk, cache, Logits::Last)?.into_data();
    }
    Ok(logits)
}

/// The process's peak resident memory in bytes (Linux), for the report mlx-lm prints.
pub fn peak_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
