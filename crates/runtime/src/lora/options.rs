//! Reading mlx_lm.lora's option values (`optimizer_config`, `lr_schedule`) into typed settings,
//! with errors that name the key at fault.

use serde::de::DeserializeOwned;
use serde_json::Value;
use thiserror::Error;

/// A training option whose value mlx-lm would refuse, or that oxlm does not support.
#[derive(Debug, Error)]
#[error("`{key}`: {reason}")]
pub struct OptionError {
    /// The option's path in mlx_lm.lora's configuration, e.g. `optimizer_config.sgd.momentum`.
    pub key: String,
    pub reason: String,
}

impl OptionError {
    pub fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        OptionError {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// `value` as `T`; a value of the wrong type is an error naming its full path under `key`.
pub(crate) fn parse<T: DeserializeOwned>(key: &str, value: &Value) -> Result<T, OptionError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let key = if path == "." {
            key.to_string()
        } else {
            format!("{key}.{path}")
        };
        OptionError::new(key, e.inner().to_string())
    })
}
