//! Token sampling with mlx-lm 0.32.2's semantics (mlx_lm/sample_utils.py `make_sampler`,
//! `make_logits_processors`; mlx_lm/generate.py `generate_step`).
//!
//! Each step, in mlx-lm's order:
//! 1. logits processors on the raw logits, in this order: `logit_bias` (added), repetition penalty (each
//!    distinct token of the context: negative logits multiplied by the penalty, others divided), presence
//!    penalty (subtracted once per distinct token), frequency penalty (subtracted once per occurrence). The
//!    context is the last `*_context_size` ids of prompt + generated tokens; a size of 0 means the whole history
//!    (Python's `tokens[-0:]`). A penalty of `None` or 0 is off.
//! 2. `logprobs = logits - logsumexp(logits)`: this is what mlx-lm reports as the step's log-probabilities, and
//!    what [`Sampler::sample`] leaves in the caller's buffer.
//! 3. `temperature == 0`: argmax (the first maximum). Otherwise the filters run on the log-probabilities,
//!    before any temperature scaling: top-p (when `0 < top_p < 1`), min-p (when `min_p != 0`), XTC (when
//!    `xtc_probability > 0`), top-k (when `top_k > 0`); then one token is drawn from
//!    `softmax(logprobs / temperature)`.
//!
//! mlx draws with its own counter-based RNG (`mx.random.categorical`); this uses rand's seeded `StdRng`, so the
//! same seed gives the same tokens here but not the tokens mlx-lm gives. Distributions are the same.
//! Exponentials are f32 and their sums f64, where mlx uses the logits' dtype for both, so borderline
//! top-p/min-p cut-offs can differ in the last bit. Filters rank only the likeliest tokens they need
//! (`walk_ranked`), not the whole vocabulary. `top_k >= vocabulary size` keeps every token (mlx-lm raises a ValueError).

use std::collections::BTreeMap;

use oxlm_engine::cpu::elementwise::{exp_into, exp_sum};
use oxlm_engine::ops::{argmax, log_sum_exp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

/// Invalid sampling parameters (mlx-lm raises `ValueError` for the same ones).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplerError {
    #[error("temperature has to be a non-negative number, but is {0}")]
    Temperature(f32),
    #[error("`min_p` has to be a float in the [0, 1] interval, but is {0}")]
    MinP(f32),
    #[error("`min_tokens_to_keep` has to be a positive integer, but is {0}")]
    MinTokensToKeep(usize),
    #[error("`threshold` has to be a float in the [0, 0.5] interval, but is {0}")]
    XtcThreshold(f32),
    #[error("`probability` has to be a float in the [0, 1] interval, but is {0}")]
    XtcProbability(f32),
    #[error("penalty must be a non-negative float, got {0}")]
    RepetitionPenalty(f32),
}

/// The smallest positive temperature that draws meaningfully. The draw weighs each token by
/// `exp(logprob / temperature - max)` in f32, which rounds `logprob / temperature` by up to
/// 2^-24 of itself. The likeliest token the filters leave has a log-probability above -130 (at
/// worst XTC keeps one of the smallest positive f32 probability, about e^-104, under a top
/// token of at least 1 / vocabulary), so from 1e-4 up that rounding stays within a tenth of a
/// nat; much colder it outgrows f32's exponent range and the weights become noise, then NaN.
/// Colder than 1e-4 is greedy in all but name anyway: a token 0.001 nats less likely than the
/// top one is drawn e^-10 times as often.
pub const MIN_TEMPERATURE: f32 = 1e-4;

