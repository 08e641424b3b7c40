//! The oxlm engine: byte buffers that may borrow a memory map, float and MLX affine-quantized
//! weight matrices, f32 activations, and the CPU kernels that run them.
//!
//! It knows nothing about language models: the `models` crate composes these pieces.
//! Every op is reached through the types here so that a second backend (CUDA) can be chosen
//! behind the same calls without the model code changing.

pub mod buffer;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod float;
pub mod grad;
pub mod ops;
pub mod quant;
pub mod recurrent;
pub mod tensor;

pub use buffer::Bytes;
pub use dtype::DType;
pub use error::EngineError;
pub use float::FloatMatrix;
pub use quant::QuantizedMatrix;
pub use tensor::Tensor;
