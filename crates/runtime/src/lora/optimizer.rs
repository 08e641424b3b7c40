//! The optimizers of mlx_lm.lora (`--optimizer` with its `optimizer_config` entry), as
//! mlx.optimizers defines them, with their defaults: f32 arithmetic in MLX's order of
//! operations, Python's scalars rounded to f32 where MLX rounds them, and sums taken in order,
//! as MLX's CPU reductions take them. Each parameter is one of mlx-lm's arrays, in its layout:
//! Adafactor's norms and Muon's orthogonalization span a whole array, all experts of a stack at
//! once.

use std::collections::BTreeMap;

use oxlm_models::lora::{stack_transposed, transpose, unstack_transposed, Adapters};
use oxlm_models::lora_grad::AdapterGrads;
use serde::de::DeserializeOwned;
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

    /// Adam's checks, and a finite decay.
    fn check(&self, key: &str) -> Result<(), OptionError> {
        self.adam().check(key)?;
        if !self.weight_decay.is_finite() {
            return Err(OptionError::new(
                format!("{key}.weight_decay"),
                "must be a finite number",
            ));
        }
        Ok(())
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

impl SgdConfig {
    /// Finite values, and `SGD.__init__`'s own check.
    fn check(&self, key: &str) -> Result<(), OptionError> {
        if [self.momentum, self.weight_decay, self.dampening]
            .iter()
            .any(|v| !v.is_finite())
        {
            return Err(OptionError::new(key, "values must be finite numbers"));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(OptionError::new(
                format!("{key}.nesterov"),
                "Nesterov momentum requires a momentum and zero dampening",
            ));
        }
        Ok(())
    }
}

/// `mlx.optimizers.Adafactor`'s settings. mlx-lm always passes a learning rate (or schedule):
/// with `relative_step` (the default) the step size is Adafactor's own and the rate is only
/// reported; without it, the rate is the step size.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdafactorConfig {
    /// Added to the squared gradient, and the least parameter scale.
    pub eps: [f64; 2],
    /// The largest RMS of the unscaled update.
    pub clip_threshold: f64,
    /// β₂ at step t is 1 - t^decay_rate.
    pub decay_rate: f64,
    /// The first moment's β, when there is one.
    pub beta_1: Option<f64>,
    pub weight_decay: f64,
    /// Scales the step by the parameter's RMS (at least `eps[1]`).
    pub scale_parameter: bool,
    pub relative_step: bool,
    /// The relative step grows as 1e-6·t instead of starting at 1e-2.
    pub warmup_init: bool,
}

impl Default for AdafactorConfig {
    fn default() -> Self {
        AdafactorConfig {
            eps: [1e-30, 1e-3],
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta_1: None,
            weight_decay: 0.0,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    }
}

impl AdafactorConfig {
    /// mlx checks none of these: the values refused are those under which updates turn NaN or
    /// stop.
    fn check(&self, key: &str) -> Result<(), OptionError> {
        let bad =
            |field: &str, reason: String| Err(OptionError::new(format!("{key}.{field}"), reason));
        for (i, eps) in self.eps.iter().enumerate() {
            if !(eps.is_finite() && *eps >= 0.0) {
                return bad(
                    &format!("eps[{i}]"),
                    format!("must be a finite number of at least 0, not {eps}"),
                );
            }
        }
        if !(self.clip_threshold.is_finite() && self.clip_threshold > 0.0) {
            return bad(
                "clip_threshold",
                format!(
                    "must be a finite number above 0, not {}",
                    self.clip_threshold
                ),
            );
        }
        // A positive rate makes β₂ = 1 - t^decay_rate negative from step 2: the running mean of
        // squares may turn negative, and its inverse square root NaN.
        if !(self.decay_rate.is_finite() && self.decay_rate <= 0.0) {
            return bad(
                "decay_rate",
                format!(
                    "must be a finite number of at most 0, not {}",
                    self.decay_rate
                ),
            );
        }
        if let Some(beta) = self.beta_1 {
            if !(0.0..1.0).contains(&beta) {
                return bad("beta_1", format!("must be in [0, 1) or null, not {beta}"));
            }
        }
        if !self.weight_decay.is_finite() {
            return bad(
                "weight_decay",
                format!("must be a finite number, not {}", self.weight_decay),
            );
        }
        Ok(())
    }
}

/// `mlx.optimizers.Muon`'s settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MuonConfig {
    pub momentum: f64,
    /// An L2 penalty added to the gradient.
    pub weight_decay: f64,
    pub nesterov: bool,
    /// Newton–Schulz iterations of the orthogonalization.
    pub ns_steps: usize,
}

