//! The state of a recurrent layer (Qwen3.5's gated DeltaNet; mlx-lm's `ArraysCache(size=2)`).

use oxlm_engine::ops::recurrent::DeltaRuleDims;
use oxlm_engine::{Device, EngineError, Tensor};

/// What one gated-DeltaNet layer carries from token to token: the last `kernel - 1` inputs of
/// its causal convolution and the delta-rule state of each value head.
///
/// Its size is fixed whatever the sequence length, and it keeps no per-token history, so it
/// cannot be cut back to an earlier position ([`Cache::truncate`](crate::Cache::truncate) refuses).
/// To resume from a prefix later (a prompt cache), keep a clone of the whole
/// [`Cache`](crate::Cache) taken at that prefix: snapshots are the way back.
#[derive(Debug, Clone, PartialEq)]
pub struct RecurrentCache {
    /// The convolution's last inputs, `[kernel - 1, channels]`, oldest first.
    pub conv: Tensor,
    /// The delta-rule state, `[v_heads, v_dim, k_dim]`.
    pub state: Tensor,
}

impl RecurrentCache {
    /// The zero state that a sequence starts from, on `device`.
    pub fn new(
        conv_channels: usize,
        conv_kernel: usize,
        dims: DeltaRuleDims,
        device: &Device,
    ) -> Result<Self, EngineError> {
        Ok(RecurrentCache {
            conv: Tensor::zeros(vec![conv_kernel.saturating_sub(1), conv_channels], device)?,
            state: Tensor::zeros(vec![dims.v_heads, dims.v_dim, dims.k_dim], device)?,
        })
    }

    /// Bytes held, whatever the number of tokens seen.
    pub fn size_in_bytes(&self) -> usize {
        self.conv.size_in_bytes() + self.state.size_in_bytes()
    }

    pub fn try_clone(&self) -> Result<Self, EngineError> {
        Ok(RecurrentCache {
            conv: self.conv.try_clone()?,
            state: self.state.try_clone()?,
        })
    }
}
