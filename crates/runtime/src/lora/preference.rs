//! Preference training as mlx-lm-lora's `--train-mode dpo|orpo` does it: each pair's chosen and
//! rejected answer (the tokens after the prompt) scored by the log-probability the model gives
//! them, and a loss of those scores, averaged over the pairs of a batch:
//! - DPO (sigmoid): `−log σ(β·((πc − πr) − (ρc − ρr)))`, π the summed log-probabilities of an
//!   answer under the trained adapters, ρ under the reference: the same model with its adapters
//!   at scale 0 (the base model);
//! - ORPO: `−c − β·log σ((c − r) − (log(1 − e^c) − log(1 − e^r)))`, c and r the mean (per
//!   answer token) log-probabilities of the chosen and rejected answer under the trained
//!   adapters: the chosen answer's negative log-likelihood plus β times the log-odds ratio term.
//!
//! The gradient flows through the policy's scores only; the loss's derivative with respect to
//! each answer's summed cross-entropy weighs that answer's backward pass.

use std::collections::HashMap;

use oxlm_models::lora::{Adaptable, AdaptedModel, Adapters};
use oxlm_models::lora_dropout::{BatchDropout, KeySequence};
use oxlm_models::lora_grad::{scored_cross_entropy, AdapterGrads, Example};
use oxlm_models::{ForwardError, LanguageModel};

use super::batches::{PreferenceBatch, PreferenceBatches};
use super::data::PreferenceSet;
use super::np_random::NumpyRandom;
use super::trainer::TrainError;

/// mlx-lm-lora's `--beta` default, for DPO and ORPO alike.
pub const DEFAULT_BETA: f64 = 0.1;

/// A preference loss with its β.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PreferenceLoss {
    Dpo { beta: f64 },
    Orpo { beta: f64 },
}

/// What the loss reads of one pair, chosen answer first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairScores {
    /// The summed cross-entropy of each answer's tokens under the trained adapters (minus its
    /// log-probability).
    pub policy: [f64; 2],
    /// The same under the reference; read by DPO only.
    pub reference: [f64; 2],
    /// Each answer's scored tokens.
    pub tokens: [usize; 2],
}

/// One pair's loss, with what training and the reports need of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairLoss {
    pub loss: f64,
    /// The loss's derivative with respect to each answer's summed cross-entropy.
    pub d_cross_entropy: [f64; 2],
    /// mlx-lm-lora's rewards of the chosen and rejected answer: β times the log-probability
    /// gained over the reference (DPO), or β times the mean log-probability (ORPO).
    pub rewards: [f64; 2],
}

/// `log(1 + e^x)` without overflow.
fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// mlx-lm-lora's `_log1mexp`: `log(1 − e^x)` of a log-probability, held at `x ≤ −1e-7` so that
/// a certain answer stays finite; and its derivative (0 where held).
fn log1mexp(x: f64) -> (f64, f64) {
    const HELD: f64 = -1e-7;
    let held = x.min(HELD);
    let value = if held > -std::f64::consts::LN_2 {
        (-held.exp_m1()).ln()
    } else {
        (-held.exp()).ln_1p()
    };
    let slope = if x > HELD { 0.0 } else { x.exp() / x.exp_m1() };
    (value, slope)
}

impl PreferenceLoss {
    /// Whether the loss reads the reference's scores.
    pub fn needs_reference(self) -> bool {
        matches!(self, PreferenceLoss::Dpo { .. })
    }

    pub fn pair(self, s: &PairScores) -> PairLoss {
        match self {
            PreferenceLoss::Dpo { beta } => {
                // Log-probabilities gained over the reference: minus the cross-entropies.
                let gained = [0, 1].map(|k| s.reference[k] - s.policy[k]);
                let z = beta * (gained[0] - gained[1]);
                // d(−log σ(z))/dz = −σ(−z), and each cross-entropy is minus its log-probability.
                let slope = beta * sigmoid(-z);
                PairLoss {
                    loss: softplus(-z),
                    d_cross_entropy: [slope, -slope],
                    rewards: gained.map(|g| beta * g),
                }
            }
            PreferenceLoss::Orpo { beta } => {
                let [c, r] = [0, 1].map(|k| -s.policy[k] / s.tokens[k] as f64);
                let ((lc, dlc), (lr, dlr)) = (log1mexp(c), log1mexp(r));
                let log_odds = (c - r) - (lc - lr);
                // −d(loss)/d(log odds)
                let pull = beta * sigmoid(-log_odds);
                let d_chosen = -1.0 - pull * (1.0 - dlc);
                let d_rejected = pull * (1.0 - dlr);
                PairLoss {
                    loss: -c + beta * softplus(-log_odds),
                    // c = −(cross-entropy sum)/tokens
                    d_cross_entropy: [
                        -d_chosen / s.tokens[0] as f64,
                        -d_rejected / s.tokens[1] as f64,
                    ],
                    rewards: [beta * c, beta * r],
                }
            }
        }
    }
}

/// Mean rewards over pairs, as mlx-lm-lora reports them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rewards {
    pub chosen: f32,
    pub rejected: f32,
    /// The share of pairs whose chosen answer has the higher reward.
    pub accuracy: f32,
    /// The chosen reward less the rejected.
    pub margin: f32,
}

/// Sums over pairs of a preference loss and its rewards.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PreferenceTally {
    pub pairs: usize,
    loss: f64,
    chosen: f64,
    rejected: f64,
    correct: usize,
}

impl PreferenceTally {
    pub fn add(&mut self, pair: &PairLoss) {
        self.pairs += 1;
        self.loss += pair.loss;
        self.chosen += pair.rewards[0];
        self.rejected += pair.rewards[1];
        self.correct += usize::from(pair.rewards[0] > pair.rewards[1]);
    }

