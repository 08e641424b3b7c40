//! The generation loop: prefill the prompt in chunks, then decode one token at a time, streaming
//! text as it becomes final, as `mlx_lm.generate`'s `stream_generate` does.

use std::collections::HashSet;
use std::ops::ControlFlow;
use std::time::Instant;

use oxlm_engine::ops::{self, Pick};
use oxlm_engine::{DecodeSteps, KvPrecision};
use oxlm_models::{Cache, ForwardError, KvQuantization, LanguageModel, Logits};

use crate::constraint::{AllowedTokens, TokenConstraint};
use crate::detokenizer::StreamingDetokenizer;
use crate::reasoning_budget::ReasoningBudget;
use crate::sampler::{top_logprobs, Sampler, SamplerConfig};
use crate::stop::StopMatcher;
use crate::tokenizer::{Tokenizer, TokenizerError};
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
    /// Which layers' caches go to affine codes, and from which token (mlx-lm's `--kv-bits`,
    /// `--kv-group-size` and `--quantized-kv-start`, or a checkpoint's `kv_config.json`):
    /// checked after each forward pass, as mlx-lm does.
    pub kv_quantization: Option<KvQuantization>,
    /// mlx-lm's `--max-kv-size`: each layer's cache a ring of this many positions that keeps
    /// the first 4, for the model types mlx-lm bounds ([`oxlm_models::takes_max_kv_size`]).
    pub max_kv_size: Option<usize>,
}

impl GenerateOptions {
    /// A fresh cache for `model` in the precision these options ask for (not yet quantized:
    /// see [`quantize_when_due`](Self::quantize_when_due)).
    pub fn new_cache(&self, model: &dyn LanguageModel) -> Result<Cache, RuntimeError> {
        let cache = match self.kv_cache {
            Some(precision) => model.new_cache_in(precision)?,
            None => model.new_cache()?,
        };
        Ok(match self.max_kv_size {
            Some(size) if oxlm_models::takes_max_kv_size(&model.info().model_type) => {
                cache.with_max_kv_size(size).map_err(ForwardError::from)?
            }
            _ => cache,
        })
    }

