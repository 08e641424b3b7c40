//! Preference training as mlx-lm-lora's `--train-mode dpo|orpo` does it: each pair's chosen and
//! rejected answer (the tokens after the prompt) scored by the log-probability the model gives
//! them, and a loss of those scores, averaged over the pairs of a batch:
//! - DPO, of the margin `z = (πc − πr) − (ρc − ρr)`, π an answer's summed log-probability under
//!   the trained adapters, ρ under the reference (the same model with its adapters at scale 0:
//!   the base model), by mlx-lm-lora's `--dpo-cpo-loss-type`: sigmoid (the default)
//!   `−log σ(β·z)`; hinge `relu(1 − β·z)`; ipo `(z − 1/(2β))²`, each score (policy and
//!   reference alike) divided by its answer's scored tokens (a mean log-probability per token);
//!   dpop `−log σ(β·z) + δ·max(0, ρc − πc)`, a penalty for the chosen answer falling below the
//!   reference. The rewards are β·(π − ρ) of each answer (of the per-token scores for ipo);
//! - ORPO: `−c − β·log σ((c − r) − (log(1 − e^c) − log(1 − e^r)))`, c and r the mean (per
//!   answer token) log-probabilities of the chosen and rejected answer under the trained
//!   adapters: the chosen answer's negative log-likelihood plus β times the log-odds ratio term.
//!
//! The gradient flows through the policy's scores only; the loss's derivative with respect to
//! each answer's summed cross-entropy weighs that answer's backward pass. Where a loss has a
//! kink, the derivative there is the one MLX's autodiff takes: `mx.maximum(a, b)` passes the
//! gradient to `b` at a tie, so hinge's `relu` (`maximum(1 − β·z, 0)`) has none at `β·z = 1`
//! and dpop's `maximum(0, ρc − πc)` has its full one at `πc = ρc`.

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

/// mlx-lm-lora's `--delta` default: δ of the dpop loss.
pub const DEFAULT_DELTA: f64 = 50.0;

/// The names of mlx-lm-lora's `--dpo-cpo-loss-type` choices, its default first.
pub const DPO_LOSS_TYPES: [&str; 4] = ["sigmoid", "hinge", "ipo", "dpop"];

/// How DPO turns a pair's margin into a loss: mlx-lm-lora's `--dpo-cpo-loss-type`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DpoLossType {
    Sigmoid,
    Hinge,
    /// Over each answer's mean log-probability per scored token.
    Ipo,
    /// Sigmoid plus δ times how far the chosen answer's log-probability fell below the
    /// reference's.
    Dpop {
        delta: f64,
    },
}

impl DpoLossType {
    /// The loss type named `name` (one of [`DPO_LOSS_TYPES`]), dpop with `delta`.
    pub fn from_name(name: &str, delta: f64) -> Option<Self> {
        Some(match name {
            "sigmoid" => DpoLossType::Sigmoid,
            "hinge" => DpoLossType::Hinge,
            "ipo" => DpoLossType::Ipo,
            "dpop" => DpoLossType::Dpop { delta },
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            DpoLossType::Sigmoid => "sigmoid",
            DpoLossType::Hinge => "hinge",
            DpoLossType::Ipo => "ipo",
            DpoLossType::Dpop { .. } => "dpop",
        }
    }
}

/// A preference loss with its β.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PreferenceLoss {
    Dpo { beta: f64, loss_type: DpoLossType },
    Orpo { beta: f64 },
}

/// What the loss reads of one pair, chosen answer first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairScores {
    /// The summed cross-entropy of each answer's tokens under the trained adapters (minus its
    /// summed log-probability).
    pub policy: [f64; 2],
    /// The same under the reference; read by DPO only.
    pub reference: [f64; 2],
    /// Each answer's scored tokens: the targets after the prompt, mlx-lm-lora's
    /// `mask[:, 1:].sum(-1)` (ipo and ORPO divide by them).
    pub tokens: [usize; 2],
}

