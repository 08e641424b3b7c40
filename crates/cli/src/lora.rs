//! `oxlm lora`: a drop-in for `mlx_lm.lora`, fine-tuning LoRA adapters on a frozen model with
//! its flags, defaults, data formats and report lines, plus a progress bar; and for
//! mlx-lm-lora's preference training (`--train-mode dpo|orpo`, `--beta`, and DPO's
//! `--dpo-cpo-loss-type` and `--delta`).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use oxlm_models::checkpoint::Checkpoint;
use oxlm_models::lora::{Adapters, LoraConfig, CONFIG_FILE, WEIGHTS_FILE};
use oxlm_models::save::write_json;
use oxlm_runtime::hub::resolve_model;
use oxlm_runtime::lora::data::{Encoder, PreferenceSet, Splits};
use oxlm_runtime::lora::np_random::NumpyRandom;
use oxlm_runtime::lora::preference::{
    evaluate_preference, DpoLossType, PreferenceLoss, ReferenceScores, Rewards, DPO_LOSS_TYPES,
};
use oxlm_runtime::lora::trainer::{self, init_adapters, Event, TrainArgs};
use oxlm_runtime::LoadedModel;
use serde_json::{json, Map, Value};

mod settings;

use settings::{check_learning_rate, Settings};

/// mlx_lm.lora's flags. Each may also be given in the `--config` file under its name with
/// underscores (`batch_size: 8`); a flag given here wins over the file, and the defaults below
/// apply to what neither gives.
#[derive(clap::Args)]
pub struct Args {
    /// The MLX model to fine-tune: a local directory, or a Hugging Face repo id (org/name or
    /// org/name@revision) fetched into the Hugging Face cache.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Train adapters.
    #[arg(long)]
    train: bool,
    /// A directory with train.jsonl, valid.jsonl and test.jsonl (chat, completions or text;
    /// for --train-mode dpo or orpo, rows of `prompt`, `chosen`, `rejected` and an optional
    /// `system`, each answer a string or a list of messages) [default: data].
    #[arg(long)]
    data: Option<PathBuf>,
    /// Only `lora` is supported [default: lora].
    #[arg(long)]
    fine_tune_type: Option<String>,
    /// sft (mlx_lm.lora's loss), or mlx-lm-lora's preference losses: dpo (of
    /// --dpo-cpo-loss-type, against the model without adapters as the reference) or orpo
    /// [default: sft].
    #[arg(long)]
    train_mode: Option<String>,
    /// β of the dpo and orpo losses, above 0 [default: 0.1].
    #[arg(long, value_parser = above_zero)]
    beta: Option<f64>,
    /// The dpo loss of each pair's margin z = (πc − πr) − (ρc − ρr), π and ρ the answers'
    /// log-probabilities under the adapters and the reference: sigmoid −log σ(βz), hinge
    /// relu(1 − βz), ipo (z − 1/(2β))² over mean per-token log-probabilities, or dpop, sigmoid
    /// plus δ·max(0, ρc − πc) [default: sigmoid].
    #[arg(long, value_parser = DPO_LOSS_TYPES)]
    dpo_cpo_loss_type: Option<String>,
    /// δ of the dpop loss type, weighing the chosen answer's log-probability lost against the
    /// reference [default: 50.0].
    #[arg(long, allow_negative_numbers = true, value_parser = finite)]
    delta: Option<f64>,
    /// adam, adamw, sgd, adafactor or muon, with mlx.optimizers' defaults; the config file's
    /// `optimizer_config.<name>` sets their parameters (betas, eps, weight_decay,
    /// bias_correction; momentum, weight_decay, dampening, nesterov; eps, clip_threshold,
    /// decay_rate, beta_1, weight_decay, scale_parameter, relative_step, warmup_init; momentum,
    /// weight_decay, nesterov, ns_steps) [default: adam].
    #[arg(long)]
    optimizer: Option<String>,
    /// Leave the prompt (everything before the last message) out of the loss.
    #[arg(long)]
    mask_prompt: bool,
    /// Blocks to adapt, counted from the last; -1 adapts all of them [default: 16].
    #[arg(long, allow_negative_numbers = true)]
    num_layers: Option<i64>,
    /// [default: 4]
    #[arg(long, value_parser = positive)]
    batch_size: Option<usize>,
    /// Iterations: batches trained on [default: 1000].
    #[arg(long, value_parser = positive)]
    iters: Option<usize>,
    /// Validation batches; -1 uses the whole validation set [default: 25].
    #[arg(long, allow_negative_numbers = true)]
    val_batches: Option<i64>,
    /// The learning rate; the config file's `lr_schedule` replaces it with a schedule
    /// (`name`: cosine_decay, linear_schedule, exponential_decay or step_decay, with its
    /// `arguments`, and an optional linear `warmup` of N steps from `warmup_init`)
    /// [default: 1e-5].
    #[arg(long, value_parser = learning_rate)]
    learning_rate: Option<f64>,
    /// Batches whose gradients are averaged into each optimizer update; iterations, reports
    /// and saves count batches [default: 1].
    #[arg(long, value_parser = positive)]
    grad_accumulation_steps: Option<usize>,
    /// Iterations between training-loss reports [default: 10].
    #[arg(long, value_parser = positive)]
    steps_per_report: Option<usize>,
    /// Iterations between validations [default: 200].
    #[arg(long, value_parser = positive)]
    steps_per_eval: Option<usize>,
    /// Start from these adapter weights (a safetensors file).
    #[arg(long)]
    resume_adapter_file: Option<PathBuf>,
    /// Where the adapters are saved (and, with --test alone, loaded from) [default: adapters].
    #[arg(long)]
    adapter_path: Option<PathBuf>,
    /// Save the adapters every N iterations [default: 100].
    #[arg(long, value_parser = positive)]
    save_every: Option<usize>,
    /// Evaluate on the test set (after training, if training).
    #[arg(long)]
    test: bool,
    /// Test batches; -1 uses the whole test set [default: 500].
    #[arg(long, allow_negative_numbers = true)]
    test_batches: Option<i64>,
    /// [default: 2048]
    #[arg(long, value_parser = positive)]
    max_seq_length: Option<usize>,
    /// A YAML file of mlx_lm.lora's options, as `mlx_lm.lora --config` reads it: any flag's
    /// name with underscores, and `lora_parameters` (`rank`, `scale`, `dropout` and `keys`: the
    /// adapters' shape, training's dropout on their input, and the layers of a block they adapt),
    /// `optimizer_config` and `lr_schedule`, which have no flags. Keys oxlm does not use are
    /// kept in adapter_config.json, as mlx-lm keeps them.
    #[arg(short = 'c', long)]
    config: Option<PathBuf>,
    /// Keep only each block's input and recompute the block in the backward pass.
    #[arg(long)]
    grad_checkpoint: bool,
    /// Seed of the batch order (numpy's, as mlx-lm), of the dropout masks (MLX's generator, as
    /// mlx-lm) and of the adapters' initial values [default: 0].
    #[arg(long)]
    seed: Option<u32>,
    /// Write each training report and validation to this file as a JSON line (`event`
    /// `train`: iteration, train_loss, learning_rate, iterations_per_second,
    /// tokens_per_second, trained_tokens, peak_memory in GB; `event` `val`: iteration,
    /// val_loss, val_time in seconds; preference runs add mlx-lm-lora's chosen_reward,
    /// rejected_reward, accuracies and margins, prefixed with train_ or val_), flushed as it is
    /// written.
    #[arg(long)]
    metrics_file: Option<PathBuf>,
}