    /// After a forward pass: `cache`'s quantized layers go to their codes once it holds the
    /// tokens these options quantize from.
    pub fn quantize_when_due(&self, cache: &mut Cache) -> Result<(), ForwardError> {
        if let Some(quantization) = &self.kv_quantization {
            cache.quantize_when_due(quantization)?;
        }
        Ok(())
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
    /// The grammar the output must follow; generation ends once it is complete.
    pub constraint: Option<TokenConstraint>,
    /// The output continues text that ends the prompt (a prefilled reply), so a space it
    /// starts with is its own, not the detokenizer's to drop.
    pub continues_text: bool,
    /// The most tokens the reply may reason for.
    pub reasoning_budget: Option<ReasoningBudget>,
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
    // Refused before prefill, which would otherwise run up to the limit before failing.
    model.info().check_context(0, prompt.len())?;
    let uncached = prompt.get(cache.offset..).unwrap_or_default();
    let sequence = Sequence::new(
        Some(tokenizer),
        prompt,
        uncached.len(),
        eos_ids,
        options,
        stream,
    )?;
    run_stream(model, sequence, uncached, cache, options, on_event)
}

/// As [`generate_stream`], continuing from `cache`, which holds the state of tokens not known
/// here (a prompt cache read from a file, `cache.offset` of them): all of `prompt` goes
/// through the model after them, as mlx-lm's `generate_step` continues a prompt cache. Only
/// `prompt` counts as the prompt: in the report, and in the history the sampler's repetition
/// penalties look back on (mlx-lm's logits processors see the same).
#[allow(clippy::too_many_arguments)]
pub fn generate_stream_after_cache(
    model: &dyn LanguageModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    cache: &mut Cache,
    eos_ids: &HashSet<u32>,
    options: &GenerateOptions,
    stream: &StreamOptions,
    on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Generation, RuntimeError> {
    model.info().check_context(cache.offset, prompt.len())?;
    let sequence = Sequence::new(
        Some(tokenizer),
        prompt,
        prompt.len(),
        eos_ids,
        options,
        stream,
    )?;
    run_stream(model, sequence, prompt, cache, options, on_event)
}

/// Prefills `uncached` after what `cache` holds, then decodes `sequence` to its end.
fn run_stream(
    model: &dyn LanguageModel,
    mut sequence: Sequence,
    uncached: &[u32],
    cache: &mut Cache,
    options: &GenerateOptions,
    on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Generation, RuntimeError> {
    let Some(logits) = prefill_quantizing(model, uncached, cache, options, on_event)? else {
        return Ok(sequence.cancel());
    };
    let mut steps = DecodeSteps::new(&model.info().device);
    let vocab = model.info().vocab_size;
    let mut stepped = Stepped::Logits(logits);
    while let Some(token) = sequence.advance(stepped.next(0, vocab), on_event)? {
        let picking = Picking::of(&mut sequence);
        stepped = decode_step(model, &mut steps, &[token], &mut [&mut *cache], picking)?;
        options.quantize_when_due(cache)?;
    }
    sequence.finish(on_event)
}

/// [`prefill_reporting`], quantizing the cache where `options` ask, at the points where
/// mlx-lm's `generate_step` does: after each chunk of all but the last prompt token, and after
/// that token, which goes through alone (so it attends a cache quantized from a start the
/// prompt reached before it, or a bounded cache as one token sees it).
pub fn prefill_quantizing(
    model: &dyn LanguageModel,
    prompt: &[u32],
    cache: &mut Cache,
    options: &GenerateOptions,
    on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Option<Vec<f32>>, ForwardError> {
    let step = options.prefill_step;
    let after = |cache: &mut Cache| options.quantize_when_due(cache);
    let total = prompt.len();
    let last_alone = options.kv_quantization.is_some() || cache.keeps_first_positions();
    if !last_alone || total < 2 {
        return prefill_chunks(model, prompt, cache, step, (0, total), &after, on_event);
    }
    let (head, last) = prompt.split_at(total - 1);
    if prefill_chunks(model, head, cache, step, (0, total), &after, on_event)?.is_none() {
        return Ok(None);
    }
    prefill_chunks(
        model,
        last,
        cache,
        step,
        (total - 1, total),
        &after,
        on_event,
    )
}

/// What one decoding step gave its sequences, in their order.
pub enum Stepped {
    /// Each one's greedy pick, made where the logits are.
    Picks(Vec<Pick>),
    /// `[sequences, vocab]` logits on the host.
    Logits(Vec<f32>),
}

impl Stepped {
    /// What sequence `i` of the step takes its next token from.
    pub fn next(&mut self, i: usize, vocab: usize) -> NextToken<'_> {
        match self {
            Stepped::Picks(picks) => NextToken::Pick(picks[i]),
            Stepped::Logits(logits) => NextToken::Logits(&mut logits[i * vocab..(i + 1) * vocab]),
        }
    }
}

/// What a decoding step hands back to its sequences.
pub enum Picking<'a> {
    /// Every sequence's logits, on the host.
    Logits,
    /// Each sequence's greedy pick, made where the logits are.
    Greedy,
    /// Greedy picks held to the tokens each sequence's grammar allows: `allowed` gives them, a
    /// sequence each (`None`: any token). It is called once the model has the step's work (on
    /// a GPU, while it runs), and waits for the masks if they are still being computed.
    GreedyAllowed(Box<dyn FnOnce() -> Vec<Option<AllowedTokens>> + 'a>),
}

impl Picking<'_> {
    /// Greedy picks, held to `sequence`'s grammar if it has one ([`Sequence::allowed_next`]),
    /// or its logits.
    fn of(sequence: &mut Sequence) -> Picking<'_> {
        if !sequence.greedy {
            Picking::Logits
        } else if sequence.constraint_mut().is_none() {
            Picking::Greedy
        } else {
            Picking::GreedyAllowed(Box::new(|| vec![sequence.allowed_next()]))
        }
    }
}

/// One decoding step, replayed by `steps`: `tokens[i]` through `model` after what `caches[i]`
/// holds. One sequence goes alone; several go as one batch (`forward_batch`, which reads each
/// weight once for all of them). With greedy `picking`, only their picks come back (see
/// [`NextToken`]); otherwise every sequence's logits, on the host. Caches grow before the
/// step, not in it ([`Cache::make_room_for_next`]).
pub fn decode_step(
    model: &dyn LanguageModel,
    steps: &mut DecodeSteps,
    tokens: &[u32],
    caches: &mut [&mut Cache],
    picking: Picking<'_>,
) -> Result<Stepped, ForwardError> {
    for cache in caches.iter_mut() {
        cache.make_room_for_next()?;
    }
    steps.run(|| {
        let logits = match caches {
            [cache] => {
                let kind = match picking {
                    Picking::Logits => Logits::Last,
                    Picking::Greedy | Picking::GreedyAllowed(_) => Logits::LastOnDevice,
                };
                model.forward(tokens, cache, kind)?
            }
            _ => model.forward_batch(tokens, caches)?,
        };
        Ok(match picking {
            Picking::Logits => Stepped::Logits(logits.into_host()?.into_data()),
            Picking::Greedy => Stepped::Picks(ops::greedy_rows(&logits)?),
            Picking::GreedyAllowed(allowed) => {
                let allowed = allowed();
                let words: Vec<Option<&[u32]>> = allowed
                    .iter()
                    .map(|a| a.as_ref().map(AllowedTokens::words))
                    .collect();
                Stepped::Picks(ops::greedy_rows_allowed(&logits, &words)?)
            }
        })
    })
}

/// What a decoding step gives a sequence: the logits of its next token, or (for a sequence
/// that [picks greedily](Sequence::picks_greedily)) their greedy pick, made where they are: a
/// GPU then copies back two numbers instead of a vocabulary's row, and the host skips the
/// sampler's pass over it.
pub enum NextToken<'a> {
    Logits(&'a mut [f32]),
    Pick(Pick),
}

/// One sequence's generation once its prompt has gone through the model: it takes each next
/// token from a decoding step's logits, streams the text that token makes final, and decides
/// when generation ends. [`generate_stream`] runs one alone; a server steps many together.
pub struct Sequence {
    sampler: Sampler,
    constraint: Option<TokenConstraint>,
    reasoning_budget: Option<ReasoningBudget>,
    /// `None`: token ids only, no text.
    detokenizer: Option<StreamingDetokenizer>,
    stop: StopMatcher,
    eos_ids: HashSet<u32>,
    max_tokens: usize,
    top_logprobs: usize,
    greedy: bool,
    /// The prompt and the generated tokens, for the sampler's repetition penalties.
    history: Vec<u32>,
    tokens: Vec<u32>,
    text: String,
    top: Vec<(u32, f32)>,
    /// Why generation ended, once it has.
    finish_reason: Option<FinishReason>,
    prompt_tokens: usize,
    uncached: usize,
    start: Instant,
    decode_start: Instant,
    prompt_tps: f64,
}

impl Sequence {
    /// A sequence of `prompt`, of which `uncached` tokens go through the model (the rest came
    /// from a prompt cache); its prompt time runs from here. Without a tokenizer it makes no
    /// text (a benchmark's model need not have one), and stop strings never match.
    pub fn new(
        tokenizer: Option<&Tokenizer>,
        prompt: &[u32],
        uncached: usize,
        eos_ids: &HashSet<u32>,
        options: &GenerateOptions,
        stream: &StreamOptions,
    ) -> Result<Sequence, RuntimeError> {
        let sampler = Sampler::new(options.sampler.clone())?;
        // Greedy decoding needs only each step's pick, held to a grammar's mask where it has one.
        let greedy = sampler.picks_greedily() && stream.top_logprobs == 0;
        let start = Instant::now();
        Ok(Sequence {
            sampler,
            constraint: stream.constraint.clone(),
            reasoning_budget: stream.reasoning_budget.clone(),
            detokenizer: tokenizer.map(Tokenizer::detokenizer).transpose()?.map(|d| {
                if stream.continues_text {
                    d.continuing()
                } else {
                    d
                }
            }),
            stop: StopMatcher::new(&stream.stop),
            eos_ids: eos_ids.clone(),
            max_tokens: options.max_tokens,
            top_logprobs: stream.top_logprobs,
            greedy,
            history: prompt.to_vec(),
            tokens: Vec::new(),
            text: String::new(),
            top: Vec::new(),
            // `max_tokens` 0 generates nothing.
            finish_reason: (options.max_tokens == 0).then_some(FinishReason::Length),
            prompt_tokens: prompt.len(),
            uncached,
            start,
            decode_start: start,
            prompt_tps: 0.0,
        })
    }