impl Default for MuonConfig {
    fn default() -> Self {
        MuonConfig {
            momentum: 0.95,
            weight_decay: 0.01,
            nesterov: true,
            ns_steps: 5,
        }
    }
}

impl MuonConfig {
    /// mlx checks none of these: the values refused are those under which updates turn NaN or
    /// stop.
    fn check(&self, key: &str) -> Result<(), OptionError> {
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(OptionError::new(
                format!("{key}.momentum"),
                format!("must be in [0, 1), not {}", self.momentum),
            ));
        }
        if !self.weight_decay.is_finite() {
            return Err(OptionError::new(
                format!("{key}.weight_decay"),
                format!("must be a finite number, not {}", self.weight_decay),
            ));
        }
        Ok(())
    }
}

/// `config` as `T`, which `check` accepts.
fn parse_checked<T: DeserializeOwned>(
    key: &str,
    config: &Value,
    check: impl Fn(&T, &str) -> Result<(), OptionError>,
) -> Result<T, OptionError> {
    let value = parse(key, config)?;
    check(&value, key)?;
    Ok(value)
}

/// An optimizer and its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    Adam(AdamConfig),
    AdamW(AdamWConfig),
    Sgd(SgdConfig),
    Adafactor(AdafactorConfig),
    Muon(MuonConfig),
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::Adam(AdamConfig::default())
    }
}

const SUPPORTED: &str = "adam, adamw, sgd, adafactor, muon";

impl OptimizerConfig {
    /// The optimizer `name` (any case, as mlx-lm lowers it) with `config`, its entry of
    /// `optimizer_config` (`{}` for the defaults). Keys the optimizer does not take are refused,
    /// as Python refuses unknown keyword arguments.
    pub fn from_config(name: &str, config: &Value) -> Result<Self, OptionError> {
        let name = name.to_lowercase();
        let key = format!("optimizer_config.{name}");
        match name.as_str() {
            "adam" => parse_checked(&key, config, AdamConfig::check).map(OptimizerConfig::Adam),
            "adamw" => parse_checked(&key, config, AdamWConfig::check).map(OptimizerConfig::AdamW),
            "sgd" => parse_checked(&key, config, SgdConfig::check).map(OptimizerConfig::Sgd),
            "adafactor" => {
                parse_checked(&key, config, AdafactorConfig::check).map(OptimizerConfig::Adafactor)
            }
            "muon" => parse_checked(&key, config, MuonConfig::check).map(OptimizerConfig::Muon),
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
            OptimizerConfig::Adafactor(_) => "adafactor",
            OptimizerConfig::Muon(_) => "muon",
        }
    }

    /// Its state for a parameter of `shape`, before any update (`init_single`).
    fn init_state(&self, shape: &[usize]) -> State {
        let zeros = || vec![0.0; shape.iter().product()];
        match self {
            OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => State::Moments {
                first: zeros(),
                second: zeros(),
            },
            OptimizerConfig::Sgd(_) | OptimizerConfig::Muon(_) => State::Velocity(zeros()),
            OptimizerConfig::Adafactor(adafactor) => {
                let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
                let matrices: usize = shape[..shape.len() - 2].iter().product();
                State::Factored {
                    rows: vec![0.0; matrices * rows],
                    cols: vec![0.0; matrices * cols],
                    first: adafactor.beta_1.map(|_| zeros()),
                }
            }
        }
    }
}