/// Sampling parameters; defaults are mlx-lm's (`mlx_lm generate` CLI / server): greedy, every filter off,
/// penalty contexts of 20 tokens.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplerConfig {
    /// 0 picks the most likely token.
    #[serde(alias = "temp")]
    pub temperature: f32,
    /// Nucleus sampling; active when `0 < top_p < 1`.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 is off.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the top token's probability; 0 is off.
    pub min_p: f32,
    /// Tokens min-p always keeps.
    pub min_tokens_to_keep: usize,
    /// Probability of applying XTC ("exclude top choices") at a step; 0 is off.
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    /// Ids XTC never removes; mlx-lm passes `tokenizer.encode("\n") + eos_token_ids`.
    pub xtc_special_tokens: Vec<u32>,
    pub repetition_penalty: Option<f32>,
    pub repetition_context_size: usize,
    pub presence_penalty: Option<f32>,
    pub presence_context_size: usize,
    pub frequency_penalty: Option<f32>,
    pub frequency_context_size: usize,
    /// Added to the logits of the given ids (JSON object keys are ids as strings).
    pub logit_bias: BTreeMap<u32, f32>,
    /// Seed for the sampling RNG; `None` seeds from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            xtc_special_tokens: Vec::new(),
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: None,
            presence_context_size: 20,
            frequency_penalty: None,
            frequency_context_size: 20,
            logit_bias: BTreeMap::new(),
            seed: None,
        }
    }
}

/// A penalty that is on (`make_logits_processors`: not `None` and not 0).
fn active(penalty: Option<f32>) -> Option<f32> {
    penalty.filter(|p| *p != 0.0)
}

/// The last `size` ids of the history; 0 means all of it, like Python's `tokens[-0:]`.
fn context(history: &[u32], size: usize) -> &[u32] {
    if size == 0 {
        history
    } else {
        &history[history.len().saturating_sub(size)..]
    }
}

/// Stateful sampler: owns the RNG and scratch buffers.
pub struct Sampler {
    config: SamplerConfig,
    rng: StdRng,
    /// Filtered log-probabilities of the current step.
    work: Vec<f32>,
    /// (log-probability, id) pairs for sorting.
    ranked: Vec<(f32, u32)>,
    ids: Vec<u32>,
    /// [`categorical`]'s scratch.
    weights: Vec<f32>,
    block_sums: Vec<f64>,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Self, SamplerError> {
        let c = &config;
        if c.temperature.is_nan() || c.temperature < 0.0 {
            return Err(SamplerError::Temperature(c.temperature));
        }
        if c.min_p != 0.0 {
            if !(0.0..=1.0).contains(&c.min_p) {
                return Err(SamplerError::MinP(c.min_p));
            }
            if c.min_tokens_to_keep < 1 {
                return Err(SamplerError::MinTokensToKeep(c.min_tokens_to_keep));
            }
        }
        if c.xtc_probability > 0.0 {
            if !(0.0..=0.5).contains(&c.xtc_threshold) {
                return Err(SamplerError::XtcThreshold(c.xtc_threshold));
            }
            if !(0.0..=1.0).contains(&c.xtc_probability) {
                return Err(SamplerError::XtcProbability(c.xtc_probability));
            }
        }
        if let Some(p) = active(c.repetition_penalty).filter(|p| *p < 0.0) {
            return Err(SamplerError::RepetitionPenalty(p));
        }
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Self {
            config,
            rng,
            work: Vec::new(),
            ranked: Vec::new(),
            ids: Vec::new(),
            weights: Vec::new(),
            block_sums: Vec::new(),
        })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Whether every pick is the logits' first maximum, untouched by biases or penalties: then
    /// `oxlm_engine::ops::greedy_rows` (run where the logits are) gives what
    /// [`sample`](Self::sample) would, and the logits need not reach the host.
    pub fn picks_greedily(&self) -> bool {
        let c = &self.config;
        c.temperature == 0.0
            && c.logit_bias.is_empty()
            && [
                c.repetition_penalty,
                c.presence_penalty,
                c.frequency_penalty,
            ]
            .into_iter()
            .all(|p| active(p).is_none())
    }

