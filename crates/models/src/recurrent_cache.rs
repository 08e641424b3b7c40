//! The state of a recurrent layer: Qwen3.5's gated DeltaNet (mlx-lm's `ArraysCache(size=2)`)
//! and LFM2's gated short convolution (`ArraysCache(size=1)`).

use oxlm_engine::ops::recurrent::DeltaRuleDims;
use oxlm_engine::{Device, EngineError, Tensor};

/// What one recurrent layer carries from token to token: the last `kernel - 1` inputs of its
/// causal convolution and, in a gated-DeltaNet layer, the delta-rule state of each value head
/// (empty in a short-convolution layer, [`RecurrentCache::conv_only`]).
///
/// Its size is fixed whatever the sequence length, and it keeps no per-token history, so it
/// cannot be cut back to an earlier position ([`Cache::truncate`](crate::Cache::truncate) refuses).
/// To resume from a prefix later (a prompt cache), keep a clone of the whole
/// [`Cache`](crate::Cache) taken at that prefix: snapshots are the way back.
#[derive(Debug, Clone, PartialEq)]
pub struct RecurrentCache {
    /// The convolution's last inputs, `[kernel - 1, channels]`, oldest first.
    pub conv: Tensor,
    /// The delta-rule state, `[v_heads, v_dim, k_dim]`; `[0]` where there is none.
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

    /// The zero state of a layer that has only a causal convolution (LFM2's short convolution),
    /// on `device`.
    pub fn conv_only(
        conv_channels: usize,
        conv_kernel: usize,
        device: &Device,
    ) -> Result<Self, EngineError> {
        Ok(RecurrentCache {
            conv: Tensor::zeros(vec![conv_kernel.saturating_sub(1), conv_channels], device)?,
            state: Tensor::zeros(vec![0], device)?,
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
