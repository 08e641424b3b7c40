//! The settings of a run as mlx_lm.lora gathers them: a flag given on the command line wins, a
//! key of the `--config` YAML file fills what the command line left out, and mlx_lm.lora's
//! defaults fill the rest. Keys the file has that oxlm does not use are kept, as mlx-lm keeps
//! them, and written to adapter_config.json with the rest. `train_mode`, `beta`,
//! `dpo_cpo_loss_type` and `delta` are mlx-lm-lora's, for preference training.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oxlm_models::lora::{LoraConfig, MAX_SCALE};
use oxlm_runtime::lora::optimizer::OptimizerConfig;
use oxlm_runtime::lora::preference::{
    DpoLossType, PreferenceLoss, DEFAULT_BETA, DEFAULT_DELTA, DPO_LOSS_TYPES,
};
use oxlm_runtime::lora::schedule::Schedule;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// mlx_lm.lora's `CONFIG_DEFAULTS` for the options oxlm takes, but `data` (oxlm fetches no
/// Hugging Face dataset, so it defaults to a local `data` directory) and `model` (no default
/// model is fetched: one must be named); and mlx-lm-lora's `train_mode`, `beta`,
/// `dpo_cpo_loss_type` and `delta`.
fn defaults() -> Map<String, Value> {
    let Value::Object(map) = json!({
        "train": false,
        "fine_tune_type": "lora",
        "optimizer": "adam",
        "optimizer_config": {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}},
        "data": "data",
        "seed": 0,
        "num_layers": 16,
        "batch_size": 4,
        "iters": 1000,
        "val_batches": 25,
        "learning_rate": 1e-5,
        "steps_per_report": 10,
        "steps_per_eval": 200,
        "resume_adapter_file": null,
        "adapter_path": "adapters",
        "save_every": 100,
        "test": false,
        "test_batches": 500,
        "max_seq_length": 2048,
        "config": null,
        "grad_checkpoint": false,
        "grad_accumulation_steps": 1,
        "lr_schedule": null,
        "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0},
        "mask_prompt": false,
        "metrics_file": null,
        "train_mode": "sft",
        "beta": DEFAULT_BETA,
        "dpo_cpo_loss_type": DPO_LOSS_TYPES[0],
        "delta": DEFAULT_DELTA,
    }) else {
        unreachable!("an object")
    };
    map
}

/// `lora_parameters`: the adapters' shape. mlx-lm reads `rank`, `scale` and `dropout` as
/// required keys and `keys` as optional.
#[derive(Debug, Deserialize)]
struct LoraParameters {
    rank: usize,
    scale: f64,
    dropout: f64,
    #[serde(default)]
    keys: Option<Vec<String>>,
}

/// The typed settings. Unknown keys stay in [`Settings::all`] only.
#[derive(Debug, Deserialize)]
struct Typed {
    model: Option<PathBuf>,
    train: bool,
    data: PathBuf,
    fine_tune_type: String,
    optimizer: String,
    optimizer_config: Map<String, Value>,
    mask_prompt: bool,
    num_layers: i64,
    batch_size: usize,
    iters: usize,
    val_batches: i64,
    learning_rate: f64,
    steps_per_report: usize,
    steps_per_eval: usize,
    grad_accumulation_steps: usize,
    resume_adapter_file: Option<PathBuf>,
    adapter_path: PathBuf,
    save_every: usize,
    test: bool,
    test_batches: i64,
    max_seq_length: usize,
    grad_checkpoint: bool,
    seed: u32,
    lr_schedule: Option<Value>,
    lora_parameters: LoraParameters,
    metrics_file: Option<PathBuf>,
    train_mode: String,
    beta: f64,
    dpo_cpo_loss_type: String,
    delta: f64,
}

/// Everything a run needs, checked.
pub struct Settings {
    pub model: PathBuf,
    pub train: bool,
    pub data: PathBuf,
    pub mask_prompt: bool,
    pub batch_size: usize,
    pub iters: usize,
    pub val_batches: i64,
    pub steps_per_report: usize,
    pub steps_per_eval: usize,
    pub grad_accumulation_steps: usize,
    pub resume_adapter_file: Option<PathBuf>,
    pub adapter_path: PathBuf,
    pub save_every: usize,
    pub test: bool,
    pub test_batches: i64,
    pub max_seq_length: usize,
    pub grad_checkpoint: bool,
    pub seed: u32,
    pub optimizer: OptimizerConfig,
    pub learning_rate: Schedule,
    /// How the header names the rate: a number, or the schedule's name.
    pub learning_rate_label: String,
    pub lora: LoraConfig,
    pub metrics_file: Option<PathBuf>,
    /// The preference loss of `train_mode` dpo or orpo; `None` for sft.
    pub preference: Option<PreferenceLoss>,
    /// Settings given that the run does not use, to be told.
    pub unused: Vec<String>,
    /// Every setting by mlx-lm's name, unknown keys of the config file included: what
    /// adapter_config.json records.
    pub all: Map<String, Value>,
}

