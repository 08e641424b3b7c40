//! The training loop of `mlx_lm.tuner.trainer.train`: batches, validation at the first step,
//! every `steps_per_eval` steps and the last, optimizer updates (after every
//! `grad_accumulation_steps` batches), reports every `steps_per_report` steps, and adapter
//! checkpoints every `save_every` steps. Checkpoints are written atomically. With LoRA dropout,
//! each step draws its masks from MLX's generator as mlx_lm.lora seeds it. The same loop trains
//! on a preference loss ([`train_preference`]), as mlx-lm-lora's DPO and ORPO trainers do.
//! What happens is told through [`Event`]s, so the caller decides what to print.

use std::path::{Path, PathBuf};
use std::time::Instant;

use oxlm_models::lora::{Adaptable, AdaptedModel, AdapterError, Adapters, LoraConfig};
use oxlm_models::lora_dropout::{BatchDropout, KeySequence};
use oxlm_models::lora_grad::{loss_sum, AdapterGrads, LoraGrad};
use oxlm_models::save::SaveError;
use oxlm_models::{ForwardError, LanguageModel};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use thiserror::Error;

use super::batches::{Batch, Batches, PreferenceBatch, PreferenceBatches, TooSmall};
use super::data::{Dataset, PreferenceSet};
use super::np_random::NumpyRandom;
use super::optimizer::{Optimizer, OptimizerConfig};
use super::preference::{
    evaluate_preference, preference_step, PreferenceLoss, PreferenceTally, ReferenceScores, Rewards,
};
use super::schedule::Schedule;
use crate::memory::peak_resident_bytes;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    #[error(transparent)]
    Data(#[from] TooSmall),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Save(#[from] SaveError),
    #[error("the learning rate must be a finite number above 0, not {0}")]
    LearningRate(f32),
    #[error("grad_accumulation_steps must be at least 1")]
    GradAccumulationSteps,
    #[error("lora_parameters.dropout must be a probability in [0, 1), not {0}")]
    Dropout(f64),
    /// The step is not applied, so that no adapters of NaN are saved.
    #[error(
        "training diverged at iteration {iteration}: the loss is {loss}; the adapters are not \
         updated or saved from this step on"
    )]
    NonFiniteLoss { iteration: usize, loss: f32 },
    /// The step is not applied, so that no adapters of NaN are saved.
    #[error(
        "training diverged at iteration {iteration}: the gradient of {layer} holds NaN or \
         infinite values; the adapters are not updated or saved from this step on"
    )]
    NonFiniteGradient { iteration: usize, layer: String },
}

/// mlx-lm's `TrainingArgs`, and the optimizer with its learning rate.
#[derive(Debug, Clone)]
pub struct TrainArgs {
    pub batch_size: usize,
    pub iters: usize,
    /// Validation batches; -1 is the whole validation set.
    pub val_batches: i64,
    pub steps_per_report: usize,
    pub steps_per_eval: usize,
    pub save_every: usize,
    pub max_seq_length: usize,
    pub optimizer: OptimizerConfig,
    pub learning_rate: Schedule,
    /// Batches whose gradients are averaged into each optimizer update.
    pub grad_accumulation_steps: usize,
    pub grad_checkpoint: bool,
    /// Where the adapter weights are saved (`adapters.safetensors` in the adapter directory).
    pub adapter_file: PathBuf,
    /// mlx_lm.lora's `seed`, which seeds MLX's generator: the dropout masks' source.
    pub seed: u64,
}

/// A training-loss report.
#[derive(Debug, Clone)]
pub struct Report {
    pub iteration: usize,
    pub train_loss: f32,
    /// The rate of the last optimizer update (the schedule's first before any).
    pub learning_rate: f32,
    pub iterations_per_second: f64,
    pub tokens_per_second: f64,
    pub trained_tokens: usize,
    pub peak_memory_gb: f64,
    /// A preference run's mean rewards over the reported steps' pairs.
    pub rewards: Option<Rewards>,
}