    /// Its grammar, while it still has tokens to take.
    pub fn constraint_mut(&mut self) -> Option<&mut TokenConstraint> {
        self.constraint
            .as_mut()
            .filter(|_| self.finish_reason.is_none())
    }

    /// Whether its steps may give it [`NextToken::Pick`] rather than logits (held to the
    /// tokens [`allowed_next`](Self::allowed_next) gives, where it has a grammar).
    pub fn picks_greedily(&self) -> bool {
        self.greedy
    }

    /// The grammar that taking `token` next advances: `None` without one, once generation has
    /// ended, or for a token that ends it. A batch advances its sequences' grammars side by
    /// side through it ([`TokenConstraint::accept_ahead`]) before each takes its token.
    pub fn grammar_advanced_by(&mut self, token: u32) -> Option<&mut TokenConstraint> {
        if self.eos_ids.contains(&token) || self.forced().is_some() {
            return None;
        }
        self.constraint_mut()
    }

    /// The token its next step must take, in place of the model's: the end of reasoning that
    /// has spent its budget.
    fn forced(&self) -> Option<u32> {
        self.reasoning_budget.as_ref()?.forced()
    }

    /// The tokens its grammar allows next, for a greedy pick; `None` without a grammar, or
    /// when they cannot be had (then [`advance`](Self::advance) ends the generation with why).
    pub fn allowed_next(&mut self) -> Option<AllowedTokens> {
        self.constraint_mut()?.take_allowed()
    }