/// What an optimizer keeps of one parameter between updates.
enum State {
    /// Adam's first and second moments.
    Moments { first: Vec<f32>, second: Vec<f32> },
    /// SGD's and Muon's.
    Velocity(Vec<f32>),
    /// Adafactor's second moment, factored as every parameter of at least two dimensions is
    /// (LoRA's all are): running means of the squared gradient over each matrix's rows and over
    /// its columns. Its first moment where `beta_1` asks for one.
    Factored {
        rows: Vec<f32>,
        cols: Vec<f32>,
        first: Option<Vec<f32>>,
    },
}

/// An optimizer stepping a set of adapters, its learning rate following a schedule.
pub struct Optimizer {
    config: OptimizerConfig,
    schedule: Schedule,
    /// Updates made so far (mlx.optimizers' `step`).
    step: u64,
    /// The rate of the last update (the schedule's first before any), as mlx-lm reports it.
    learning_rate: f32,
    /// By mlx-lm's parameter name (`path.lora_a`).
    state: BTreeMap<String, State>,
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
        for (path, layer) in &mut adapters.layers {
            let Some(g) = grads.layers.get(path) else {
                continue;
            };
            let (rank, inputs, outputs) = (layer.rank, layer.in_features, layer.out_features);
            let name = |array| format!("{path}.{array}");
            self.apply(name("lora_a"), &[inputs, rank], &mut layer.a, &g.a);
            self.apply(name("lora_b"), &[rank, outputs], &mut layer.b, &g.b);
        }
        for (path, each) in &mut adapters.experts {
            let (Some(g), Some(first)) = (grads.experts.get(path), each.first()) else {
                continue;
            };
            let (rank, inputs, outputs) = (first.rank, first.in_features, first.out_features);
            let experts = each.len();
            let mut a = stack_transposed(each.iter().map(|l| &l.a[..]), inputs, rank);
            let mut b = stack_transposed(each.iter().map(|l| &l.b[..]), rank, outputs);
            let ga = stack_transposed(g.iter().map(|g| &g.a[..]), inputs, rank);
            let gb = stack_transposed(g.iter().map(|g| &g.b[..]), rank, outputs);
            let name = |array| format!("{path}.{array}");
            self.apply(name("lora_a"), &[experts, rank, inputs], &mut a, &ga);
            self.apply(name("lora_b"), &[experts, outputs, rank], &mut b, &gb);
            for (e, layer) in each.iter_mut().enumerate() {
                layer.a = unstack_transposed(&a, e, inputs, rank);
                layer.b = unstack_transposed(&b, e, rank, outputs);
            }
        }
    }

    /// One parameter's update (`apply_single`): `w` of `shape`, its gradient `g`.
    fn apply(&mut self, name: String, shape: &[usize], w: &mut [f32], g: &[f32]) {
        let lr = self.learning_rate;
        let state = (self.state.entry(name)).or_insert_with(|| self.config.init_state(shape));
        match (&self.config, state) {
            (OptimizerConfig::Adam(adam), State::Moments { first, second }) => {
                adam_step(adam, lr, self.step, w, g, first, second)
            }
            (OptimizerConfig::AdamW(adamw), State::Moments { first, second }) => {
                // The parameter decays before Adam's step, by 1 - lr·λ.
                let keep = 1.0 - lr * adamw.weight_decay as f32;
                for v in w.iter_mut() {
                    *v *= keep;
                }
                adam_step(&adamw.adam(), lr, self.step, w, g, first, second)
            }
            (OptimizerConfig::Sgd(sgd), State::Velocity(velocity)) => {
                sgd_step(sgd, lr, w, g, velocity)
            }
            (OptimizerConfig::Adafactor(adafactor), State::Factored { rows, cols, first }) => {
                let moments = Factored {
                    rows,
                    cols,
                    first: first.as_deref_mut(),
                };
                adafactor_step(adafactor, lr, self.step, shape, w, g, moments)
            }
            (OptimizerConfig::Muon(muon), State::Velocity(velocity)) => {
                muon_step(muon, lr, shape, w, g, velocity)
            }
            _ => unreachable!("the state is made by the optimizer that reads it"),
        }
    }
}