/// What the loop tells its caller, in order.
#[derive(Debug)]
pub enum Event<'a> {
    /// A batch held an item longer than `max_seq_length`; it was cut.
    Truncated {
        longest: usize,
        max: usize,
    },
    ValStart {
        iteration: usize,
        batches: usize,
    },
    ValBatch,
    Val {
        iteration: usize,
        loss: f32,
        seconds: f64,
        /// A preference run's mean rewards over the validation pairs.
        rewards: Option<Rewards>,
    },
    /// One optimizer step is done.
    Step {
        iteration: usize,
    },
    Report(&'a Report),
    Saved(&'a Path),
}

/// Fresh adapters for every layer `config` adapts: `lora_a` uniform in ±1/√in, `lora_b` zero,
/// as `LoRALinear` draws them (from another generator, so the numbers differ from mlx-lm's).
pub fn init_adapters(
    model: &dyn LanguageModel,
    config: LoraConfig,
    seed: u64,
) -> Result<Adapters, AdapterError> {
    let mut adapters = Adapters::zeros(config, model)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let experts = adapters.experts.values_mut().flatten();
    for layer in adapters.layers.values_mut().chain(experts) {
        let bound = 1.0 / (layer.in_features as f32).sqrt();
        for a in &mut layer.a {
            *a = rng.random_range(-bound..bound);
        }
    }
    Ok(adapters)
}

/// MLX's generator as training finds it in mlx_lm.lora: seeded with `seed`, then drawn from twice
/// for each adapted layer as `linear_to_lora_layers` builds it (the weight of a placeholder
/// `Linear`, then `lora_a`), whether or not the adapters are then loaded from a file.
fn keys_at_training_start(adapters: &Adapters, seed: u64) -> KeySequence {
    let mut keys = KeySequence::new(seed);
    for _ in 0..2 * (adapters.layers.len() + adapters.experts.len()) {
        keys.next_key();
    }
    keys
}

/// mlx-lm's `evaluate`: the mean loss over `num_batches` batches of one epoch (-1: all of it);
/// `on_batch` is called after each.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &dyn LanguageModel,
    adapters: &Adapters,
    dataset: &Dataset,
    batch_size: usize,
    num_batches: i64,
    max_seq_length: usize,
    rng: &mut NumpyRandom,
    on_batch: &mut dyn FnMut(),
) -> Result<f32, TrainError> {
    let adapted = AdaptedModel::new(model, adapters)?;
    let mut batches = Batches::new(dataset, batch_size, max_seq_length, false)?;
    let limit = usize::try_from(num_batches).unwrap_or(usize::MAX);
    let (mut sum, mut tokens) = (0.0f64, 0usize);
    for _ in 0..limit {
        let Some(batch) = batches.next_batch(rng) else {
            break;
        };
        let (s, t) = loss_sum(&adapted, &batch.examples)?;
        sum += s;
        tokens += t;
        on_batch();
    }
    Ok((sum / tokens as f64) as f32)
}

/// One training step's outcome.
struct Step {
    loss: f32,
    /// Positions that counted towards the loss.
    tokens: usize,
    grads: AdapterGrads,
    /// A preference step's pairs.
    tally: Option<PreferenceTally>,
}

/// What a run trains the adapters for: its batches, a step's loss and gradients on one, and a
/// validation.
trait Objective {
    type Batch;

    /// The next training batch.
    fn next_batch(&mut self, rng: &mut NumpyRandom) -> Self::Batch;

    /// The longest sequence of `batch` before cutting, when it was cut.
    fn truncated_from(batch: &Self::Batch) -> Option<usize>;

    /// With `dropout_keys`, the step's dropout masks are drawn from them.
    fn step(
        &mut self,
        batch: &Self::Batch,
        adapters: &Adapters,
        dropout_keys: Option<&mut KeySequence>,
        checkpoint: bool,
    ) -> Result<Step, TrainError>;

    /// The validation loss, and a preference run's rewards.
    fn validate(
        &mut self,
        adapters: &Adapters,
        args: &TrainArgs,
        rng: &mut NumpyRandom,
        on_batch: &mut dyn FnMut(),
    ) -> Result<(f32, Option<Rewards>), TrainError>;
}

/// Why a training batch is always drawn.
const ENDLESS: &str = "training batches never run out";

/// mlx-lm's loss: the mean cross-entropy of the scored tokens.
struct Sft<'a> {
    model: &'a dyn LanguageModel,
    adaptable: &'a dyn Adaptable,
    batches: Batches<'a>,
    valid: &'a Dataset,
}

impl Objective for Sft<'_> {
    type Batch = Batch;

    fn next_batch(&mut self, rng: &mut NumpyRandom) -> Batch {
        (self.batches.next_batch(rng)).expect(ENDLESS)
    }

    fn truncated_from(batch: &Batch) -> Option<usize> {
        batch.truncated_from
    }

    fn step(
        &mut self,
        batch: &Batch,
        adapters: &Adapters,
        dropout_keys: Option<&mut KeySequence>,
        checkpoint: bool,
    ) -> Result<Step, TrainError> {
        let step = match dropout_keys {
            Some(keys) => {
                let layout = batch.layout.clone();
                let dropout = BatchDropout::draw(self.adaptable, adapters, layout, keys);
                let examples = &batch.examples;
                (self.adaptable)
                    .loss_and_grads_with_dropout(examples, adapters, &dropout, checkpoint)?
            }
            None => (self.adaptable).loss_and_grads(&batch.examples, adapters, checkpoint)?,
        };
        Ok(Step {
            loss: step.loss,
            tokens: step.tokens,
            grads: step.grads,
            tally: None,
        })
    }

    fn validate(
        &mut self,
        adapters: &Adapters,
        args: &TrainArgs,
        rng: &mut NumpyRandom,
        on_batch: &mut dyn FnMut(),
    ) -> Result<(f32, Option<Rewards>), TrainError> {
        let (batch_size, batches, max) = (args.batch_size, args.val_batches, args.max_seq_length);
        let loss = evaluate(
            self.model, adapters, self.valid, batch_size, batches, max, rng, on_batch,
        )?;
        Ok((loss, None))
    }
}