    /// Takes the next token from `next` and reports it; returns the token for the model to
    /// take next, or `None` once generation has ended (an end-of-sequence token, a stop
    /// string, `max_tokens`, or `on_event` answering `Break`).
    pub fn advance(
        &mut self,
        next: NextToken<'_>,
        on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    ) -> Result<Option<u32>, RuntimeError> {
        if self.finish_reason.is_some() {
            return Ok(None);
        }
        let forced = self.forced();
        let (token, logprob) = match next {
            NextToken::Pick(pick) => {
                if let Some(constraint) = &mut self.constraint {
                    constraint.check_pick()?;
                }
                // A forced token is certain: its log-probability is 0.
                forced.map_or((pick.id, pick.logprob), |token| (token, 0.0))
            }
            NextToken::Logits(logits) => {
                if let Some(constraint) = &mut self.constraint {
                    constraint.mask(logits)?;
                }
                match forced {
                    // Not sampled: a grammar that refuses the token says so as it advances.
                    Some(token) => {
                        if self.top_logprobs > 0 {
                            self.top = vec![(token, 0.0)];
                        }
                        (token, 0.0)
                    }
                    None => {
                        let token = self.sampler.sample(logits, &self.history);
                        if self.top_logprobs > 0 {
                            self.top = top_logprobs(logits, self.top_logprobs);
                        }
                        let logprob = logits.get(token as usize).copied();
                        (token, logprob.unwrap_or(f32::NEG_INFINITY))
                    }
                }
            }
        };
        if self.tokens.is_empty() {
            self.decode_start = Instant::now();
            let prompt_time = (self.decode_start - self.start).as_secs_f64();
            self.prompt_tps = self.uncached as f64 / prompt_time;
        }
        let is_eos = self.eos_ids.contains(&token);
        let mut grammar_complete = false;
        let released = if is_eos {
            // The end-of-sequence token itself is not output.
            self.finish_reason = Some(FinishReason::Stop);
            let text = self.detokenized(|d| d.finish())?;
            self.stop.push(&text)
        } else {
            self.tokens.push(token);
            self.history.push(token);
            if let Some(budget) = &mut self.reasoning_budget {
                budget.took(&self.tokens);
            }
            let mut text = self.detokenized(|d| d.push(token))?;
            if let Some(constraint) = &mut self.constraint {
                grammar_complete = constraint.accept(token)?;
            }
            if grammar_complete {
                // Nothing follows: the text held back for later tokens is final.
                text.push_str(&self.detokenized(|d| d.finish())?);
            }
            self.stop.push(&text)
        };
        self.text.push_str(&released.text);
        let event = Event::Token {
            id: token,
            logprob,
            top: &self.top,
            text: &released.text,
        };
        if on_event(event).is_break() {
            self.finish_reason = Some(FinishReason::Cancelled);
        } else if released.stopped || grammar_complete {
            self.finish_reason = Some(FinishReason::Stop);
        } else if !is_eos && self.tokens.len() == self.max_tokens {
            self.finish_reason = Some(FinishReason::Length);
        }
        Ok(self.finish_reason.is_none().then_some(token))
    }