/// Reads `path`: a YAML mapping of mlx_lm.lora's option names to values.
fn read_config(path: &Path) -> Result<Map<String, Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: Value = serde_yaml::from_str(&text)
        .with_context(|| format!("{}: not a valid YAML config", path.display()))?;
    match value {
        Value::Object(map) => Ok(map),
        // An empty file.
        Value::Null => Ok(Map::new()),
        _ => bail!(
            "{}: a config must be a mapping of option names to values",
            path.display()
        ),
    }
}

/// A rate Adam can step with: training computes in f32, where the rate must be finite and above
/// 0 (a NaN, infinite or negative rate, or one that f32 rounds to 0 or infinity, is refused).
pub fn check_learning_rate(rate: f64) -> Result<f64, String> {
    let in_f32 = rate as f32;
    if in_f32.is_finite() && in_f32 > 0.0 {
        Ok(rate)
    } else {
        Err("expected a finite number above 0".into())
    }
}

/// The preference loss of `train_mode`, and the notes on what it leaves unused.
/// `dpo_cpo_loss_type` and `delta` are DPO's (`delta` its dpop loss type's only): of the modes
/// oxlm has, mlx-lm-lora passes them to DPO alone (its ORPO trainer takes neither). Where unused
/// neither is checked, and a value other than the default is noted. (mlx-lm-lora 5.10.2 itself never reads either from its config file:
/// its argparse defaults shadow the file. They are read here as every other key is.)
fn preference(
    mode: &str,
    beta: f64,
    loss_type: &str,
    delta: f64,
) -> Result<(Option<PreferenceLoss>, Vec<String>)> {
    let mut unused = Vec::new();
    if mode != "dpo" && loss_type != DPO_LOSS_TYPES[0] {
        unused.push(format!(
            "`dpo_cpo_loss_type` {loss_type} is unused for train_mode {mode}: only dpo reads it"
        ));
    }
    if delta != DEFAULT_DELTA && (mode != "dpo" || loss_type != "dpop") {
        let user = if mode == "dpo" {
            format!("the dpo loss type {loss_type}")
        } else {
            format!("train_mode {mode}")
        };
        unused.push(format!(
            "`delta` {delta} is unused for {user}: only dpo's dpop loss type reads it"
        ));
    }
    if mode == "sft" {
        return Ok((None, unused));
    }
    if !(beta.is_finite() && beta > 0.0) {
        bail!("`beta` is {beta}: expected a finite number above 0");
    }
    let loss = match mode {
        "dpo" => {
            let Some(loss_type) = DpoLossType::from_name(loss_type, delta) else {
                bail!(
                    "`dpo_cpo_loss_type` {loss_type} is not supported (supported: {})",
                    DPO_LOSS_TYPES.join(", ")
                );
            };
            PreferenceLoss::Dpo { beta, loss_type }
        }
        "orpo" => PreferenceLoss::Orpo { beta },
        _ => bail!("`train_mode` {mode} is not supported (supported: sft, dpo, orpo)"),
    };
    Ok((Some(loss), unused))
}

impl Settings {
    /// `given` (the flags of the command line, by mlx-lm's names) over the file `config` over
    /// the defaults; a key whose value is null counts as not given, as in mlx-lm.
    pub fn gather(given: Map<String, Value>, config: Option<&Path>) -> Result<Settings> {
        let mut all = given;
        let mut fill = |from: Map<String, Value>| {
            for (key, value) in from {
                if all.get(&key).is_none_or(Value::is_null) {
                    all.insert(key, value);
                }
            }
        };
        if let Some(path) = config {
            fill(read_config(path)?);
        }
        fill(defaults());
        let origin = config.map_or(String::new(), |p| format!("{}: ", p.display()));
        // mlx-lm's own hint: other frameworks call the scale `alpha` and divide it by the rank.
        if let Some(params) = all.get("lora_parameters").and_then(Value::as_object) {
            if !params.contains_key("scale") {
                bail!(
                    "{origin}`lora_parameters.scale` is missing (mlx-lm uses `scale`, not `alpha`)"
                );
            }
        }
        let typed: Typed = serde_path_to_error::deserialize(Value::Object(all.clone()))
            .map_err(|e| anyhow::anyhow!("{origin}`{}`: {}", e.path(), e.inner()))?;
        Self::check(typed, all).map_err(|e| anyhow::anyhow!("{origin}{e}"))
    }

