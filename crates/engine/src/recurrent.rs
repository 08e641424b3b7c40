//! The ops of recurrent sequence mixers (Qwen3.5's gated DeltaNet) on [`Tensor`]s: a causal
//! depthwise convolution that carries its last inputs between calls, the delta rule's gates and
//! the gated delta rule. Each runs a whole chunk of tokens in one call, so a prompt is prefilled
//! without a per-token pass through the model; a decode step is the same call with one token.

use crate::tensor::Storage;
use crate::{cpu, cuda, EngineError, Tensor};

type Result<T> = std::result::Result<T, EngineError>;

/// Head counts and sizes of one [`gated_delta_rule`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleDims {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads: a multiple of `k_heads`; value head `h` reads key head
    /// `h / (v_heads / k_heads)`.
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

impl DeltaRuleDims {
    /// f32s in one sequence's state: `[v_heads, v_dim, k_dim]`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.v_dim * self.k_dim
    }
}

fn shape(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(EngineError::Shape(what()))
    }
}

fn mismatch(op: &str) -> EngineError {
    EngineError::Device(format!("{op}: operands are on different devices"))
}

/// Causal depthwise 1-D convolution of `x` (`[tokens, channels]`) continuing from `state`
/// (`[kernel - 1, channels]`, the inputs before `x`, oldest first; zeros at the start of a
/// sequence), with `weight` `[channels, kernel]`. `state` then holds the last `kernel - 1`
/// inputs.
pub fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    kernel: usize,
    state: &mut Tensor,
) -> Result<Tensor> {
    let channels = x.cols();
    shape(
        kernel >= 1 && weight.len() == channels * kernel && state.len() == (kernel - 1) * channels,
        || format!("conv1d of {:?} with kernel {kernel}", x.shape()),
    )?;
    match (&x.storage, &weight.storage, &mut state.storage) {
        (Storage::Host(x_), Storage::Host(w), Storage::Host(s)) => {
            let mut out = vec![0.0; x_.len()];
            cpu::recurrent::causal_conv1d(x_, channels, w, kernel, s, &mut out);
            Ok(Tensor::new(x.shape().to_vec(), out))
        }
        (Storage::Cuda(x_), Storage::Cuda(w), Storage::Cuda(s)) => {
            let out = cuda::ops::causal_conv1d(x_, w, s, channels, kernel)?;
            Ok(Tensor::on_gpu(x.shape().to_vec(), out))
        }
        _ => Err(mismatch("causal_conv1d")),
    }
}

/// The decay `g = exp(neg_a · softplus(a + dt_bias))` and write strength `beta = sigmoid(b)`
/// per token and value head, from `a` and `b` (`[tokens, v_heads]`).
pub fn delta_gates(
    a: &Tensor,
    b: &Tensor,
    dt_bias: &Tensor,
    neg_a: &Tensor,
) -> Result<(Tensor, Tensor)> {
    shape(
        a.len() == b.len() && dt_bias.len() == neg_a.len() && a.cols() == dt_bias.len(),
        || {
            format!(
                "delta gates of {:?} over {} heads",
                a.shape(),
                dt_bias.len()
            )
        },
    )?;
    let s = a.shape().to_vec();
    match (&a.storage, &b.storage, &dt_bias.storage, &neg_a.storage) {
        (Storage::Host(a_), Storage::Host(b_), Storage::Host(dt), Storage::Host(na)) => {
            let (mut g, mut beta) = (vec![0.0; a_.len()], vec![0.0; a_.len()]);
            cpu::recurrent::delta_gates(a_, b_, dt, na, &mut g, &mut beta);
            Ok((Tensor::new(s.clone(), g), Tensor::new(s, beta)))
        }
        (Storage::Cuda(a_), Storage::Cuda(b_), Storage::Cuda(dt), Storage::Cuda(na)) => {
            let (g, beta) = cuda::ops::delta_gates(a_, b_, dt, na)?;
            Ok((Tensor::on_gpu(s.clone(), g), Tensor::on_gpu(s, beta)))
        }
        _ => Err(mismatch("delta_gates")),
    }
}

/// The gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks"), as mlx-lm's
/// `gated_delta_ops` computes it, over every token of the chunk: `q`, `k` `[tokens, k_heads ·
/// k_dim]` (normalized and scaled), `v` `[tokens, v_heads · v_dim]`, `g` and `beta`
/// `[tokens, v_heads]`. For each value head, with `S` its `[v_dim, k_dim]` slice of `state`:
///
/// ```text
/// S ← g_t · S;   δ = β_t · (v_t − S k_t);   S ← S + δ k_tᵀ;   y_t = S q_t
/// ```
///
/// Returns `y` (`[tokens, v_heads · v_dim]`); `state` is updated in place.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    dims: DeltaRuleDims,
    state: &mut Tensor,
) -> Result<Tensor> {
    let tokens = g.len() / dims.v_heads.max(1);
    shape(
        dims.k_heads > 0
            && dims.v_heads.is_multiple_of(dims.k_heads)
            && g.len() == tokens * dims.v_heads
            && beta.len() == g.len()
            && q.len() == tokens * dims.k_heads * dims.k_dim
            && k.len() == q.len()
            && v.len() == tokens * dims.v_heads * dims.v_dim
            && state.len() == dims.state_len(),
        || format!("gated delta rule of {:?} with {dims:?}", v.shape()),
    )?;
    let s = v.shape().to_vec();
    match (
        &q.storage,
        &k.storage,
        &v.storage,
        &g.storage,
        &beta.storage,
        &mut state.storage,
    ) {
        (
            Storage::Host(q),
            Storage::Host(k),
            Storage::Host(v),
            Storage::Host(g),
            Storage::Host(b),
            Storage::Host(st),
        ) => {
            let mut y = vec![0.0; v.len()];
            cpu::recurrent::gated_delta_rule(q, k, v, g, b, dims, st, &mut y);
            Ok(Tensor::new(s, y))
        }
        (
            Storage::Cuda(q),
            Storage::Cuda(k),
            Storage::Cuda(v),
            Storage::Cuda(g),
            Storage::Cuda(b),
            Storage::Cuda(st),
        ) => Ok(Tensor::on_gpu(
            s,
            cuda::ops::gated_delta(q, k, v, g, b, st, dims)?,
        )),
        _ => Err(mismatch("gated_delta_rule")),
    }
}