    pub fn merge(&mut self, other: &PreferenceTally) {
        self.pairs += other.pairs;
        self.loss += other.loss;
        self.chosen += other.chosen;
        self.rejected += other.rejected;
        self.correct += other.correct;
    }

    /// The mean loss over the pairs (0 with none).
    pub fn loss(&self) -> f32 {
        (self.loss / self.pairs.max(1) as f64) as f32
    }

    pub fn rewards(&self) -> Rewards {
        let n = self.pairs.max(1) as f64;
        Rewards {
            chosen: (self.chosen / n) as f32,
            rejected: (self.rejected / n) as f32,
            accuracy: (self.correct as f64 / n) as f32,
            margin: ((self.chosen - self.rejected) / n) as f32,
        }
    }
}

/// The reference's summed cross-entropy of each pair's answers, by item of one set, computed
/// once: the reference never changes.
#[derive(Debug, Default)]
pub struct ReferenceScores {
    by_item: HashMap<usize, [f64; 2]>,
}

impl ReferenceScores {
    /// The scores of `batch`'s pairs under `model` without adapters.
    fn of(
        &mut self,
        model: &dyn LanguageModel,
        batch: &PreferenceBatch,
    ) -> Result<Vec<[f64; 2]>, ForwardError> {
        let mut out = Vec::with_capacity(batch.pairs.len());
        for (&item, pair) in batch.items.iter().zip(&batch.pairs) {
            let scores = match self.by_item.get(&item) {
                Some(&scores) => scores,
                None => {
                    let scores = [
                        scored_cross_entropy(model, &pair[0])?,
                        scored_cross_entropy(model, &pair[1])?,
                    ];
                    self.by_item.insert(item, scores);
                    scores
                }
            };
            out.push(scores);
        }
        Ok(out)
    }

    /// The reference's scores where `loss` reads them, zeros elsewhere.
    fn for_loss(
        &mut self,
        loss: PreferenceLoss,
        model: &dyn LanguageModel,
        batch: &PreferenceBatch,
    ) -> Result<Vec<[f64; 2]>, ForwardError> {
        if loss.needs_reference() {
            self.of(model, batch)
        } else {
            Ok(vec![[0.0; 2]; batch.pairs.len()])
        }
    }
}

fn answer_tokens(pair: &[Example; 2]) -> [usize; 2] {
    pair.each_ref().map(Example::scored)
}

/// One preference step's loss over its pairs and the gradient of their mean.
#[derive(Debug, Clone)]
pub struct PreferenceStep {
    pub tally: PreferenceTally,
    pub grads: AdapterGrads,
}

/// The loss of `batch` under `model` adapted by `adapters` (the reference's scores taken from,
/// or added to, `reference`), and its gradient. With `dropout_keys`, the trained adapters'
/// inputs are dropped with masks drawn from them over the batch's sequences.
#[allow(clippy::too_many_arguments)]
pub fn preference_step(
    model: &dyn LanguageModel,
    adaptable: &dyn Adaptable,
    adapters: &Adapters,
    batch: &PreferenceBatch,
    loss: PreferenceLoss,
    reference: &mut ReferenceScores,
    dropout_keys: Option<&mut KeySequence>,
    checkpoint: bool,
) -> Result<PreferenceStep, TrainError> {
    let references = reference.for_loss(loss, model, batch)?;
    let dropout =
        dropout_keys.map(|keys| BatchDropout::draw(adaptable, adapters, batch.layout(), keys));
    let groups: Vec<&[Example]> = batch.pairs.iter().map(|p| p.as_slice()).collect();
    let pairs = batch.pairs.len() as f64;
    let mut tally = PreferenceTally::default();
    let mut weigh = |g: usize, sums: &[f64]| {
        let scores = PairScores {
            policy: [sums[0], sums[1]],
            reference: references[g],
            tokens: answer_tokens(&batch.pairs[g]),
        };
        let pair = loss.pair(&scores);
        tally.add(&pair);
        // The batch's loss is the mean over its pairs.
        pair.d_cross_entropy.map(|d| (d / pairs) as f32).to_vec()
    };
    let step =
        adaptable.grads_of_sums(&groups, adapters, dropout.as_ref(), checkpoint, &mut weigh)?;
    Ok(PreferenceStep {
        tally,
        grads: step.grads,
    })
}

/// The preference loss over `num_batches` batches of one epoch of `data` (-1: all of it), and
/// its rewards; `on_batch` is called after each.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_preference(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    data: &PreferenceSet,
    loss: PreferenceLoss,
    batch_size: usize,
    num_batches: i64,
    max_seq_length: usize,
    reference: &mut ReferenceScores,
    rng: &mut NumpyRandom,
    on_batch: &mut dyn FnMut(),
) -> Result<PreferenceTally, TrainError> {
    let adapted = AdaptedModel::new(model, adapters)?;
    let mut batches = PreferenceBatches::new(data, batch_size, max_seq_length, false)?;
    let limit = usize::try_from(num_batches).unwrap_or(usize::MAX);
    let mut tally = PreferenceTally::default();
    for _ in 0..limit {
        let Some(batch) = batches.next_batch(rng) else {
            break;
        };
        let references = reference.for_loss(loss, model, &batch)?;
        for (pair, reference) in batch.pairs.iter().zip(references) {
            let policy = [
                scored_cross_entropy(&adapted, &pair[0])?,
                scored_cross_entropy(&adapted, &pair[1])?,
            ];
            let scores = PairScores {
                policy,
                reference,
                tokens: answer_tokens(pair),
            };
            tally.add(&loss.pair(&scores));
        }
        on_batch();
    }
    Ok(tally)
}