    fn check(typed: Typed, all: Map<String, Value>) -> Result<Settings> {
        let Some(model) = typed.model else {
            bail!("no model: give --model (or `model` in the config file)");
        };
        if typed.fine_tune_type != "lora" {
            bail!(
                "`fine_tune_type` {} is not supported (supported: lora)",
                typed.fine_tune_type
            );
        }
        for (key, value) in [
            ("batch_size", typed.batch_size),
            ("iters", typed.iters),
            ("steps_per_report", typed.steps_per_report),
            ("steps_per_eval", typed.steps_per_eval),
            ("save_every", typed.save_every),
            ("max_seq_length", typed.max_seq_length),
            ("grad_accumulation_steps", typed.grad_accumulation_steps),
        ] {
            if value == 0 {
                bail!("`{key}` must be at least 1");
            }
        }
        let name = typed.optimizer.to_lowercase();
        // mlx-lm passes the optimizer's entry, or nothing, as its keyword arguments.
        let options = (typed.optimizer_config.get(&name).cloned()).unwrap_or_else(|| json!({}));
        let optimizer = OptimizerConfig::from_config(&name, &options)?;
        let (learning_rate, learning_rate_label) = match &typed.lr_schedule {
            Some(config) => {
                let schedule = Schedule::from_config(config)?;
                let name = config.get("name").and_then(Value::as_str).unwrap_or("");
                (schedule, name.to_string())
            }
            None => {
                let rate = check_learning_rate(typed.learning_rate)
                    .map_err(|e| anyhow::anyhow!("`learning_rate` {}: {e}", typed.learning_rate))?;
                (Schedule::Constant(rate as f32), format!("{rate:.1e}"))
            }
        };
        let params = &typed.lora_parameters;
        if params.rank == 0 {
            bail!("`lora_parameters.rank` must be at least 1");
        }
        if !(-MAX_SCALE..=MAX_SCALE).contains(&params.scale) {
            bail!(
                "`lora_parameters.scale` is {}: expected a number from -{MAX_SCALE} to {MAX_SCALE}",
                params.scale
            );
        }
        // nn.Dropout's own check.
        if !(0.0..1.0).contains(&params.dropout) {
            bail!(
                "`lora_parameters.dropout` is {}: expected a probability in [0, 1)",
                params.dropout
            );
        }
        let (preference, unused) = preference(
            &typed.train_mode,
            typed.beta,
            &typed.dpo_cpo_loss_type,
            typed.delta,
        )?;
        let lora = LoraConfig {
            num_layers: typed.num_layers,
            rank: params.rank,
            scale: params.scale as f32,
            dropout: params.dropout,
            keys: params.keys.clone(),
        };
        Ok(Settings {
            model,
            train: typed.train,
            data: typed.data,
            mask_prompt: typed.mask_prompt,
            batch_size: typed.batch_size,
            iters: typed.iters,
            val_batches: typed.val_batches,
            steps_per_report: typed.steps_per_report,
            steps_per_eval: typed.steps_per_eval,
            grad_accumulation_steps: typed.grad_accumulation_steps,
            resume_adapter_file: typed.resume_adapter_file,
            adapter_path: typed.adapter_path,
            save_every: typed.save_every,
            test: typed.test,
            test_batches: typed.test_batches,
            max_seq_length: typed.max_seq_length,
            grad_checkpoint: typed.grad_checkpoint,
            seed: typed.seed,
            optimizer,
            learning_rate,
            learning_rate_label,
            lora,
            metrics_file: typed.metrics_file,
            preference,
            unused,
            all,
        })
    }

    /// adapter_config.json as mlx_lm.lora writes it: every setting of the run, sorted, so that
    /// mlx-lm (and `oxlm generate --adapter-path`) can rebuild the adapted layers.
    pub fn adapter_config(&self) -> Value {
        let mut entries: Vec<(String, Value)> = self.all.clone().into_iter().collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        Value::Object(entries.into_iter().collect())
    }
}
