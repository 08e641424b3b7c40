//! The sampling settings a checkpoint recommends in `generation_config.json`, used where a
//! request leaves them unset (mlx-lm ignores them; transformers' `generate` applies them).

use std::path::Path;

use oxlm_models::checkpoint::read_json;
use oxlm_models::LoadError;
use serde_json::Value;

/// The settings the file states. As in transformers, temperature and the filters only apply
/// when `do_sample` is true (otherwise decoding is greedy); a repetition penalty always applies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// Reads `generation_config.json` of a model directory; none of it when the file is absent.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        match read_json(&dir.join("generation_config.json")) {
            Ok(config) => Ok(Self::from_json(&config)),
            Err(LoadError::MissingFile(_)) => Ok(Self::default()),
            Err(e) => Err(e),
        }
    }

    pub fn from_json(config: &Value) -> Self {
        let float = |key: &str| config.get(key).and_then(Value::as_f64).map(|v| v as f32);
        let repetition_penalty = float("repetition_penalty").filter(|&p| p != 1.0);
        if config.get("do_sample").and_then(Value::as_bool) != Some(true) {
            return SamplingDefaults {
                repetition_penalty,
                ..Self::default()
            };
        }
        SamplingDefaults {
            // transformers' default temperature when sampling.
            temperature: Some(float("temperature").unwrap_or(1.0)),
            top_p: float("top_p"),
            top_k: config
                .get("top_k")
                .and_then(Value::as_u64)
                .map(|k| k as usize),
            min_p: float("min_p"),
            repetition_penalty,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sampling_settings_need_do_sample() {
        let qwen = json!({"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                          "repetition_penalty": 1.05, "eos_token_id": [1, 2]});
        assert_eq!(
            SamplingDefaults::from_json(&qwen),
            SamplingDefaults {
                temperature: Some(0.7),
                top_p: Some(0.8),
                top_k: Some(20),
                min_p: None,
                repetition_penalty: Some(1.05),
            }
        );
        let greedy = json!({"temperature": 0.7, "repetition_penalty": 1.0});
        assert_eq!(
            SamplingDefaults::from_json(&greedy),
            SamplingDefaults::default()
        );
        assert_eq!(
            SamplingDefaults::from_json(&json!({"do_sample": true})).temperature,
            Some(1.0)
        );
    }
}
