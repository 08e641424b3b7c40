//! The optimizers of mlx_lm.lora (`--optimizer` with its `optimizer_config` entry), as
//! mlx.optimizers defines them, with their defaults: f32 arithmetic in MLX's order of
//! operations, Python's scalars rounded to f32 where MLX rounds them.

use std::collections::BTreeMap;

use oxlm_models::lora::Adapters;
use oxlm_models::lora_grad::{AdapterGrads, LoraGrad};
use serde::Deserialize;
use serde_json::Value;

use super::options::{parse, OptionError};
use super::schedule::Schedule;

/// `mlx.optimizers.Adam`'s (and AdamW's) settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamConfig {
    #[serde(default = "AdamConfig::default_betas")]
    pub betas: [f64; 2],
    #[serde(default = "AdamConfig::default_eps")]
    pub eps: f64,
    #[serde(default)]
    pub bias_correction: bool,
}

impl AdamConfig {
    fn default_betas() -> [f64; 2] {
        [0.9, 0.999]
    }

    fn default_eps() -> f64 {
        1e-8
    }

    /// `Adam.__init__`'s checks.
    fn check(&self, key: &str) -> Result<(), OptionError> {
        for (i, beta) in self.betas.iter().enumerate() {
            if !(0.0..1.0).contains(beta) {
                return Err(OptionError::new(
                    format!("{key}.betas[{i}]"),
                    format!("must be in [0, 1), not {beta}"),
                ));
            }
        }
        if !(self.eps >= 0.0 && self.eps.is_finite()) {
            return Err(OptionError::new(
                format!("{key}.eps"),
                format!("must be a finite number of at least 0, not {}", self.eps),
            ));
        }
        Ok(())
    }
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            betas: Self::default_betas(),
            eps: Self::default_eps(),
            bias_correction: false,
        }
    }
}

/// `mlx.optimizers.AdamW`'s settings: Adam's and a decoupled weight decay.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    #[serde(default = "AdamConfig::default_betas")]
    pub betas: [f64; 2],
    #[serde(default = "AdamConfig::default_eps")]
    pub eps: f64,
    #[serde(default = "AdamWConfig::default_weight_decay")]
    pub weight_decay: f64,
    #[serde(default)]
    pub bias_correction: bool,
}

impl AdamWConfig {
    fn default_weight_decay() -> f64 {
        0.01
    }

    fn adam(&self) -> AdamConfig {
        AdamConfig {
            betas: self.betas,
            eps: self.eps,
            bias_correction: self.bias_correction,
        }
    }
}

/// `mlx.optimizers.SGD`'s settings.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SgdConfig {
    #[serde(default)]
    pub momentum: f64,
    /// An L2 penalty added to the gradient.
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default)]
    pub dampening: f64,
    #[serde(default)]
    pub nesterov: bool,
}

/// An optimizer and its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    Adam(AdamConfig),
    AdamW(AdamWConfig),
    Sgd(SgdConfig),
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::Adam(AdamConfig::default())
    }
}

const SUPPORTED: &str = "adam, adamw, sgd";

impl OptimizerConfig {
    /// The optimizer `name` (any case, as mlx-lm lowers it) with `config`, its entry of
    /// `optimizer_config` (`{}` for the defaults). Keys the optimizer does not take are refused,
    /// as Python refuses unknown keyword arguments.
    pub fn from_config(name: &str, config: &Value) -> Result<Self, OptionError> {
        let name = name.to_lowercase();
        let key = format!("optimizer_config.{name}");
        match name.as_str() {
            "adam" => {
                let adam: AdamConfig = parse(&key, config)?;
                adam.check(&key)?;
                Ok(OptimizerConfig::Adam(adam))
            }
            "adamw" => {
                let adamw: AdamWConfig = parse(&key, config)?;
                adamw.adam().check(&key)?;
                if !adamw.weight_decay.is_finite() {
                    return Err(OptionError::new(
                        format!("{key}.weight_decay"),
                        "must be a finite number",
                    ));
                }
                Ok(OptimizerConfig::AdamW(adamw))
            }
            "sgd" => {
                let sgd: SgdConfig = parse(&key, config)?;
                if [sgd.momentum, sgd.weight_decay, sgd.dampening]
                    .iter()
                    .any(|v| !v.is_finite())
                {
                    return Err(OptionError::new(key, "values must be finite numbers"));
                }
                // SGD.__init__'s own check.
                if sgd.nesterov && (sgd.momentum <= 0.0 || sgd.dampening != 0.0) {
                    return Err(OptionError::new(
                        format!("{key}.nesterov"),
                        "Nesterov momentum requires a momentum and zero dampening",
                    ));
                }
                Ok(OptimizerConfig::Sgd(sgd))
            }
            "muon" | "adafactor" => Err(OptionError::new(
                "optimizer",
                format!("`{name}` is not supported yet (supported: {SUPPORTED})"),
            )),
            _ => Err(OptionError::new(
                "optimizer",
                format!("unknown optimizer `{name}` (supported: {SUPPORTED})"),
            )),
        }
    }

