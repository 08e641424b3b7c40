use thiserror::Error;

/// Errors raised while building engine objects from untrusted shapes and bytes.
#[derive(Debug, Error, PartialEq)]
pub enum EngineError {
    #[error("{what}: expected {expected} bytes, found {found}")]
    SizeMismatch {
        what: String,
        expected: usize,
        found: usize,
    },
    #[error("unsupported quantization: {0}")]
    UnsupportedQuantization(String),
    #[error("unsupported dtype {dtype} for {what}")]
    UnsupportedDType { what: String, dtype: String },
    #[error("shape mismatch: {0}")]
    Shape(String),
}