    /// What the detokenizer releases through `f`; nothing without one.
    fn detokenized(
        &mut self,
        f: impl FnOnce(&mut StreamingDetokenizer) -> Result<String, TokenizerError>,
    ) -> Result<String, TokenizerError> {
        self.detokenizer.as_mut().map_or(Ok(String::new()), f)
    }

    /// Ends the generation before its first token: the caller stopped the prompt.
    pub fn cancel(self) -> Generation {
        Generation {
            tokens: Vec::new(),
            text: String::new(),
            finish_reason: FinishReason::Cancelled,
            prompt_tokens: self.prompt_tokens,
            prompt_tps: 0.0,
            generation_tps: 0.0,
        }
    }

    /// Ends the generation where it stands (a generation still going ends as `Length`):
    /// releases the text held back, unless a stop string or the caller ended it.
    pub fn finish(
        mut self,
        on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
    ) -> Result<Generation, RuntimeError> {
        let finish_reason = self.finish_reason.unwrap_or(FinishReason::Length);
        let mut rest = String::new();
        if finish_reason == FinishReason::Length {
            let text = self.detokenized(|d| d.finish())?;
            rest = self.stop.push(&text).text;
        }
        if finish_reason != FinishReason::Cancelled && !self.stop.stopped() {
            rest.push_str(&self.stop.finish());
        }
        // Nothing is left to stop.
        let _ = on_event(Event::Text(&rest));
        self.text.push_str(&rest);
        let elapsed = self.decode_start.elapsed().as_secs_f64();
        Ok(Generation {
            generation_tps: if elapsed > 0.0 && !self.tokens.is_empty() {
                self.tokens.len() as f64 / elapsed
            } else {
                0.0
            },
            tokens: self.tokens,
            text: self.text,
            finish_reason,
            prompt_tokens: self.prompt_tokens,
            prompt_tps: self.prompt_tps,
        })
    }
}

/// [`prefill`], reporting progress after each chunk; `None` when `on_event` stopped it.
pub fn prefill_reporting(
    model: &dyn LanguageModel,
    prompt: &[u32],
    cache: &mut Cache,
    step: usize,
    on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Option<Vec<f32>>, ForwardError> {
    let total = prompt.len();
    prefill_chunks(
        model,
        prompt,
        cache,
        step,
        (0, total),
        &|_| Ok(()),
        on_event,
    )
}

/// [`prefill_reporting`] of `prompt`, the tokens after the first `progress.0` of `progress.1`,
/// calling `after` on the cache after each chunk.
fn prefill_chunks(
    model: &dyn LanguageModel,
    prompt: &[u32],
    cache: &mut Cache,
    step: usize,
    (mut done, total): (usize, usize),
    after: &dyn Fn(&mut Cache) -> Result<(), ForwardError>,
    on_event: &mut dyn FnMut(Event<'_>) -> ControlFlow<()>,
) -> Result<Option<Vec<f32>>, ForwardError> {
    if prompt.is_empty() {
        return Err(ForwardError::EmptyInput);
    }
    let mut logits = Vec::new();
    for chunk in prompt.chunks(step.max(1)) {
        logits = model.forward(chunk, cache, Logits::Last)?.into_data();
        after(cache)?;
        done += chunk.len();
        if on_event(Event::Prefill { done, total }).is_break() {
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