    /// mlx-lm's name for it.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::Adam(_) => "adam",
            OptimizerConfig::AdamW(_) => "adamw",
            OptimizerConfig::Sgd(_) => "sgd",
        }
    }
}

/// Per-layer state: Adam's first and second moments, or SGD's velocity in `first`.
struct Moments {
    first: LoraGrad,
    second: LoraGrad,
}

/// An optimizer stepping a set of adapters, its learning rate following a schedule.
pub struct Optimizer {
    config: OptimizerConfig,
    schedule: Schedule,
    /// Updates made so far (mlx.optimizers' `step`).
    step: u64,
    /// The rate of the last update (the schedule's first before any), as mlx-lm reports it.
    learning_rate: f32,
    /// By layer (`path`, or `path[e]` for expert `e` of a stack).
    state: BTreeMap<String, Moments>,
}

impl Optimizer {
    pub fn new(config: OptimizerConfig, schedule: Schedule) -> Self {
        let learning_rate = schedule.at(0);
        Optimizer {
            config,
            schedule,
            step: 0,
            learning_rate,
            state: BTreeMap::new(),
        }
    }

    /// The learning rate mlx-lm reports: that of the last update.
    pub fn learning_rate(&self) -> f32 {
        self.learning_rate
    }

    /// One update of every adapter matrix from its gradient.
    pub fn update(&mut self, adapters: &mut Adapters, grads: &AdapterGrads) {
        self.learning_rate = self.schedule.at(self.step);
        self.step += 1;
        let plain =
            (adapters.layers.iter_mut()).map(|(path, l)| (path.clone(), l, grads.layers.get(path)));
        let experts = adapters.experts.iter_mut().flat_map(|(path, each)| {
            let g = grads.experts.get(path);
            (each.iter_mut().enumerate())
                .map(move |(e, l)| (format!("{path}[{e}]"), l, g.and_then(|g| g.get(e))))
        });
        for (name, layer, g) in plain.chain(experts) {
            let Some(g) = g else { continue };
            let mut moments = self.state.remove(&name).unwrap_or_else(|| Moments {
                first: LoraGrad::zeros(layer),
                second: LoraGrad::zeros(layer),
            });
            let Moments { first, second } = &mut moments;
            self.apply(&mut layer.a, &g.a, &mut first.a, &mut second.a);
            self.apply(&mut layer.b, &g.b, &mut first.b, &mut second.b);
            self.state.insert(name, moments);
        }
    }

    /// One matrix's update (`apply_single`).
    fn apply(&self, w: &mut [f32], g: &[f32], first: &mut [f32], second: &mut [f32]) {
        let lr = self.learning_rate;
        match &self.config {
            OptimizerConfig::Adam(adam) => self.adam(adam, w, g, first, second),
            OptimizerConfig::AdamW(adamw) => {
                // The parameter decays before Adam's step, by 1 - lr·λ.
                let keep = 1.0 - lr * adamw.weight_decay as f32;
                for v in w.iter_mut() {
                    *v *= keep;
                }
                self.adam(&adamw.adam(), w, g, first, second)
            }
            OptimizerConfig::Sgd(sgd) => sgd_step(sgd, lr, w, g, first),
        }
    }

    fn adam(&self, adam: &AdamConfig, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let lr = self.learning_rate;
        let [b1, b2] = adam.betas;
        // `1 - b1` and `1 - b2` are computed by Python in f64, then made f32.
        let (c1, c2) = ((1.0 - b1) as f32, (1.0 - b2) as f32);
        let (b1, b2, eps) = (b1 as f32, b2 as f32, adam.eps as f32);
        for i in 0..w.len() {
            m[i] = b1 * m[i] + c1 * g[i];
            v[i] = b2 * v[i] + c2 * (g[i] * g[i]);
        }
        if adam.bias_correction {
            let t = self.step as f32;
            let numerator_scale = lr / (1.0 - b1.powf(t));
            let denominator_scale = 1.0 / (1.0 - b2.powf(t)).sqrt();
            for i in 0..w.len() {
                w[i] -= numerator_scale * m[i] / (v[i].sqrt() * denominator_scale + eps);
            }
        } else {
            for i in 0..w.len() {
                w[i] -= lr * m[i] / (v[i].sqrt() + eps);
            }
        }
    }
}

fn sgd_step(sgd: &SgdConfig, lr: f32, w: &mut [f32], g: &[f32], velocity: &mut [f32]) {
    let (decay, momentum) = (sgd.weight_decay as f32, sgd.momentum as f32);
    let damped = (1.0 - sgd.dampening) as f32;
    for i in 0..w.len() {
        let grad = if sgd.weight_decay != 0.0 {
            g[i] + decay * w[i]
        } else {
            g[i]
        };
        if sgd.momentum <= 0.0 {
            w[i] -= lr * grad;
            continue;
        }
        let mut v = momentum * velocity[i];
        v += if sgd.dampening > 0.0 {
            damped * grad
        } else {
            grad
        };
        let update = if sgd.nesterov { grad + momentum * v } else { v };
        velocity[i] = v;
        w[i] -= lr * update;
    }
}