impl Args {
    /// The flags given, by mlx-lm's option names; a switch left off is not given, so that the
    /// config file may turn it on.
    fn given(&self) -> Map<String, Value> {
        // Paths as text, as mlx-lm's config holds them (one that is not UTF-8 included).
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| json!(p.display().to_string()));
        let switch = |on: bool| on.then_some(json!(true));
        [
            ("model", path(&self.model)),
            ("train", switch(self.train)),
            ("data", path(&self.data)),
            ("fine_tune_type", value(&self.fine_tune_type)),
            ("train_mode", value(&self.train_mode)),
            ("beta", value(&self.beta)),
            ("dpo_cpo_loss_type", value(&self.dpo_cpo_loss_type)),
            ("delta", value(&self.delta)),
            ("optimizer", value(&self.optimizer)),
            ("mask_prompt", switch(self.mask_prompt)),
            ("num_layers", value(&self.num_layers)),
            ("batch_size", value(&self.batch_size)),
            ("iters", value(&self.iters)),
            ("val_batches", value(&self.val_batches)),
            ("learning_rate", value(&self.learning_rate)),
            (
                "grad_accumulation_steps",
                value(&self.grad_accumulation_steps),
            ),
            ("steps_per_report", value(&self.steps_per_report)),
            ("steps_per_eval", value(&self.steps_per_eval)),
            ("resume_adapter_file", path(&self.resume_adapter_file)),
            ("adapter_path", path(&self.adapter_path)),
            ("save_every", value(&self.save_every)),
            ("test", switch(self.test)),
            ("test_batches", value(&self.test_batches)),
            ("max_seq_length", value(&self.max_seq_length)),
            ("config", path(&self.config)),
            ("grad_checkpoint", switch(self.grad_checkpoint)),
            ("seed", value(&self.seed)),
            ("metrics_file", path(&self.metrics_file)),
        ]
        .into_iter()
        .filter_map(|(key, value)| Some((key.to_string(), value?)))
        .collect()
    }
}