    /// Picks the next token from one step's `logits`, given every id so far (prompt then generated).
    /// On return `logits` holds mlx-lm's `logprobs` for the step: the log-softmax of the processed logits,
    /// before filtering and temperature.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.process(logits, history);
        log_softmax(logits);
        if self.config.temperature == 0.0 {
            return argmax(logits);
        }
        self.work.clear();
        self.work.extend_from_slice(logits);
        let c = &self.config;
        if 0.0 < c.top_p && c.top_p < 1.0 {
            apply_top_p(&mut self.work, c.top_p, &mut self.ranked);
        }
        if c.min_p != 0.0 {
            apply_min_p(
                &mut self.work,
                c.min_p,
                c.min_tokens_to_keep,
                &mut self.ranked,
            );
        }
        if c.xtc_probability > 0.0 {
            let draw: f32 = self.rng.random();
            apply_xtc(
                &mut self.work,
                draw,
                c.xtc_probability,
                c.xtc_threshold,
                &c.xtc_special_tokens,
            );
        }
        if c.top_k > 0 {
            apply_top_k(&mut self.work, c.top_k, &mut self.ranked);
        }
        let draw: f64 = self.rng.random();
        let inv_temp = 1.0 / self.config.temperature;
        categorical(
            &self.work,
            inv_temp,
            draw,
            &mut self.weights,
            &mut self.block_sums,
        )
    }

    /// The logits processors, in `make_logits_processors` order.
    fn process(&mut self, logits: &mut [f32], history: &[u32]) {
        let c = &self.config;
        for (&id, &bias) in &c.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        let distinct = |ids: &mut Vec<u32>, size: usize| {
            ids.clear();
            ids.extend_from_slice(context(history, size));
            ids.sort_unstable();
            ids.dedup();
        };
        if let Some(penalty) = active(c.repetition_penalty) {
            distinct(&mut self.ids, c.repetition_context_size);
            for &id in &self.ids {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
                }
            }
        }
        if let Some(penalty) = active(c.presence_penalty) {
            distinct(&mut self.ids, c.presence_context_size);
            for &id in &self.ids {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= penalty;
                }
            }
        }
        if let Some(penalty) = active(c.frequency_penalty) {
            for &id in context(history, c.frequency_context_size) {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= penalty;
                }
            }
        }
    }
}

/// In place `x - logsumexp(x)`.
fn log_softmax(x: &mut [f32]) {
    let lse = log_sum_exp(x);
    x.iter_mut().for_each(|v| *v -= lse);
}

/// The order of [`rank`]: largest first, ties by lower id.
fn ranked_order(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Fills `ranked` with (value, id) for every finite entry, largest first (ties: lower id first).
fn rank(x: &[f32], ranked: &mut Vec<(f32, u32)>) {
    ranked.clear();
    ranked.extend(finite(x));
    ranked.sort_unstable_by(ranked_order);
}

fn finite(x: &[f32]) -> impl Iterator<Item = (f32, u32)> + '_ {
    x.iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (v, i as u32))
}

/// Hands the finite entries of `x` to `visit` in [`rank`]'s order until it returns false,
/// leaving the visited ones at the front of `ranked`, in that order; returns how many it
/// visited. Only entries within a bar of the largest are gathered at first (the bar lowered
/// while `visit` wants more), and those are ranked a chunk at a time (the chunk's entries
/// picked out, then sorted): a few likely tokens of a large vocabulary cost no sort of all.
fn walk_ranked(
    x: &[f32],
    ranked: &mut Vec<(f32, u32)>,
    mut visit: impl FnMut(f32) -> bool,
) -> usize {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let bars = [4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0].map(|drop| max - drop);
    ranked.clear();
    let (mut done, mut chunk) = (0, 64);
    // Entries at or above `upper` are gathered already.
    let mut upper = f32::INFINITY;
    for bar in bars.into_iter().chain([f32::NEG_INFINITY]) {
        ranked.extend(finite(x).filter(|&(v, _)| v >= bar && v < upper));
        upper = bar;
        while done < ranked.len() {
            let end = (done + chunk).min(ranked.len());
            if end < ranked.len() {
                ranked[done..].select_nth_unstable_by(end - done - 1, ranked_order);
            }
            ranked[done..end].sort_unstable_by(ranked_order);
            if let Some(stop) = ranked[done..end].iter().position(|&(v, _)| !visit(v)) {
                return done + stop;
            }
            (done, chunk) = (end, chunk * 4);
        }
    }
    done
}