/// One pair's loss, with what training and the reports need of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairLoss {
    pub loss: f64,
    /// The loss's derivative with respect to each answer's summed cross-entropy.
    pub d_cross_entropy: [f64; 2],
    /// mlx-lm-lora's rewards of the chosen and rejected answer: β times the log-probability
    /// gained over the reference (DPO; per token for ipo), or β times the mean log-probability
    /// (ORPO).
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
            PreferenceLoss::Dpo { beta, loss_type } => {
                // compute_score: ipo divides each score by its answer's scored tokens (at least
                // 1), the others keep the sum.
                let per = |k: usize| match loss_type {
                    DpoLossType::Ipo => s.tokens[k].max(1) as f64,
                    _ => 1.0,
                };
                // Scores are log-probabilities: minus the cross-entropies.
                let policy = [0, 1].map(|k| -s.policy[k] / per(k));
                let reference = [0, 1].map(|k| -s.reference[k] / per(k));
                let gained = [0, 1].map(|k| policy[k] - reference[k]);
                let z = gained[0] - gained[1];
                // The loss, its derivative with respect to z, and the derivative with respect
                // to πc of what does not go through z (dpop's penalty).
                let (loss, slope, chosen_only) = match loss_type {
                    // d(−log σ(βz))/dz = −β·σ(−βz)
                    DpoLossType::Sigmoid => (softplus(-beta * z), -beta * sigmoid(-beta * z), 0.0),
                    DpoLossType::Hinge => {
                        let margin = 1.0 - beta * z;
                        // relu's derivative is 0 at 0, as MLX takes it.
                        let slope = if margin > 0.0 { -beta } else { 0.0 };
                        (margin.max(0.0), slope, 0.0)
                    }
                    DpoLossType::Ipo => {
                        let off = z - 1.0 / (2.0 * beta);
                        (off * off, 2.0 * off, 0.0)
                    }
                    DpoLossType::Dpop { delta } => {
                        let fell = reference[0] - policy[0];
                        // mx.maximum(0, ρc − πc) passes its gradient on at a tie too.
                        let penalty_slope = if fell >= 0.0 { -delta } else { 0.0 };
                        (
                            softplus(-beta * z) + delta * fell.max(0.0),
                            -beta * sigmoid(-beta * z),
                            penalty_slope,
                        )
                    }
                };
                // dz/dπc = 1, dz/dπr = −1, and dπ/d(cross-entropy) = −1/per.
                PairLoss {
                    loss,
                    d_cross_entropy: [-(slope + chosen_only) / per(0), slope / per(1)],
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
    /// The scores of `batch`'s pairs where `loss` reads them (zeros elsewhere), each computed
    /// once by `score`.
    fn for_loss(
        &mut self,
        loss: PreferenceLoss,
        batch: &PreferenceBatch,
        mut score: impl FnMut(&Example) -> Result<f64, ForwardError>,
    ) -> Result<Vec<[f64; 2]>, ForwardError> {
        if !loss.needs_reference() {
            return Ok(vec![[0.0; 2]; batch.pairs.len()]);
        }
        let mut out = Vec::with_capacity(batch.pairs.len());
        for (&item, pair) in batch.items.iter().zip(&batch.pairs) {
            let scores = match self.by_item.get(&item) {
                Some(&scores) => scores,
                None => {
                    let scores = [score(&pair[0])?, score(&pair[1])?];
                    self.by_item.insert(item, scores);
                    scores
                }
            };
            out.push(scores);
        }
        Ok(out)
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

/// The loss of `batch` under the model `adaptable` adapted by `adapters` (the reference's
/// scores taken from, or added to, `reference`), and its gradient. With `dropout_keys`, the
/// trained adapters' inputs are dropped with masks drawn from them over the batch's sequences.
pub fn preference_step(
    adaptable: &dyn Adaptable,
    adapters: &Adapters,
    batch: &PreferenceBatch,
    loss: PreferenceLoss,
    reference: &mut ReferenceScores,
    dropout_keys: Option<&mut KeySequence>,
    checkpoint: bool,
) -> Result<PreferenceStep, TrainError> {
    // The reference runs the policy's own passes at adapter scale 0: fresh adapters (b = 0)
    // then tie with it to the last bit, as mlx-lm-lora's separately loaded reference does. The
    // copy at scale 0 is made only for items not scored yet: most steps find theirs.
    let mut at_zero = None;
    let references = reference.for_loss(loss, batch, |ex| {
        let at_zero = at_zero.get_or_insert_with(|| adapters.at_scale(0.0));
        Ok(adaptable.sums(std::slice::from_ref(ex), at_zero)?[0])
    })?;
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
    let at_zero = adapters.at_scale(0.0);
    let reference_model = AdaptedModel::new(model, &at_zero)?;
    let mut batches = PreferenceBatches::new(data, batch_size, max_seq_length, false)?;
    let limit = usize::try_from(num_batches).unwrap_or(usize::MAX);
    let mut tally = PreferenceTally::default();
    for _ in 0..limit {
        let Some(batch) = batches.next_batch(rng) else {
            break;
        };
        let references = reference.for_loss(loss, &batch, |ex| {
            scored_cross_entropy(&reference_model, ex)
        })?;
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

#[cfg(test)]
mod tests {
    use super::*;

    const BETA: f64 = 0.1;

    /// Every DPO loss type, and ORPO.
    fn losses() -> Vec<PreferenceLoss> {
        let mut all: Vec<_> = (DPO_LOSS_TYPES.iter())
            .map(|name| PreferenceLoss::Dpo {
                beta: BETA,
                loss_type: DpoLossType::from_name(name, DEFAULT_DELTA).unwrap(),
            })
            .collect();
        all.push(PreferenceLoss::Orpo { beta: BETA });
        all
    }

    /// Against the same reference (cross-entropies 42 and 57), policies where hinge is active
    /// (β·z < 1) or not, and where dpop's penalty is on (the chosen answer's log-probability
    /// below the reference's) or off.
    fn cases() -> Vec<(&'static str, PairScores)> {
        let scores = |policy| PairScores {
            policy,
            reference: [42.0, 57.0],
            tokens: [8, 12],
        };
        vec![
            ("hinge on, penalty off", scores([40.0, 60.0])),
            ("hinge on, penalty on", scores([45.0, 50.0])),
            ("hinge off, penalty off", scores([30.0, 70.0])),
            ("hinge off, penalty on", scores([44.0, 80.0])),
        ]
    }

    fn name(loss: PreferenceLoss) -> &'static str {
        match loss {
            PreferenceLoss::Dpo { loss_type, .. } => loss_type.name(),
            PreferenceLoss::Orpo { .. } => "orpo",
        }
    }

    /// `d_cross_entropy` is the loss's derivative: a central difference of `loss` in each
    /// answer's summed cross-entropy, away from the kinks.
    #[test]
    fn derivatives_match_central_differences() {
        const STEP: f64 = 1e-4;
        for loss in losses() {
            for (case, scores) in cases() {
                let pair = loss.pair(&scores);
                for k in 0..2 {
                    let at = |d: f64| {
                        let mut moved = scores;
                        moved.policy[k] += d;
                        loss.pair(&moved).loss
                    };
                    let numeric = (at(STEP) - at(-STEP)) / (2.0 * STEP);
                    let got = pair.d_cross_entropy[k];
                    println!("{} {case} [{k}]: {got} vs {numeric}", name(loss));
                    assert!(
                        (got - numeric).abs() <= 1e-7 * (1.0 + numeric.abs()),
                        "{} {case} [{k}]: {got} vs {numeric}",
                        name(loss)
                    );
                }
            }
        }
    }

    /// The cases are what they say: hinge's loss is 0 where inactive, dpop's exceeds sigmoid's
    /// by δ·(ρc − πc) where the penalty is on.
    #[test]
    fn losses_are_mlx_lm_loras() {
        let dpo = |loss_type| PreferenceLoss::Dpo {
            beta: BETA,
            loss_type,
        };
        for (case, scores) in cases() {
            let z =
                (scores.policy[1] - scores.policy[0]) - (scores.reference[1] - scores.reference[0]);
            let sigmoid = dpo(DpoLossType::Sigmoid).pair(&scores);
            let want = -(1.0 / (1.0 + (-BETA * z).exp())).ln();
            assert!((sigmoid.loss - want).abs() < 1e-15, "{case}");
            let hinge = dpo(DpoLossType::Hinge).pair(&scores).loss;
            assert_eq!(hinge > 0.0, case.starts_with("hinge on"), "{case}");
            assert!((hinge - (1.0 - BETA * z).max(0.0)).abs() < 1e-15, "{case}");
            let delta = 3.0;
            let dpop = dpo(DpoLossType::Dpop { delta }).pair(&scores);
            let fell = (scores.policy[0] - scores.reference[0]).max(0.0);
            assert_eq!(fell > 0.0, case.ends_with("penalty on"), "{case}");
            assert!(
                (dpop.loss - sigmoid.loss - delta * fell).abs() < 1e-12,
                "{case}"
            );
            assert_eq!(dpop.rewards, sigmoid.rewards);
            // The penalty weighs the chosen answer only.
            assert_eq!(dpop.d_cross_entropy[1], sigmoid.d_cross_entropy[1]);
            let extra = if fell > 0.0 { delta } else { 0.0 };
            assert_eq!(dpop.d_cross_entropy[0], sigmoid.d_cross_entropy[0] + extra);
            // ipo: everything per scored token, rewards included.
            let ipo = dpo(DpoLossType::Ipo).pair(&scores);
            let mean = |ce: [f64; 2], k: usize| -ce[k] / scores.tokens[k] as f64;
            let gained = [0, 1].map(|k| mean(scores.policy, k) - mean(scores.reference, k));
            let want = (gained[0] - gained[1] - 1.0 / (2.0 * BETA)).powi(2);
            assert!((ipo.loss - want).abs() < 1e-12 * want, "{case}");
            assert_eq!(ipo.rewards, gained.map(|g| BETA * g));
        }
    }

    /// At the kinks, the derivative MLX's autodiff takes: none of hinge's at β·z = 1, all of
    /// dpop's penalty at πc = ρc (where fresh adapters start: lora_b is 0).
    #[test]
    fn kinks_take_mlxs_side() {
        let dpo = |beta, loss_type| PreferenceLoss::Dpo { beta, loss_type };
        // z = (−40 + 60) − (−42 + 60) = 2: β·z = 1 at β 0.5.
        let at_hinge = PairScores {
            policy: [40.0, 60.0],
            reference: [42.0, 60.0],
            tokens: [8, 12],
        };
        let pair = dpo(0.5, DpoLossType::Hinge).pair(&at_hinge);
        assert_eq!((pair.loss, pair.d_cross_entropy), (0.0, [0.0, 0.0]));
        let tie = PairScores {
            reference: [40.0, 60.0],
            ..at_hinge
        };
        let pair = dpo(BETA, DpoLossType::Dpop { delta: 50.0 }).pair(&tie);
        assert!((pair.loss - std::f64::consts::LN_2).abs() < 1e-15);
        assert_eq!(pair.d_cross_entropy, [BETA / 2.0 + 50.0, -BETA / 2.0]);
    }

    #[test]
    fn loss_types_are_named_as_mlx_lm_lora_names_them() {
        for name in DPO_LOSS_TYPES {
            let loss_type = DpoLossType::from_name(name, 2.0).unwrap();
            assert_eq!(loss_type.name(), name);
        }
        assert_eq!(
            DpoLossType::from_name("dpop", 2.0),
            Some(DpoLossType::Dpop { delta: 2.0 })
        );
        assert_eq!(DpoLossType::from_name("kto", 2.0), None);
    }
}
