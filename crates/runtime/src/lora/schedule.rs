//! Learning rates by optimizer step, as mlx-lm's `build_schedule` makes them from `lr_schedule`:
//! one of mlx.optimizers' schedules, after a linear warmup joined as `join_schedules` joins it.
//! Values are computed in f32 in MLX's order of operations, as MLX evaluates them.

use serde::Deserialize;
use serde_json::Value;

use super::options::{parse, OptionError};

/// `lr_schedule` as mlx_lm.lora's config gives it.
#[derive(Debug, Clone, Deserialize)]
struct ScheduleConfig {
    name: String,
    arguments: Vec<f64>,
    #[serde(default)]
    warmup: u64,
    #[serde(default)]
    warmup_init: f64,
}

/// The learning rate as a function of the number of optimizer updates already made.
#[derive(Debug, Clone, PartialEq)]
pub enum Schedule {
    Constant(f32),
    /// `mlx.optimizers.cosine_decay(init, decay_steps, end)`.
    CosineDecay {
        init: f64,
        decay_steps: u64,
        end: f64,
    },
    /// `mlx.optimizers.linear_schedule(init, end, steps)`.
    Linear {
        init: f64,
        end: f64,
        steps: u64,
    },
    /// `mlx.optimizers.exponential_decay(init, decay_rate)`.
    ExponentialDecay {
        init: f64,
        decay_rate: f64,
    },
    /// `mlx.optimizers.step_decay(init, decay_rate, step_size)`.
    StepDecay {
        init: f64,
        decay_rate: f64,
        step_size: u64,
    },
    /// `join_schedules([warmup, then], [boundary])`: `warmup` before step `boundary`, then
    /// `then` counted from it.
    Joined {
        warmup: Box<Schedule>,
        boundary: u64,
        then: Box<Schedule>,
    },
}

const NAMES: &str = "cosine_decay, linear_schedule, exponential_decay, step_decay";

impl Schedule {
    /// mlx-lm's `build_schedule(lr_schedule)`: `name` picks the schedule, `arguments` are its
    /// positional arguments, and a `warmup` of N steps rises linearly from `warmup_init` to the
    /// first argument over steps 0..=N, the schedule itself starting at step N + 1.
    pub fn from_config(config: &Value) -> Result<Self, OptionError> {
        let config: ScheduleConfig = parse("lr_schedule", config)?;
        let args = &config.arguments;
        let arity = |min: usize, max: usize| -> Result<(), OptionError> {
            if (min..=max).contains(&args.len()) {
                return Ok(());
            }
            let wanted = if min == max {
                format!("{min}")
            } else {
                format!("{min} or {max}")
            };
            Err(OptionError::new(
                "lr_schedule.arguments",
                format!(
                    "{} takes {wanted} arguments, not {}",
                    config.name,
                    args.len()
                ),
            ))
        };
        let steps = |i: usize, what: &str| -> Result<u64, OptionError> {
            let v = args[i];
            if v.fract() == 0.0 && v >= 1.0 && v <= u32::MAX as f64 {
                Ok(v as u64)
            } else {
                Err(OptionError::new(
                    format!("lr_schedule.arguments[{i}]"),
                    format!("{what} must be a whole number of steps, at least 1, not {v}"),
                ))
            }
        };
        let schedule = match config.name.as_str() {
            "cosine_decay" => {
                arity(2, 3)?;
                Schedule::CosineDecay {
                    init: args[0],
                    decay_steps: steps(1, "decay_steps")?,
                    end: args.get(2).copied().unwrap_or(0.0),
                }
            }
            "linear_schedule" => {
                arity(3, 3)?;
                Schedule::Linear {
                    init: args[0],
                    end: args[1],
                    steps: steps(2, "steps")?,
                }
            }
            "exponential_decay" => {
                arity(2, 2)?;
                Schedule::ExponentialDecay {
                    init: args[0],
                    decay_rate: args[1],
                }
            }
            "step_decay" => {
                arity(3, 3)?;
                Schedule::StepDecay {
                    init: args[0],
                    decay_rate: args[1],
                    step_size: steps(2, "step_size")?,
                }
            }
            name => {
                return Err(OptionError::new(
                    "lr_schedule.name",
                    format!("unknown schedule `{name}` (supported: {NAMES})"),
                ))
            }
        };
        let schedule = if config.warmup == 0 {
            schedule
        } else {
            let warmup = Schedule::Linear {
                init: config.warmup_init,
                end: args[0],
                steps: config.warmup,
            };
            Schedule::Joined {
                warmup: Box::new(warmup),
                boundary: config.warmup + 1,
                then: Box::new(schedule),
            }
        };
        schedule.check()?;
        Ok(schedule)
    }

    /// The learning rate of the update that follows `step` updates.
    pub fn at(&self, step: u64) -> f32 {
        match *self {
            Schedule::Constant(lr) => lr,
            Schedule::CosineDecay {
                init,
                decay_steps,
                end,
            } => {
                let s = step.min(decay_steps) as f32;
                let decay =
                    0.5 * (1.0 + ((std::f64::consts::PI / decay_steps as f64) as f32 * s).cos());
                end as f32 + decay * (init - end) as f32
            }
            Schedule::Linear { init, end, steps } => {
                step.min(steps) as f32 * ((end - init) / steps as f64) as f32 + init as f32
            }
            Schedule::ExponentialDecay { init, decay_rate } => {
                init as f32 * (decay_rate as f32).powf(step as f32)
            }
            Schedule::StepDecay {
                init,
                decay_rate,
                step_size,
            } => init as f32 * (decay_rate as f32).powf((step / step_size) as f32),
            Schedule::Joined {
                ref warmup,
                boundary,
                ref then,
            } => {
                if step < boundary {
                    warmup.at(step)
                } else {
                    then.at(step - boundary)
                }
            }
        }
    }

    /// Every rate this schedule can give is finite and none is negative (a rate of 0, where a
    /// warmup starts or a decay ends, is a rate Adam steps with).
    pub fn check(&self) -> Result<(), OptionError> {
        let bad = |v: f64| !v.is_finite() || v < 0.0 || !(v as f32).is_finite();
        let values: Vec<f64> = match *self {
            Schedule::Constant(lr) => vec![lr as f64],
            Schedule::CosineDecay { init, end, .. } | Schedule::Linear { init, end, .. } => {
                vec![init, end]
            }
            Schedule::ExponentialDecay { init, decay_rate }
            | Schedule::StepDecay {
                init, decay_rate, ..
            } => vec![init, decay_rate],
            Schedule::Joined {
                ref warmup,
                ref then,
                ..
            } => {
                warmup.check()?;
                return then.check();
            }
        };
        match values.into_iter().find(|&v| bad(v)) {
            Some(v) => Err(OptionError::new(
                "lr_schedule.arguments",
                format!("{v} would make the learning rate negative or not finite"),
            )),
            None => Ok(()),
        }
    }
}