/// A flag's value, if it was given.
fn value<T: serde::Serialize>(flag: &Option<T>) -> Option<Value> {
    flag.as_ref().map(|v| json!(v))
}

/// Counts and periods of zero would divide by zero or never step.
fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A number the losses can compute with: NaN or an infinity would make every loss NaN (and
/// would reach the settings as null: not given).
fn finite(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        Ok(_) => Err("expected a finite number".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite number above 0 (a NaN or infinity would reach the config as null, the default).
fn above_zero(text: &str) -> Result<f64, String> {
    match finite(text)? {
        x if x > 0.0 => Ok(x),
        _ => Err("expected a number above 0".into()),
    }
}

/// See [`check_learning_rate`].
fn learning_rate(text: &str) -> Result<f64, String> {
    let rate: f64 = text
        .parse()
        .map_err(|e: std::num::ParseFloatError| e.to_string())?;
    check_learning_rate(rate)
}

/// `--metrics-file`: one JSON object a line, each flushed as it is written.
struct MetricsLog {
    path: PathBuf,
    file: File,
    /// The first write that failed; no more are tried, and the run ends with it.
    failed: Option<std::io::Error>,
}

impl MetricsLog {
    fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(MetricsLog {
            path: path.to_path_buf(),
            file,
            failed: None,
        })
    }

    fn write(&mut self, record: Value) {
        if self.failed.is_some() {
            return;
        }
        let line = format!("{record}\n");
        let written = (self.file.write_all(line.as_bytes())).and_then(|()| self.file.flush());
        self.failed = written.err();
    }

    fn finish(self) -> Result<()> {
        match self.failed {
            Some(e) => Err(e).with_context(|| format!("writing {}", self.path.display())),
            None => Ok(()),
        }
    }
}

/// Prints report lines above the progress bars (or plainly when the bars are hidden), and
/// logs them to the metrics file when there is one.
struct Ui {
    bars: MultiProgress,
    train: ProgressBar,
    val: Option<ProgressBar>,
    prev_loss: Option<f32>,
    metrics: Option<MetricsLog>,
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix:<5} {bar:30.blue} {percent:>3}% · {pos:>5}/{len}")
        .expect("a valid template")
        .progress_chars("█▉░")
}

impl Ui {
    fn new(iters: usize, metrics: Option<MetricsLog>) -> Self {
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
            metrics,
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
                rewards,
            } => {
                if let Some(bar) = self.val.take() {
                    bar.finish_and_clear();
                    self.bars.remove(&bar);
                }
                let rewards_column = rewards.as_ref().map_or(String::new(), |r| {
                    format!("    margin {:.3} · acc {:.3}", r.margin, r.accuracy)
                });
                self.line(format!(
                    "  {iteration:>4}    val {loss:>5.3}    {seconds:.2}s{rewards_column}"
                ));
                if let Some(log) = &mut self.metrics {
                    let mut record = json!({
                        "event": "val",
                        "iteration": iteration,
                        "val_loss": loss,
                        "val_time": seconds,
                    });
                    add_rewards(&mut record, "val", rewards.as_ref());
                    log.write(record);
                }
            }
            Event::Step { .. } => self.train.inc(1),
            Event::Report(r) => {
                let arrow = if self.prev_loss.is_none_or(|p| r.train_loss <= p) {
                    "▼"
                } else {
                    "▲"
                };
                self.prev_loss = Some(r.train_loss);
                let rewards_columns = (r.rewards.as_ref())
                    .map_or(String::new(), |r| format!("    {:>6.3}    {:>5.3}", r.margin, r.accuracy));
                self.line(format!(
                    "  {:>4}    {:>5.3} {arrow}    {:>5}    {:>5.1}k    {:>6.3}    {:.3} GB{rewards_columns}",
                    r.iteration,
                    r.train_loss,
                    thousands(r.tokens_per_second.round() as u64),
                    r.trained_tokens as f64 / 1000.0,
                    r.iterations_per_second,
                    r.peak_memory_gb
                ));
                if let Some(log) = &mut self.metrics {
                    let mut record = json!({
                        "event": "train",
                        "iteration": r.iteration,
                        "train_loss": r.train_loss,
                        "learning_rate": r.learning_rate,
                        "iterations_per_second": r.iterations_per_second,
                        "tokens_per_second": r.tokens_per_second,
                        "trained_tokens": r.trained_tokens,
                        "peak_memory": r.peak_memory_gb,
                    });
                    add_rewards(&mut record, "train", r.rewards.as_ref());
                    log.write(record);
                }
            }
            Event::Saved(path) => self.line(format!(
                "  save  {}",
                path.file_name().unwrap_or_default().to_string_lossy()
            )),
        }
    }
}

