//! `oxlm lora`: a drop-in for `mlx_lm.lora`, fine-tuning LoRA adapters on a frozen model with
//! its flags, defaults, data formats and report lines, plus a progress bar.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use oxlm_models::checkpoint::Checkpoint;
use oxlm_models::lora::{Adapters, LoraConfig, CONFIG_FILE, WEIGHTS_FILE};
use oxlm_models::save::write_json;
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::lora::data::{Dataset, Encoder};
use oxlm_runtime::lora::np_random::NumpyRandom;
use oxlm_runtime::lora::optimizer::OptimizerConfig;
use oxlm_runtime::lora::schedule::Schedule;
use oxlm_runtime::lora::trainer::{self, init_adapters, Event, TrainArgs};
use oxlm_runtime::LoadedModel;
use serde_json::{json, Map, Value};

#[derive(clap::Args)]
pub struct Args {
    /// The MLX model to fine-tune: a local directory, or a Hugging Face repo id (org/name or
    /// org/name@revision) fetched into the Hugging Face cache.
    #[arg(long)]
    model: PathBuf,
    /// Train adapters.
    #[arg(long)]
    train: bool,
    /// A directory with train.jsonl, valid.jsonl and test.jsonl (chat, completions or text).
    #[arg(long, default_value = "data")]
    data: PathBuf,
    /// Only `lora` is supported.
    #[arg(long, default_value = "lora")]
    fine_tune_type: String,
    /// adam, adamw or sgd, with mlx.optimizers' defaults.
    #[arg(long, default_value = "adam")]
    optimizer: String,
    /// Leave the prompt (everything before the last message) out of the loss.
    #[arg(long)]
    mask_prompt: bool,
    /// Blocks to adapt, counted from the last; -1 adapts all of them.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true)]
    num_layers: i64,
    #[arg(long, default_value_t = 4, value_parser = positive)]
    batch_size: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 1000)]
    iters: usize,
    /// Validation batches; -1 uses the whole validation set.
    #[arg(long, default_value_t = 25, allow_negative_numbers = true)]
    val_batches: i64,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-5, value_parser = learning_rate)]
    learning_rate: f64,
    /// Batches whose gradients are averaged into each optimizer update; iterations, reports
    /// and saves count batches.
    #[arg(long, default_value_t = 1, value_parser = positive)]
    grad_accumulation_steps: usize,
    /// Steps between training-loss reports.
    #[arg(long, default_value_t = 10, value_parser = positive)]
    steps_per_report: usize,
    /// Steps between validations.
    #[arg(long, default_value_t = 200, value_parser = positive)]
    steps_per_eval: usize,
    /// Start from these adapter weights (a safetensors file).
    #[arg(long)]
    resume_adapter_file: Option<PathBuf>,
    /// Where the adapters are saved (and, with --test alone, loaded from).
    #[arg(long, default_value = "adapters")]
    adapter_path: PathBuf,
    /// Save the adapters every N steps.
    #[arg(long, default_value_t = 100, value_parser = positive)]
    save_every: usize,
    /// Evaluate on the test set (after training, if training).
    #[arg(long)]
    test: bool,
    /// Test batches; -1 uses the whole test set.
    #[arg(long, default_value_t = 500, allow_negative_numbers = true)]
    test_batches: i64,
    #[arg(long, default_value_t = 2048, value_parser = positive)]
    max_seq_length: usize,
    /// Keep only each block's input and recompute the block in the backward pass.
    #[arg(long)]
    grad_checkpoint: bool,
    /// Seed of the batch order (numpy's, as mlx-lm) and of the adapters' initial values.
    #[arg(long, default_value_t = 0)]
    seed: u32,
}

/// Counts and periods of zero would divide by zero or never step.
fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A rate Adam can step with: training computes in f32, where the rate must be finite and above
/// 0 (a NaN, infinite or negative rate, or one that f32 rounds to 0 or infinity, is refused).
fn learning_rate(text: &str) -> Result<f64, String> {
    let rate: f64 = text
        .parse()
        .map_err(|e: std::num::ParseFloatError| e.to_string())?;
    let in_f32 = rate as f32;
    if in_f32.is_finite() && in_f32 > 0.0 {
        Ok(rate)
    } else {
        Err("expected a finite number above 0".into())
    }
}

/// Prints report lines above the progress bars (or plainly when the bars are hidden).
struct Ui {
    bars: MultiProgress,
    train: ProgressBar,
    val: Option<ProgressBar>,
    prev_loss: Option<f32>,
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix:<5} {bar:30.blue} {percent:>3}% · {pos:>5}/{len}")
        .expect("a valid template")
        .progress_chars("█▉░")
}

