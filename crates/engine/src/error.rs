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
    /// A device that cannot be opened, or operands on different devices.
    #[error("{0}")]
    Device(String),
    /// Something this build does not do yet.
    #[error("{0} is not supported")]
    Unsupported(String),
    /// A CUDA driver, NVRTC or cuBLAS call failed (out of device memory, for one).
    #[error("CUDA: {0}")]
    Cuda(String),
}
