//! Fine-tuning LoRA adapters as `mlx_lm.lora` does: its data formats, batches, loss, optimizer
//! and training loop, over a frozen (quantized) model.

pub mod batches;
pub mod data;
pub mod np_random;
pub mod optimizer;
pub mod options;
pub mod schedule;
pub mod trainer;
