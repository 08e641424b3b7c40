//! Fine-tuning LoRA adapters as `mlx_lm.lora` does: its data formats, batches, loss, optimizer
//! and training loop, over a frozen (quantized) model; and preference training (DPO, ORPO) as
//! mlx-lm-lora does it.

pub mod batches;
pub mod data;
pub mod np_random;
pub mod optimizer;
pub mod options;
pub mod preference;
pub mod schedule;
pub mod trainer;