fn adam_step(
    adam: &AdamConfig,
    lr: f32,
    step: u64,
    w: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let [b1, b2] = adam.betas;
    // `1 - b1` and `1 - b2` are computed by Python in f64, then made f32.
    let (c1, c2) = ((1.0 - b1) as f32, (1.0 - b2) as f32);
    let (b1, b2, eps) = (b1 as f32, b2 as f32, adam.eps as f32);
    for i in 0..w.len() {
        m[i] = b1 * m[i] + c1 * g[i];
        v[i] = b2 * v[i] + c2 * (g[i] * g[i]);
    }
    if adam.bias_correction {
        let t = step as f32;
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

/// `mx.mean` of `values`: their sum, in order, times 1/n (rounded to f32 from f64).
fn mean(values: impl ExactSizeIterator<Item = f32>) -> f32 {
    let scale = (1.0 / values.len() as f64) as f32;
    values.sum::<f32>() * scale
}

/// The root mean square of `values` (Adafactor's `_compute_rms`).
fn rms(values: &[f32]) -> f32 {
    mean(values.iter().map(|v| v * v)).sqrt()
}

/// Adafactor's state of one parameter.
struct Factored<'s> {
    rows: &'s mut [f32],
    cols: &'s mut [f32],
    first: Option<&'s mut [f32]>,
}

fn adafactor_step(
    c: &AdafactorConfig,
    lr: f32,
    step: u64,
    shape: &[usize],
    w: &mut [f32],
    g: &[f32],
    state: Factored,
) {
    let t = step as f32;
    let relative_step_size = if c.relative_step {
        let min_step = if c.warmup_init { 1e-6 * t } else { 1e-2 };
        min_step.min(1.0 / t.sqrt())
    } else {
        lr
    };
    let lr = if c.scale_parameter {
        (c.eps[1] as f32).max(rms(w)) * relative_step_size
    } else {
        relative_step_size
    };
    let beta_2 = 1.0 - t.powf(c.decay_rate as f32);
    let keep = 1.0 - beta_2;
    let eps = c.eps[0] as f32;
    let squared: Vec<f32> = g.iter().map(|g| g * g + eps).collect();
    // Each matrix `[rows, cols]` of the parameter: row and column means, then
    // `rsqrt(row / mean(row)) · rsqrt(col)`, an estimate of the second moment's inverse root.
    let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let mut update = vec![0.0f32; g.len()];
    let matrices = (squared.chunks_exact(rows * cols))
        .zip(g.chunks_exact(rows * cols))
        .zip(update.chunks_exact_mut(rows * cols))
        .zip(state.rows.chunks_exact_mut(rows))
        .zip(state.cols.chunks_exact_mut(cols));
    for ((((sq, g), update), row_avg), col_avg) in matrices {
        for (r, avg) in row_avg.iter_mut().enumerate() {
            let row_mean = mean(sq[r * cols..(r + 1) * cols].iter().copied());
            *avg = beta_2 * *avg + keep * row_mean;
        }
        for (j, avg) in col_avg.iter_mut().enumerate() {
            let col_mean = mean((0..rows).map(|r| sq[r * cols + j]));
            *avg = beta_2 * *avg + keep * col_mean;
        }
        let row_scale = mean(row_avg.iter().copied());
        let col_factor: Vec<f32> = col_avg.iter().map(|v| 1.0 / v.sqrt()).collect();
        for (r, avg) in row_avg.iter().enumerate() {
            let row_factor = 1.0 / (avg / row_scale).sqrt();
            let at = r * cols..(r + 1) * cols;
            for ((u, g), c) in update[at.clone()].iter_mut().zip(&g[at]).zip(&col_factor) {
                *u = row_factor * c * g;
            }
        }
    }
    let clip = 1.0f32.max(rms(&update) / c.clip_threshold as f32);
    for u in &mut update {
        *u = lr * (*u / clip);
    }
    if let (Some(beta), Some(first)) = (c.beta_1, state.first) {
        let (b, keep) = (beta as f32, (1.0 - beta) as f32);
        for (m, u) in first.iter_mut().zip(&mut update) {
            *m = b * *m + keep * *u;
            *u = *m;
        }
    }
    if c.weight_decay != 0.0 {
        let decay = -(c.weight_decay as f32) * lr;
        for v in w.iter_mut() {
            *v += *v * decay;
        }
    }
    for (v, u) in w.iter_mut().zip(&update) {
        *v -= u;
    }
}

fn muon_step(c: &MuonConfig, lr: f32, shape: &[usize], w: &mut [f32], g: &[f32], v: &mut [f32]) {
    let (momentum, keep) = (c.momentum as f32, (1.0 - c.momentum) as f32);
    let decay = c.weight_decay as f32;
    let mut update = Vec::with_capacity(g.len());
    for i in 0..g.len() {
        let grad = if c.weight_decay != 0.0 {
            g[i] + decay * w[i]
        } else {
            g[i]
        };
        v[i] = momentum * v[i] + keep * grad;
        update.push(if c.nesterov {
            grad * keep + v[i] * momentum
        } else {
            v[i]
        });
    }
    // A stack of matrices is orthogonalized as one `[experts, rest]` matrix, as mlx reshapes it.
    let update = newton_schulz(update, shape[0], g.len() / shape[0], c.ns_steps);
    let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    // Python's `max(1, rows / cols) ** 0.5`, in f64.
    let lr = lr * (rows as f64 / cols as f64).max(1.0).sqrt() as f32;
    for (w, u) in w.iter_mut().zip(&update) {
        *w -= lr * u;
    }
}

/// `x · yᵀ` for `x` `[m, k]` and `y` `[n, k]`, row-major, summed in order.
fn matmul_transposed(x: &[f32], y: &[f32], k: usize) -> Vec<f32> {
    (x.chunks_exact(k))
        .flat_map(|xr| {
            (y.chunks_exact(k)).map(move |yr| xr.iter().zip(yr).map(|(a, b)| a * b).sum())
        })
        .collect()
}

/// Muon's `_zeropower_via_newtonschulz5` of `x` `[rows, cols]`: the nearest semi-orthogonal
/// matrix, approximately, by `steps` quintic Newton–Schulz iterations on the wide orientation of
/// `x` scaled to unit Frobenius norm. MLX runs them in the gradient's dtype, f32 for adapters.
fn newton_schulz(x: Vec<f32>, rows: usize, cols: usize, steps: usize) -> Vec<f32> {
    let (a, b, c) = (3.4445f32, -4.7750f32, 2.0315f32);
    let tall = rows > cols;
    let (mut x, rows, cols) = if tall {
        (transpose(&x, rows, cols), cols, rows)
    } else {
        (x, rows, cols)
    };
    let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt() + 1e-7;
    x.iter_mut().for_each(|v| *v /= norm);
    for _ in 0..steps {
        // A = x·xᵀ is symmetric, so A·A = A·Aᵀ; B = c·A·A + b·A; x = B·x + a·x.
        let gram = matmul_transposed(&x, &x, cols);
        let square = matmul_transposed(&gram, &gram, rows);
        let poly: Vec<f32> = (square.iter().zip(&gram))
            .map(|(s, g)| c * s + b * g)
            .collect();
        let next = matmul_transposed(&poly, &transpose(&x, rows, cols), rows);
        x = next.iter().zip(&x).map(|(n, v)| n + a * v).collect();
    }
    if tall {
        transpose(&x, rows, cols)
    } else {
        x
    }
}
