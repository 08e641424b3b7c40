//! Fine-tuning LoRA adapters as `mlx_lm.lora` does: its data formats, batches, loss, optimizer
//! and training loop, over a frozen (quantized) model.

pub mod adam;
pub mod batches;
pub mod data;
pub mod np_random;
pub mod trainer;