impl Ui {
    fn new(iters: usize) -> Self {
        let bars = MultiProgress::new();
        let train = bars.add(ProgressBar::new(iters as u64));
        train.set_style(bar_style());
        train.set_prefix("train");
        train.enable_steady_tick(Duration::from_millis(250));
        Ui {
            bars,
            train,
            val: None,
            prev_loss: None,
        }
    }

    fn line(&self, text: String) {
        self.bars.suspend(|| say!("{text}"));
    }

    fn event(&mut self, event: Event) {
        match event {
            Event::Truncated { longest, max } => self.line(format!(
                "[WARNING] Some sequences are longer than {max} tokens. The longest sentence {longest} \
                 will be truncated to {max}. Consider pre-splitting your data to save memory."
            )),
            Event::ValStart { batches, .. } => {
                let bar = self.bars.add(ProgressBar::new(batches as u64));
                bar.set_style(bar_style());
                bar.set_prefix("val");
                self.val = Some(bar);
            }
            Event::ValBatch => {
                if let Some(bar) = &self.val {
                    bar.inc(1);
                }
            }
            Event::Val {
                iteration,
                loss,
                seconds,
            } => {
                if let Some(bar) = self.val.take() {
                    bar.finish_and_clear();
                    self.bars.remove(&bar);
                }
                self.line(format!("  {iteration:>4}    val {loss:>5.3}    {seconds:.2}s"));
            }
            Event::Step { .. } => self.train.inc(1),
            Event::Report(r) => {
                let arrow = if self.prev_loss.is_none_or(|p| r.train_loss <= p) {
                    "▼"
                } else {
                    "▲"
                };
                self.prev_loss = Some(r.train_loss);
                self.line(format!(
                    "  {:>4}    {:>5.3} {arrow}    {:>5}    {:>5.1}k    {:>6.3}    {:.3} GB",
                    r.iteration,
                    r.train_loss,
                    thousands(r.tokens_per_second.round() as u64),
                    r.trained_tokens as f64 / 1000.0,
                    r.iterations_per_second,
                    r.peak_memory_gb
                ));
            }
            Event::Saved(path) => self.line(format!(
                "  save  {}",
                path.file_name().unwrap_or_default().to_string_lossy()
            )),
        }
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// adapter_config.json as mlx_lm.lora writes it: every setting of the run, so that mlx-lm (and
/// `oxlm generate --adapter-path`) can rebuild the adapted layers.
fn run_config(args: &Args, lora: &LoraConfig) -> Value {
    let path = |p: &Path| Value::String(p.display().to_string());
    let mut config = lora.to_json();
    let extra = json!({
        "model": path(&args.model),
        "train": args.train,
        "data": path(&args.data),
        "optimizer": args.optimizer,
        "optimizer_config": {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}},
        "mask_prompt": args.mask_prompt,
        "batch_size": args.batch_size,
        "iters": args.iters,
        "val_batches": args.val_batches,
        "learning_rate": args.learning_rate,
        "steps_per_report": args.steps_per_report,
        "steps_per_eval": args.steps_per_eval,
        "resume_adapter_file": args.resume_adapter_file.as_deref().map(path),
        "adapter_path": path(&args.adapter_path),
        "save_every": args.save_every,
        "test": args.test,
        "test_batches": args.test_batches,
        "max_seq_length": args.max_seq_length,
        "grad_checkpoint": args.grad_checkpoint,
        "grad_accumulation_steps": args.grad_accumulation_steps,
        "lr_schedule": null,
        "seed": args.seed,
    });
    let (Value::Object(map), Value::Object(more)) = (&mut config, extra) else {
        unreachable!("both are objects")
    };
    map.extend(more);
    let mut entries: Vec<(String, Value)> = std::mem::take(map).into_iter().collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Value::Object(entries.into_iter().collect::<Map<_, _>>())
}

fn evaluate_test(
    loaded: &LoadedModel,
    adapters: &Adapters,
    test: &Dataset,
    args: &Args,
    rng: &mut NumpyRandom,
) -> Result<()> {
    let whole = test.len() / args.batch_size;
    let total = usize::try_from(args.test_batches).map_or(whole, |n| n.min(whole));
    let bar = ProgressBar::new(total as u64).with_message("Calculating loss...");
    let loss = trainer::evaluate(
        loaded.model.as_ref(),
        adapters,
        test,
        args.batch_size,
        args.test_batches,
        args.max_seq_length,
        rng,
        &mut || bar.inc(1),
    )?;
    bar.finish_and_clear();
    say!("Test loss {loss:.3}, Test ppl {:.3}.", (loss as f64).exp());
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    if args.fine_tune_type != "lora" {
        bail!(
            "--fine-tune-type {} is not supported (supported: lora)",
            args.fine_tune_type
        );
    }
    let optimizer = OptimizerConfig::from_config(&args.optimizer, &json!({}))?;
    if !args.train && !args.test {
        bail!("Must provide at least one of --train or --test");
    }
    let mut rng = NumpyRandom::new(args.seed);
    say!("Loading pretrained model");
    let loaded = LoadedModel::load(&resolve_model(&args.model)?)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let model = loaded.model.as_ref();
    say!("Loading datasets");
    if !args.data.is_dir() {
        bail!(
            "--data {}: no such directory (a directory of .jsonl files is needed; Hugging Face \
             datasets are not fetched)",
            args.data.display()
        );
    }
    let encoder = Encoder {
        tokenizer: &loaded.tokenizer,
        template: loaded.chat_template.as_ref(),
        mask_prompt: args.mask_prompt,
    };
    let splits = encoder.load_dir(&args.data)?;
    if args.train && splits.train.is_empty() {
        bail!("Training set not found or empty. Must provide training set for fine-tuning.");
    }
    if args.train && splits.valid.is_empty() {
        say!(
            "Warning: Validation set not found or empty. Training will proceed without validation."
        );
    }
    if args.test && splits.test.is_empty() {
        bail!("Test set not found or empty. Must provide test set for evaluation.");
    }

    let adapters = if args.train {
        say!("Training");
        let layers = model.info().num_layers;
        if args.num_layers > layers as i64 {
            bail!(
                "Requested to train {} layers but the model only has {layers} layers.",
                args.num_layers
            );
        }
        let config = LoraConfig::new(args.num_layers);
        let mut adapters = init_adapters(model, config.clone(), args.seed as u64)?;
        if let Some(file) = &args.resume_adapter_file {
            say!("Loading fine-tuned weights from {}", file.display());
            adapters.load_weights(file)?;
        }
        train(
            &args,
            optimizer,
            &loaded,
            &mut adapters,
            &config,
            &splits.train,
            &splits.valid,
            &mut rng,
        )?;
        adapters
    } else {
        Adapters::load(&args.adapter_path, model)
            .with_context(|| format!("loading adapters from {}", args.adapter_path.display()))?
    };
    if args.test {
        say!("Testing");
        evaluate_test(&loaded, &adapters, &splits.test, &args, &mut rng)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn train(
    args: &Args,
    optimizer: OptimizerConfig,
    loaded: &LoadedModel,
    adapters: &mut Adapters,
    config: &LoraConfig,
    train_set: &Dataset,
    valid_set: &Dataset,
    rng: &mut NumpyRandom,
) -> Result<()> {
    let rows = [
        ("model", args.model.display().to_string()),
        (
            "type",
            format!("lora · {} layers · rank {}", args.num_layers, config.rank),
        ),
        ("dataset", args.data.display().to_string()),
        (
            "optimizer",
            format!("{} · lr {:.1e}", args.optimizer, args.learning_rate),
        ),
        (
            "batch · iters",
            format!("{} · {}", args.batch_size, thousands(args.iters as u64)),
        ),
        ("max seq", thousands(args.max_seq_length as u64)),
    ];
    say!("oxlm lora");
    for (key, value) in rows {
        say!("  {key:<13}   {value}");
    }
    let trainable: usize = adapters
        .layers
        .values()
        .map(|l| l.a.len() + l.b.len())
        .sum();
    let total = Checkpoint::open(&loaded.dir)?.parameter_count();
    say!(
        "Trainable parameters: {:.3}% ({:.3}M/{:.3}M)",
        trainable as f64 * 100.0 / total as f64,
        trainable as f64 / 1e6,
        total as f64 / 1e6
    );
    std::fs::create_dir_all(&args.adapter_path)
        .with_context(|| format!("creating {}", args.adapter_path.display()))?;
    write_json(
        &args.adapter_path.join(CONFIG_FILE),
        &run_config(args, config),
    )?;
    let train_args = TrainArgs {
        batch_size: args.batch_size,
        iters: args.iters,
        val_batches: args.val_batches,
        steps_per_report: args.steps_per_report,
        steps_per_eval: args.steps_per_eval,
        save_every: args.save_every,
        max_seq_length: args.max_seq_length,
        optimizer,
        learning_rate: Schedule::Constant(args.learning_rate as f32),
        grad_accumulation_steps: args.grad_accumulation_steps,
        grad_checkpoint: args.grad_checkpoint,
        adapter_file: args.adapter_path.join(WEIGHTS_FILE),
    };
    let mut ui = Ui::new(args.iters);
    ui.line("  iter   train_loss     tok/s     tokens      it/s    peak mem".into());
    trainer::train(
        loaded.model.as_ref(),
        adapters,
        train_set,
        valid_set,
        &train_args,
        rng,
        &mut |e| ui.event(e),
    )?;
    ui.train.finish();
    Ok(())
}
