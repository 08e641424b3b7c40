//! The oxlm engine: byte buffers that may borrow a memory map, float and MLX-quantized (affine,
//! mxfp4, nvfp4, mxfp8) weight matrices, f32 activation [`Tensor`]s on a [`Device`], and the
//! kernels that run them: `cpu` (AVX2/FMA with portable fallbacks) and `cuda` (CUDA C compiled
//! by NVRTC at run time).
//!
//! It knows nothing about language models: the `models` crate composes these pieces through
//! [`ops`] and [`recurrent`], which run on whichever device their operands live on, so a model
//! is written once for every backend.

pub mod buffer;
pub mod cpu;
pub mod cuda;
mod device;
pub mod dtype;
pub mod error;
pub mod float;
pub mod grad;
pub mod kv;
pub mod ops;
pub mod params;
mod positions;
pub mod quant;
pub mod tensor;

pub use buffer::{Bytes, WeightBuffer};
pub use device::{DecodeSteps, Device};
pub use dtype::DType;
pub use error::EngineError;
pub use float::FloatMatrix;
pub use kv::{check_quantized_head_dim, KvPrecision, KvQuant, KvRing, QuantRing};
pub use positions::Positions;
pub use quant::QuantizedMatrix;
pub use tensor::Tensor;
