//! The generation loop: prefill the prompt in chunks, then decode one token at a time, streaming
//! text as it becomes final, as `mlx_lm.generate`'s `stream_generate` does.

use std::collections::HashSet;
use std::ops::ControlFlow;
use std::time::Instant;

use oxlm_engine::ops::{self, Pick};
use oxlm_engine::{DecodeSteps, KvPrecision};
use oxlm_models::{Cache, ForwardError, LanguageModel, Logits};

use crate::sampler::{top_logprobs, Sampler, SamplerConfig};
use crate::stop::StopMatcher;
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
    /// How the cache keeps keys and values; `None`: the device's default (f16 on the host, f32
    /// on a GPU).
    pub kv_cache: Option<KvPrecision>,
}

impl GenerateOptions {
    /// A fresh cache for `model` in the precision these options ask for.
    pub fn new_cache(&self, model: &dyn LanguageModel) -> Result<Cache, RuntimeError> {
        Ok(match self.kv_cache {
            Some(precision) => model.new_cache_in(precision)?,
            None => model.new_cache()?,
        })
    }
}

/// Why generation ended, named as the OpenAI API and mlx-lm name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was produced, or a stop string.
    Stop,
    /// `max_tokens` were produced.
    Length,
    /// The caller stopped it (its client went away).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
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
    let mut cache = options.new_cache(model)?;
    generate_stream(
        model,
        tokenizer,
        prompt,
        &mut cache,
        eos_ids,
        options,
        &StreamOptions::default(),
        &mut |event| {
            match event {
                Event::Token { text, .. } | Event::Text(text) => on_text(text),
                Event::Prefill { .. } => {}
            }
            ControlFlow::Continue(())
        },
    )
}

/// What a server asks of generation beyond [`GenerateOptions`].
#[derive(Debug, Clone, Default)]
pub struct StreamOptions {
    /// Strings that end generation where they appear in the output, which stops right before
    /// them (see [`StopMatcher`]).
    pub stop: Vec<String>,
    /// How many of the most likely tokens to report with each sampled one.
    pub top_logprobs: usize,
}

/// Progress reported by [`generate_stream`]; the callback answers whether to go on.
#[derive(Debug)]
pub enum Event<'a> {
    /// `done` of the `total` uncached prompt tokens have gone through the model.
    Prefill { done: usize, total: usize },
    /// A token was sampled (an end-of-sequence token included). `text` is the output it made
    /// final, possibly empty: the detokenizer and the stop strings may hold text back.
    Token {
        id: u32,
        /// Its log-probability (mlx-lm's: after logits processors, before filters and temperature).
        logprob: f32,
        /// The `top_logprobs` most likely `(id, logprob)`, most likely first.
        top: &'a [(u32, f32)],
        text: &'a str,
    },
    /// Output released once no more tokens come.
    Text(&'a str),
}

/// As [`generate`], continuing from `cache`, which holds the state of the first `cache.offset`
/// prompt tokens (a prompt cache hit; 0 for a fresh cache). On return, `cache` holds the state
/// of the first `cache.offset` tokens of the prompt followed by the generated tokens.
///
/// `on_event` can stop generation by returning `Break` (the client went away); the generation
/// then ends with [`FinishReason::Cancelled`].
#[allow(clippy::too_many_arguments)]
pub fn generate_stream(
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    cache: &mut Cache,
    eos_ids: &HashSet<u32>,
    options: &GenerateOptions,
    stream: &StreamOptions,
    on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Generation, RuntimeError> {
    let start = Instant::now();
    let mut sampler = Sampler::new(options.sampler.clone())?;
    let mut detokenizer = tokenizer.detokenizer()?;
    let mut stop = StopMatcher::new(&stream.stop);
    let mut history: Vec<u32> = prompt.to_vec();
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut prompt_tps = 0.0;
    let mut decode_start = start;
    let uncached = prompt.get(cache.offset..).unwrap_or_default();
    let Some(mut logits) =
        prefill_reporting(model, uncached, cache, options.prefill_step, on_event)?
    else {
        return Ok(Generation {
            tokens,
            text,
            finish_reason: FinishReason::Cancelled,
            prompt_tokens: prompt.len(),
            prompt_tps,
            generation_tps: 0.0,
        });
    };
    let mut finish_reason = FinishReason::Length;
    let mut top = Vec::new();
    let mut steps = DecodeSteps::new(&model.info().device);
    // Plain greedy decoding needs only each step's pick, taken where the logits are: a GPU then
    // copies back two numbers instead of a vocabulary's row, and the host skips the sampler's
    // pass over it.
    let greedy = sampler.picks_greedily() && stream.top_logprobs == 0;
    let mut pick: Option<Pick> = None;
    while tokens.len() < options.max_tokens {
        let (token, logprob) = match pick.take() {
            Some(pick) => (pick.id, pick.logprob),
            None => {
                let token = sampler.sample(&mut logits, &history);
                if stream.top_logprobs > 0 {
                    top = top_logprobs(&logits, stream.top_logprobs);
                }
                let logprob = logits.get(token as usize).copied();
                (token, logprob.unwrap_or(f32::NEG_INFINITY))
            }
        };
        if tokens.is_empty() {
            decode_start = Instant::now();
            prompt_tps = uncached.len() as f64 / (decode_start - start).as_secs_f64();
        }
        let is_eos = eos_ids.contains(&token);
        let released = if is_eos {
            // The end-of-sequence token itself is not output.
            finish_reason = FinishReason::Stop;
            stop.push(&detokenizer.finish()?)
        } else {
            tokens.push(token);
            history.push(token);
            stop.push(&detokenizer.push(token)?)
        };
        text.push_str(&released.text);
        let event = Event::Token {
            id: token,
            logprob,
            top: &top,
            text: &released.text,
        };
        if on_event(event).is_break() {
            finish_reason = FinishReason::Cancelled;
            break;
        }
        if released.stopped {
            finish_reason = FinishReason::Stop;
            break;
        }
        if is_eos || tokens.len() == options.max_tokens {
            break;
        }
        if greedy {
            pick = Some(steps.run(|| {
                let logits = model.forward(&[token], cache, Logits::LastOnDevice)?;
                Ok::<_, ForwardError>(ops::greedy_rows(&logits)?[0])
            })?);
        } else {
            logits = steps
                .run(|| model.forward(&[token], cache, Logits::Last))?
                .into_data();
        }
    }
    // Text still held back is output unless a stop string ended generation.
    let mut rest = String::new();
    if finish_reason == FinishReason::Length {
        rest = stop.push(&detokenizer.finish()?).text;
    }
    if finish_reason != FinishReason::Cancelled && !stop.stopped() {
        rest.push_str(&stop.finish());
    }
    // Nothing is left to stop.
    let _ = on_event(Event::Text(&rest));
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

/// [`prefill`], reporting progress after each chunk; `None` when `on_event` stopped it.
fn prefill_reporting(
    model: &dyn LanguageModel,
    prompt: &[u32],
    cache: &mut Cache,
    step: usize,
    on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Option<Vec<f32>>, ForwardError> {
    if prompt.is_empty() {
        return Err(ForwardError::EmptyInput);
    }
    let mut logits = Vec::new();
    let mut done = 0;
    for chunk in prompt.chunks(step.max(1)) {
        logits = model.forward(chunk, cache, Logits::Last)?.into_data();
        done += chunk.len();
        let event = Event::Prefill {
            done,
            total: prompt.len(),
        };
        if on_event(event).is_break() {
            return Ok(None);
        }
    }
    Ok(Some(logits))
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