/// mlx-lm-lora's DPO or ORPO loss over pairs of answers.
struct Preference<'a> {
    model: &'a dyn LanguageModel,
    adaptable: &'a dyn Adaptable,
    loss: PreferenceLoss,
    batches: PreferenceBatches<'a>,
    valid: &'a PreferenceSet,
    train_reference: ReferenceScores,
    valid_reference: ReferenceScores,
}

impl Objective for Preference<'_> {
    type Batch = PreferenceBatch;

    fn next_batch(&mut self, rng: &mut NumpyRandom) -> PreferenceBatch {
        (self.batches.next_batch(rng)).expect(ENDLESS)
    }

    fn truncated_from(batch: &PreferenceBatch) -> Option<usize> {
        batch.truncated_from
    }

    fn step(
        &mut self,
        batch: &PreferenceBatch,
        adapters: &Adapters,
        dropout_keys: Option<&mut KeySequence>,
        checkpoint: bool,
    ) -> Result<Step, TrainError> {
        let step = preference_step(
            self.adaptable,
            adapters,
            batch,
            self.loss,
            &mut self.train_reference,
            dropout_keys,
            checkpoint,
        )?;
        Ok(Step {
            loss: step.tally.loss(),
            tokens: batch.tokens(),
            grads: step.grads,
            tally: Some(step.tally),
        })
    }

    fn validate(
        &mut self,
        adapters: &Adapters,
        args: &TrainArgs,
        rng: &mut NumpyRandom,
        on_batch: &mut dyn FnMut(),
    ) -> Result<(f32, Option<Rewards>), TrainError> {
        let tally = evaluate_preference(
            self.model,
            adapters,
            self.valid,
            self.loss,
            args.batch_size,
            args.val_batches,
            args.max_seq_length,
            &mut self.valid_reference,
            rng,
            on_batch,
        )?;
        Ok((tally.loss(), Some(tally.rewards())))
    }
}

/// The model's training interface, once `args` and the adapters' dropout are checked.
fn trainable<'m>(
    model: &'m dyn LanguageModel,
    adapters: &Adapters,
    args: &TrainArgs,
) -> Result<&'m dyn Adaptable, TrainError> {
    let adaptable = model
        .adaptable()
        .ok_or_else(|| AdapterError::UnsupportedModel(model.info().model_type.clone()))?;
    if let Schedule::Constant(rate) = args.learning_rate {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(TrainError::LearningRate(rate));
        }
    }
    if args.grad_accumulation_steps == 0 {
        return Err(TrainError::GradAccumulationSteps);
    }
    if !(0.0..1.0).contains(&adapters.config.dropout) {
        return Err(TrainError::Dropout(adapters.config.dropout));
    }
    Ok(adaptable)
}

/// Trains `adapters` on `train` (validating on `valid` when it is not empty), saving them to
/// `args.adapter_file` every `save_every` steps (beside a numbered copy) and at the end. A step
/// whose loss or gradients are not finite ends training with an error before it changes them.
///
/// As mlx-lm's loop, an iteration is one batch: with `grad_accumulation_steps` N, the gradients
/// of N batches are summed and divided by N, and the optimizer steps at every N-th iteration
/// (the gradients of a last incomplete group are not applied); reports and saves count
/// iterations.
pub fn train(
    model: &dyn LanguageModel,
    adapters: &mut Adapters,
    train: &Dataset,
    valid: &Dataset,
    args: &TrainArgs,
    rng: &mut NumpyRandom,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), TrainError> {
    let adaptable = trainable(model, adapters, args)?;
    let mut objective = Sft {
        model,
        adaptable,
        batches: Batches::new(train, args.batch_size, args.max_seq_length, true)?,
        valid,
    };
    run(&mut objective, valid.len(), adapters, args, rng, on_event)
}

