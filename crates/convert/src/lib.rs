//! `oxlm convert`: checkpoints in other layouts to MLX format, as `mlx_lm.convert` writes it.
//!
//! - [`gguf`] reads llama.cpp's GGUF files: metadata, tensors and their block quantizations.

pub mod gguf;