/// A preference run's rewards in a metrics record, by mlx-lm-lora's names (`train_margins`).
fn add_rewards(record: &mut Value, prefix: &str, rewards: Option<&Rewards>) {
    let Some(r) = rewards else { return };
    for (name, value) in [
        ("chosen_reward", r.chosen),
        ("rejected_reward", r.rejected),
        ("accuracies", r.accuracy),
        ("margins", r.margin),
    ] {
        record[format!("{prefix}_{name}")] = json!(value);
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

/// The run's data sets: mlx-lm's formats, or preference rows.
enum Data {
    Sft(Splits),
    Preference(Splits<PreferenceSet>),
}

impl Data {
    /// Whether the train, valid and test sets are empty.
    fn empty(&self) -> [bool; 3] {
        match self {
            Data::Sft(s) => [s.train.is_empty(), s.valid.is_empty(), s.test.is_empty()],
            Data::Preference(s) => [s.train.is_empty(), s.valid.is_empty(), s.test.is_empty()],
        }
    }

    fn test_len(&self) -> usize {
        match self {
            Data::Sft(s) => s.test.len(),
            Data::Preference(s) => s.test.len(),
        }
    }
}

fn evaluate_test(
    loaded: &LoadedModel,
    adapters: &Adapters,
    data: &Data,
    args: &Settings,
    rng: &mut NumpyRandom,
) -> Result<()> {
    let whole = data.test_len() / args.batch_size;
    let total = usize::try_from(args.test_batches).map_or(whole, |n| n.min(whole));
    let bar = ProgressBar::new(total as u64).with_message("Calculating loss...");
    let model = loaded.model.as_ref();
    let (batch_size, batches, max) = (args.batch_size, args.test_batches, args.max_seq_length);
    let on_batch = &mut || bar.inc(1);
    match (data, args.preference) {
        (Data::Preference(splits), Some(loss)) => {
            let mut reference = ReferenceScores::default();
            let tally = evaluate_preference(
                model,
                adapters,
                &splits.test,
                loss,
                batch_size,
                batches,
                max,
                &mut reference,
                rng,
                on_batch,
            )?;
            bar.finish_and_clear();
            let r = tally.rewards();
            say!(
                "Test loss {:.3}, Test chosen reward {:.3}, Test rejected reward {:.3}, Test \
                 accuracy {:.3}, Test margin {:.3}.",
                tally.loss(),
                r.chosen,
                r.rejected,
                r.accuracy,
                r.margin
            );
        }
        (Data::Sft(splits), _) => {
            let test = &splits.test;
            let loss = trainer::evaluate(
                model, adapters, test, batch_size, batches, max, rng, on_batch,
            )?;
            bar.finish_and_clear();
            say!("Test loss {loss:.3}, Test ppl {:.3}.", (loss as f64).exp());
        }
        (Data::Preference(_), None) => unreachable!("preference data is loaded for dpo and orpo"),
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    if let Some(path) = &args.config {
        say!("Loading configuration file {}", path.display());
    }
    let args = Settings::gather(args.given(), args.config.as_deref())?;
    for note in &args.unused {
        eprintln!("Note: {note}.");
    }
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
    let data = match args.preference {
        Some(_) => Data::Preference(encoder.load_preference_dir(&args.data)?),
        None => Data::Sft(encoder.load_dir(&args.data)?),
    };
    let [no_train, no_valid, no_test] = data.empty();
    if args.train && no_train {
        bail!("Training set not found or empty. Must provide training set for fine-tuning.");
    }
    if args.train && no_valid {
        say!(
            "Warning: Validation set not found or empty. Training will proceed without validation."
        );
    }
    if args.test && no_test {
        bail!("Test set not found or empty. Must provide test set for evaluation.");
    }

    let adapters = if args.train {
        say!("Training");
        let layers = model.info().num_layers;
        if args.lora.num_layers > layers as i64 {
            bail!(
                "Requested to train {} layers but the model only has {layers} layers.",
                args.lora.num_layers
            );
        }
        let config = args.lora.clone();
        let mut adapters = init_adapters(model, config.clone(), args.seed as u64)?;
        if let Some(file) = &args.resume_adapter_file {
            say!("Loading fine-tuned weights from {}", file.display());
            adapters.load_weights(file)?;
        }
        train(&args, &loaded, &mut adapters, &config, &data, &mut rng)?;
        adapters
    } else {
        Adapters::load(&args.adapter_path, model)
            .with_context(|| format!("loading adapters from {}", args.adapter_path.display()))?
    };
    if args.test {
        say!("Testing");
        evaluate_test(&loaded, &adapters, &data, &args, &mut rng)?;
    }
    Ok(())
}

/// How the header names the loss.
fn mode_label(preference: Option<PreferenceLoss>) -> String {
    match preference {
        None => "sft".into(),
        Some(PreferenceLoss::Dpo {
            beta,
            loss_type: DpoLossType::Dpop { delta },
        }) => format!("dpo (dpop · δ {delta}) · β {beta}"),
        Some(PreferenceLoss::Dpo { beta, loss_type }) => {
            format!("dpo ({}) · β {beta}", loss_type.name())
        }
        Some(PreferenceLoss::Orpo { beta }) => format!("orpo · β {beta}"),
    }
}

fn train(
    args: &Settings,
    loaded: &LoadedModel,
    adapters: &mut Adapters,
    config: &LoraConfig,
    data: &Data,
    rng: &mut NumpyRandom,
) -> Result<()> {
    let rows = [
        ("model", args.model.display().to_string()),
        (
            "type",
            format!(
                "lora · {} layers · rank {} · scale {}",
                args.lora.num_layers, config.rank, config.scale
            ),
        ),
        ("mode", mode_label(args.preference)),
        ("dataset", args.data.display().to_string()),
        (
            "optimizer",
            format!(
                "{} · lr {}",
                args.optimizer.name(),
                args.learning_rate_label
            ),
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
    write_json(&args.adapter_path.join(CONFIG_FILE), &args.adapter_config())?;
    let train_args = TrainArgs {
        batch_size: args.batch_size,
        iters: args.iters,
        val_batches: args.val_batches,
        steps_per_report: args.steps_per_report,
        steps_per_eval: args.steps_per_eval,
        save_every: args.save_every,
        max_seq_length: args.max_seq_length,
        optimizer: args.optimizer.clone(),
        learning_rate: args.learning_rate.clone(),
        grad_accumulation_steps: args.grad_accumulation_steps,
        grad_checkpoint: args.grad_checkpoint,
        adapter_file: args.adapter_path.join(WEIGHTS_FILE),
        seed: args.seed.into(),
    };
    let metrics = (args.metrics_file.as_deref())
        .map(MetricsLog::create)
        .transpose()?;
    let mut ui = Ui::new(args.iters, metrics);
    let mut header = "  iter   train_loss     tok/s     tokens      it/s    peak mem".to_string();
    if args.preference.is_some() {
        header.push_str("    margin      acc");
    }
    ui.line(header);
    let model = loaded.model.as_ref();
    let on_event: &mut dyn FnMut(Event) = &mut |e| ui.event(e);
    match (data, args.preference) {
        (Data::Preference(splits), Some(loss)) => {
            let (train, valid) = (&splits.train, &splits.valid);
            trainer::train_preference(
                model,
                adapters,
                train,
                valid,
                loss,
                &train_args,
                rng,
                on_event,
            )?
        }
        (Data::Sft(splits), _) => {
            let (train, valid) = (&splits.train, &splits.valid);
            trainer::train(model, adapters, train, valid, &train_args, rng, on_event)?
        }
        (Data::Preference(_), None) => unreachable!("preference data is loaded for dpo and orpo"),
    }
    ui.train.finish();
    ui.metrics.map_or(Ok(()), MetricsLog::finish)
}