/// [`train`] on a preference loss over the pairs of `train` (validating on `valid` when it is
/// not empty); the reports carry the rewards. The reference's scores (DPO's) are computed once
/// for each item, the first time it is drawn.
#[allow(clippy::too_many_arguments)]
pub fn train_preference(
    model: &dyn LanguageModel,
    adapters: &mut Adapters,
    train: &PreferenceSet,
    valid: &PreferenceSet,
    loss: PreferenceLoss,
    args: &TrainArgs,
    rng: &mut NumpyRandom,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), TrainError> {
    let adaptable = trainable(model, adapters, args)?;
    let mut objective = Preference {
        model,
        adaptable,
        loss,
        batches: PreferenceBatches::new(train, args.batch_size, args.max_seq_length, true)?,
        valid,
        train_reference: ReferenceScores::default(),
        valid_reference: ReferenceScores::default(),
    };
    run(&mut objective, valid.len(), adapters, args, rng, on_event)
}

/// The loop of [`train`] for any objective, validating when `valid_len` (the items of its
/// validation set) is not 0.
fn run<O: Objective>(
    objective: &mut O,
    valid_len: usize,
    adapters: &mut Adapters,
    args: &TrainArgs,
    rng: &mut NumpyRandom,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), TrainError> {
    let mut optimizer = Optimizer::new(args.optimizer.clone(), args.learning_rate.clone());
    let mut dropout_keys =
        (adapters.config.dropout > 0.0).then(|| keys_at_training_start(adapters, args.seed));
    let mut accumulated: Option<AdapterGrads> = None;
    let (mut losses, mut tokens, mut steps, mut trained_tokens) = (0.0f64, 0usize, 0usize, 0usize);
    let mut tally: Option<PreferenceTally> = None;
    let mut train_time = 0.0f64;
    for it in 1..=args.iters {
        // As mlx-lm's loop, the batch is drawn before validation runs.
        let batch = objective.next_batch(rng);
        if let Some(longest) = O::truncated_from(&batch) {
            on_event(Event::Truncated {
                longest,
                max: args.max_seq_length,
            });
        }
        let mut tic = Instant::now();
        if valid_len > 0 && (it == 1 || it % args.steps_per_eval == 0 || it == args.iters) {
            let whole = valid_len / args.batch_size;
            let total = usize::try_from(args.val_batches).map_or(whole, |n| n.min(whole));
            on_event(Event::ValStart {
                iteration: it,
                batches: total,
            });
            let start = Instant::now();
            let on_batch = &mut || on_event(Event::ValBatch);
            let (loss, rewards) = objective.validate(adapters, args, rng, on_batch)?;
            let seconds = start.elapsed().as_secs_f64();
            on_event(Event::Val {
                iteration: it,
                loss,
                seconds,
                rewards,
            });
            tic = Instant::now();
        }
        let keys = dropout_keys.as_mut();
        let step = objective.step(&batch, adapters, keys, args.grad_checkpoint)?;
        if !step.loss.is_finite() {
            return Err(TrainError::NonFiniteLoss {
                iteration: it,
                loss: step.loss,
            });
        }
        let finite = |g: &LoraGrad| g.a.iter().chain(&g.b).all(|v| v.is_finite());
        if let Some((layer, _)) = step.grads.named().find(|(_, g)| !finite(g)) {
            return Err(TrainError::NonFiniteGradient {
                iteration: it,
                layer,
            });
        }
        let mut grads = match accumulated.take() {
            Some(mut sum) => {
                sum.add(&step.grads);
                sum
            }
            None => step.grads,
        };
        if it % args.grad_accumulation_steps == 0 {
            if args.grad_accumulation_steps > 1 {
                grads.divide(args.grad_accumulation_steps as f32);
            }
            optimizer.update(adapters, &grads);
        } else {
            accumulated = Some(grads);
        }
        losses += step.loss as f64;
        tokens += step.tokens;
        if let Some(pairs) = &step.tally {
            tally.get_or_insert_default().merge(pairs);
        }
        steps += 1;
        train_time += tic.elapsed().as_secs_f64();
        on_event(Event::Step { iteration: it });

        if it % args.steps_per_report == 0 || it == args.iters {
            trained_tokens += tokens;
            let report = Report {
                iteration: it,
                train_loss: (losses / steps as f64) as f32,
                learning_rate: optimizer.learning_rate(),
                iterations_per_second: args.steps_per_report as f64 / train_time,
                tokens_per_second: tokens as f64 / train_time,
                trained_tokens,
                peak_memory_gb: peak_resident_bytes().unwrap_or(0) as f64 / 1e9,
                rewards: tally.take().map(|t| t.rewards()),
            };
            on_event(Event::Report(&report));
            (losses, tokens, steps, train_time) = (0.0, 0, 0, 0.0);
        }
        if it % args.save_every == 0 {
            adapters.save_weights(&args.adapter_file)?;
            let numbered = args
                .adapter_file
                .with_file_name(format!("{it:07}_adapters.safetensors"));
            adapters.save_weights(&numbered)?;
            on_event(Event::Saved(&numbered));
        }
    }
    adapters.save_weights(&args.adapter_file)?;
    Ok(())
}