/// [`rank`]'s first `k` entries (fewer if fewer are finite).
fn rank_top(x: &[f32], k: usize, ranked: &mut Vec<(f32, u32)>) {
    let mut left = k;
    let visited = walk_ranked(x, ranked, |_| {
        let more = left > 0;
        left = left.saturating_sub(1);
        more
    });
    ranked.truncate(visited);
}

/// mlx-lm `apply_top_p`: a token survives when the probability mass of the tokens ranked above it is below
/// `top_p` times the total; every token tied with the last survivor survives too.
fn apply_top_p(logprobs: &mut [f32], top_p: f32, ranked: &mut Vec<(f32, u32)>) {
    let limit = f64::from(top_p) * exp_sum(logprobs, 1.0, 0.0);
    let mut above = 0.0;
    let mut threshold = f32::NEG_INFINITY;
    walk_ranked(logprobs, ranked, |value| {
        if above >= limit {
            return false;
        }
        threshold = value;
        above += f64::from(value.exp());
        true
    });
    logprobs
        .iter_mut()
        .filter(|v| **v < threshold)
        .for_each(|v| *v = f32::NEG_INFINITY);
}

/// mlx-lm `apply_min_p`: drop tokens below `max + ln(min_p)`, except the `min_tokens_to_keep` most likely.
fn apply_min_p(
    logprobs: &mut [f32],
    min_p: f32,
    min_tokens_to_keep: usize,
    ranked: &mut Vec<(f32, u32)>,
) {
    let top = logprobs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let threshold = top + min_p.ln();
    ranked.clear();
    if min_tokens_to_keep > 1 {
        rank_top(logprobs, min_tokens_to_keep, ranked);
    }
    for (i, v) in logprobs.iter_mut().enumerate() {
        if *v < threshold && !ranked.iter().any(|(_, id)| *id as usize == i) {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// mlx-lm `apply_xtc`: with probability `xtc_probability` (`draw` is uniform in [0, 1)), remove every token
/// more likely than the least likely token above `threshold`, sparing `special` ids.
fn apply_xtc(
    logprobs: &mut [f32],
    draw: f32,
    xtc_probability: f32,
    threshold: f32,
    special: &[u32],
) {
    if draw > xtc_probability {
        return;
    }
    let max = logprobs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logprobs.iter().map(|&v| f64::from(v - max).exp()).sum();
    let prob = |v: f32| (f64::from(v - max).exp() / sum) as f32;
    let floor = logprobs
        .iter()
        .map(|&v| prob(v))
        .filter(|&p| p > threshold)
        .fold(f32::INFINITY, f32::min);
    for (i, v) in logprobs.iter_mut().enumerate() {
        if prob(*v) > floor && !special.contains(&(i as u32)) {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// mlx-lm `apply_top_k`: keep the `top_k` largest (ties broken by id here, arbitrarily in mlx).
fn apply_top_k(logprobs: &mut [f32], top_k: usize, ranked: &mut Vec<(f32, u32)>) {
    if top_k >= logprobs.len() {
        return;
    }
    rank_top(logprobs, top_k, ranked);
    // The survivors are those ranked at or before the last one: larger, or tied with a lower id.
    let (last, last_id) = ranked.last().copied().unwrap_or((f32::INFINITY, 0));
    for (id, v) in logprobs.iter_mut().enumerate() {
        if !(*v > last || (*v == last && id as u32 <= last_id)) {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Weights summed a block at a time by [`categorical`], which then walks one block.
const CATEGORICAL_BLOCK: usize = 1024;

/// `mx.random.categorical(logprobs * inv_temp)` with `draw` uniform in [0, 1): the first id at
/// which the running sum of `exp(logprob · inv_temp − max)` passes `draw` times their total.
/// `weights` and `block_sums` are scratch.
fn categorical(
    logprobs: &[f32],
    inv_temp: f32,
    draw: f64,
    weights: &mut Vec<f32>,
    block_sums: &mut Vec<f64>,
) -> u32 {
    let max = logprobs
        .iter()
        .map(|&v| v * inv_temp)
        .fold(f32::NEG_INFINITY, f32::max);
    weights.resize(logprobs.len(), 0.0);
    exp_into(logprobs, inv_temp, max, weights);
    block_sums.clear();
    block_sums.extend(weights.chunks(CATEGORICAL_BLOCK).map(|block| {
        // Four sums side by side, so that the compiler keeps them in vectors.
        let mut lanes = [0.0f64; 4];
        for quad in block.chunks(4) {
            for (lane, &w) in lanes.iter_mut().zip(quad) {
                *lane += f64::from(w);
            }
        }
        lanes.iter().sum::<f64>()
    }));
    let total: f64 = block_sums.iter().sum();
    let mut target = draw * total;
    let chosen = block_sums.iter().position(|&sum| {
        let inside = target < sum;
        if !inside {
            target -= sum;
        }
        inside
    });
    let block = chosen.unwrap_or_else(|| {
        // Rounding left a sliver past the last weight: the last weight it is.
        target = f64::INFINITY;
        block_sums.iter().rposition(|&sum| sum > 0.0).unwrap_or(0)
    });
    let start = block * CATEGORICAL_BLOCK;
    let mut last = start;
    for (i, &w) in weights[start..].iter().take(CATEGORICAL_BLOCK).enumerate() {
        let w = f64::from(w);
        if w > 0.0 {
            last = start + i;
            if target < w {
                break;
            }
            target -= w;
        }
    }
    last as u32
}

/// The `n` most likely entries of a step's log-probabilities, as `(id, logprob)`, most likely first
/// (mlx-lm's server reports `top_logprobs` from the same values).
pub fn top_logprobs(logprobs: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut ranked = Vec::new();
    rank(logprobs, &mut ranked);
    ranked.into_iter().take(n).map(|(v, id)| (id, v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEG: f32 = f32::NEG_INFINITY;

    fn ln(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn kept(x: &[f32]) -> Vec<usize> {
        (0..x.len()).filter(|&i| x[i].is_finite()).collect()
    }

    fn sampler(config: SamplerConfig) -> Sampler {
        Sampler::new(config).unwrap()
    }

    #[test]
    fn defaults_match_mlx_lm() {
        let config: SamplerConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, SamplerConfig::default());
        assert_eq!(config.repetition_context_size, 20);
        let config: SamplerConfig =
            serde_json::from_str(r#"{"temp": 0.7, "logit_bias": {"5": -100.0}, "seed": 3}"#)
                .unwrap();
        assert_eq!(config.temperature, 0.7);
        assert_eq!(config.logit_bias[&5], -100.0);
    }

    #[test]
    fn greedy_picks_first_argmax_and_reports_logprobs() {
        let mut s = sampler(SamplerConfig::default());
        let mut logits = vec![1.0, 3.0, -2.0, 3.0];
        assert_eq!(s.sample(&mut logits, &[]), 1);
        let total: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!((logits[1] - logits[0] - 2.0).abs() < 1e-6);
    }

    #[test]
    fn plain_greedy_needs_only_the_pick() {
        let logits = vec![0.5, 2.0, -1.0, 2.0, 1.5];
        let mut s = sampler(SamplerConfig::default());
        assert!(s.picks_greedily());
        let pick = oxlm_engine::ops::greedy_rows(&oxlm_engine::Tensor::new(
            vec![1, logits.len()],
            logits.clone(),
        ))
        .unwrap()[0];
        let mut processed = logits;
        assert_eq!(s.sample(&mut processed, &[]), pick.id);
        assert_eq!(processed[pick.id as usize], pick.logprob);
        let changed = [
            SamplerConfig {
                temperature: 0.7,
                ..Default::default()
            },
            SamplerConfig {
                logit_bias: [(4, 1.0)].into(),
                ..Default::default()
            },
            SamplerConfig {
                repetition_penalty: Some(1.1),
                ..Default::default()
            },
            SamplerConfig {
                presence_penalty: Some(0.5),
                ..Default::default()
            },
            SamplerConfig {
                frequency_penalty: Some(0.5),
                ..Default::default()
            },
        ];
        for config in changed {
            assert!(!sampler(config.clone()).picks_greedily(), "{config:?}");
        }
        // A penalty of 0 is off, as in mlx-lm.
        assert!(sampler(SamplerConfig {
            repetition_penalty: Some(0.0),
            ..Default::default()
        })
        .picks_greedily());
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        for (seed, temperature) in [(0, 0.5), (1, 1.0), (2, 5.0), (3, 100.0)] {
            let mut s = sampler(SamplerConfig {
                temperature,
                top_k: 1,
                seed: Some(seed),
                ..Default::default()
            });
            for _ in 0..50 {
                assert_eq!(s.sample(&mut [0.1, 0.5, 0.49, -1.0, 0.3], &[]), 1);
            }
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let mut ranked = Vec::new();
        // probabilities 0.5, 0.3, 0.15, 0.05 in shuffled order
        let base = ln(&[0.15, 0.5, 0.05, 0.3]);
        for (top_p, want) in [
            (0.4, vec![1]),
            (0.79, vec![1, 3]),
            (0.81, vec![0, 1, 3]),
            (0.96, vec![0, 1, 2, 3]),
        ] {
            let mut x = base.clone();
            apply_top_p(&mut x, top_p, &mut ranked);
            assert_eq!(kept(&x), want, "top_p {top_p}");
        }
        // Ties with the last kept token are kept.
        let mut x = ln(&[0.4, 0.2, 0.2, 0.2]);
        apply_top_p(&mut x, 0.5, &mut ranked);
        assert_eq!(kept(&x), [0, 1, 2, 3]);
    }

    #[test]
    fn min_p_keeps_tokens_above_the_scaled_top() {
        let mut ranked = Vec::new();
        let base = ln(&[0.15, 0.5, 0.05, 0.3]);
        for (min_p, keep, want) in [
            (0.2, 1, vec![0, 1, 3]),
            (0.35, 1, vec![1, 3]),
            (0.35, 3, vec![0, 1, 3]),
            (0.9, 1, vec![1]),
        ] {
            let mut x = base.clone();
            apply_min_p(&mut x, min_p, keep, &mut ranked);
            assert_eq!(kept(&x), want, "min_p {min_p} keep {keep}");
        }
    }

    #[test]
    fn top_k_and_xtc_filters() {
        let mut ranked = Vec::new();
        let mut x = ln(&[0.15, 0.5, 0.05, 0.3]);
        apply_top_k(&mut x, 2, &mut ranked);
        assert_eq!(kept(&x), [1, 3]);
        // XTC removes every token above the least likely one over the threshold (here 0.15).
        let mut x = ln(&[0.15, 0.5, 0.05, 0.3]);
        apply_xtc(&mut x, 0.0, 1.0, 0.1, &[]);
        assert_eq!(kept(&x), [0, 2]);
        let mut x = ln(&[0.15, 0.5, 0.05, 0.3]);
        apply_xtc(&mut x, 0.0, 1.0, 0.1, &[1]);
        assert_eq!(kept(&x), [0, 1, 2]);
        // Not applied when the draw exceeds the probability.
        let mut x = ln(&[0.15, 0.5, 0.05, 0.3]);
        apply_xtc(&mut x, 0.6, 0.5, 0.1, &[]);
        assert_eq!(kept(&x), [0, 1, 2, 3]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let config = |size| SamplerConfig {
            repetition_penalty: Some(2.0),
            repetition_context_size: size,
            ..Default::default()
        };
        let mut logits = vec![2.0, -1.0, 0.5, 3.0];
        sampler(config(20)).process(&mut logits, &[0, 1, 0]);
        // token 0 is penalised once although it occurs twice
        assert_eq!(logits, [1.0, -2.0, 0.5, 3.0]);
        let mut logits = vec![2.0, -1.0, 0.5, 3.0];
        sampler(config(1)).process(&mut logits, &[1, 2, 0]);
        assert_eq!(logits, [1.0, -1.0, 0.5, 3.0]);
        // A context size of 0 is Python's tokens[-0:], the whole history.
        let mut logits = vec![2.0, -1.0, 0.5, 3.0];
        sampler(config(0)).process(&mut logits, &[3, 1]);
        assert_eq!(logits, [2.0, -2.0, 0.5, 1.5]);
    }

    #[test]
    fn bias_presence_and_frequency_penalties() {
        let mut s = sampler(SamplerConfig {
            logit_bias: [(2, 1.5), (9, 4.0)].into_iter().collect(),
            presence_penalty: Some(0.5),
            frequency_penalty: Some(0.25),
            ..Default::default()
        });
        let mut logits = vec![0.0; 4];
        s.process(&mut logits, &[0, 0, 1]);
        assert_eq!(logits, [-1.0, -0.75, 1.5, 0.0]);
    }

    #[test]
    fn filters_apply_before_temperature() {
        let mut s = sampler(SamplerConfig {
            temperature: 50.0,
            top_p: 0.79,
            seed: Some(7),
            ..Default::default()
        });
        for _ in 0..500 {
            let id = s.sample(&mut ln(&[0.15, 0.5, 0.05, 0.3]), &[]);
            assert!(id == 1 || id == 3, "{id}");
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let run = |seed| {
            let mut s = sampler(SamplerConfig {
                temperature: 1.0,
                seed: Some(seed),
                ..Default::default()
            });
            (0..64)
                .map(|_| s.sample(&mut [0.0; 32], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn frequencies_follow_the_tempered_softmax() {
        let logits = [1.0f32, 0.2, -0.5, 2.0, NEG];
        let temperature = 0.7;
        let mut s = sampler(SamplerConfig {
            temperature,
            seed: Some(1),
            ..Default::default()
        });
        let n = 40_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.sample(&mut logits.to_vec(), &[]) as usize] += 1;
        }
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| f64::from(l / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        for (count, w) in counts.iter().zip(&weights) {
            let (got, want) = (*count as f64 / n as f64, w / total);
            assert!((got - want).abs() < 0.01, "{counts:?}: {got} vs {want}");
        }
        assert_eq!(counts[4], 0);
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        let bad = |config| Sampler::new(config).err();
        assert_eq!(
            bad(SamplerConfig {
                min_p: 1.5,
                ..Default::default()
            }),
            Some(SamplerError::MinP(1.5))
        );
        assert_eq!(
            bad(SamplerConfig {
                repetition_penalty: Some(-1.0),
                ..Default::default()
            }),
            Some(SamplerError::RepetitionPenalty(-1.0))
        );
        assert_eq!(
            bad(SamplerConfig {
                xtc_probability: 0.5,
                xtc_threshold: 0.7,
                ..Default::default()
            }),
            Some(SamplerError::XtcThreshold(0.7))
        );
        assert_eq!(
            bad(SamplerConfig {
                temperature: -1.0,
                ..Default::default()
            }),
            Some(SamplerError::Temperature(-1.0))
        );
    }

    /// A vocabulary-sized row with many ties and filtered (−∞) entries, spread over 40 nats so
    /// that the walk lowers its bar several times.
    fn tied_row(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..len)
            .map(|_| match rng.random_range(0..400) {
                0..20 => NEG,
                v => -(v as f32) * 0.1,
            })
            .collect()
    }

    #[test]
    fn partial_ranking_matches_the_full_sort() {
        let mut full = Vec::new();
        let mut ranked = Vec::new();
        for seed in 0..4 {
            let x = tied_row(5000, seed);
            rank(&x, &mut full);
            for k in [0, 1, 7, 64, 65, 300, 4000, full.len(), full.len() + 9] {
                rank_top(&x, k, &mut ranked);
                assert_eq!(ranked, full[..k.min(full.len())], "seed {seed}, k {k}");
                // top-k keeps exactly those, ties at the cut broken by id.
                let mut y = x.clone();
                apply_top_k(&mut y, k, &mut ranked);
                let mut want: Vec<usize> = ranked.iter().map(|&(_, id)| id as usize).collect();
                want.sort_unstable();
                if k < x.len() {
                    assert_eq!(kept(&y), want, "top-k, seed {seed}, k {k}");
                }
            }
            let walked = walk_ranked(&x, &mut ranked, |_| true);
            assert_eq!((walked, &ranked), (full.len(), &full));
        }
    }

    /// The nucleus found by ranking a chunk at a time is the one a full sort finds.
    #[test]
    fn top_p_ranks_only_as_far_as_the_nucleus() {
        let mut ranked = Vec::new();
        for seed in 0..4 {
            let mut logprobs = tied_row(5000, seed);
            log_softmax(&mut logprobs);
            for top_p in [0.01, 0.3, 0.9, 0.999] {
                let mut full = Vec::new();
                rank(&logprobs, &mut full);
                let total: f64 = full.iter().map(|(v, _)| f64::from(v.exp())).sum();
                let mut above = 0.0;
                let threshold = full
                    .iter()
                    .take_while(|(v, _)| {
                        let inside = above < f64::from(top_p) * total;
                        above += f64::from(v.exp());
                        inside
                    })
                    .last()
                    .map_or(NEG, |(v, _)| *v);
                let want: Vec<usize> = (0..logprobs.len())
                    .filter(|&i| logprobs[i].is_finite() && logprobs[i] >= threshold)
                    .collect();
                let mut x = logprobs.clone();
                apply_top_p(&mut x, top_p, &mut ranked);
                assert_eq!(kept(&x), want, "seed {seed}, top_p {top_p}");
            }
        }
    }

    /// The draw walks the weights as one running sum across the blocks it adds up first.
    #[test]
    fn categorical_draws_across_blocks() {
        let (mut weights, mut sums) = (Vec::new(), Vec::new());
        let mut logprobs = vec![NEG; 3 * CATEGORICAL_BLOCK + 5];
        for id in [3, CATEGORICAL_BLOCK + 1, 3 * CATEGORICAL_BLOCK + 4] {
            logprobs[id] = (1.0f32 / 3.0).ln();
        }
        let mut draw = |d| categorical(&logprobs, 1.0, d, &mut weights, &mut sums);
        assert_eq!(draw(0.0), 3);
        assert_eq!(draw(0.34), CATEGORICAL_BLOCK as u32 + 1);
        assert_eq!(draw(0.66), CATEGORICAL_BLOCK as u32 + 1);
        assert_eq!(draw(0.67), 3 * CATEGORICAL_BLOCK as u32 + 4);
        assert_eq!(draw(1.0 - 1e-12), 3 * CATEGORICAL_BLOCK as u32 + 4);
        // Past the total (a rounding sliver): the last weight.
        assert_eq!(draw(1.5), 3 * CATEGORICAL_BLOCK as u32 + 4);
    }

    #[test]
    fn top_logprobs_are_sorted() {
        assert_eq!(
            top_logprobs(&[-3.0, -0.5, NEG, -1.0], 2),
            [(1, -0.5), (3, -1.0)]
        );
    }
}
